"""Pruning the node-local fetch cache: newest `cache_keep` versions, never the one fetched or
served, and never a version another process is fetching (it holds that version's lock)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moerl.config import CheckpointConfig
from moerl.errors import CheckpointError
from moerl.store.folder import LocalStore
from moerl.store.nodecache import MARKER, lock_path, prune_cache
from moerl.store.runs import SERVING, engine_copy, fetch_for_engine, run_cache, run_store
from tests.store.test_store import make_checkpoint, tree
from tests.store.test_store_faults import _wait_for


def _cached(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.is_dir())


@pytest.fixture
def five(tmp_path: Path) -> tuple[LocalStore, Path]:
    store, cache = LocalStore(tmp_path / "store"), tmp_path / "cache"
    for v in range(1, 6):
        store.publish(v, make_checkpoint(tmp_path / f"src{v}", seed=v))
        store.fetch(v, cache)
    return store, cache


def test_prune_keeps_the_newest_and_the_protected(
    five: tuple[LocalStore, Path], tmp_path: Path
) -> None:
    store, cache = five
    (cache / ".tmp-v000003-0badcafe").mkdir()  # a fetch killed midway (its lock is free)
    (cache / ".tmp-v000003-0badcafe" / "config.json").write_text("{")
    assert prune_cache(cache, keep=2, protect={1}) == [2, 3]
    assert _cached(cache) == ["v000001", "v000004", "v000005"]
    assert not (cache / ".v000002.lock").exists()  # bounded: a pruned version's lock file goes
    assert (cache / ".v000004.lock").exists()
    assert prune_cache(cache, keep=2, protect={1}) == []
    again = store.fetch(2, cache)  # a pruned version is simply fetched again, verified
    assert (again / MARKER).exists() and "config.json" in tree(again)
    with pytest.raises(
        CheckpointError, match="keep at least 1 version, got 0; fix checkpoint.cache_keep"
    ):
        prune_cache(cache, keep=0)
    assert prune_cache(tmp_path / "no-cache-yet", keep=1) == []


_LOCKER = r"""
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
open(sys.argv[2], "w").close()
sys.stdin.read()  # hold the lock until the parent closes stdin
"""


def test_prune_leaves_a_version_another_process_is_fetching(
    five: tuple[LocalStore, Path], tmp_path: Path
) -> None:
    _, cache = five
    ready = tmp_path / "locked"
    # another process holds version 2's fetch lock, as `fetch` does while it downloads
    holder = subprocess.Popen(
        [sys.executable, "-c", _LOCKER, str(lock_path(cache, 2)), str(ready)],
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for(ready.exists, 30, "the other process to take the lock", holder)
        assert prune_cache(cache, keep=2) == [1, 3]
        assert _cached(cache) == ["v000002", "v000004", "v000005"]
        assert (cache / "v000002" / MARKER).exists()  # untouched, still verified
    finally:
        holder.communicate("", timeout=10)
    assert prune_cache(cache, keep=2) == [2]


def test_fetch_for_engine_prunes_to_cache_keep_but_keeps_the_served_version(tmp_path: Path) -> None:
    cfg = CheckpointConfig(
        uri=str(tmp_path / "ck"), cache_dir=str(tmp_path / "cache"), cache_keep=2
    )
    store, cache = run_store(cfg, "r1"), run_cache(cfg, "r1")
    for v in range(1, 5):
        store.publish(v, make_checkpoint(tmp_path / f"src{v}", seed=v))
    fetch_for_engine(cfg, "r1", 1)
    (cache / SERVING).write_text(json.dumps({"version": 1}))  # an engine serves version 1 ...
    for v in (2, 3, 4):
        fetch_for_engine(cfg, "r1", v)
    assert _cached(cache) == ["v000001", "v000003", "v000004"]  # ... so it stays; 2 went
    (cache / SERVING).write_text(json.dumps({"version": 4}))
    fetch_for_engine(cfg, "r1", 1)  # fetching an old version again: it is never pruned
    assert _cached(cache) == ["v000001", "v000003", "v000004"]
    fetch_for_engine(cfg, "r1", 4)
    assert _cached(cache) == ["v000003", "v000004"]


def test_unreadable_serving_file_skips_pruning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = CheckpointConfig(
        uri=str(tmp_path / "ck"), cache_dir=str(tmp_path / "cache"), cache_keep=1
    )
    store, cache = run_store(cfg, "r1"), run_cache(cfg, "r1")
    for v in (1, 2):
        store.publish(v, make_checkpoint(tmp_path / f"src{v}", seed=v))
    fetch_for_engine(cfg, "r1", 1)
    (cache / SERVING).write_text("{broken")
    with caplog.at_level("WARNING", logger="moerl.store.runs"):
        assert fetch_for_engine(cfg, "r1", 2) == cache / "v000002"  # the fetch still succeeds
    assert "could not prune the fetch cache" in caplog.text and "serving.json" in caplog.text
    assert _cached(cache) == ["v000001", "v000002"]  # without knowing what is served, nothing goes


def test_a_copy_being_loaded_is_never_pruned_by_a_neighbour(tmp_path: Path) -> None:
    """Two engines on one node: one loads version 1 while the other's fetch of version 2 prunes
    the cache (cache_keep 1). The held copy survives; once released, it can go."""
    cfg = CheckpointConfig(
        uri=str(tmp_path / "ck"), cache_dir=str(tmp_path / "cache"), cache_keep=1
    )
    store, cache = run_store(cfg, "r1"), run_cache(cfg, "r1")
    for v in (1, 2):
        store.publish(v, make_checkpoint(tmp_path / f"src{v}", seed=v))
    with engine_copy(cfg, "r1", 1) as loading:
        fetch_for_engine(cfg, "r1", 2)  # the neighbour: fetch, then prune to 1 copy
        assert _cached(cache) == ["v000001", "v000002"]  # v1 is held: skipped, not deleted
        assert tree(loading)["config.json"] == (tmp_path / "src1" / "config.json").read_bytes()
    fetch_for_engine(cfg, "r1", 2)
    assert _cached(cache) == ["v000002"]


def test_a_copy_pruned_before_it_is_held_is_fetched_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import moerl.store.runs as runs

    cfg = CheckpointConfig(
        uri=str(tmp_path / "ck"), cache_dir=str(tmp_path / "cache"), cache_keep=1
    )
    run_store(cfg, "r1").publish(1, make_checkpoint(tmp_path / "src1", seed=1))
    real, calls = runs.fetch_nearest, []

    def fetch_then_lose_it(*a):
        path, source = real(*a)
        calls.append(path)
        if len(calls) == 1:  # a neighbour pruned it between our fetch and our lock
            shutil.rmtree(path)
        return path, source

    monkeypatch.setattr(runs, "fetch_nearest", fetch_then_lose_it)
    with runs.engine_copy(cfg, "r1", 1) as path:
        assert len(calls) == 2 and (path / "config.json").is_file()


def test_engines_on_one_node_load_a_verified_copy_at_once(tmp_path: Path) -> None:
    """One engine holds its copy while it loads (minutes for a large model); another engine of
    the same node that asks for the same verified version gets it at once, not after that load."""
    import threading
    import time

    cfg = CheckpointConfig(
        uri=str(tmp_path / "ck"), cache_dir=str(tmp_path / "cache"), cache_keep=2
    )
    run_store(cfg, "r1").publish(1, make_checkpoint(tmp_path / "src1", seed=1))
    fetch_for_engine(cfg, "r1", 1)
    got: list[float] = []
    with engine_copy(cfg, "r1", 1):  # the first engine is loading
        t = threading.Thread(
            target=lambda: (time.monotonic(), fetch_for_engine(cfg, "r1", 1), got.append(1))
        )
        t0 = time.monotonic()
        t.start()
        t.join(5)
        assert got and time.monotonic() - t0 < 5  # not blocked by the first engine's hold


def test_a_waiter_on_a_lock_file_the_pruner_unlinked_locks_the_new_file_never_the_old(
    tmp_path: Path,
) -> None:
    """The pruner unlinks a pruned version's lock file while it holds it. A process that was
    waiting on that file must not go on holding a lock on the unlinked inode (nobody else could
    see it, so two processes would hold "the" lock); it takes the lock on the file the path
    names now, and waits for whoever holds that one."""
    import fcntl
    import os
    import threading

    from moerl.store.nodecache import exclusive

    path = tmp_path / ".v000007.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the pruner holds it
    got = threading.Event()

    def waiter() -> None:
        with exclusive(path):
            got.set()

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.2)  # the waiter blocks on the old file
    path.unlink()  # pruned, under the lock
    with exclusive(path):  # a new fetch of that version locks the new file
        os.close(fd)  # the pruner lets go of the old one: the waiter wakes on a dead inode
        assert not got.wait(0.5)  # and must not count itself the holder
    assert got.wait(10)  # once the new file is free, it holds it
    t.join(timeout=10)


def test_a_fetch_makes_room_before_it_downloads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache is pruned before the download, not after: a node that held cache_keep
    versions never holds cache_keep + 1 (the high-water mark, seen as each download starts, is
    cache_keep with the incoming one). The served version and a copy being loaded still stay."""
    from moerl.store.tiers import Tiers

    cfg = CheckpointConfig(
        uri=str(tmp_path / "ck"), cache_dir=str(tmp_path / "cache"), cache_keep=2
    )
    store, cache = run_store(cfg, "r1"), run_cache(cfg, "r1")
    for v in range(1, 8):
        store.publish(v, make_checkpoint(tmp_path / f"src{v}", seed=v))
    real, at_start = Tiers.fetch, {}

    def fetch(self, version, dest, *a, **kw):
        at_start[version] = _cached(dest) if dest.is_dir() else []  # on disk as it begins
        return real(self, version, dest, *a, **kw)

    monkeypatch.setattr(Tiers, "fetch", fetch)
    for v in range(1, 5):
        fetch_for_engine(cfg, "r1", v)
    assert at_start[3] == ["v000002"]  # v1 went before v3 was downloaded
    assert at_start[4] == ["v000003"]
    assert max(len(c) + 1 for c in at_start.values()) == 2  # never 3 copies on disk
    assert _cached(cache) == ["v000003", "v000004"]
    # the served version stays (cache_keep + 1 at most) ...
    (cache / SERVING).write_text(json.dumps({"version": 3}))
    fetch_for_engine(cfg, "r1", 5)
    assert at_start[5] == ["v000003", "v000004"] and _cached(cache) == [
        "v000003",
        "v000004",
        "v000005",
    ]
    # ... and so does a copy an engine on this node is loading (its shared lock)
    (cache / SERVING).write_text(json.dumps({"version": 5}))
    with engine_copy(cfg, "r1", 3):
        fetch_for_engine(cfg, "r1", 6)
        assert at_start[6] == ["v000003", "v000005"]  # 4 went first; 3 is held
    # a version already cached needs no room: nothing goes before its (node-hit) fetch; the
    # prune after it drops the copy that was held
    fetch_for_engine(cfg, "r1", 5)
    assert at_start[5] == ["v000003", "v000005", "v000006"]
    assert _cached(cache) == ["v000005", "v000006"]


