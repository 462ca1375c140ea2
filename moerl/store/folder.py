"""The folder backend of the checkpoint store (see `moerl.store.base` for the contract).

A publish is staged in `versions/.tmp-*` and renamed into place once complete; every copied
file, the rename and the `latest.json` swap are fsynced, so a crash leaves either the previous
state or the new one. A fetch copies each file in one read pass, hashing it on the way.

Limitations:
- The fetch copy goes through user space (read, hash, write) instead of the kernel's
  `copy_file_range`/`sendfile`: one pass that hashes beats a zero-copy pass plus a second read.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import uuid
from pathlib import Path

from moerl.errors import CheckpointError
from moerl.store.base import MANIFEST, CheckpointStore, copy_hashed, version_dir

log = logging.getLogger(__name__)


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

    def check_access(self, missing_ok: bool = False) -> bool:
        """The folder, created if missing (so never missing), and writable."""
        try:
            (self.root / "versions").mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(
                f"cannot create checkpoint folder {self.root}: {e}; fix checkpoint.uri"
            ) from e
        if not os.access(self.root / "versions", os.W_OK):
            raise CheckpointError(
                f"checkpoint folder {self.root} is not writable; fix its permissions"
            )
        return True

    def _path(self, stage: str, rel: str = "") -> Path:
        return self.root / "versions" / stage / rel

    def _begin(
        self, version: int, exclusive: bool = False
    ) -> str:  # the rename in _commit is create-only
        self.check_access()
        stage = f".tmp-{version_dir(version)}-{uuid.uuid4().hex[:8]}"
        self._path(stage).mkdir()
        return stage

    def _commit(self, stage: str, version: int) -> None:
        """Rename the staged version into place, create-only: a version another publisher put
        there since publish checked (two trainers of one run) is never replaced."""
        final = self._path(version_dir(version))
        if (final / MANIFEST).exists():
            raise CheckpointError(
                f"version {version} was published by another writer in {self.uri} while this "
                "publish ran; a run has one trainer at a time, so this one stops"
            )
        if final.exists():  # no manifest: debris of a killed publish
            log.warning("replacing incomplete version directory %s", final)
            shutil.rmtree(final)
        try:
            # fails if another publisher's version appeared meanwhile
            os.rename(self._path(stage), final)
        except OSError as e:
            raise CheckpointError(
                f"version {version} appeared in {self.uri} while this publish ran ({e}); "
                "another writer published it"
            ) from e
        _fsync(final.parent)

    def _abort(self, stage: str) -> None:
        shutil.rmtree(self._path(stage), ignore_errors=True)

    def _delete_stage(self, stage: str) -> None:
        try:
            shutil.rmtree(self._path(stage))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise CheckpointError(f"cannot delete {self._path(stage)}: {e}") from e

    def _put(self, stage: str, rel: str, src: Path) -> None:
        dst = self._path(stage, rel)
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
            _fsync(dst)  # the rename that publishes must not outrun the data
        except OSError as e:
            raise CheckpointError(f"cannot copy {src} into {self.root}: {e}") from e

    def _get(self, stage: str, rel: str, dest: Path) -> str:
        try:  # one read pass: copy and hash together (fetch compares the hash with the manifest)
            return copy_hashed(self._path(stage, rel), dest)
        except FileNotFoundError as e:
            if not self._path(stage, rel).is_file():
                raise CheckpointError(
                    f"{rel} of {stage} is missing from {self.root}; republish it"
                ) from e
            raise

    def _get_range(self, stage: str, rel: str, start: int, length: int) -> bytes:
        try:
            with open(self._path(stage, rel), "rb") as f:
                f.seek(start)
                return f.read(length)
        except OSError as e:
            raise CheckpointError(f"cannot read {rel} of {stage} in {self.root}: {e}") from e

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
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(text)
            _fsync(tmp)
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise CheckpointError(f"cannot write {path}: {e}") from e

    def _read_tagged(self, key: str) -> tuple[str | None, str | None]:
        text = self._read_text(key)
        return text, None if text is None else hashlib.sha256(text.encode()).hexdigest()

    def _write_if(self, key: str, text: str, tag: str | None) -> bool:
        """Compare-and-set under a lock file beside the store's objects (`fcntl.flock`: writers on
        one machine, as a folder store has)."""
        lock = self.root / ".moerl-write.lock"
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
            with open(lock, "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                if self._read_tagged(key)[1] != tag:
                    return False
                self._write_text(key, text)
                return True
        except OSError as e:
            raise CheckpointError(f"cannot write {self.root / key}: {e}") from e

    def _version_dirs(self) -> dict[str, bool]:
        d = self.root / "versions"
        return (
            {v.name: (v / MANIFEST).is_file() for v in d.iterdir() if v.is_dir()}
            if d.is_dir()
            else {}
        )

    def _list(self, prefix: str) -> list[str]:
        d = self.root / prefix
        return (
            [p.relative_to(self.root).as_posix() for p in d.rglob("*") if p.is_file()]
            if d.is_dir()
            else []
        )

    def _delete(self, keys: list[str]) -> None:
        try:
            for key in keys:
                (self.root / key).unlink(missing_ok=True)
            # deletions must not be reordered
            for parent in {(self.root / key).parent for key in keys}:
                if parent.is_dir():
                    _fsync(parent)
        except OSError as e:
            raise CheckpointError(f"cannot delete from {self.root}: {e}") from e
