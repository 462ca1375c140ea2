"""The S3 backend of the checkpoint store (see `moerl.store.base` for the layout and the contract).

Design, details and limitations: docs/weights.md#moerlstores3py.
"""

from __future__ import annotations

import base64
import hashlib
import io
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import boto3
from boto3.exceptions import Boto3Error
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    HTTPClientError,
    NoCredentialsError,
    ReadTimeoutError,
)

from moerl.config import CheckpointConfig
from moerl.errors import CheckpointError, SourceChanged, StoreUnavailable
from moerl.store.base import MANIFEST, CheckpointStore, FileEntry, HashingWriter
from moerl.store.fence import CLAIM

log = logging.getLogger(__name__)

_MISSING = {"404", "NoSuchKey", "NotFound"}
# A conditional write lost: the object exists (412), or was written concurrently (409).
_TAKEN = {"412", "PreconditionFailed", "409", "ConditionalRequestConflict"}
_UNREACHABLE = (
    EndpointConnectionError,
    ConnectTimeoutError,
    ConnectionClosedError,
    ReadTimeoutError,
)
# Server-side answers that a later call may not get (a brownout, a restarting server).
_BUSY = {"500", "502", "503", "504", "InternalError", "ServiceUnavailable", "SlowDown"}
_BUSY |= {"RequestTimeout", "Throttling", "ThrottlingException", "RequestTimeTooSkewed"}
_MiB = 1024 * 1024
_MIN_PART = 5 * _MiB  # S3's smallest part (but the last)
_MAX_PARTS = 10_000  # S3's most parts in one upload
_R = TypeVar("_R")


