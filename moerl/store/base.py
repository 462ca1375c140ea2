"""Checkpoint store: publish, list, fetch, pin and prune policy versions in a folder or in S3.

Design, details and limitations: docs/weights.md#moerlstorebasepy.
"""

from __future__ import annotations

import functools
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
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO, Protocol, TypeVar

from moerl.errors import CheckpointError
from moerl.store.fence import CLAIM, Claim, new_owner, older, refused
from moerl.store.leases import PinLeases
from moerl.store.manifest import (
    MANIFEST,
    FileEntry,
    Manifest,
    files_dir,
    hash_file,
    new_objects,
    sha256_file,
    version_dir,
)
from moerl.store.nodecache import MARKER, exclusive, is_verified, lock_path, shared, vouch

__all__ = [
    "MANIFEST",
    "LATEST",
    "MARKER",
    "CheckpointStore",
    "FileEntry",
    "HashingWriter",
    "Manifest",
    "copy_hashed",
    "sha256_file",
    "version_dir",
]

log = logging.getLogger(__name__)

LATEST = "latest.json"
_VERSION_DIR = re.compile(r"^v(\d{6,})$")
# a version dir or a local staging dir
_STAGE_DIR = re.compile(r"^(?:\.tmp-)?v(\d{6,})(?:-[0-9a-f]+)?$")
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


@dataclass(frozen=True)
class _Publishing:
    """One `publish` under way: what its steps share once its stage is open."""

    version: int
    src_dir: Path
    stage: str
    objects: str  # this publish's own object folder ("" where the store has none)
    files_at: str  # where its files go, under `versions/`
    claim: Claim | None  # held while it runs (`exclusive=True` on a store with claims)
    manifest: Manifest | None  # given: the files are not hashed again
    chunk_size: int


