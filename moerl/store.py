"""Checkpoint store: publish, list and fetch policy versions in a local folder or in S3.

A policy version is a directory of files (an HF safetensors checkpoint). `publish` copies every
file, writes `manifest.json` (path, size, sha256 of each file) last, reads it back, checks that
every object is there with the right size, and only then moves the `latest` pointer. A version
is complete when its manifest exists, so a crash mid-publish never looks like a version.
`fetch` verifies every file against the manifest and leaves a marker, so a verified copy is
reused. Layout under a local root or s3://bucket/prefix:
    versions/v000001/<files>   versions/v000001/manifest.json   latest.json

Limitations:
- One writer per store: nothing locks, so two publishers of one version can interleave.
  Concurrent fetches into one dest_dir are not coordinated either.
- Publish checks each stored object's size, not its checksum (re-reading every byte would
  double the cost); fetch checks checksums. A source file that changes while it is published
  gives a manifest that does not match it, and fetch then refuses that version.
- A failed S3 publish leaves its objects under the version prefix, invisible without a
  manifest; republishing the version overwrites them, nothing deletes them. Nothing
  garbage-collects old versions or cached copies.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

import boto3
from boto3.exceptions import Boto3Error
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, ConnectTimeoutError, EndpointConnectionError
from botocore.exceptions import NoCredentialsError

from moerl.config import CheckpointConfig
from moerl.errors import CheckpointError

log = logging.getLogger(__name__)

MANIFEST, LATEST = "manifest.json", "latest.json"
MARKER = ".moerl-verified"  # written into a fetched copy once verified; holds the manifest's sha256
_VERSION_DIR = re.compile(r"^v(\d{6,})$")
_MISSING = {"404", "NoSuchKey", "NotFound"}
_MiB = 1024 * 1024
_R = TypeVar("_R")


def version_dir(version: int) -> str:
    return f"v{version:06d}"


def sha256_file(path: str | os.PathLike[str]) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the version directory, '/'-separated
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    version: int
    files: tuple[FileEntry, ...]
    created_at: str  # UTC, ISO 8601
    meta: dict[str, str] = field(default_factory=dict)  # small labels: git sha, run id, ...

    def to_json(self) -> str:
        files = [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in self.files]
        body = {"version": self.version, "created_at": self.created_at,
                "meta": dict(sorted(self.meta.items())), "files": files}
        return json.dumps(body, indent=1) + "\n"

    @staticmethod
    def from_json(text: str) -> Manifest:
        try:
            d = json.loads(text)
            files = tuple(FileEntry(str(f["path"]), int(f["size"]), str(f["sha256"])) for f in d["files"])
            meta = {str(k): str(v) for k, v in d.get("meta", {}).items()}
            m = Manifest(int(d["version"]), files, str(d["created_at"]), meta)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"malformed manifest ({e!r}); republish this version") from e
        for f in m.files:  # a manifest must not make fetch write outside its folder
            p = PurePosixPath(f.path)
            if p.is_absolute() or ".." in p.parts or not p.parts or "\\" in f.path:
                raise CheckpointError(f"manifest of version {m.version} has an unsafe path {f.path!r}")
        return m

    def sha256(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()


class CheckpointStore(ABC):
    """Publish/fetch logic for both stores; subclasses supply the object primitives.

    A `stage` is a directory name under versions/: the final `v000001`, or a local temp dir.
    Keys given to `_read_text`/`_write_text` are relative to the store root.
    """

    uri: str
    _workers: int = 1  # files copied at once

    @abstractmethod
    def check_access(self) -> None: ...
    @abstractmethod
    def _put(self, stage: str, rel: str, src: Path) -> None: ...
    @abstractmethod
    def _get(self, stage: str, rel: str, dest: Path) -> None: ...
    @abstractmethod
    def _size(self, stage: str, rel: str) -> int | None: ...  # None: missing
    @abstractmethod
    def _read_text(self, key: str) -> str | None: ...  # None: missing
    @abstractmethod
    def _write_text(self, key: str, text: str) -> None: ...  # replaces atomically
    @abstractmethod
    def _version_dirs(self) -> list[str]: ...  # names under versions/ that hold a manifest

    def _begin(self, version: int) -> str:
        return version_dir(version)

    def _commit(self, stage: str, version: int) -> None:
        """Make a staged version visible (local: rename). Its manifest is already written."""

    def _abort(self, stage: str) -> None:
        """Best-effort cleanup after a failed publish."""

    def publish(self, version: int, src_dir: Path, meta: dict[str, str] | None = None) -> Manifest:
        """Publish the files under `src_dir` as `version`, then point `latest` at it."""
        t0, src_dir, meta = time.monotonic(), Path(src_dir), dict(meta or {})
        # 1. Refuse anything that would rewrite history, before copying a byte.
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise CheckpointError(f"version must be an int >= 0, got {version!r}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise CheckpointError("manifest meta must map str to str")
        latest = self.latest()
        if version in self.versions():
            raise CheckpointError(f"version {version} already exists in {self.uri}; publish a new version")
        if latest is not None and version <= latest:
            raise CheckpointError(f"version {version} is not greater than latest version {latest} in {self.uri}")
        files = _list_files(src_dir)
        stage = self._begin(version)
        try:
            # 2. Copy every file, hashing each one just before it is copied.
            entries = self._map(lambda rel: self._put_hashed(stage, rel, src_dir / rel), files)
            created = datetime.now(timezone.utc).isoformat(timespec="seconds")
            manifest = Manifest(version, tuple(entries), created, meta)
            # 3. The manifest goes last: its presence is what makes a version complete.
            self._write_text(f"versions/{stage}/{MANIFEST}", manifest.to_json())
            # 4. Read it back and check that every object is there with the right size.
            self._verify_stored(stage, manifest)
            self._commit(stage, version)
        except BaseException:
            self._abort(stage)
            raise
        # 5. Only now move the pointer.
        self._write_text(LATEST, json.dumps({"version": version, "manifest_sha256": manifest.sha256()}) + "\n")
        log.info("published version %d to %s: %d files, %.1f MiB in %.1f s", version, self.uri, len(files),
                 sum(e.size for e in entries) / _MiB, time.monotonic() - t0)
        return manifest

    def latest(self) -> int | None:
        text = self._read_text(LATEST)
        try:
            return None if text is None else int(json.loads(text)["version"])
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"malformed {LATEST} in {self.uri} ({e!r}); republish a version") from e

    def versions(self) -> list[int]:
        """Complete versions (those with a manifest), ascending."""
        return sorted(int(m.group(1)) for d in self._version_dirs() if (m := _VERSION_DIR.match(d)))

    def manifest(self, version: int) -> Manifest:
        text = self._read_text(f"versions/{version_dir(version)}/{MANIFEST}")
        if text is None:
            raise CheckpointError(f"version {version} not found in {self.uri} (no manifest); "
                                  f"complete versions: {self.versions()}")
        m = Manifest.from_json(text)
        if m.version != version:
            raise CheckpointError(f"the manifest under {version_dir(version)} says version {m.version}")
        return m

    def fetch(self, version: int, dest_dir: Path) -> Path:
        """Download `version` into dest_dir/v{version:06d}, verified; reuse a verified copy."""
        t0, manifest, dest_dir = time.monotonic(), self.manifest(version), Path(dest_dir)
        final = dest_dir / version_dir(version)
        if _is_verified(final, manifest):
            log.info("version %d: reusing verified copy %s", version, final)
            return final
        tmp = dest_dir / f".tmp-{version_dir(version)}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir(parents=True)
            self._map(lambda e: self._get_verified(version, e, tmp), manifest.files)
            (tmp / MANIFEST).write_text(manifest.to_json())
            (tmp / MARKER).write_text(manifest.sha256())
            if not _is_verified(final, manifest):  # else another fetcher won the race
                if final.exists():  # an unverified leftover
                    shutil.rmtree(final)
                os.replace(tmp, final)
        except OSError as e:
            raise CheckpointError(f"cannot write version {version} into {dest_dir}: {e}") from e
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("fetched version %d from %s to %s in %.1f s", version, self.uri, final, time.monotonic() - t0)
        return final

    def _map(self, fn: Callable[[Any], _R], items: Iterable[Any]) -> list[_R]:
        ex = ThreadPoolExecutor(max_workers=self._workers)
        try:
            return list(ex.map(fn, items))
        finally:  # after the first failure, start no more copies
            ex.shutdown(wait=True, cancel_futures=True)

    def _put_hashed(self, stage: str, rel: str, src: Path) -> FileEntry:
        try:
            entry = FileEntry(rel, src.stat().st_size, sha256_file(src))
        except OSError as e:
            raise CheckpointError(f"cannot read {src}: {e}; is the checkpoint folder complete?") from e
        self._put(stage, rel, src)
        return entry

    def _verify_stored(self, stage: str, manifest: Manifest) -> None:
        v = manifest.version
        if self._read_text(f"versions/{stage}/{MANIFEST}") != manifest.to_json():
            raise CheckpointError(f"the manifest of version {v} did not read back as written in {self.uri}; retry")
        sizes = self._map(lambda e: self._size(stage, e.path), manifest.files)
        for e, size in zip(manifest.files, sizes):
            if size != e.size:
                raise CheckpointError(f"{e.path} of version {v} in {self.uri}: expected {e.size} bytes, "
                                      f"found {'nothing' if size is None else size}; retry the publish")

    def _get_verified(self, version: int, e: FileEntry, tmp: Path) -> None:
        dest = tmp / e.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        self._get(version_dir(version), e.path, dest)
        size, sha = dest.stat().st_size, sha256_file(dest)
        if size != e.size or sha != e.sha256:
            raise CheckpointError(f"{e.path} of version {version} in {self.uri} is corrupt: expected sha256 "
                                  f"{e.sha256} ({e.size} bytes), got sha256 {sha} ({size} bytes); republish it")


def _list_files(src: Path) -> list[str]:
    if not src.is_dir():
        raise CheckpointError(f"{src} is not a directory; pass the checkpoint folder")
    files = sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file())
    if not files:
        raise CheckpointError(f"{src} holds no files; nothing to publish")
    if reserved := {MANIFEST, MARKER} & set(files):
        raise CheckpointError(f"{src} contains {sorted(reserved)}, names the store reserves; remove them")
    return files


def _is_verified(final: Path, manifest: Manifest) -> bool:
    """A marker holding this manifest's sha256, and every file present with the right size."""
    try:
        return ((final / MARKER).read_text() == manifest.sha256()
                and all((final / e.path).stat().st_size == e.size for e in manifest.files))
    except OSError:
        return False


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore(CheckpointStore):
    """A folder. A publish is staged in versions/.tmp-* and renamed into place once complete."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.uri = str(self.root)

    def check_access(self) -> None:
        try:
            (self.root / "versions").mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"cannot create checkpoint folder {self.root}: {e}; fix checkpoint.uri") from e
        if not os.access(self.root / "versions", os.W_OK):
            raise CheckpointError(f"checkpoint folder {self.root} is not writable; fix its permissions")

    def _path(self, stage: str, rel: str = "") -> Path:
        return self.root / "versions" / stage / rel

    def _begin(self, version: int) -> str:
        self.check_access()
        stage = f".tmp-{version_dir(version)}-{uuid.uuid4().hex[:8]}"
        self._path(stage).mkdir()
        return stage

    def _commit(self, stage: str, version: int) -> None:
        final = self._path(version_dir(version))
        if final.exists():  # it has no manifest, or publish would have refused: debris
            log.warning("replacing incomplete version directory %s", final)
            shutil.rmtree(final)
        os.replace(self._path(stage), final)
        _fsync(final.parent)

    def _abort(self, stage: str) -> None:
        shutil.rmtree(self._path(stage), ignore_errors=True)

    def _put(self, stage: str, rel: str, src: Path) -> None:
        dst = self._path(stage, rel)
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
            _fsync(dst)  # the rename that publishes must not outrun the data
        except OSError as e:
            raise CheckpointError(f"cannot copy {src} into {self.root}: {e}") from e

    def _get(self, stage: str, rel: str, dest: Path) -> None:
        try:
            shutil.copyfile(self._path(stage, rel), dest)
        except FileNotFoundError as e:
            raise CheckpointError(f"{rel} of {stage} is missing from {self.root}; republish it") from e

    def _size(self, stage: str, rel: str) -> int | None:
        p = self._path(stage, rel)
        return p.stat().st_size if p.is_file() else None

    def _read_text(self, key: str) -> str | None:
        try:
            return (self.root / key).read_text()
        except FileNotFoundError:
            return None

    def _write_text(self, key: str, text: str) -> None:
        path = self.root / key
        tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            tmp.write_text(text)
            _fsync(tmp)
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise CheckpointError(f"cannot write {path}: {e}") from e

    def _version_dirs(self) -> list[str]:
        d = self.root / "versions"
        return [v.name for v in d.iterdir() if (v / MANIFEST).is_file()] if d.is_dir() else []


class S3Store(CheckpointStore):
    """s3://bucket/prefix. Credentials come only from the standard AWS chain (env, profile, IRSA)."""

    def __init__(self, cfg: CheckpointConfig) -> None:
        self.uri = cfg.uri
        self.bucket, _, prefix = cfg.uri.removeprefix("s3://").partition("/")
        self.prefix = prefix.strip("/")
        self.endpoint = cfg.endpoint_url or "the default AWS endpoint"
        self._workers = min(4, cfg.max_concurrency)
        # Small timeouts, 5 attempts: an unreachable endpoint fails within about 30 s, not minutes.
        # Path-style addressing, because S3-compatible servers rarely serve bucket host names.
        config = Config(region_name=cfg.region, connect_timeout=3, read_timeout=10,
                        retries={"max_attempts": 5, "mode": "standard"},
                        max_pool_connections=cfg.max_concurrency * self._workers,
                        s3={"addressing_style": "path"} if cfg.endpoint_url else None)
        self._s3 = boto3.session.Session().client("s3", endpoint_url=cfg.endpoint_url, config=config)
        chunk = cfg.multipart_chunk_mb * _MiB
        self._transfer = TransferConfig(multipart_threshold=chunk, multipart_chunksize=chunk,
                                        max_concurrency=cfg.max_concurrency)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        """Turn botocore failures into CheckpointErrors; their messages carry no credentials."""
        try:
            yield
        except (EndpointConnectionError, ConnectTimeoutError) as e:
            raise CheckpointError(f"cannot reach S3 endpoint {self.endpoint} while {what}: {e}; "
                                  "check checkpoint.endpoint_url and the network") from e
        except NoCredentialsError as e:
            raise CheckpointError(f"no AWS credentials while {what}; provide them through the standard "
                                  "chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile, IRSA)") from e
        except (ClientError, BotoCoreError, Boto3Error) as e:
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

    def check_access(self) -> None:
        with self._errors(f"checking bucket {self.bucket!r}"):
            try:
                self._s3.head_bucket(Bucket=self.bucket)
            except ClientError as e:
                if _code(e) in _MISSING | {"NoSuchBucket"}:
                    raise CheckpointError(f"bucket {self.bucket!r} does not exist at {self.endpoint}; "
                                          "create it or fix checkpoint.uri") from e
                if _code(e) in ("403", "AccessDenied", "Forbidden"):
                    raise CheckpointError(f"access to bucket {self.bucket!r} at {self.endpoint} is denied; "
                                          "check the AWS credentials (env, profile, IRSA)") from e
                raise

    def _abort(self, stage: str) -> None:
        try:  # without its manifest the partial version stays invisible
            self._s3.delete_object(Bucket=self.bucket, Key=self._key(f"versions/{stage}/{MANIFEST}"))
        except (ClientError, BotoCoreError) as e:
            log.warning("could not remove the manifest of failed publish %s: %s", stage, e)

    def _put(self, stage: str, rel: str, src: Path) -> None:
        key = self._key(f"versions/{stage}/{rel}")
        with self._errors(f"uploading {rel}"):
            self._s3.upload_file(str(src), self.bucket, key, Config=self._transfer)

    def _get(self, stage: str, rel: str, dest: Path) -> None:
        key = self._key(f"versions/{stage}/{rel}")
        with self._errors(f"downloading {rel} of {stage}"):
            self._s3.download_file(self.bucket, key, str(dest), Config=self._transfer)

    def _size(self, stage: str, rel: str) -> int | None:
        head = self._or_none(f"checking {rel}", lambda: self._s3.head_object(
            Bucket=self.bucket, Key=self._key(f"versions/{stage}/{rel}")))
        return None if head is None else int(head["ContentLength"])

    def _read_text(self, key: str) -> str | None:
        body = self._or_none(f"reading {key}", lambda: self._s3.get_object(
            Bucket=self.bucket, Key=self._key(key))["Body"].read())
        return None if body is None else body.decode()

    def _write_text(self, key: str, text: str) -> None:
        with self._errors(f"writing {key}"):  # one PUT replaces the object atomically
            self._s3.put_object(Bucket=self.bucket, Key=self._key(key), Body=text.encode())

    def _version_dirs(self) -> list[str]:
        root, names = self._key("versions/"), []
        with self._errors("listing versions"):
            for page in self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=root):
                for obj in page.get("Contents", []):
                    name, _, rest = obj["Key"][len(root):].partition("/")
                    if rest == MANIFEST:
                        names.append(name)
        return names


def _code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def open_store(cfg: CheckpointConfig) -> CheckpointStore:
    """`s3://bucket/prefix` gives an S3Store; anything else is a local folder."""
    return S3Store(cfg) if cfg.uri.startswith("s3://") else LocalStore(Path(cfg.uri))