class S3Store(CheckpointStore):
    """s3://bucket/prefix."""

    _claims = True  # conditional writes: claims, the manifest and `latest` are create-only / compare-and-set

    def __init__(self, cfg: CheckpointConfig, credentials: tuple[str, str] | None = None) -> None:
        """`credentials`: an access key and secret for this store only (the cache tier's server
        has identities of its own); None: the standard AWS chain."""
        self.uri = cfg.uri
        self.bucket, _, prefix = cfg.uri.removeprefix("s3://").partition("/")
        self.prefix = prefix.strip("/")
        self.endpoint = cfg.endpoint_url or "the default AWS endpoint"
        self.max_attempts = cfg.max_attempts
        self._workers = min(4, cfg.max_concurrency)
        self._s3 = s3_client(cfg, credentials, pool=cfg.max_concurrency * self._workers)
        self._own_keys = credentials is not None
        chunk = cfg.multipart_chunk_mb * _MiB
        # s3transfer retries a download whose body breaks off mid-stream on its own; same budget.
        self._transfer = TransferConfig(
            multipart_threshold=chunk,
            multipart_chunksize=chunk,
            max_concurrency=cfg.max_concurrency,
            num_download_attempts=cfg.max_attempts,
        )

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        """Turn botocore failures into CheckpointErrors; their messages carry no credentials."""
        try:
            yield
        except (*_UNREACHABLE, ClientError, BotoCoreError, Boto3Error) as e:
            if _transient(e):  # a brownout: the publisher and recovery retry it (`outage`)
                how = "reach" if isinstance(e, _UNREACHABLE) else "get an answer from"
                raise StoreUnavailable(
                    f"cannot {how} S3 endpoint {self.endpoint} after {self.max_attempts} "
                    f"attempts while {what}: {e}; check checkpoint.endpoint_url and the network"
                ) from e
            if isinstance(e, NoCredentialsError):
                raise CheckpointError(
                    f"no AWS credentials while {what}; provide them through the standard "
                    "chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile, IRSA)"
                ) from e
            raise CheckpointError(f"S3 error while {what} in {self.uri}: {e}") from e

    def _or_none(self, what: str, call: Callable[[], _R]) -> _R | None:
        """`call()`, or None when the object is missing (a missing bucket stays an error)."""
        with self._errors(what):
            try:
                return call()
            except ClientError as e:
                if _code(e) in _MISSING:
                    return None
                raise

    def check_access(self, missing_ok: bool = False) -> bool:
        """Whether the bucket exists, raising when it cannot be reached or the keys are refused.
        `missing_ok`: a missing bucket is not an error (False), for a cache server that keeps
        its buckets in memory and whose writer creates the bucket at its first publication: the
        server answered, and it answers a missing bucket only after it accepted the keys."""
        with self._errors(f"checking bucket {self.bucket!r}"):
            try:
                self._s3.head_bucket(Bucket=self.bucket)
                return True
            except ClientError as e:
                if _code(e) in _MISSING | {"NoSuchBucket"}:
                    if missing_ok:
                        return False
                    raise CheckpointError(
                        f"bucket {self.bucket!r} does not exist at {self.endpoint}; "
                        "create it or fix checkpoint.uri"
                    ) from e
                if _code(e) in ("403", "AccessDenied", "Forbidden"):
                    raise CheckpointError(
                        f"access to bucket {self.bucket!r} at {self.endpoint} is denied; "
                        "check the AWS credentials (env, profile, IRSA)"
                    ) from e
                raise

    def ensure_bucket(self) -> bool:
        """Create the bucket if it is missing; True if it was created. For the cache tier, whose
        server keeps its data in memory: after a restart nothing else recreates it (the writer
        identity may: manifests/base/ckpt-cache.yaml gives it Admin on the server)."""
        with self._errors(f"checking bucket {self.bucket!r}"):
            try:
                self._s3.head_bucket(Bucket=self.bucket)
                return False
            except ClientError as e:
                if _code(e) not in _MISSING | {"NoSuchBucket"}:
                    raise
        with self._errors(f"creating bucket {self.bucket!r}"):
            try:
                region = self._s3.meta.region_name
                conf = (
                    {}
                    if region in (None, "us-east-1")
                    else {"CreateBucketConfiguration": {"LocationConstraint": region}}
                )
                self._s3.create_bucket(Bucket=self.bucket, **conf)
            except ClientError as e:
                # another writer was first
                if _code(e) not in (
                    "BucketAlreadyOwnedByYou",
                    "BucketAlreadyExists",
                ):
                    raise
                return False
        log.warning(
            "bucket %r was missing at %s (a restarted cache server?); created it",
            self.bucket,
            self.endpoint,
        )
        return True

    def _read_tagged(self, key: str) -> tuple[str | None, str | None]:
        def get() -> tuple[str, str]:
            r = self._s3.get_object(Bucket=self.bucket, Key=self._key(key))
            return r["Body"].read().decode(), r["ETag"]

        got = self._or_none(f"reading {key}", get)
        return (None, None) if got is None else got

    def _write_if(self, key: str, text: str, tag: str | None) -> bool:
        """A conditional PUT (S3 conditional writes; weed mini 4.48 enforces both, measured):
        `If-Match` the ETag read, or `If-None-Match: *` to create only."""
        cond = {"IfMatch": tag} if tag is not None else {"IfNoneMatch": "*"}
        with self._errors(f"writing {key}"):
            try:
                self._s3.put_object(
                    Bucket=self.bucket, Key=self._key(key), Body=text.encode(), **cond
                )
                return True
            except ClientError as e:
                # changed, created, or (If-Match) deleted meanwhile
                if _code(e) in _TAKEN | _MISSING:
                    return False
                raise

    def _abort(self, stage: str) -> None:
        """Delete a failed publish's objects: its manifest first (the version is never complete
        without it), then its files, its claim last (until then no one else writes there)."""
        keys = self._list(f"versions/{stage}/")
        self._delete([k for k in keys if k.endswith(f"/{MANIFEST}")])
        self._delete([k for k in keys if not k.endswith((f"/{MANIFEST}", f"/{CLAIM}"))])
        self._delete([k for k in keys if k.endswith(f"/{CLAIM}")])

    def _stored(self, stage: str, e: FileEntry, chunk_size: int) -> tuple[int | None, bool | None]:
        """HEAD with the object's SHA-256 checksum (`ChecksumMode=ENABLED`). An object uploaded in
        one part reports the sha256 of its bytes; one uploaded in parts reports the sha256 of its
        parts' sha256s ("...-N"), which the manifest's chunk hashes give when the parts were its
        chunks (`_put` uploads them so). Anything else (no checksum, other parts): size only."""
        head = self._or_none(
            f"checking {e.path}",
            lambda: self._s3.head_object(
                Bucket=self.bucket,
                Key=self._key(f"versions/{stage}/{e.path}"),
                ChecksumMode="ENABLED",
            ),
        )
        if head is None:
            return None, None
        size, got = int(head["ContentLength"]), head.get("ChecksumSHA256")
        if not got:
            return size, None
        digest, _, parts = got.partition("-")
        if not parts:
            return size, base64.b64decode(digest).hex() == e.sha256
        if int(parts) != len(e.chunks) or not e.chunks:
            return size, None
        composite = hashlib.sha256(b"".join(bytes.fromhex(c) for c in e.chunks)).digest()
        return size, base64.b64decode(digest) == composite

    def _put(self, stage: str, rel: str, src: Path) -> None:
        """Upload with a SHA-256 checksum (the server refuses bytes that do not match it, and
        reports it back for `_stored`), in parts of the manifest's chunk size when that is a valid
        part size (S3: 5 MiB at least), so a multipart object's checksum is checkable."""
        key = self._key(f"versions/{stage}/{rel}")
        config = self._transfer
        if self._part_size >= _MIN_PART:
            config = TransferConfig(
                multipart_threshold=self._part_size,
                multipart_chunksize=self._part_size,
                max_concurrency=self._transfer.max_request_concurrency,
                num_download_attempts=self._transfer.num_download_attempts,
            )
        with self._errors(f"uploading {rel}"):
            self._s3.upload_file(
                str(src), self.bucket, key, Config=config, ExtraArgs={"ChecksumAlgorithm": "SHA256"}
            )

    def _part_for(self, size: int) -> int:
        """The part size for an object of `size` bytes: the manifest's chunk size where it is a
        valid part size (so the composite checksum is checkable against the chunk hashes), else
        multipart_chunk_mb; larger (and said) where that would take more than S3's 10000 parts."""
        part = (
            self._part_size if self._part_size >= _MIN_PART else self._transfer.multipart_chunksize
        )
        if size > part * _MAX_PARTS:
            bigger = -(-size // _MAX_PARTS // _MiB) * _MiB
            log.warning(
                "an object of %d bytes needs parts of %d MiB (S3 allows %d parts); its checksum "
                "is checked by size only (raise checkpoint.chunk_mb to keep it checkable)",
                size,
                bigger // _MiB,
                _MAX_PARTS,
            )
            return bigger
        return part

    def put_stream(
        self, stage: str, rel: str, blocks: Iterable[bytes], size: int | None = None
    ) -> None:
        """Upload `blocks` (`size` bytes, where known) without a file: a multipart upload in
        parts of `_part_for(size)`, each with its SHA-256."""
        key = self._key(f"versions/{stage}/{rel}")
        part = self._part_for(size or 0)
        config = TransferConfig(
            multipart_threshold=part,
            multipart_chunksize=part,
            max_concurrency=self._transfer.max_request_concurrency,
        )
        with self._errors(f"uploading {rel}"):
            self._s3.upload_fileobj(
                _BlockReader(blocks),
                self.bucket,
                key,
                Config=config,
                ExtraArgs={"ChecksumAlgorithm": "SHA256"},
            )

    def same_service(self, endpoint_url: str | None) -> bool:
        """Whether a source at `endpoint_url` is on this store's S3 service and this store uses
        the AWS chain (no keys of its own), so it can copy the source's objects server-side."""
        return not self._own_keys and (endpoint_url or "the default AWS endpoint") == self.endpoint

    def copy_in(self, stage: str, rel: str, bucket: str, key: str, size: int, etag: str) -> str:
        """Copy object s3://`bucket`/`key` (`size` bytes, ETag `etag`, refused if it changed)
        into `rel` of `stage` on the server, never through this process: one CopyObject up to
        the part size, else UploadPartCopy in parts of the manifest's chunk size (or
        multipart_chunk_mb), each with its SHA-256 so `_stored` can check the copy. Returns the
        route ("copy" or "multipart copy")."""
        dest = self._key(f"versions/{stage}/{rel}")
        part = self._part_for(size)
        src = {"Bucket": bucket, "Key": key}
        with self._changed(bucket, key), self._errors(f"copying s3://{bucket}/{key} to {rel}"):
            if size <= part:
                self._s3.copy_object(
                    Bucket=self.bucket,
                    Key=dest,
                    CopySource=src,
                    CopySourceIfMatch=etag,
                    ChecksumAlgorithm="SHA256",
                )
                return "copy"
            up = self._s3.create_multipart_upload(
                Bucket=self.bucket, Key=dest, ChecksumAlgorithm="SHA256"
            )["UploadId"]
            try:
                parts = []
                for i, start in enumerate(range(0, size, part)):
                    got = self._s3.upload_part_copy(
                        Bucket=self.bucket,
                        Key=dest,
                        UploadId=up,
                        PartNumber=i + 1,
                        CopySource=src,
                        CopySourceIfMatch=etag,
                        CopySourceRange=f"bytes={start}-{min(start + part, size) - 1}",
                    )["CopyPartResult"]
                    parts.append(
                        {"PartNumber": i + 1, "ETag": got["ETag"]}
                        | (
                            {"ChecksumSHA256": got["ChecksumSHA256"]}
                            if "ChecksumSHA256" in got
                            else {}
                        )
                    )
                self._s3.complete_multipart_upload(
                    Bucket=self.bucket, Key=dest, UploadId=up, MultipartUpload={"Parts": parts}
                )
            except BaseException:
                self._s3.abort_multipart_upload(Bucket=self.bucket, Key=dest, UploadId=up)
                raise
        return "multipart copy"

    @contextmanager
    def _changed(self, bucket: str, key: str) -> Iterator[None]:
        """A copy's source that no longer has the listed ETag: SourceChanged, naming it."""
        try:
            yield
        except CheckpointError as e:
            cause = e.__cause__
            if isinstance(cause, ClientError) and _code(cause) in ("412", "PreconditionFailed"):
                raise SourceChanged(
                    f"s3://{bucket}/{key} changed after this run listed it (another ETag)"
                ) from None
            raise

    def _get(self, stage: str, rel: str, dest: Path) -> str:
        """Concurrent ranged GETs, written and hashed in offset order as they arrive (see
        `HashingWriter`): the checksum costs no second read of the file."""
        key = self._key(f"versions/{stage}/{rel}")
        with self._errors(f"downloading {rel} of {stage}"), open(dest, "wb") as f:
            out = HashingWriter(f)
            self._s3.download_fileobj(self.bucket, key, out, Config=self._transfer)
        return out.hexdigest()

    def _get_range(self, stage: str, rel: str, start: int, length: int) -> bytes:
        key = self._key(f"versions/{stage}/{rel}")
        with self._errors(f"reading bytes {start}-{start + length - 1} of {rel} of {stage}"):
            return self._s3.get_object(
                Bucket=self.bucket, Key=key, Range=f"bytes={start}-{start + length - 1}"
            )["Body"].read()

    def _size(self, stage: str, rel: str) -> int | None:
        head = self._or_none(
            f"checking {rel}",
            lambda: self._s3.head_object(
                Bucket=self.bucket, Key=self._key(f"versions/{stage}/{rel}")
            ),
        )
        return None if head is None else int(head["ContentLength"])

    def _read_text(self, key: str) -> str | None:
        body = self._or_none(
            f"reading {key}",
            lambda: self._s3.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read(),
        )
        return None if body is None else body.decode()

    def _write_text(self, key: str, text: str) -> None:
        with self._errors(f"writing {key}"):  # one PUT replaces the object atomically
            self._s3.put_object(Bucket=self.bucket, Key=self._key(key), Body=text.encode())

    def _list(self, prefix: str) -> list[str]:
        root = self._key("")
        with self._errors(f"listing {prefix}"):
            pages = self._s3.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._key(prefix)
            )
            return [obj["Key"][len(root) :] for page in pages for obj in page.get("Contents", [])]

    def _version_dirs(self) -> dict[str, bool]:
        dirs: dict[str, bool] = {}
        for key in self._list("versions/"):
            name, _, rest = key.removeprefix("versions/").partition("/")
            dirs[name] = dirs.get(name, False) or rest == MANIFEST
        return dirs

    def _delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": self._key(k)} for k in keys[i : i + 1000]]
            with self._errors(f"deleting {len(batch)} objects"):
                errors = self._s3.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
                ).get("Errors", [])
            if errors:
                raise CheckpointError(
                    f"S3 refused to delete {len(errors)} objects in {self.uri}, first "
                    f"{errors[0].get('Key')}: {errors[0].get('Message')}"
                )


