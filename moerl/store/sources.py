"""What a run reads but never writes: a user's model (`model.path`) and data (`task.dataset`,
`reward_model.data`) under an `s3://bucket/prefix`, read with the checkpoint store's endpoint,
region and retries and the pod's own identity (IRSA on EKS: read-only on those prefixes,
manifests/). Every read after the listing names the object's ETag (`If-Match`), so an object
rewritten while a run reads it is refused (`SourceChanged`), never mixed with its old bytes.
Errors name the config field and the key.

Design, details and limitations: docs/weights.md#moerlstoresourcespy.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from moerl.config import CheckpointConfig
from moerl.errors import MoerlError, SourceChanged
from moerl.store.s3 import _MISSING, _UNREACHABLE, _code, s3_client

__all__ = ["S3Object", "S3Source", "SourceChanged", "split_s3"]

log = logging.getLogger(__name__)
_CHANGED = {"412", "PreconditionFailed"}
_DENIED = {
    "403",
    "AccessDenied",
    "AllAccessDisabled",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
}
CHUNK = 8 << 20  # a streamed read's block


@dataclass(frozen=True)
class S3Object:
    """One object under a source: its path below the source's prefix, size and ETag."""

    rel: str
    size: int
    etag: str


def split_s3(uri: str) -> tuple[str, str]:
    """(bucket, key or prefix) of an s3:// URI."""
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key


class S3Source:
    """A read-only view of `uri` (an object, or a prefix read as a folder) for config `field`;
    its errors are `error` (ConfigError for a model, DataError for data)."""

    def __init__(
        self, uri: str, ck: CheckpointConfig, field: str, error: type[MoerlError] = MoerlError
    ) -> None:
        self.uri, self.field, self.error = uri, field, error
        self.bucket, self.key = split_s3(uri)
        if not self.bucket:
            raise error(f"{field}: {uri!r} names no bucket; expected s3://bucket/prefix")
        self.endpoint = ck.endpoint_url or "the default AWS endpoint"
        self.attempts = ck.max_attempts
        self._s3: Any = s3_client(ck, pool=ck.max_concurrency)

    def url(self, rel: str = "") -> str:
        """The s3:// URI of `rel` under this source."""
        return f"s3://{self.bucket}/{self._full(rel)}"

    def key_of(self, rel: str) -> str:
        """The object key of `rel` under this source."""
        return self._full(rel)

    def _full(self, rel: str) -> str:
        if not rel:
            return self.key
        return f"{self.key.rstrip('/')}/{rel}" if self.key else rel

    def _fail(self, what: str, e: Exception) -> MoerlError:
        if isinstance(e, ClientError):
            code = _code(e)
            if code in _CHANGED:
                return SourceChanged(
                    f"{self.field}: {what} changed after this run listed it (another ETag); a source "
                    "must not change under a run: write a new prefix and start a new run"
                )
            if code in _MISSING or code == "NoSuchBucket":
                return self.error(
                    f"{self.field}: {what}: no such object or bucket at {self.endpoint}"
                )
            if code in _DENIED:
                return self.error(
                    f"{self.field}: {what}: access denied ({code}); the pod's role needs s3:GetObject "
                    f"and s3:ListBucket on s3://{self.bucket}/{self.key} "
                    "(manifests/iam/moerl-s3-sources.json, docs/eks.md step 5)"
                )
        if isinstance(e, _UNREACHABLE):
            return self.error(
                f"{self.field}: {what}: cannot reach S3 endpoint {self.endpoint} ({e}); check "
                "checkpoint.endpoint_url and the network"
            )
        return self.error(f"{self.field}: {what}: {type(e).__name__}: {e}")

    def list(self) -> list[S3Object]:
        """Every object under the prefix (as a folder: `key/`), sorted by path; or the one object
        `key` names, as rel "". Refuses an empty listing naming the URI."""
        what = f"listing {self.uri}"
        try:
            if self.key and not self.key.endswith("/"):
                try:
                    h = self._s3.head_object(Bucket=self.bucket, Key=self.key)
                    return [S3Object("", int(h["ContentLength"]), h["ETag"])]
                except ClientError as e:
                    # a role that may read only `key/*` is denied a HEAD of `key` itself: a
                    # prefix named without its slash, listed as one
                    if _code(e) not in _MISSING and _code(e) not in _DENIED:
                        raise
            prefix = self.key.rstrip("/") + "/" if self.key else ""
            out = []
            for page in self._s3.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix
            ):
                for o in page.get("Contents", []):
                    rel = o["Key"][len(prefix) :]
                    if rel and not rel.endswith("/"):
                        out.append(S3Object(rel, int(o["Size"]), o["ETag"]))
        except (ClientError, BotoCoreError) as e:
            raise self._fail(what, e) from None
        if not out:
            raise self.error(f"{self.field}: {self.uri} holds no objects at {self.endpoint}")
        return sorted(out, key=lambda o: o.rel)

    def read_range(self, obj: S3Object, start: int, length: int) -> bytes:
        """Bytes [start, start+length) of `obj`, refused if it changed since it was listed."""
        if length <= 0:
            return b""
        what = self.url(obj.rel)
        try:
            return self._s3.get_object(
                Bucket=self.bucket,
                Key=self._full(obj.rel),
                Range=f"bytes={start}-{start + length - 1}",
                IfMatch=obj.etag,
            )["Body"].read()
        except (ClientError, BotoCoreError) as e:
            raise self._fail(what, e) from None

    def read(self, obj: S3Object, cap: int | None = None) -> bytes:
        """The whole of `obj` (refused past `cap` bytes), as listed."""
        if cap is not None and obj.size > cap:
            raise self.error(
                f"{self.field}: {self.url(obj.rel)} is {obj.size} bytes; at most {cap} expected"
            )
        return self.read_range(obj, 0, obj.size)

    def stream(self, obj: S3Object, chunk: int = CHUNK) -> Iterator[bytes]:
        """`obj` in blocks of `chunk` bytes (refused if it changed since it was listed). A body
        that breaks off mid-stream (a reset, a read timeout: likely over a 5 GB file) resumes
        from the byte it reached, under the same ETag, up to `attempts` times in a row."""
        what = self.url(obj.rel)
        got, failures = 0, 0
        while True:
            try:
                body = self._s3.get_object(
                    Bucket=self.bucket,
                    Key=self._full(obj.rel),
                    IfMatch=obj.etag,
                    **({"Range": f"bytes={got}-"} if got else {}),
                )["Body"]
                while block := body.read(chunk):
                    got += len(block)
                    failures = 0
                    yield block
                break
            except ClientError as e:
                raise self._fail(what, e) from None
            except BotoCoreError as e:  # the connection broke: resume, bounded
                failures += 1
                if failures >= self.attempts or got >= obj.size:
                    raise self._fail(f"{what} (after {failures} broken reads)", e) from None
                log.warning("%s: read broke off at byte %d (%s); resuming", what, got, e)
        if got != obj.size:
            raise SourceChanged(
                f"{self.field}: {what} gave {got} bytes, listed as {obj.size}; it changed or broke off"
            )

    def check(self, obj: S3Object) -> None:
        """Refuse `obj` if its ETag is no longer the listed one (rewritten or deleted since)."""
        try:
            h = self._s3.head_object(Bucket=self.bucket, Key=self._full(obj.rel), IfMatch=obj.etag)
        except (ClientError, BotoCoreError) as e:
            raise self._fail(self.url(obj.rel), e) from None
        if h["ETag"] != obj.etag:
            raise SourceChanged(
                f"{self.field}: {self.url(obj.rel)} changed after this run listed it"
            )