class CheckpointStore(PinLeases, ABC):
    """Publish/fetch/retention logic for both stores; subclasses supply the object primitives.

    A `stage` is a directory name under versions/: the final `v000001`, or a local temp dir.
    Keys given to `_read_text`/`_write_text`/`_list`/`_delete` are relative to the store root.
    """

    uri: str
    _workers: int = 1  # files copied at once
    _claims: bool = (
        False  # the backend can write create-only objects (S3); a folder stages privately
    )
    claim_ttl_s: float = 3600.0  # checkpoint.claim_ttl_s: a claim older than this may be removed
    hash_checked: int = 0  # objects the last verification checked by hash, not only by size
    _part_size: int = (
        0  # the publish under way: its manifest's chunk size (S3 uploads parts this size)
    )
    keep_version_zero: bool = (
        True  # retention keeps version 0 (a cache tier need not: the durable store has it)
    )
    # path prefixes this store's copies of a version lack although the manifest lists them (the
    # cache tier: `trainer/`, which only the durable store holds); see docs/weights.md
    absent: tuple[str, ...] = ()

    @abstractmethod
    def check_access(self, missing_ok: bool = False) -> bool:
        """Whether the store exists, raising when it cannot be reached or written. `missing_ok`:
        a store that does not exist yet is not an error (False)."""

    @abstractmethod
    def _put(self, stage: str, rel: str, src: Path) -> None: ...
    @abstractmethod
    def _get(
        self, stage: str, rel: str, dest: Path
    ) -> str: ...  # the sha256 of what it wrote, hashed as it streamed
    @abstractmethod
    def _get_range(
        self, stage: str, rel: str, start: int, length: int
    ) -> bytes: ...  # one chunk, unverified
    @abstractmethod
    def _size(self, stage: str, rel: str) -> int | None: ...  # None: missing
    @abstractmethod
    def _read_text(self, key: str) -> str | None: ...  # None: missing
    @abstractmethod
    def _write_text(self, key: str, text: str) -> None: ...  # replaces atomically
    @abstractmethod
    def _version_dirs(
        self,
    ) -> dict[str, bool]: ...  # every name under versions/ -> holds a manifest
    @abstractmethod
    def _list(self, prefix: str) -> list[str]: ...  # keys under prefix, recursively
    @abstractmethod
    def _delete(self, keys: list[str]) -> None: ...  # missing keys are fine

    def _read_tagged(self, key: str) -> tuple[str | None, str | None]:
        """The object's text and a tag that changes whenever it is rewritten (S3: its ETag)."""
        raise NotImplementedError

    def _write_if(self, key: str, text: str, tag: str | None) -> bool:
        """Write only if the object still has `tag` (None: only if it does not exist); False if
        another writer changed it first."""
        raise NotImplementedError

    def _stored(self, stage: str, e: FileEntry, chunk_size: int) -> tuple[int | None, bool | None]:
        """A stored object's size (None: missing) and whether its bytes hash to the manifest's
        (None: the backend reports no hash for it, so only the size can be checked)."""
        return self._size(stage, e.path), None

    def _begin(self, version: int, exclusive: bool = False) -> str:
        """Where the version's files go (a claim, when asked for, is taken by `publish`)."""
        return version_dir(version)

    def _commit(self, stage: str, version: int) -> None:
        """Make a staged version visible (local: rename). Its manifest is already written."""

    def _abort(self, stage: str) -> None:
        """Best-effort cleanup after a failed publish."""

    def _delete_stage(self, stage: str) -> None:
        self._delete(self._list(f"versions/{stage}/"))

    def publish(
        self,
        version: int,
        src_dir: Path,
        meta: dict[str, str] | None = None,
        retention: tuple[int, int] | None = None,
        exclusive: bool = False,
        chunk_size: int = 0,
        manifest: Manifest | None = None,
        epoch: int | None = None,
        owner: str | None = None,
        parts: RemoteParts | None = None,
    ) -> Manifest:
        """Publish the files under `src_dir` as `version`, then point `latest` at it.

        `parts`: the version's other files, which other processes (the trainer mesh's other
        nodes) put into this store themselves, under this publish's claim and stage
        (`put_parts`); the manifest lists theirs with `src_dir`'s, and is written only once
        every part is in.

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

        `epoch`: the trainer's epoch (`moerl.store.fence`): the claim carries it, a writer older
        than an existing claim or than the epoch `latest` records is refused, and `latest` records
        it. `owner`: who writes (default: host, pid and a random token).

        `retention=(keep_last, keep_every)` prunes old versions afterwards (see
        `apply_retention`); a failure there is logged as a warning, never raised.

        A store with `absent` prefixes (the cache tier) does not upload the files under them:
        without `manifest` they are hashed all the same (the manifest lists them exactly as the
        durable store will hold them); with one, `src_dir` may lack them.
        """
        t0, src_dir, meta = time.monotonic(), Path(src_dir), dict(meta or {})
        # 1. Refuse anything that would rewrite history, before copying a byte.
        files = self._refuse_publish(version, src_dir, meta, retention, manifest, parts)
        # a replaced writer copies no byte
        self._check_epoch(epoch, f"publish of version {version}")
        job = self._start_publish(version, src_dir, exclusive, chunk_size, manifest, epoch, owner)
        try:
            # 2. Copy every file, hashing each one just before it is copied (unless given).
            manifest = self._copy_files(job, files, parts, meta)
            # 3. The manifest, 4. read back and checked, 5. then `latest` (`_complete_publish`).
            self._complete_publish(job, manifest, epoch)
        except BaseException:
            self._cleanup_failed(job.stage, version, job.claim)
            raise
        self._log_published(version, manifest, t0)
        # 6. Prune. The version is published whatever happens here, so nothing here may fail it.
        if retention is not None:
            self._retain_after(version, retention)
        return manifest

    def _refuse_publish(
        self,
        version: int,
        src_dir: Path,
        meta: dict[str, str],
        retention: tuple[int, int] | None,
        manifest: Manifest | None,
        parts: RemoteParts | None,
    ) -> list[str]:
        """`publish` step 1: raise if `version` cannot be published from `src_dir` (a bad
        argument, a version that exists or is not above `latest`, files that differ from the
        given `manifest`); return the files to copy."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise CheckpointError(f"version must be an int >= 0, got {version!r}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise CheckpointError("manifest meta must map str to str")
        if retention is not None:
            _check_retention(*retention)
        latest = self.latest()
        if version in self.versions():
            raise CheckpointError(
                f"version {version} already exists in {self.uri}; publish a new version"
            )
        if latest is not None and version <= latest:
            raise CheckpointError(
                f"version {version} is not greater than latest version {latest} in {self.uri}"
            )
        files = _list_files(src_dir)
        if manifest is not None:
            _check_same_files(
                manifest, version, src_dir, files, partial=parts is not None, absent=self.absent
            )
        return files

    def _start_publish(
        self,
        version: int,
        src_dir: Path,
        exclusive: bool,
        chunk_size: int,
        manifest: Manifest | None,
        epoch: int | None,
        owner: str | None,
    ) -> _Publishing:
        """Claim `version` (if `exclusive`) and open its stage, before any file is copied."""
        owner = owner or new_owner()
        # the claim, before any file: a writer older than the version's claim is refused here
        claim = self._claim(version, epoch, owner) if exclusive and self._claims else None
        # this publish's own object folder (a store whose writers share the version's keys:
        # S3), which the manifest names; the second tier's copy uses the first's
        objects = (
            manifest.objects if manifest is not None else new_objects() if self._claims else ""
        )
        # upload parts the size of the manifest's chunks, so a multipart object's checksum can be
        # checked against the chunk hashes (S3's composite SHA-256; see `_stored`)
        self._part_size = manifest.chunk_size if manifest is not None else chunk_size
        stage = self._begin(version, exclusive)
        return _Publishing(
            version, src_dir, stage, objects, files_dir(stage, objects), claim, manifest, chunk_size
        )

    def _put_file(self, job: _Publishing, rel: str) -> FileEntry | None:
        """Copy one file of `job` (hashed unless its manifest is given)."""
        if job.claim is not None:  # fenced since? stop within one file
            self._check_claim(job.version, job.claim)
        if job.manifest is None:
            return self._put_hashed(job.files_at, rel, job.src_dir / rel, job.chunk_size)
        if self.holds(rel):
            self._put(job.files_at, rel, job.src_dir / rel)
        return None

    def _copy_files(
        self, job: _Publishing, files: list[str], parts: RemoteParts | None, meta: dict[str, str]
    ) -> Manifest:
        """`publish` step 2: copy every file (and wait for the other nodes' `parts`); return
        the manifest: the given one, or one built from the hashes taken while copying."""
        entries = self._map(functools.partial(self._put_file, job), files)
        if parts is not None:  # the other nodes' files, put by them under this claim
            theirs = parts.put(
                self, job.version, job.files_at, job.claim, job.manifest, job.chunk_size
            )
            entries += theirs
            _check_parts(job.version, files, theirs, job.manifest, self.absent)
        if job.manifest is not None:
            return job.manifest
        created = datetime.now(UTC).isoformat(timespec="seconds")
        return Manifest(
            job.version,
            tuple(e for e in entries if e is not None),
            created,
            meta,
            job.chunk_size,
            job.objects,
        )

    def _complete_publish(self, job: _Publishing, manifest: Manifest, epoch: int | None) -> None:
        """`publish` steps 3 to 5: write the manifest, check the stored files against it,
        commit the stage, then move `latest`."""
        version, claim = job.version, job.claim
        # 3. The manifest goes last: its presence is what makes a version complete. Under a
        # claim it is written create-only: of two writers of one version, one manifest.
        key = f"versions/{job.stage}/{MANIFEST}"
        if claim is not None:
            self._check_claim(version, claim)
            # the same text: this publish's own write, whose reply was lost (its objects folder
            # and time make a manifest its writer's), retried by the client into a 412
            text = manifest.to_json()
            if not self._write_if(key, text, None) and self._read_text(key) != text:
                raise CheckpointError(
                    f"version {version} in {self.uri}: another writer's manifest appeared "
                    "while this publish ran; this one stops"
                )
        else:
            self._write_text(key, manifest.to_json())
        # 4. Read it back and check every object against it (by hash where the backend has one).
        self._verify_stored(job.stage, manifest)
        if claim is not None:
            self._check_claim(version, claim)
        self._commit(job.stage, version)
        # 5. Only now move the pointer: a compare-and-set that an older epoch cannot pass.
        self._point_latest(manifest, epoch)

    def _log_published(self, version: int, manifest: Manifest, t0: float) -> None:
        log.info(
            "published version %d to %s: %d files, %.1f MiB in %.1f s%s",
            version,
            self.uri,
            sum(1 for e in manifest.files if self.holds(e.path)),
            sum(e.size for e in manifest.files if self.holds(e.path)) / _MiB,
            time.monotonic() - t0,
            f" (not stored here: {', '.join(self.absent)})" if self.absent else "",
        )

    def _retain_after(self, version: int, retention: tuple[int, int]) -> None:
        """`publish` step 6: prune, logging a failure as a warning instead of raising it."""
        try:
            self.apply_retention(*retention)
        except Exception as e:  # noqa: BLE001 (housekeeping must not undo a successful publish)
            log.warning(
                "retention after publishing version %d in %s failed: %s", version, self.uri, e
            )

    def holds(self, rel: str) -> bool:
        """Whether this store's copies hold the file `rel` (False: under an `absent` prefix)."""
        return not (self.absent and rel.startswith(self.absent))

    def latest(self) -> int | None:
        return self._latest_doc(self._read_text(LATEST))["version"]

    def latest_epoch(self) -> int | None:
        """The trainer epoch that last moved or fenced `latest` (None: no fenced writer yet)."""
        return self._latest_doc(self._read_text(LATEST))["epoch"]

    def _latest_doc(self, text: str | None) -> dict[str, Any]:
        """`latest.json` as {version, manifest_sha256, epoch}; `version` is None when nothing was
        published or only a fence was written (a new trainer's epoch before its first version)."""
        if text is None:
            return {"version": None, "manifest_sha256": None, "epoch": None}
        try:
            d = json.loads(text)
            return {
                "version": None if d["version"] is None else int(d["version"]),
                "manifest_sha256": d.get("manifest_sha256"),
                "epoch": None if d.get("epoch") is None else int(d["epoch"]),
            }
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(
                f"malformed {LATEST} in {self.uri} ({e!r}); republish a version"
            ) from e

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
            raise CheckpointError(
                f"version {version} not found in {self.uri} (no manifest); "
                f"complete versions: {self.versions()}"
            )
        m = Manifest.from_json(text)
        if m.version != version:
            raise CheckpointError(
                f"the manifest under {version_dir(version)} says version {m.version}"
            )
        return m

    def fetch(
        self,
        version: int,
        dest_dir: Path,
        exclude: tuple[str, ...] = (),
        expect_sha256: str | None = None,
    ) -> Path:
        """Download `version` into dest_dir/v{version:06d}, verified; reuse a verified copy.

        `exclude`: path prefixes not to fetch (rollout engines skip `trainer/`, the optimizer
        state). A full copy serves any request; a partial one only requests excluding as much.
        Processes on one node may fetch into one dest_dir at once: a lock file per version makes
        the second wait for the first and then reuse its copy. `expect_sha256`: refuse a version
        whose manifest is not this one (another tier's copy, a store changed under the run).
        A store with `absent` prefixes (the cache tier) refuses a request for a file under one
        (an `exclude` that does not cover it): the durable store has those files.
        """
        t0, manifest, dest_dir = time.monotonic(), self.manifest(version), Path(dest_dir)
        if expect_sha256 is not None and manifest.sha256() != expect_sha256:
            raise CheckpointError(
                f"version {version} in {self.uri} has manifest sha256 {manifest.sha256()}, not the "
                f"expected {expect_sha256}"
            )
        wanted = (
            [e for e in manifest.files if not e.path.startswith(tuple(exclude))]
            if exclude
            else list(manifest.files)
        )
        if lacking := sorted({p for e in wanted for p in self.absent if e.path.startswith(p)}):
            raise CheckpointError(
                f"version {version} in {self.uri}: this store does not hold {', '.join(lacking)} "
                f"(its manifest lists them; the durable store has them): fetch with exclude="
                f"{tuple(lacking)!r} here, or read the version from the durable store"
            )
        final = dest_dir / version_dir(version)
        try:
            dest_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(
                f"cannot create cache folder {dest_dir}: {e}; fix checkpoint.cache_dir"
            ) from e
        # fast path: readers of a verified copy never wait on each other
        with shared(lock_path(dest_dir, version)):
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
                self._map(lambda e: self._get_verified(version, e, tmp, manifest.objects), wanted)
                (tmp / MANIFEST).write_text(manifest.to_json())
                (tmp / MARKER).write_text(
                    manifest.sha256() + "".join(f"\nexclude={p}" for p in sorted(exclude))
                )
                if final.exists():  # an unverified leftover
                    shutil.rmtree(final)
                os.replace(tmp, final)
                vouch(final, manifest, tuple(exclude))
            except OSError as e:
                raise CheckpointError(f"cannot write version {version} into {dest_dir}: {e}") from e
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        log.info(
            "fetched version %d from %s to %s in %.1f s",
            version,
            self.uri,
            final,
            time.monotonic() - t0,
        )
        return final

    def fetch_file(
        self, version: int, rel: str, dest: Path, manifest: Manifest | None = None
    ) -> Path:
        """One file of `version` into `dest`, verified against its manifest entry (written under
        a temporary name, renamed once its sha256 matches; a file of the right size already at
        `dest` was put there so and is kept). What a trainer rank uses to read only the shards
        of a Distributed Checkpoint it needs. Processes may fetch one file at once: each renames
        its own verified copy."""
        manifest = manifest or self.manifest(version)
        entry = next((e for e in manifest.files if e.path == rel), None)
        if entry is None:
            raise CheckpointError(f"version {version} in {self.uri} has no file {rel}")
        if lacking := [p for p in self.absent if rel.startswith(p)]:
            raise CheckpointError(
                f"version {version} in {self.uri}: this store does not hold {lacking[0]} (the "
                "durable store has it)"
            )
        dest = Path(dest)
        if dest.is_file() and dest.stat().st_size == entry.size:
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}")
        try:
            sha = self._get(files_dir(version_dir(version), manifest.objects), rel, tmp)
            if sha != entry.sha256:
                raise CheckpointError(
                    f"{rel} of version {version} in {self.uri} has sha256 {sha}, its manifest "
                    f"says {entry.sha256}; refused"
                )
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        return dest

    def read_chunk(
        self, version: int, rel: str, start: int, length: int, objects: str = ""
    ) -> bytes:
        """`length` bytes of a version's file from `start` (a fan-out chunk; the caller checks
        it against the manifest's chunk hash). `objects`: the manifest's object folder."""
        if not self.holds(rel):
            raise CheckpointError(
                f"{rel} of version {version} is not in {self.uri} (it holds no "
                f"{', '.join(self.absent)}); the durable store has it"
            )
        if length <= 0:  # an empty file's one chunk: no request (`bytes=0--1` is not a range)
            return b""
        return self._get_range(files_dir(version_dir(version), objects), rel, start, length)

    def apply_retention(
        self, keep_last: int, keep_every: int, pinned: Iterable[int] = frozenset()
    ) -> list[int]:
        """Delete old versions; return the deleted ones, ascending.

        Kept: the newest `keep_last` complete versions, every multiple of `keep_every` (if > 0),
        `latest`, version 0 (unless `keep_version_zero` is off), `pinned` and every version a live lease pins. Each deletion removes
        the manifest first, so a half-deleted version is never complete. Leftovers of failed
        publishes and deletions at or below `latest` are removed too, and so are expired pins.
        """
        _check_retention(keep_last, keep_every)
        dirs, latest, now, leases = (
            self._version_dirs(),
            self.latest(),
            self.clock(),
            self._leases(),
        )
        versions = _complete(dirs)
        keep = (
            set(versions[-keep_last:])
            | {*pinned}
            | {lease.version for _, _, lease in leases if lease.live(now)}
        )
        keep |= {0} if self.keep_version_zero else set()
        keep |= {v for v in versions if keep_every > 0 and v % keep_every == 0}
        keep |= set() if latest is None else {latest}
        deleted, failed = [], []
        for v in (v for v in versions if v not in keep):
            try:
                # first: v is no longer complete
                self._delete([f"versions/{version_dir(v)}/{MANIFEST}"])
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
            log.info(
                "retention in %s deleted versions %s; kept %s",
                self.uri,
                deleted,
                sorted(keep & set(versions)),
            )
        if failed:
            raise CheckpointError(
                f"retention in {self.uri} deleted {deleted} but failed on: {'; '.join(failed)}"
            )
        return deleted

    def recover(
        self,
        epoch: int | None = None,
        servable: tuple[int, str] | None = None,
        owner: str | None = None,
    ) -> int | None:
        """Repair what a writer killed mid-publish left above `latest`; return the new `latest`.

        `epoch` (a new trainer's): first recorded in `latest` (`fence`), so every older writer is
        refused from then on (and this one is, if a newer epoch is recorded already). A version
        or staging folder above `latest` under a live claim of the same or a newer epoch (not
        `owner`'s) is left alone: its writer is alive and not replaced. Every other one is
        adopted or deleted: a complete version that verifies as publish verifies (the manifest
        reads back, every object matches it by hash or size) becomes `latest` if it is the
        version `servable` names (version, manifest sha256) or, for a caller without an epoch or
        a servable pointer (`--resume`, one writer at a time), if it is the newest; the rest are
        deleted, manifest first, claim last.
        """
        if epoch is not None:
            self.fence(epoch)
        latest, dirs, now = self.latest(), self._version_dirs(), self.clock()
        good: dict[int, Manifest] = {}
        above = sorted(
            (int(m.group(1)), d)
            for d in dirs
            if (m := _STAGE_DIR.match(d)) and (latest is None or int(m.group(1)) > latest)
        )
        for v, d in above:
            claim = self.read_claim(v) if _VERSION_DIR.match(d) and self._claims else None
            if claim is not None and claim.owner != owner and not claim.removable_by(epoch, now):
                log.warning(
                    "recovery in %s: leaving %s alone: a live claim of epoch %s (%s) holds it",
                    self.uri,
                    d,
                    claim.epoch,
                    claim.owner,
                )
                continue
            why = (
                "a staging folder"
                if not _VERSION_DIR.match(d)
                else None
                if dirs[d]
                else "no manifest"
            )
            if why is None:
                try:
                    found = self.manifest(v)
                    named = servable is not None and servable == (v, found.sha256())
                    if not named and (servable is not None or epoch is not None):
                        raise CheckpointError(f"not the servable version {servable}")
                    self._verify_stored(d, found)
                    good[v] = found
                    continue
                except CheckpointError as e:
                    why = str(e)
            log.warning(
                "recovery in %s: deleting %s, above latest %s: %s", self.uri, d, latest, why
            )
            self._delete([f"versions/{d}/{MANIFEST}"])
            self._delete_stage(d)
        if not good:
            return latest
        v = max(good)
        self._point_latest(good[v], epoch)
        log.warning(
            "recovery in %s: version %d was complete and verified but latest was %s (a publish died "
            "before moving it); latest is now %d",
            self.uri,
            v,
            latest,
            v,
        )
        return v

    def _point_latest(
        self, manifest: Manifest | None, epoch: int | None, back: bool = False
    ) -> None:
        """Move `latest` to `manifest` (None: keep its version, a fence; None with `back`: name no
        version, for a cache tier whose versions above the durable `latest` were dropped) as
        writer `epoch`: a compare-and-set on `latest.json`, refused if a newer epoch moved it or,
        unless `back`, if it already names a newer version. The recorded epoch only grows; a
        writer without an epoch keeps the recorded one."""
        for _ in range(20):
            text, tag = self._read_tagged(LATEST)
            cur = self._latest_doc(text)
            if older(epoch, cur["epoch"]):
                raise refused(
                    "moving latest" if manifest else "fencing latest", self.uri, epoch, cur["epoch"]
                )
            if manifest is None:
                doc = {**cur, "epoch": max(e for e in (epoch, cur["epoch"], 0) if e is not None)}
                if back:
                    doc |= {"version": None, "manifest_sha256": None}
            else:
                if not back and cur["version"] is not None and cur["version"] > manifest.version:
                    raise CheckpointError(
                        f"latest in {self.uri} already names version {cur['version']}, newer than "
                        f"{manifest.version}; another writer moved it"
                    )
                doc = {
                    "version": manifest.version,
                    "manifest_sha256": manifest.sha256(),
                    "epoch": cur["epoch"] if epoch is None else epoch,
                }
            new = json.dumps(doc) + "\n"
            # equal: our own write whose reply was lost
            if new == text or self._write_if(LATEST, new, tag):
                return
        raise CheckpointError(
            f"latest in {self.uri} kept changing under 20 compare-and-set attempts; "
            "more than one writer is moving it"
        )

    def fence(self, epoch: int) -> None:
        """Record `epoch` in `latest.json` (its version unchanged): every writer of an older
        epoch is refused from now on. Raises if a newer epoch is recorded already."""
        self._point_latest(None, epoch)

    def _check_epoch(self, epoch: int | None, what: str) -> None:
        if epoch is not None and older(epoch, recorded := self.latest_epoch()):
            raise refused(what, self.uri, epoch, recorded)

    def _claim_key(self, version: int) -> str:
        return f"versions/{version_dir(version)}/{CLAIM}"

    def read_claim(self, version: int) -> Claim | None:
        text = self._read_text(self._claim_key(version))
        return None if text is None else Claim.from_json(text)

    def _claim(self, version: int, epoch: int | None, owner: str) -> Claim:
        """Claim `version` create-only. A claim there already: ours (a retried PUT whose reply was
        lost) is kept; one this writer may remove (expired, or of an older epoch) is replaced,
        together with whatever its writer left; any other refuses this writer."""
        mine = Claim(owner, epoch, self.clock() + self.claim_ttl_s)
        key = self._claim_key(version)
        for _ in range(3):
            if self._write_if(key, mine.to_json(), None):
                return mine
            theirs = self.read_claim(version)
            if theirs is None:
                continue  # removed meanwhile: try again
            if theirs.owner == owner:
                return theirs
            if older(epoch, theirs.epoch):
                raise refused(
                    f"claiming version {version}", self.uri, epoch, theirs.epoch, theirs.owner
                )
            if not theirs.removable_by(epoch, self.clock()):
                raise CheckpointError(
                    f"version {version} is already claimed in {self.uri} by another publisher of "
                    f"epoch {theirs.epoch} ({theirs.owner}), live until {theirs.expires_at:.0f} "
                    "(a second trainer of this run?); this one stops"
                )
            if version in self.versions():
                raise CheckpointError(
                    f"version {version} already exists in {self.uri}; publish a new version"
                )
            log.warning(
                "version %d in %s: replacing the claim of epoch %s (%s, %s) left by a replaced or dead "
                "writer, with what it wrote",
                version,
                self.uri,
                theirs.epoch,
                theirs.owner,
                "expired" if not theirs.live(self.clock()) else "older epoch",
            )
            self._delete([f"versions/{version_dir(version)}/{MANIFEST}"])
            self._delete(
                [
                    k
                    for k in self._list(f"versions/{version_dir(version)}/")
                    if not k.endswith(f"/{CLAIM}")
                ]
            )
            self._delete([key])
        raise CheckpointError(
            f"could not claim version {version} in {self.uri}: its claim kept changing"
        )

    def _check_claim(self, version: int, claim: Claim) -> None:
        """Raise if this writer no longer holds `version`'s claim (a newer writer removed it)."""
        cur = self.read_claim(version)
        if cur is None or cur.owner != claim.owner:
            theirs = None if cur is None else cur.epoch
            if cur is not None and older(claim.epoch, theirs):
                raise refused(
                    f"publish of version {version}", self.uri, claim.epoch, theirs, cur.owner
                )
            raise CheckpointError(
                f"publish of version {version} in {self.uri}: this writer's claim (epoch "
                f"{claim.epoch}) was removed{'' if cur is None else f' and taken by epoch {theirs}'}"
                " (a newer trainer recovered the store); this one stops"
            )

    def put_parts(
        self,
        version: int,
        stage: str,
        src_dir: Path,
        claim: Claim | None,
        manifest: Manifest | None,
        chunk_size: int = 0,
    ) -> list[FileEntry]:
        """Another process's share of a publish under way (`publish(parts=...)`): put the files
        under `src_dir` into `stage`, hashing each as it is read (`manifest` None) or checking
        its size against the manifest (the second tier of a version). The claim is checked
        before every file: a fenced writer stops within one file. Returns their entries.
        Files under `absent` prefixes are hashed (or checked) but not uploaded, as in `publish`."""
        src_dir = Path(src_dir)
        if not src_dir.is_dir():  # every rank writes into it: a node without one lost its part
            raise CheckpointError(
                f"version {version}: {src_dir} is not a directory; this node holds no part of it"
            )
        files = sorted(p.relative_to(src_dir).as_posix() for p in src_dir.rglob("*") if p.is_file())
        _check_reserved(src_dir, files)
        listed = {e.path: e for e in manifest.files} if manifest is not None else {}
        self._part_size = manifest.chunk_size if manifest is not None else chunk_size

        def put(rel: str) -> FileEntry:
            if claim is not None:
                self._check_claim(version, claim)
            if manifest is None:
                return self._put_hashed(stage, rel, src_dir / rel, chunk_size)
            e = listed.get(rel)
            if e is None or e.size != (src_dir / rel).stat().st_size:
                raise CheckpointError(
                    f"publish of version {version}: {rel} is not in its manifest as it is on "
                    "this node; the folder changed since it was hashed"
                )
            if self.holds(rel):
                self._put(stage, rel, src_dir / rel)
            return e

        return self._map(put, files)

    def _cleanup_failed(self, stage: str, version: int, claim: Claim | None) -> None:
        """Delete what a failed publish wrote (its manifest first), unless a newer writer holds
        the version now: then those objects may be the newer writer's."""
        try:
            if claim is not None:
                cur = self.read_claim(version)
                if cur is None or cur.owner != claim.owner:
                    log.warning(
                        "version %d in %s: this publish failed after another writer took the version "
                        "over; leaving its objects alone",
                        version,
                        self.uri,
                    )
                    return
            self._abort(stage)
        except (
            CheckpointError
        ) as e:  # the store itself failed: recovery or retention removes them later
            log.warning(
                "could not remove what the failed publish of version %d left in %s: %s",
                version,
                self.uri,
                e,
            )

    def _map(self, fn: Callable[[Any], _R], items: Iterable[Any]) -> list[_R]:
        ex = ThreadPoolExecutor(max_workers=self._workers)
        try:
            return list(ex.map(fn, items))
        finally:  # after the first failure, start no more copies
            ex.shutdown(wait=True, cancel_futures=True)

    def put_stream(
        self, stage: str, rel: str, blocks: Iterable[bytes], size: int | None = None
    ) -> None:
        """Store the bytes of `blocks` as `rel` of `stage` (a file read from a source while it
        is copied: `moerl.models.source`). This default spools them to a temporary file beside
        nothing the run keeps, then `_put`s it; S3 streams them without a file."""
        import tempfile

        with tempfile.NamedTemporaryFile(prefix="moerl-put-") as tmp:
            for b in blocks:
                tmp.write(b)
            tmp.flush()
            self._put(stage, rel, Path(tmp.name))

    def _put_hashed(self, stage: str, rel: str, src: Path, chunk_size: int = 0) -> FileEntry:
        """Hash `src` into its manifest entry and upload it (not a file under `absent`: the
        manifest lists it, this store does not hold it)."""
        try:
            entry = FileEntry(rel, *hash_file(src, chunk_size))
        except OSError as e:
            raise CheckpointError(
                f"cannot read {src}: {e}; is the checkpoint folder complete?"
            ) from e
        if self.holds(rel):
            self._put(stage, rel, src)
        return entry

    def _verify_stored(self, stage: str, manifest: Manifest) -> None:
        """The manifest reads back as itself and every object matches it: by its hash where the
        backend reports one (an object another writer replaced has other bytes, usually of the
        same size), else by its size. `hash_checked` counts the objects checked by hash. Files
        under `absent` prefixes are not checked: this store does not hold them."""
        v = manifest.version
        if self._read_text(f"versions/{stage}/{MANIFEST}") != manifest.to_json():
            raise CheckpointError(
                f"the manifest of version {v} did not read back as written in {self.uri}; retry"
            )
        held = [e for e in manifest.files if self.holds(e.path)]
        files_at = files_dir(stage, manifest.objects)
        stored = self._map(lambda e: self._stored(files_at, e, manifest.chunk_size), held)
        for e, (size, same) in zip(held, stored):
            if size != e.size:
                raise CheckpointError(
                    f"{e.path} of version {v} in {self.uri}: expected {e.size} bytes, "
                    f"found {'nothing' if size is None else size}; retry the publish"
                )
            if same is False:
                raise CheckpointError(
                    f"{e.path} of version {v} in {self.uri} does not hash to its manifest's sha256 "
                    f"{e.sha256}: another writer replaced it, or the source file changed while it "
                    "was published; retry the publish"
                )
        self.hash_checked = sum(1 for _, same in stored if same)

    def _get_verified(self, version: int, e: FileEntry, tmp: Path, objects: str = "") -> None:
        """Download one file into the staging folder, hashed as it streams; refuse a mismatch.

        The bytes land only under `tmp`: fetch renames that folder to its final name after every
        file passed, so a corrupt or short object never shows up at the final path.
        """
        dest = tmp / e.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        sha = self._get(files_dir(version_dir(version), objects), e.path, dest)
        size = dest.stat().st_size
        if size != e.size or sha != e.sha256:
            raise CheckpointError(
                f"{e.path} of version {version} in {self.uri} is corrupt: expected sha256 "
                f"{e.sha256} ({e.size} bytes), got sha256 {sha} ({size} bytes); republish it"
            )


