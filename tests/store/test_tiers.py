"""The weight tiers on real servers: a cache tier and a durable store on S3 (`weed mini`), the node
cache and the publisher off the trainer's path. Fault tests: a publisher killed mid-copy, a cache
server that is down or serves a corrupt file. The fan-out between engines: tests/store/test_fanout.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from moerl.config import CheckpointConfig
from moerl.errors import CheckpointError
from moerl.store.base import MANIFEST, MARKER, CheckpointStore, FileEntry, Manifest
from moerl.store.fence import Claim
from moerl.store.manifest import hash_file
from moerl.store.runs import ENGINE_EXCLUDE
from moerl.store.tiers import Tiers, node_copy, run_tiers
from tests.store.test_store import make_checkpoint, tree
from tests.support.objects import file_key, in_version

CHUNK = 4096


@pytest.fixture(scope="module")
def buckets(s3_server):
    client = s3_server.client()
    for b in ("tier-cache", "tier-durable"):
        try:
            client.create_bucket(Bucket=b)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
    return s3_server


def _cfg(s3, tmp: Path, cache_endpoint: str | None = None, **over) -> CheckpointConfig:
    return CheckpointConfig(
        uri=f"s3://tier-durable/{tmp.name}",
        endpoint_url=s3.endpoint_url,
        region="us-east-1",
        cache_dir=str(tmp / "node"),
        chunk_mb=1,
        cache_tier={
            "uri": f"s3://tier-cache/{tmp.name}",
            "endpoint_url": cache_endpoint or s3.endpoint_url,
        },
        **over,
    )


def _small_chunks(tiers: Tiers) -> Tiers:
    tiers.chunk_size = CHUNK  # several chunks per file in these small checkpoints
    return tiers


def with_state(d: Path, rank: int = 0) -> Path:
    """`d` plus a trainer state beside the weights, as the trainer saves it: `trainer/` holds
    Distributed Checkpoint shards (master weights and Adam's moments) and the counters."""
    state = d / "trainer"
    (state / "model").mkdir(parents=True, exist_ok=True)
    (state / "optim").mkdir(parents=True, exist_ok=True)
    (state / "model" / f"__{rank}_0.distcp").write_bytes(os.urandom(3 * CHUNK + 7))
    (state / "optim" / f"__{rank}_0.distcp").write_bytes(os.urandom(6 * CHUNK + 1))
    if rank == 0:
        (state / "counters.json").write_text('{"version": 1}')
    return d


def _objects(s3, bucket: str, prefix: str) -> list[str]:
    pages = s3.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [o["Key"].removeprefix(prefix) for page in pages for o in page.get("Contents", [])]


def _state_files(d: Path) -> set[str]:
    return {p.relative_to(d).as_posix() for p in (d / "trainer").rglob("*") if p.is_file()}


def test_a_version_is_servable_in_the_cache_tier_before_it_is_durable(
    buckets, tmp_path: Path
) -> None:
    tiers = _small_chunks(run_tiers(_cfg(buckets, tmp_path), "r1"))
    src = make_checkpoint(tmp_path / "src", seed=1, big_mib=0)
    (src / "model.safetensors").write_bytes(os.urandom(3 * CHUNK + 5))
    m = tiers.publish_servable(1, src, {"note": "x"})
    assert tiers.cache.latest() == 1 and tiers.durable.latest() is None  # servable, not yet durable
    assert (
        m.chunk_size == CHUNK
        and len(next(f for f in m.files if f.path == "model.safetensors").chunks) == 4
    )
    # an engine reads it from the cache tier, verified, while S3 does not have it yet
    path, source = tiers.fetch(1, tmp_path / "node", expect_sha256=m.sha256())
    assert (
        source == "cache"
        and tree(path)["model.safetensors"] == (src / "model.safetensors").read_bytes()
    )
    tiers.publish_durable(m, src)
    # one manifest, both tiers
    assert tiers.durable.latest() == 1 and tiers.durable.manifest(1).sha256() == m.sha256()
    # the node cache is read without any server
    assert tiers.fetch(1, tmp_path / "node", expect_sha256=m.sha256()) == (path, "node")
    # another manifest under that number is not served
    assert node_copy(tmp_path / "node", 1, "0" * 64) is None


def test_a_cache_tier_that_is_down_or_corrupt_falls_back_to_s3(buckets, tmp_path: Path) -> None:
    tiers = _small_chunks(run_tiers(_cfg(buckets, tmp_path), "r1"))
    src = make_checkpoint(tmp_path / "src", seed=2)
    m = tiers.publish(1, src, {})
    # a corrupt object in the cache tier: refused by its checksum, read from S3
    buckets.client().put_object(
        Bucket="tier-cache",
        Key=f"{tmp_path.name}/runs/r1/{file_key(tiers.cache, 1, 'model.safetensors')}",
        Body=b"\0" * 4097,
    )
    path, source = tiers.fetch(1, tmp_path / "a", expect_sha256=m.sha256())
    assert (
        source == "durable"
        and tree(path)["model.safetensors"] == (src / "model.safetensors").read_bytes()
    )
    # a cache server that is gone: a few seconds of attempts, then S3
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    down = run_tiers(_cfg(buckets, tmp_path, cache_endpoint=dead), "r1")
    t0 = time.monotonic()
    path, source = down.fetch(1, tmp_path / "b", expect_sha256=m.sha256())
    assert source == "durable" and time.monotonic() - t0 < 30
    # a manifest nobody published is never served
    with pytest.raises(CheckpointError, match="not the expected"):
        tiers.fetch(1, tmp_path / "c", expect_sha256="f" * 64)


def test_recovery_promotes_a_servable_version_and_rebuilds_an_empty_cache_tier(
    buckets, tmp_path: Path
) -> None:
    tiers = run_tiers(_cfg(buckets, tmp_path), "r1")
    tiers.publish(0, make_checkpoint(tmp_path / "s0", seed=0), {})
    src = make_checkpoint(tmp_path / "s1", seed=1)
    m1 = tiers.publish_servable(1, src, {"groups": '["g1"]'})  # the publisher died here
    assert tiers.durable.latest() == 0
    assert tiers.recover(servable=(1, m1.sha256())) == 1  # promoted: nothing trained is lost
    assert (
        tiers.durable.manifest(1).sha256() == m1.sha256()
        and tiers.durable.manifest(1).meta["groups"] == '["g1"]'
    )
    path = tiers.durable.fetch(1, tmp_path / "check")  # every file verified
    assert tree(path)["model.safetensors"] == (src / "model.safetensors").read_bytes()
    # the cache server lost its data: rebuilt with the durable latest
    other = run_tiers(
        _cfg(buckets, tmp_path / "fresh").model_copy(
            update={"uri": tiers.durable.uri.rsplit("/runs/", 1)[0]}
        ),
        "r1",
    )
    assert other.cache.latest() is None
    assert (
        other.recover() == 1
        and other.cache.latest() == 1
        and other.cache.manifest(1).sha256() == m1.sha256()
    )
    assert other.cache.read_claim(1) is None  # a rebuild without an epoch claims nothing


def test_recovery_promotes_only_the_version_the_servable_pointer_names(
    buckets, tmp_path: Path
) -> None:
    """A complete cache-tier version above the durable `latest` that the servable pointer does not
    name (another manifest under that number, or no pointer at all) never enters the durable
    lineage: it is deleted and the cache tier's `latest` goes back to the durable one."""
    tiers = run_tiers(_cfg(buckets, tmp_path), "r1", epoch=1)
    tiers.publish(0, make_checkpoint(tmp_path / "s0", seed=0), {}, exclusive=True)
    m1 = tiers.publish_servable(1, make_checkpoint(tmp_path / "s1", seed=1), {}, exclusive=True)
    m2 = tiers.publish_servable(2, make_checkpoint(tmp_path / "s2", seed=2), {}, exclusive=True)
    assert tiers.cache.latest() == 2 and tiers.durable.latest() == 0
    # the pointer names version 1 with another manifest (a republished number): nothing is promoted
    again = run_tiers(_cfg(buckets, tmp_path), "r1", epoch=2)
    assert again.recover(servable=(1, "0" * 64)) == 0
    assert (
        again.durable.versions() == [0]
        and again.cache.versions() == [0]
        and again.cache.latest() == 0
    )
    # both tiers fenced by the new epoch
    assert again.cache.latest_epoch() == again.durable.latest_epoch() == 2
    # the same, rebuilt; now the pointer names version 1 exactly: only it is promoted, not 2 above it
    m1 = again.publish_servable(1, tmp_path / "s1", {}, exclusive=True)
    again.publish_servable(2, tmp_path / "s2", {}, exclusive=True)
    third = run_tiers(_cfg(buckets, tmp_path), "r1", epoch=3)
    assert third.recover(servable=(1, m1.sha256())) == 1
    assert third.durable.versions() == [0, 1] and third.durable.manifest(1).sha256() == m1.sha256()
    assert 2 not in third.cache.versions() and third.cache.latest() == 1
    assert m2.sha256() != m1.sha256()


_KILLED_PUBLISHER = textwrap.dedent("""
    import os, sys, threading, time
    from pathlib import Path
    from moerl.config import CheckpointConfig
    from moerl.store.tiers import run_tiers
    cfg = CheckpointConfig.model_validate_json(sys.argv[1])
    tiers = run_tiers(cfg, "r1")
    src = Path(sys.argv[2])
    hold = int(sys.argv[3]) if len(sys.argv) > 3 else None  # stop this version's durable copy midway
    durable_put, holding = tiers.durable._put, [False]
    told = threading.Lock()  # never released: the first thread holding says so

    def put(stage, rel, path):
        durable_put(stage, rel, path)
        if holding[0]:  # one file of it is in the durable store: say so, and wait for the kill
            if told.acquire(blocking=False):  # files go up on several threads: one says it
                print("holding", hold, flush=True)
            time.sleep(600)

    tiers.durable._put = put
    first = max(tiers.durable.latest() or 0, tiers.cache.latest() or 0) + 1  # after what recovery left
    for v in range(first, first + 100):
        (src / "big.bin").write_bytes(os.urandom(12 * 2**20 + v))
        holding[0] = v == hold
        tiers.publish(v, src, {})
        print(v, flush=True)
""")


def test_a_publisher_killed_mid_copy_leaves_both_tiers_on_complete_versions(
    buckets, tmp_path: Path
) -> None:
    from moerl.store.base import MANIFEST

    cfg = _cfg(buckets, tmp_path)
    tiers = run_tiers(cfg, "r1")
    tiers.publish(0, make_checkpoint(tmp_path / "s0"), {})
    src = make_checkpoint(tmp_path / "src", seed=3)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}

    # 1. killed between the tiers, by construction: version 2's copy to the durable store
    # stops after its first file; at that moment the tiers are checked, then the kill lands
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_PUBLISHER, cfg.model_dump_json(), str(src), "2"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        said: list[str] = []
        # until it holds (or exits: then the check fails)
        for line in iter(proc.stdout.readline, ""):
            said.append(line.strip())
            if said[-1].startswith("holding"):
                break
        assert said == ["1", "holding 2"], said
        # the moment of the kill: servable (complete in the cache tier), not durable
        assert (
            tiers.cache.latest() == 2
            and tiers.durable.latest() == 1
            and 2 not in tiers.durable.versions()
        )
        servable = (2, tiers.cache.manifest(2).sha256())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # it died holding the copy, not of an error of its own
    assert proc.returncode == -signal.SIGKILL
    # after it: the cache tier holds version 2 whole (every byte verified against its manifest);
    # the durable store holds part of it and no manifest, its latest still version 1, complete
    tiers.cache.fetch(2, tmp_path / "verify-between-cache", expect_sha256=servable[1])
    prefix = f"{tmp_path.name}/runs/r1/versions/v000002/"
    listed = buckets.client().list_objects_v2(Bucket="tier-durable", Prefix=prefix)
    keys = [o["Key"] for o in listed.get("Contents", [])]
    assert keys and not any(k.endswith(MANIFEST) for k in keys), keys
    assert tiers.durable.latest() == 1 and 2 not in tiers.durable.versions()
    tiers.durable.fetch(1, tmp_path / "verify-between-durable")
    # the next trainer, told by the servable pointer that version 2 was served, promotes it
    assert tiers.recover(servable=servable) == 2
    assert (
        tiers.durable.latest() == tiers.cache.latest() == 2
        and tiers.durable.manifest(2).sha256() == servable[1]
    )
    tiers.durable.fetch(2, tmp_path / "verify-promoted")

    # 2. killed wherever the clock says (mid-copy to either tier, or between): both tiers are
    # on complete versions, and the next publisher goes on from what recovery left
    for kill_after in (0.8, 1.7, 2.9):
        proc = subprocess.Popen(
            [sys.executable, "-c", _KILLED_PUBLISHER, cfg.model_dump_json(), str(src)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(kill_after)
        assert proc.poll() is None  # still publishing when killed (not stopped by an error)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # each tier's latest: complete, every byte verified
        for store in (
            tiers.durable,
            tiers.cache,
        ):
            latest = store.latest()
            store.fetch(latest, tmp_path / f"verify-{kill_after}-{store.uri.split('/')[2]}")
        latest = tiers.recover()
        assert latest is not None and latest >= tiers.cache.latest()
        assert tiers.durable.manifest(latest).sha256() == tiers.cache.manifest(latest).sha256()
        src_next = latest + 1
        # the next publisher continues after whatever recovery left
        (src / "big.bin").write_bytes(os.urandom(1000))
        tiers.publish(src_next, src, {})
        assert tiers.durable.latest() == tiers.cache.latest() == src_next


def test_embedded_restart(tmp_path: Path) -> None:
    """A resumed local run starts its embedded cache tier again under the run's folder (a short
    test name: weed's unix sockets live under tmp_path, and their paths are limited)."""
    from moerl.store.s3server import local_s3_server

    for _ in range(2):
        with local_s3_server(tmp_path / "c") as server:
            server.client().create_bucket(Bucket="moerl-cache")


def test_the_cache_tier_holds_engine_weights_only_under_the_one_manifest(
    buckets, tmp_path: Path
) -> None:
    """The cache tier stores no `trainer/` object, yet its manifest lists every file with the
    sha256 and chunks the durable copy holds: one manifest sha256 names the version in both. An
    engine's fetch (without `trainer/`) verifies from the cache tier; a full fetch there is
    refused naming `trainer/`, and `Tiers.fetch` reads it from the durable store instead."""
    tiers = _small_chunks(run_tiers(_cfg(buckets, tmp_path), "r1", epoch=1))
    assert tiers.cache.absent == ENGINE_EXCLUDE and tiers.durable.absent == ()
    src = with_state(make_checkpoint(tmp_path / "src", seed=1))
    state = _state_files(src)
    m = tiers.publish_servable(1, src, {}, exclusive=True)
    assert tiers.cache_failed is None and tiers.cache.latest() == 1
    run = f"{tmp_path.name}/runs/r1/versions/v000001/"
    cached = _objects(buckets, "tier-cache", run)
    assert not [k for k in cached if "trainer/" in k], cached
    engine_files = {"config.json", "model.safetensors", "tokenizer/nested/tokenizer.json"}
    assert in_version(m, engine_files) <= set(cached)
    # the manifest lists the state exactly as it is (sha256 and every chunk's)
    listed = {e.path: e for e in m.files}
    for rel in state:
        assert listed[rel] == FileEntry(rel, *hash_file(src / rel, CHUNK))
    assert len(listed["trainer/optim/__0_0.distcp"].chunks) == 7
    # the durable copy: every file, under the same manifest
    tiers.publish_durable(m, src, exclusive=True)
    assert tiers.durable.manifest(1).sha256() == tiers.cache.manifest(1).sha256() == m.sha256()
    assert in_version(m, state) <= set(_objects(buckets, "tier-durable", run))
    # an engine reads the cache tier, every file verified
    path, source = tiers.fetch(1, tmp_path / "node", ENGINE_EXCLUDE, expect_sha256=m.sha256())
    engine = {k: v for k, v in tree(src).items() if not k.startswith("trainer/")}
    assert (
        source == "cache"
        and {k: v for k, v in tree(path).items() if k not in (MANIFEST, MARKER)} == engine
    )
    # a full fetch from the cache tier is refused, naming what it lacks and where it is
    with pytest.raises(CheckpointError, match=r"does not hold trainer/ .*the durable store has"):
        tiers.cache.fetch(1, tmp_path / "full-cache")
    with pytest.raises(CheckpointError, match="trainer/"):
        tiers.cache.read_chunk(1, "trainer/optim/__0_0.distcp", 0, CHUNK)
    # ... and the tiers read it from the durable store, whole and verified
    path, source = tiers.fetch(1, tmp_path / "full", expect_sha256=m.sha256())
    assert source == "durable" and state <= set(tree(path))
    assert all(tree(path)[k] == v for k, v in tree(src).items())


class _OtherNode:
    """The trainer mesh's other node: it puts its own files into the publish under way, with
    the store's own `put_parts` (what `RemoteParts.put` has every holder do)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def put(
        self,
        store: CheckpointStore,
        version: int,
        stage: str,
        claim: Claim | None,
        manifest: Manifest | None,
        chunk_size: int,
    ) -> list[FileEntry]:
        return store.put_parts(version, stage, self.folder, claim, manifest, chunk_size)


def test_parts_put_by_other_nodes_leave_their_state_out_of_the_cache_tier(
    buckets, tmp_path: Path
) -> None:
    tiers = _small_chunks(run_tiers(_cfg(buckets, tmp_path), "r1", epoch=1))
    local = with_state(make_checkpoint(tmp_path / "rank0", seed=1))
    other = with_state(tmp_path / "rank1", rank=1)
    (other / "model-00002.safetensors").write_bytes(os.urandom(2 * CHUNK))
    parts = _OtherNode(other)
    m = tiers.publish_servable(1, local, {}, exclusive=True, parts=parts)
    assert tiers.cache_failed is None and tiers.cache.latest() == 1
    listed = {e.path: e for e in m.files}
    for d in (local, other):
        for rel in {p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()}:
            assert listed[rel] == FileEntry(rel, *hash_file(d / rel, CHUNK))
    run = f"{tmp_path.name}/runs/r1/versions/v000001/"
    cached = _objects(buckets, "tier-cache", run)
    assert in_version(m, ["model-00002.safetensors"]) <= set(cached) and not [
        k for k in cached if "trainer/" in k
    ]
    tiers.publish_durable(m, local, exclusive=True, parts=parts)
    assert tiers.durable.manifest(1).sha256() == m.sha256()
    state = _state_files(local) | _state_files(other)
    assert in_version(m, state) <= set(_objects(buckets, "tier-durable", run))
    whole = tiers.durable.fetch(1, tmp_path / "whole")
    assert (
        tree(whole)["trainer/optim/__1_0.distcp"]
        == (other / "trainer/optim/__1_0.distcp").read_bytes()
    )


def test_recovery_drops_a_servable_version_with_state_and_promotes_one_without(
    buckets, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A version servable in the cache tier but not durable used to be promoted from there; its
    `trainer/` state is in neither tier now, so it is deleted and trained again (the caller
    points the servable pointer back at the durable `latest` it gets). A version without
    state (version 0) is still promoted. A cache tier that lost its data is rebuilt from the
    durable `latest` without its state."""
    tiers = run_tiers(_cfg(buckets, tmp_path), "r1", epoch=1)
    m0 = tiers.publish_servable(0, make_checkpoint(tmp_path / "s0", seed=0), {}, exclusive=True)
    assert tiers.durable.latest() is None  # the publisher died here: version 0 is only servable
    again = run_tiers(_cfg(buckets, tmp_path), "r1", epoch=2)
    assert again.recover(servable=(0, m0.sha256())) == 0  # promoted: no state to lack
    assert again.durable.manifest(0).sha256() == m0.sha256()
    again.durable.fetch(0, tmp_path / "check0")  # every file verified
    # version 1, with its state, servable and then the publisher died
    src = with_state(make_checkpoint(tmp_path / "s1", seed=1))
    m1 = again.publish_servable(1, src, {}, exclusive=True)
    assert again.cache.latest() == 1 and again.durable.latest() == 0
    third = run_tiers(_cfg(buckets, tmp_path), "r1", epoch=3)
    with caplog.at_level("WARNING", logger="moerl.store.tiers"):
        assert third.recover(servable=(1, m1.sha256())) == 0
    assert "cannot be promoted: its trainer/ state" in caplog.text
    assert third.durable.versions() == [0] and third.durable.latest() == 0
    assert third.cache.versions() == [0] and third.cache.latest() == 0
    run = f"{tmp_path.name}/runs/r1/versions/v000001/"
    assert _objects(buckets, "tier-cache", run) == []
    # the number is trained again: its new copy goes to both tiers as usual
    m1b = third.publish(
        1, with_state(make_checkpoint(tmp_path / "s1b", seed=5)), {}, exclusive=True
    )
    assert third.durable.latest() == third.cache.latest() == 1 and m1b.sha256() != m1.sha256()
    # the cache server lost its data: rebuilt with the durable latest, without its state
    fresh = run_tiers(
        _cfg(buckets, tmp_path / f"{tmp_path.name}-fresh").model_copy(
            update={"uri": third.durable.uri.rsplit("/runs/", 1)[0]}
        ),
        "r1",
    )
    assert fresh.cache.latest() is None
    assert fresh.recover() == 1 and fresh.cache.latest() == 1
    assert fresh.cache.manifest(1).sha256() == m1b.sha256()
    rebuilt = _objects(buckets, "tier-cache", f"{tmp_path.name}-fresh/runs/r1/versions/v000001/")
    assert in_version(m1b, ["model.safetensors"]) <= set(rebuilt)
    assert not [k for k in rebuilt if "trainer/" in k]
    fresh.cache.fetch(1, tmp_path / "check1", exclude=ENGINE_EXCLUDE)  # verified


def test_the_embedded_cache_tier_of_a_local_run_holds_no_trainer_state(tmp_path: Path) -> None:
    """`cache_tier.endpoint_url: embedded` (a local `moerl run`): its own `weed mini`, and the
    store built on it lacks `trainer/` like the cluster's (a short name: weed's unix sockets)."""
    from moerl.config import parse_config
    from moerl.store.s3server import embedded_cache_tier
    from moerl.store.tiers import cache_tier_store

    cfg = parse_config(
        {
            "checkpoint": {
                "uri": str(tmp_path / "durable"),
                "cache_dir": str(tmp_path / "node"),
                "cache_tier": {"uri": "s3://moerl-cache/ckpt", "endpoint_url": "embedded"},
            }
        }
    )
    with embedded_cache_tier(cfg, tmp_path / "c") as local:
        assert cache_tier_store(local.checkpoint, "r1").absent == ENGINE_EXCLUDE
        tiers = run_tiers(local.checkpoint, "r1", epoch=1)
        src = with_state(make_checkpoint(tmp_path / "s1", seed=1))
        m = tiers.publish(1, src, {}, exclusive=True)
        assert tiers.cache_failed is None and tiers.cache.manifest(1).sha256() == m.sha256()
        assert not [k for k in tiers.cache._list("versions/") if "/trainer/" in k]
        # the folder store's copy under the cache tier's manifest: its object folder too
        counters = file_key(tiers.durable, 1, "trainer/counters.json")
        assert m.objects and (tmp_path / "durable/runs/r1" / counters).is_file()
