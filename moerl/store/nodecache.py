"""The node-local fetch cache: verified copies of policy versions, their locks, and pruning.

A copy is served only while its bytes are the ones this process verified: a fetch vouches for
what it wrote (every byte was hashed on the way in); a copy another process left is hashed
against the manifest once, then known by its files' (inode, size, mtime, ctime), which no
rewrite of the bytes keeps. A copy whose files changed is unverified, so it is fetched again.

Limitations: a rewrite between the last check and an engine's read is not seen; the sandbox
keeps model-written code off this folder. Design: docs/weights.md#the-store-as-a-user-sees-it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from moerl.errors import CheckpointError
from moerl.store.manifest import sha256_file

if TYPE_CHECKING:
    from moerl.store.manifest import Manifest

log = logging.getLogger(__name__)

MARKER = ".moerl-verified"  # written into a fetched copy once verified; holds the manifest's sha256
_COPY = re.compile(r"^v(\d{6,})$")
# the staging dir of a fetch (killed, if its lock is free)
_PARTIAL = re.compile(r"^\.tmp-v(\d{6,})-[0-9a-f]+$")


def lock_path(cache_dir: Path, version: int) -> Path:
    return Path(cache_dir) / f".v{version:06d}.lock"


Stamp = tuple[tuple[str, int, int, int, int], ...]
# (copy folder, manifest sha256) -> the stamp of the files this process verified
_vouched: dict[tuple[str, str], Stamp] = {}
_refused: dict[tuple[str, str], Stamp] = {}  # found rewritten: not hashed again while so
_vouched_lock = threading.Lock()
stats = {"rehashed": 0, "tampered": 0}  # copies hashed again; copies found rewritten
HASH_THREADS = 8  # a node's NVMe RAID reads faster than one core hashes
_REMEMBER = 64  # copies remembered per process (a cache keeps a few versions)


def _remember(book: dict[tuple[str, str], Stamp], key: tuple[str, str], stamp: Stamp) -> None:
    with _vouched_lock:
        book.pop(key, None)
        book[key] = stamp
        while len(book) > _REMEMBER:
            book.pop(next(iter(book)))


def _wanted(manifest: Manifest, exclude: tuple[str, ...]):
    return [e for e in manifest.files if not (exclude and e.path.startswith(exclude))]


def _stamp(final: Path, manifest: Manifest, exclude: tuple[str, ...]) -> Stamp:
    out = []
    for e in _wanted(manifest, exclude):
        st = os.stat(final / e.path)
        out.append((e.path, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(out)


def vouch(final: Path, manifest: Manifest, exclude: tuple[str, ...] = ()) -> None:
    """Record that this process verified every byte of `final` (it hashed them as it wrote)."""
    _remember(
        _vouched, (str(Path(final).resolve()), manifest.sha256()), _stamp(final, manifest, exclude)
    )


def _rehash(final: Path, manifest: Manifest, exclude: tuple[str, ...]) -> str:
    """The first file whose bytes are not the manifest's, or ""."""

    def bad(e) -> str:
        return "" if sha256_file(final / e.path) == e.sha256 else e.path

    with ThreadPoolExecutor(max_workers=HASH_THREADS) as ex:
        return next((p for p in ex.map(bad, _wanted(manifest, exclude)) if p), "")


def is_verified(final: Path, manifest: Manifest, exclude: tuple[str, ...] = ()) -> bool:
    """A marker holding this manifest's sha256 (and what the copy left out, a subset of what
    may be left out now), every wanted file present with the right size, and its bytes the
    manifest's: vouched for by this process and unchanged since, or hashed now (once)."""
    try:
        sha, *left_out = (final / MARKER).read_text().split("\n")
        skipped = {x.removeprefix("exclude=") for x in left_out}
        if not (
            sha == manifest.sha256()
            and skipped <= set(exclude)
            and all((final / e.path).stat().st_size == e.size for e in _wanted(manifest, exclude))
        ):
            return False
        key = (str(Path(final).resolve()), sha)
        stamp = _stamp(final, manifest, exclude)
        with _vouched_lock:
            if _vouched.get(key) == stamp:
                return True
            if _refused.get(key) == stamp:
                return False
        stats["rehashed"] += 1
        if rewritten := _rehash(final, manifest, exclude):
            stats["tampered"] += 1
            _remember(_refused, key, stamp)
            log.warning(
                "fetch cache: %s/%s is not the bytes its manifest names (rewritten since it was "
                "verified); fetching the version again",
                final,
                rewritten,
            )
            return False
        _remember(_vouched, key, stamp)
        return True
    except OSError:
        return False


def _open_lock(path: Path) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise CheckpointError(
            f"cannot create lock file {path}: {e}; fix checkpoint.cache_dir"
        ) from e


