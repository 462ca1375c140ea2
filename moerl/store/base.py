"""Checkpoint store: publish, list, fetch, pin and prune policy versions in a folder or in S3.

A policy version is a directory of files (an HF safetensors checkpoint). `publish` copies every
file, writes `manifest.json` (path, size, sha256 of each file) last, reads it back, checks that
every object is there with the right size, and only then moves the `latest` pointer. A version
is complete when its manifest exists, so a crash mid-publish never looks like a version, and
retention deletes a version's manifest before its files for the same reason. `fetch` verifies
every file against the manifest while it streams (sha256 updated chunk by chunk as the bytes
arrive, no second read) into a staging folder, renames that folder into place only once every
file matched, and leaves a marker, so a verified copy is reused; a file lock per version lets
processes on one node share a cache folder. Layout under a root or s3://b/prefix:
    versions/v000001/<files>   versions/v000001/manifest.json   latest.json   pins/<holder>.json
This module is the contract; the folder backend is `moerl.store.folder`, the S3 backend
`moerl.store.s3`, and `moerl.store.runs.open_store` picks one (boto3 is imported only for
s3:// URIs). The contract never imports its backends.

Limitations:
- One writer per store: nothing locks publishes, so two publishers of one version interleave.
- Publish checks each stored object's size, not its checksum (re-reading every byte would
  double the cost); fetch checks checksums. A source file that changes while it is published
  gives a manifest that does not match it, and fetch then refuses that version.
- A failed publish leaves files under its version (S3) or a `.tmp-*` folder (local), invisible
  without a manifest; republishing overwrites them, and retention removes them once `latest`
  has passed them. An S3 multipart upload killed midway stays as an incomplete upload: give the
  bucket a lifecycle rule (AbortIncompleteMultipartUpload).
- A publish killed after its manifest is stored but before `latest` moves leaves a complete
  version above `latest`, which publish then refuses to overwrite; `recover` (run by
  `--resume`) adopts it if it verifies, or deletes it. Nothing runs it outside a resume.
- Pins are leases (`moerl.store.leases`): a pin protects its version while its holder renews it
  within `checkpoint.pin_ttl_s`; a holder that dies stops renewing, and retention then deletes
  its version and its pin file. Expiry compares UTC wall clocks on different machines, so the
  TTL must dwarf their skew. A pin protects a version only from retention that starts after
  the pin is written; pin a version before fetching it.
- The fetch cache (`moerl.store.nodecache`) keeps what `prune_cache` leaves: callers prune to the
  newest `checkpoint.cache_keep` versions plus the ones fetched and served. Its lock is
  `fcntl.flock`: it holds on one node's local disk, not across NFS clients.
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
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from moerl.errors import CheckpointError
from moerl.store.leases import PinLeases
from moerl.store.manifest import MANIFEST, FileEntry, Manifest, hash_file, sha256_file, version_dir
from moerl.store.nodecache import MARKER, exclusive, is_verified, lock_path, shared

__all__ = ["MANIFEST", "LATEST", "MARKER", "CheckpointStore", "FileEntry", "HashingWriter", "Manifest",
           "copy_hashed", "sha256_file", "version_dir"]

log = logging.getLogger(__name__)

LATEST = "latest.json"
_VERSION_DIR = re.compile(r"^v(\d{6,})$")
_STAGE_DIR = re.compile(r"^(?:\.tmp-)?v(\d{6,})(?:-[0-9a-f]+)?$")  # a version dir or a local staging dir
_MiB = 1024 * 1024
_COPY_CHUNK = 8 * _MiB  # hashlib releases the GIL on buffers this large, so parallel copies overlap
_R = TypeVar("_R")


class HashingWriter:
    """A write-only, non-seekable file that hashes every byte on its way to `f`.

    Non-seekable on purpose: s3transfer then hands over a concurrent ranged download in offset
    order (it buffers parts that arrive early), so the sha256 covers the bytes exactly as they
    land in the file, with no second read. A retried part is deduplicated by s3transfer before
    it reaches `write`.
    """

    def __init__(self, f: BinaryIO) -> None:
        self._f, self._h, self.size = f, hashlib.sha256(), 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self._h.update(data)
        n = self._f.write(data)
        self.size += len(data)
        return n if n is not None else len(data)

    def seekable(self) -> bool:
        return False

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def copy_hashed(src: Path, dest: Path) -> str:
    """Copy `src` to `dest` in one read pass and return the sha256 of the bytes written."""
    buf, h = bytearray(_COPY_CHUNK), hashlib.sha256()
    view = memoryview(buf)
    with open(src, "rb", buffering=0) as fi, open(dest, "wb", buffering=0) as fo:
        while n := fi.readinto(buf):
            h.update(view[:n])
            done = 0
            while done < n:  # a raw write may be short
                done += fo.write(view[done:n])
    return h.hexdigest()


class CheckpointStore(PinLeases, ABC):
    """Publish/fetch/retention logic for both stores; subclasses supply the object primitives.

    A `stage` is a directory name under versions/: the final `v000001`, or a local temp dir.
    Keys given to `_read_text`/`_write_text`/`_list`/`_delete` are relative to the store root.
    """

    uri: str
    _workers: int = 1  # files copied at once

    @abstractmethod
    def check_access(self) -> None: ...
    @abstractmethod
    def _put(self, stage: str, rel: str, src: Path) -> None: ...
    @abstractmethod
    def _get(self, stage: str, rel: str, dest: Path) -> str: ...  # the sha256 of what it wrote, hashed as it streamed
    @abstractmethod
    def _get_range(self, stage: str, rel: str, start: int, length: int) -> bytes: ...  # one chunk, unverified
    @abstractmethod
    def _size(self, stage: str, rel: str) -> int | None: ...  # None: missing
    @abstractmethod
    def _read_text(self, key: str) -> str | None: ...  # None: missing
    @abstractmethod
    def _write_text(self, key: str, text: str) -> None: ...  # replaces atomically
    @abstractmethod
    def _version_dirs(self) -> dict[str, bool]: ...  # every name under versions/ -> holds a manifest
    @abstractmethod
    def _list(self, prefix: str) -> list[str]: ...  # keys under prefix, recursively
    @abstractmethod
    def _delete(self, keys: list[str]) -> None: ...  # missing keys are fine

    def _begin(self, version: int, exclusive: bool = False) -> str:
        """Where the version's files go. `exclusive`: claim the version create-only first, so a
        second publisher of it fails before writing anything (S3: a conditional write)."""
        return version_dir(version)

    def _commit(self, stage: str, version: int) -> None:
        """Make a staged version visible (local: rename). Its manifest is already written."""

    def _abort(self, stage: str) -> None:
        """Best-effort cleanup after a failed publish."""

    def _delete_stage(self, stage: str) -> None:
        self._delete(self._list(f"versions/{stage}/"))

    def publish(self, version: int, src_dir: Path, meta: dict[str, str] | None = None,
                retention: tuple[int, int] | None = None, exclusive: bool = False, chunk_size: int = 0,
                manifest: Manifest | None = None) -> Manifest:
        """Publish the files under `src_dir` as `version`, then point `latest` at it.

        `chunk_size`: also record each file's sha256 per chunk of that many bytes (fan-out).
        `manifest`: publish under this exact manifest, already computed from the same files
        (the second tier of one version: the cache tier and the durable store then hold the
        same manifest, so one sha256 names the version in both); the files are not hashed
        again, and each must have the size it lists.

        `exclusive=True` (the async trainer, which may race a second trainer of its run): the
        version is claimed create-only before any file is written, so two publishers of one
        version never mix their files under one manifest. A claim left by a killed publish is
        removed by `recover`, which the trainer runs at start. Without it (the sync pipeline,
        whose DAG has one publisher at a time and whose retries re-publish a killed version),
        a version directory without a manifest is overwritten.

        `retention=(keep_last, keep_every)` prunes old versions afterwards (see
        `apply_retention`); a failure there is logged as a warning, never raised.
        """
        t0, src_dir, meta = time.monotonic(), Path(src_dir), dict(meta or {})
        # 1. Refuse anything that would rewrite history, before copying a byte.
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise CheckpointError(f"version must be an int >= 0, got {version!r}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise CheckpointError("manifest meta must map str to str")
        if retention is not None:
            _check_retention(*retention)
        latest = self.latest()
        if version in self.versions():
            raise CheckpointError(f"version {version} already exists in {self.uri}; publish a new version")
        if latest is not None and version <= latest:
            raise CheckpointError(f"version {version} is not greater than latest version {latest} in {self.uri}")
        files = _list_files(src_dir)
        if manifest is not None:
            _check_same_files(manifest, version, src_dir, files)
        stage = self._begin(version, exclusive)
        try:
            # 2. Copy every file, hashing each one just before it is copied (unless given).
            if manifest is None:
                entries = self._map(lambda rel: self._put_hashed(stage, rel, src_dir / rel, chunk_size), files)
                created = datetime.now(timezone.utc).isoformat(timespec="seconds")
                manifest = Manifest(version, tuple(entries), created, meta, chunk_size)
            else:
                self._map(lambda rel: self._put(stage, rel, src_dir / rel), files)
            # 3. The manifest goes last: its presence is what makes a version complete.
            self._write_text(f"versions/{stage}/{MANIFEST}", manifest.to_json())
            # 4. Read it back and check that every object is there with the right size.
            self._verify_stored(stage, manifest)
            self._commit(stage, version)
        except BaseException:
            self._abort(stage)
            raise
        # 5. Only now move the pointer.
        self._point_latest(manifest)
        log.info("published version %d to %s: %d files, %.1f MiB in %.1f s", version, self.uri, len(files),
                 sum(e.size for e in manifest.files) / _MiB, time.monotonic() - t0)
        # 6. Prune. The version is published whatever happens here, so nothing here may fail it.
        if retention is not None:
            try:
                self.apply_retention(*retention)
            except Exception as e:  # noqa: BLE001 (housekeeping must not undo a successful publish)
                log.warning("retention after publishing version %d in %s failed: %s", version, self.uri, e)
        return manifest

    def latest(self) -> int | None:
        text = self._read_text(LATEST)
        try:
            return None if text is None else int(json.loads(text)["version"])
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"malformed {LATEST} in {self.uri} ({e!r}); republish a version") from e

    def require_lineage(self) -> int:
        """The latest version; raises when nothing was ever published under this URI."""
        latest = self.latest()
        if latest is None:
            raise CheckpointError(f"no published versions under {self.uri}; check checkpoint.uri")
        return latest

    def versions(self) -> list[int]:
        """Complete versions (those with a manifest), ascending."""
        return _complete(self._version_dirs())

    def manifest(self, version: int) -> Manifest:
        text = self._read_text(f"versions/{version_dir(version)}/{MANIFEST}")
        if text is None:
            raise CheckpointError(f"version {version} not found in {self.uri} (no manifest); "
                                  f"complete versions: {self.versions()}")
        m = Manifest.from_json(text)
        if m.version != version:
            raise CheckpointError(f"the manifest under {version_dir(version)} says version {m.version}")
        return m

    def fetch(self, version: int, dest_dir: Path, exclude: tuple[str, ...] = (), expect_sha256: str | None = None) -> Path:
        """Download `version` into dest_dir/v{version:06d}, verified; reuse a verified copy.

        `exclude`: path prefixes not to fetch (rollout engines skip `trainer/`, the optimizer
        state). A full copy serves any request; a partial one only requests excluding as much.
        Processes on one node may fetch into one dest_dir at once: a lock file per version makes
        the second wait for the first and then reuse its copy. `expect_sha256`: refuse a version
        whose manifest is not this one (another tier's copy, a store changed under the run).
        """
        t0, manifest, dest_dir = time.monotonic(), self.manifest(version), Path(dest_dir)
        if expect_sha256 is not None and manifest.sha256() != expect_sha256:
            raise CheckpointError(f"version {version} in {self.uri} has manifest sha256 {manifest.sha256()}, not the "
                                  f"expected {expect_sha256}")
        wanted = [e for e in manifest.files if not e.path.startswith(tuple(exclude))] if exclude else list(manifest.files)
        final = dest_dir / version_dir(version)
        try:
            dest_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"cannot create cache folder {dest_dir}: {e}; fix checkpoint.cache_dir") from e
        with shared(lock_path(dest_dir, version)):  # fast path: readers of a verified copy never wait on each other
            if is_verified(final, manifest, tuple(exclude)):
                log.info("version %d: reusing verified copy %s", version, final)
                return final
        with exclusive(lock_path(dest_dir, version)):
            if is_verified(final, manifest, tuple(exclude)):
                log.info("version %d: reusing verified copy %s", version, final)
                return final
            tmp = dest_dir / f".tmp-{version_dir(version)}-{uuid.uuid4().hex[:8]}"
            try:
                tmp.mkdir()
                self._map(lambda e: self._get_verified(version, e, tmp), wanted)
                (tmp / MANIFEST).write_text(manifest.to_json())
                (tmp / MARKER).write_text(manifest.sha256() + "".join(f"\nexclude={p}" for p in sorted(exclude)))
                if final.exists():  # an unverified leftover
                    shutil.rmtree(final)
                os.replace(tmp, final)
            except OSError as e:
                raise CheckpointError(f"cannot write version {version} into {dest_dir}: {e}") from e
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        log.info("fetched version %d from %s to %s in %.1f s", version, self.uri, final, time.monotonic() - t0)
        return final

    def read_chunk(self, version: int, rel: str, start: int, length: int) -> bytes:
        """`length` bytes of a version's file from `start` (a fan-out chunk; the caller checks
        it against the manifest's chunk hash)."""
        if length <= 0:  # an empty file's one chunk: no request (`bytes=0--1` is not a range)
            return b""
        return self._get_range(version_dir(version), rel, start, length)

    def apply_retention(self, keep_last: int, keep_every: int, pinned: Iterable[int] = frozenset()) -> list[int]:
        """Delete old versions; return the deleted ones, ascending.

        Kept: the newest `keep_last` complete versions, every multiple of `keep_every` (if > 0),
        `latest`, version 0, `pinned` and every version a live lease pins. Each deletion removes
        the manifest first, so a half-deleted version is never complete. Leftovers of failed
        publishes and deletions at or below `latest` are removed too, and so are expired pins.
        """
        _check_retention(keep_last, keep_every)
        dirs, latest, now, leases = self._version_dirs(), self.latest(), self.clock(), self._leases()
        versions = _complete(dirs)
        keep = set(versions[-keep_last:]) | {0, *pinned} | {lease.version for _, _, lease in leases if lease.live(now)}
        keep |= {v for v in versions if keep_every > 0 and v % keep_every == 0}
        keep |= set() if latest is None else {latest}
        deleted, failed = [], []
        for v in (v for v in versions if v not in keep):
            try:
                self._delete([f"versions/{version_dir(v)}/{MANIFEST}"])  # first: v is no longer complete
                self._delete_stage(version_dir(v))
                deleted.append(v)
            except CheckpointError as e:
                failed.append(f"version {v}: {e}")
        for d in (d for d, complete in dirs.items() if _is_leftover(d, complete, latest)):
            try:
                self._delete_stage(d)
            except CheckpointError as e:
                failed.append(f"leftover {d}: {e}")
        try:
            if dropped := self._drop_expired(leases, now):
                log.info("retention in %s removed expired pins %s", self.uri, dropped)
        except CheckpointError as e:
            failed.append(f"expired pins: {e}")
        if deleted:
            log.info("retention in %s deleted versions %s; kept %s", self.uri, deleted, sorted(keep & set(versions)))
        if failed:
            raise CheckpointError(f"retention in {self.uri} deleted {deleted} but failed on: {'; '.join(failed)}")
        return deleted

    def recover(self) -> int | None:
        """Repair what a writer killed mid-publish left above `latest`; return the new `latest`.

        Call it only while nothing publishes (one writer per store): resume calls it before the
        pipeline starts. The newest complete version above `latest` that verifies as publish
        verifies before it moves `latest` (the manifest reads back as itself, every object is
        there with its size) becomes `latest`. Every other version or staging folder above
        `latest` (no manifest, a missing or short object) is deleted, manifest first. Checksums
        are not re-read, as in publish: that would download the whole version, and fetch checks
        every checksum before anything uses it.
        """
        latest, dirs = self.latest(), self._version_dirs()
        good: dict[int, Manifest] = {}
        above = sorted((int(m.group(1)), d) for d in dirs
                       if (m := _STAGE_DIR.match(d)) and (latest is None or int(m.group(1)) > latest))
        for v, d in above:
            why = "a staging folder" if not _VERSION_DIR.match(d) else None if dirs[d] else "no manifest"
            if why is None:
                try:
                    good[v] = self.manifest(v)
                    self._verify_stored(d, good[v])
                    continue
                except CheckpointError as e:
                    good.pop(v, None)
                    why = str(e)
            log.warning("recovery in %s: deleting %s, above latest %s: %s", self.uri, d, latest, why)
            self._delete([f"versions/{d}/{MANIFEST}"])
            self._delete_stage(d)
        if not good:
            return latest
        v = max(good)
        self._point_latest(good[v])
        log.warning("recovery in %s: version %d was complete and verified but latest was %s (a publish died "
                    "before moving it); latest is now %d", self.uri, v, latest, v)
        return v

    def _point_latest(self, manifest: Manifest) -> None:
        self._write_text(LATEST, json.dumps({"version": manifest.version, "manifest_sha256": manifest.sha256()}) + "\n")

    def _map(self, fn: Callable[[Any], _R], items: Iterable[Any]) -> list[_R]:
        ex = ThreadPoolExecutor(max_workers=self._workers)
        try:
            return list(ex.map(fn, items))
        finally:  # after the first failure, start no more copies
            ex.shutdown(wait=True, cancel_futures=True)

    def _put_hashed(self, stage: str, rel: str, src: Path, chunk_size: int = 0) -> FileEntry:
        try:
            entry = FileEntry(rel, *hash_file(src, chunk_size))
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
        """Download one file into the staging folder, hashed as it streams; refuse a mismatch.

        The bytes land only under `tmp`: fetch renames that folder to its final name after every
        file passed, so a corrupt or short object never shows up at the final path.
        """
        dest = tmp / e.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        sha = self._get(version_dir(version), e.path, dest)
        size = dest.stat().st_size
        if size != e.size or sha != e.sha256:
            raise CheckpointError(f"{e.path} of version {version} in {self.uri} is corrupt: expected sha256 "
                                  f"{e.sha256} ({e.size} bytes), got sha256 {sha} ({size} bytes); republish it")


def _complete(dirs: dict[str, bool]) -> list[int]:
    return sorted(int(m.group(1)) for d, complete in dirs.items() if complete and (m := _VERSION_DIR.match(d)))


def _is_leftover(name: str, complete: bool, latest: int | None) -> bool:
    """An incomplete version or a staging dir at or below `latest`: publish refuses those
    numbers, so no publish can be writing there (one writer per store)."""
    m = _STAGE_DIR.match(name)
    return bool(m and latest is not None and int(m.group(1)) <= latest and not (complete and _VERSION_DIR.match(name)))


def _check_retention(keep_last: int, keep_every: int) -> None:
    if keep_last < 1 or keep_every < 0:
        raise CheckpointError(f"retention needs keep_last >= 1 and keep_every >= 0, got {keep_last}, {keep_every}")


def _check_same_files(manifest: Manifest, version: int, src: Path, files: list[str]) -> None:
    """A given manifest must describe exactly the files about to be published."""
    if manifest.version != version:
        raise CheckpointError(f"publish: the given manifest is version {manifest.version}, not {version}")
    listed = {e.path: e.size for e in manifest.files}
    if set(files) != set(listed):
        raise CheckpointError(f"publish of version {version}: {src} holds {sorted(set(files) ^ set(listed))[:5]} "
                              "that its manifest does not list, or lacks them")
    for rel in files:
        if (src / rel).stat().st_size != listed[rel]:
            raise CheckpointError(f"publish of version {version}: {rel} is {(src / rel).stat().st_size} bytes, "
                                  f"its manifest says {listed[rel]}; the folder changed since it was hashed")


def _list_files(src: Path) -> list[str]:
    if not src.is_dir():
        raise CheckpointError(f"{src} is not a directory; pass the checkpoint folder")
    files = sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file())
    if not files:
        raise CheckpointError(f"{src} holds no files; nothing to publish")
    if reserved := {MANIFEST, MARKER} & set(files):
        raise CheckpointError(f"{src} contains {sorted(reserved)}, names the store reserves; remove them")
    return files
