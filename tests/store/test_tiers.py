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
from moerl.store.tiers import Tiers, node_copy, run_tiers
from tests.store.test_store import make_checkpoint, tree

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
        Key=f"{tmp_path.name}/runs/r1/versions/v000001/model.safetensors",
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