def _still_named(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open as `fd` (a pruner may have unlinked it)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


@contextmanager
def _held(path: Path, op: int) -> Iterator[None]:
    """Hold flock `op` (LOCK_EX or LOCK_SH) on `path`, waiting for it, and say so when it waits.
    A lock on a file that was unlinked meanwhile is no lock: taken again on the new file."""
    while True:
        fd = _open_lock(path)
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process that holds %s", path)
            fcntl.flock(fd, op)
        if _still_named(fd, path):
            break
        os.close(fd)
    try:
        yield
    finally:
        os.close(fd)  # releases the lock


def exclusive(path: Path):
    """Hold an exclusive flock on `path` (a fetch or a prune of that version), waiting for it."""
    return _held(path, fcntl.LOCK_EX)


def shared(path: Path):
    """Hold a shared flock on `path` (a reader loading a copy), waiting for a running fetch of
    that version. Pruning takes the same lock exclusively without waiting, so a copy that some
    engine on this node is loading is never deleted under it."""
    return _held(path, fcntl.LOCK_SH)


@contextmanager
def try_exclusive(path: Path) -> Iterator[bool]:
    """Like `exclusive`, without waiting: yields False (and holds nothing) when it is taken."""
    while True:
        fd = _open_lock(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            yield False
            return
        if _still_named(fd, path):
            break
        os.close(fd)
    try:
        yield True
    finally:
        os.close(fd)


def prune_cache(cache_dir: Path, keep: int, protect: Iterable[int] = ()) -> list[int]:
    """Delete cached copies except the newest `keep` versions and `protect`; return the pruned
    versions, ascending. Leftovers of killed fetches go too. Each deletion holds the version's
    fetch lock, taken without waiting: a version being fetched right now is left alone."""
    _check_keep(keep)
    copies, protect = _copies(Path(cache_dir)), set(protect)
    return _prune(Path(cache_dir), copies, {*sorted(copies)[-keep:], *protect}, keep, protect)


def make_room(cache_dir: Path, keep: int, incoming: int, protect: Iterable[int] = ()) -> list[int]:
    """Before fetching version `incoming`: delete cached copies so that, once it lands, the
    cache holds `keep` versions: the newest `keep` - 1 others, `incoming`, and `protect` (the
    served version). A version another process holds (loading it, or fetching it) stays. Nothing
    goes when `incoming` is cached already (no room is needed). Returns what `prune_cache` does."""
    _check_keep(keep)
    cache_dir = Path(cache_dir)
    copies, protect = _copies(cache_dir), set(protect)
    if incoming in copies:
        return []
    others = sorted(copies)[max(0, len(copies) - (keep - 1)) :]
    return _prune(cache_dir, copies, {*others, incoming, *protect}, keep, protect)


def _check_keep(keep: int) -> None:
    if keep < 1:
        raise CheckpointError(
            f"the fetch cache must keep at least 1 version, got {keep}; fix checkpoint.cache_keep"
        )


def _copies(cache_dir: Path) -> dict[int, Path]:
    if not cache_dir.is_dir():
        return {}
    return {
        int(m.group(1)): p for p in cache_dir.iterdir() if p.is_dir() and (m := _COPY.match(p.name))
    }


def _prune(
    cache_dir: Path, copies: dict[int, Path], spare: set[int], keep: int, protect: set[int]
) -> list[int]:
    """Delete `copies` not in `spare`, and leftovers of killed fetches, each under its lock."""
    if not cache_dir.is_dir():
        return []
    victims = [(v, p) for v, p in sorted(copies.items()) if v not in spare]
    victims += [
        (int(m.group(1)), p)
        for p in cache_dir.iterdir()
        if p.is_dir() and (m := _PARTIAL.match(p.name))
    ]
    pruned = []
    for v, path in victims:
        with try_exclusive(lock_path(cache_dir, v)) as held:
            if not held:
                log.info("fetch cache: %s is being fetched or loaded; not pruning it now", path)
                continue
            try:
                # first: a half-deleted copy is never "verified"
                (path / MARKER).unlink(missing_ok=True)
                shutil.rmtree(path)
                if _COPY.match(path.name):  # held: a waiter re-checks the path once it has the lock
                    lock_path(cache_dir, v).unlink(missing_ok=True)
            except OSError as e:
                raise CheckpointError(f"cannot prune {path} from the fetch cache: {e}") from e
        if _COPY.match(path.name):
            pruned.append(v)
    if pruned:
        log.info(
            "fetch cache %s: pruned versions %s (keeps the newest %d and %s)",
            cache_dir,
            pruned,
            keep,
            sorted(protect),
        )
    return pruned