class _BlockReader(io.RawIOBase):
    """A readable file over an iterator of byte blocks (for `upload_fileobj`)."""

    def __init__(self, blocks: Iterable[bytes]) -> None:
        self._it, self._buf = iter(blocks), bytearray()

    def readable(self) -> bool:
        return True

    def read(self, n: int | None = -1) -> bytes:
        while n is None or n < 0 or len(self._buf) < n:
            block = next(self._it, None)
            if block is None:
                break
            self._buf.extend(block)
        take = len(self._buf) if n is None or n < 0 else min(n, len(self._buf))
        out = bytes(self._buf[:take])
        del self._buf[:take]
        return out


def s3_client(cfg: CheckpointConfig, credentials: tuple[str, str] | None = None, pool: int = 10):
    """A boto3 S3 client for `cfg`'s endpoint and region. Small timeouts and a bounded number of
    attempts: an unreachable endpoint fails in seconds, not minutes (`total_max_attempts`
    counts the first try; `max_attempts` would not). `credentials`: keys for this client only;
    None: the standard AWS chain (IRSA on EKS). `pool`: its connection pool."""
    config = Config(
        region_name=cfg.region,
        connect_timeout=3,
        read_timeout=10,
        retries={"total_max_attempts": cfg.max_attempts, "mode": "standard"},
        max_pool_connections=pool,
        s3={"addressing_style": "path"} if cfg.endpoint_url else None,
    )
    keys = (
        {"aws_access_key_id": credentials[0], "aws_secret_access_key": credentials[1]}
        if credentials
        else {}
    )
    return boto3.session.Session(**keys).client("s3", endpoint_url=cfg.endpoint_url, config=config)


def _code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _transient(e: BaseException | None) -> bool:
    """Whether `e`, or what it wraps (s3transfer's upload and download failures wrap the last
    error), is the endpoint unreachable or a server-side error a later call may not meet."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, (*_UNREACHABLE, HTTPClientError)):
            return True
        if isinstance(e, ClientError):
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            return _code(e) in _BUSY or int(status) >= 500
        e, seen = e.__cause__ or e.__context__ or getattr(e, "last_exception", None), seen + 1
    return False