def _complete(dirs: dict[str, bool]) -> list[int]:
    return sorted(
        int(m.group(1)) for d, complete in dirs.items() if complete and (m := _VERSION_DIR.match(d))
    )


def _is_leftover(name: str, complete: bool, latest: int | None) -> bool:
    """An incomplete version or a staging dir at or below `latest`: publish refuses those
    numbers, so no publish can be writing there (one writer per store)."""
    m = _STAGE_DIR.match(name)
    return bool(
        m
        and latest is not None
        and int(m.group(1)) <= latest
        and not (complete and _VERSION_DIR.match(name))
    )


def _check_retention(keep_last: int, keep_every: int) -> None:
    if keep_last < 1 or keep_every < 0:
        raise CheckpointError(
            f"retention needs keep_last >= 1 and keep_every >= 0, got {keep_last}, {keep_every}"
        )


class RemoteParts(Protocol):
    """A version's files that other processes hold and put themselves (`publish(parts=...)`)."""

    def put(
        self,
        store: CheckpointStore,
        version: int,
        stage: str,
        claim: Claim | None,
        manifest: Manifest | None,
        chunk_size: int,
    ) -> list[FileEntry]:
        """Have every holder `store.put_parts(...)` its files into `stage`; their entries. Bounded:
        raises naming the holders that did not answer."""
        ...