def test_make_room_keeps_the_newest_others_the_incoming_and_the_protected(
    five: tuple[LocalStore, Path],
) -> None:
    from moerl.store.nodecache import make_room

    _, cache = five
    assert make_room(cache, keep=6, incoming=6) == []  # 5 others + the incoming: room enough
    assert make_room(cache, keep=3, incoming=3) == []  # cached already: no room needed
    assert make_room(cache, keep=3, incoming=6, protect={1}) == [2, 3]
    assert _cached(cache) == ["v000001", "v000004", "v000005"]
    assert make_room(cache, keep=1, incoming=9, protect={4}) == [1, 5]
    assert _cached(cache) == ["v000004"]
    with pytest.raises(CheckpointError, match="keep at least 1 version, got 0"):
        make_room(cache, keep=0, incoming=9)


def _rewrite_same_size(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF  # one byte flipped: same size, other bytes
    path.write_bytes(bytes(data))


def test_a_copy_rewritten_with_same_size_bytes_is_fetched_again(tmp_path: Path) -> None:
    """Code that can write the node cache (model-written code run without isolation) swaps a
    file's bytes keeping its size and the marker: the copy is no longer served, but fetched
    again, and the engine reads the published bytes."""
    from moerl.store import nodecache

    store, cache = LocalStore(tmp_path / "store"), tmp_path / "cache"
    store.publish(1, make_checkpoint(tmp_path / "src", seed=1))
    final = store.fetch(1, cache)
    good = (final / "config.json").read_bytes()
    before = dict(nodecache.stats)
    assert store.fetch(1, cache) == final  # vouched for by the fetch: no hashing again
    assert nodecache.stats["rehashed"] == before["rehashed"]

    _rewrite_same_size(final / "config.json")
    assert (final / MARKER).exists()  # the marker and the sizes alone would still pass
    again = store.fetch(1, cache)
    assert (again / "config.json").read_bytes() == good
    assert nodecache.stats["tampered"] == before["tampered"] + 1


_REUSE = r"""
import sys
from pathlib import Path
from moerl.store import nodecache
from moerl.store.folder import LocalStore
store = LocalStore(Path(sys.argv[1]))
final = store.fetch(1, Path(sys.argv[2]))
print(nodecache.stats["rehashed"], nodecache.stats["tampered"], (final / "config.json").read_bytes().hex())
"""


def test_another_process_hashes_a_copy_it_did_not_fetch_once(tmp_path: Path) -> None:
    """A process that finds a copy it did not fetch (a restarted worker, a second engine on the
    node) hashes it once against the manifest before serving it; a rewritten one it fetches."""
    store, cache = LocalStore(tmp_path / "store"), tmp_path / "cache"
    store.publish(1, make_checkpoint(tmp_path / "src", seed=1))
    final = store.fetch(1, cache)
    good = (final / "config.json").read_bytes().hex()

    def reuse() -> list[str]:
        got = subprocess.run(
            [sys.executable, "-c", _REUSE, str(tmp_path / "store"), str(cache)],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return got.stdout.split()

    assert reuse() == ["1", "0", good]  # intact: hashed once, served
    _rewrite_same_size(final / "config.json")
    assert reuse() == ["1", "1", good]  # rewritten: found out, fetched again