def _check_parts(
    version: int,
    local: list[str],
    theirs: list[FileEntry],
    manifest: Manifest | None,
    absent: tuple[str, ...] = (),
) -> None:
    """The parts and the local files make one version: no path twice, and (a second tier) the
    manifest's files exactly (those under `absent` prefixes may be missing: not stored here)."""
    paths = list(local) + [e.path for e in theirs]
    if len(set(paths)) != len(paths):
        dup = sorted({p for p in paths if paths.count(p) > 1})[:5]
        raise CheckpointError(f"publish of version {version}: {dup} were put by two writers")
    if manifest is not None:
        listed = {e.path for e in manifest.files}
        needed = {p for p in listed if not (absent and p.startswith(absent))}
        if not needed <= set(paths) <= listed:
            missing = sorted((needed - set(paths)) | (set(paths) - listed))[:5]
            raise CheckpointError(
                f"publish of version {version}: the parts do not match its manifest ({missing})"
            )


def _check_same_files(
    manifest: Manifest,
    version: int,
    src: Path,
    files: list[str],
    partial: bool = False,
    absent: tuple[str, ...] = (),
) -> None:
    """A given manifest must describe exactly the files about to be published (`partial`: the
    local ones among them, the rest coming as parts; those under `absent` prefixes may be
    missing, as the store does not hold them)."""
    if manifest.version != version:
        raise CheckpointError(
            f"publish: the given manifest is version {manifest.version}, not {version}"
        )
    listed = {e.path: e.size for e in manifest.files}
    needed = {p for p in listed if not (absent and p.startswith(absent))}
    if not set(files) <= set(listed) or not (partial or needed <= set(files)):
        raise CheckpointError(
            f"publish of version {version}: {src} holds "
            f"{sorted((set(files) - set(listed)) | (needed - set(files)))[:5]} "
            "that its manifest does not list, or lacks them"
        )
    for rel in files:
        if (src / rel).stat().st_size != listed[rel]:
            raise CheckpointError(
                f"publish of version {version}: {rel} is {(src / rel).stat().st_size} bytes, "
                f"its manifest says {listed[rel]}; the folder changed since it was hashed"
            )


def _list_files(src: Path) -> list[str]:
    if not src.is_dir():
        raise CheckpointError(f"{src} is not a directory; pass the checkpoint folder")
    files = sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file())
    if not files:
        raise CheckpointError(f"{src} holds no files; nothing to publish")
    _check_reserved(src, files)
    return files


def _check_reserved(src: Path, files: list[str]) -> None:
    """A version's files may not take the names the store keeps beside them: its manifest, the
    node cache's marker, the publisher's claim."""
    if reserved := {MANIFEST, MARKER, CLAIM} & set(files):
        raise CheckpointError(
            f"{src} contains {sorted(reserved)}, names the store reserves; remove them"
        )
