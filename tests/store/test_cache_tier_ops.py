"""The cache tier's housekeeping on real S3 servers (weed mini): its bucket created again after the
server lost its memory, a failed publication's objects deleted, a version too large for the tier
sent to the durable store first (counted), a finished run's prefix deleted."""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path

import pytest
from botocore.exceptions import BotoCoreError, ClientError

from moerl.config import CheckpointConfig, parse_config
from moerl.errors import CheckpointError
from moerl.store.s3 import S3Store
from moerl.store.tiers import drop_cache_run, run_tiers
from tests.store.test_store import make_checkpoint, tree
from tests.support.s3server import S3Process


@pytest.fixture
def durable(s3_server) -> str:
    bucket = f"dur-{uuid.uuid4().hex[:10]}"
    s3_server.client().create_bucket(Bucket=bucket)
    return bucket


def _cfg(
    s3_server, durable: str, cache_endpoint: str, cache_bucket: str, **cache
) -> CheckpointConfig:
    return CheckpointConfig(
        uri=f"s3://{durable}/ckpt",
        endpoint_url=s3_server.endpoint_url,
        region="us-east-1",
        chunk_mb=1,
        cache_tier={"uri": f"s3://{cache_bucket}/ckpt", "endpoint_url": cache_endpoint, **cache},
    )


def _vanish_after_first_file(store, src: Path, rel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's folder loses `rel` once the publish has stored its first file: a real read
    failure in the middle of an upload, after objects were written."""
    put, done = store._put, []

    def put_then_vanish(stage: str, r: str, path: Path) -> None:
        put(stage, r, path)
        if not done:
            done.append(r)
            (src / rel).rename(src.parent / f"{src.name}-{Path(rel).name}.gone")

    monkeypatch.setattr(store, "_put", put_then_vanish)
    store._workers = 1  # one file at a time: the vanished one is read after the first is stored


def test_the_writer_creates_the_cache_bucket_again_after_the_server_lost_its_memory(
    s3_server,
    durable: str,
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root = tmp_path_factory.mktemp("ct")  # short: weed's unix sockets live under it
    cache = S3Process(root, reader=True)
    server = cache.start()
    try:
        # the writer identity
        monkeypatch.setenv("MOERL_CACHE_TIER_ACCESS_KEY_ID", server.access_key)
        monkeypatch.setenv("MOERL_CACHE_TIER_SECRET_ACCESS_KEY", server.secret_key)
        cfg = _cfg(s3_server, durable, server.endpoint_url, "moerl-cache")
        tiers = run_tiers(cfg, "r1", epoch=1)
        # no bucket yet: created
        m0 = tiers.publish(0, make_checkpoint(tmp_path / "s0"), {}, exclusive=True)
        assert tiers.cache_failed is None and tiers.cache.latest() == 0
        # the pod restarts on a new node: its memory-backed volume is empty, the bucket gone
        cache.kill()
        shutil.rmtree(root)
        server = cache.start()
        client = server.client()
        deadline = time.monotonic() + 60
        while True:  # ready before its volume server takes writes: probe in a bucket of its own
            try:
                client.create_bucket(Bucket="probe")
                break
            except (BotoCoreError, ClientError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        cache.wait_writable("probe")
        assert "moerl-cache" not in {b["Name"] for b in client.list_buckets()["Buckets"]}
        # the reader identity (engines) may not create it: least privilege holds
        reader = S3Store(
            CheckpointConfig(
                uri="s3://moerl-cache/ckpt",
                endpoint_url=server.endpoint_url,
                region="us-east-1",
                max_attempts=1,
            ),
            credentials=server.reader,
        )
        with pytest.raises(CheckpointError, match="creating bucket 'moerl-cache'"):
            reader.ensure_bucket()
        # the restarted trainer's recovery creates it and rebuilds the durable latest there
        again = run_tiers(cfg, "r1", epoch=2)
        assert again.recover(servable=(0, m0.sha256())) == 0
        assert again.cache.latest() == 0 and again.cache.manifest(0).sha256() == m0.sha256()
        # and the next version is servable from it again
        m1 = again.publish_servable(1, make_checkpoint(tmp_path / "s1", seed=1), {}, exclusive=True)
        assert again.cache_failed is None and again.cache.latest() == 1
        path, source = again.fetch(1, tmp_path / "node", expect_sha256=m1.sha256())
        assert (
            source == "cache"
            and tree(path)["config.json"] == (tmp_path / "s1" / "config.json").read_bytes()
        )
    finally:
        cache.stop()


def test_a_failed_publish_leaves_no_objects_behind(
    s3_server, durable: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3_server.client().create_bucket(Bucket=(cache_bucket := f"cache-{uuid.uuid4().hex[:10]}"))
    tiers = run_tiers(_cfg(s3_server, durable, s3_server.endpoint_url, cache_bucket), "r1", epoch=1)
    tiers.publish(0, make_checkpoint(tmp_path / "s0"), {}, exclusive=True)
    # the cache tier's copy fails after its first file: its objects and claim are deleted, and
    # the version goes to the durable store first
    src = make_checkpoint(tmp_path / "s1", seed=1, big_mib=6)
    _vanish_after_first_file(tiers.cache, src, "model.safetensors", monkeypatch)
    tiers.publish_servable(1, src, {}, exclusive=True)
    assert "cannot read" in tiers.cache_failed
    assert tiers.cache._list("versions/v000001/") == [] and tiers.cache.latest() == 0
    assert tiers.durable.latest() == 1
    # the durable store's own copy failing (unfenced, as the sync pipeline publishes): the same
    src2 = make_checkpoint(tmp_path / "s2", seed=2, big_mib=6)
    _vanish_after_first_file(tiers.durable, src2, "model.safetensors", monkeypatch)
    with pytest.raises(CheckpointError, match="cannot read"):
        tiers.durable.publish(2, src2)
    assert tiers.durable._list("versions/v000002/") == [] and tiers.durable.latest() == 1


def test_a_version_larger_than_the_cache_tier_goes_to_the_durable_store_first_and_is_counted(
    s3_server, durable: str, tmp_path: Path
) -> None:
    import torch
    from safetensors.torch import save_file

    from moerl.components.publish_checkpoint.stage import publish_durable, publish_servable

    s3_server.client().create_bucket(Bucket=(cache_bucket := f"cache-{uuid.uuid4().hex[:10]}"))
    # 64 bytes
    ck = _cfg(s3_server, durable, s3_server.endpoint_url, cache_bucket, capacity_gb=64 / 2**30)
    cfg = parse_config({"checkpoint": ck.model_dump()})
    src = tmp_path / "state"
    src.mkdir()
    save_file({"w": torch.ones(4, 4)}, str(src / "model.safetensors"))
    manifest, policy, metrics = publish_servable(cfg, "r1", src, 0, {}, exclusive=True, epoch=1)
    assert (
        metrics["weights/cache_tier_too_small"] == 1.0
        and metrics["weights/cache_tier_failed"] == 1.0
    )
    assert metrics["weights/cache_tier"] == 0.0
    tiers = run_tiers(cfg.checkpoint, "r1")
    # not a byte in the cache tier
    assert tiers.durable.latest() == 0 and tiers.cache._list("") == []
    publish_durable(cfg, "r1", src, manifest, exclusive=True, already=True, epoch=1)
    assert tiers.durable.manifest(0).sha256() == policy.manifest_sha256
    from moerl.store.tiers import check_tier_fits

    check_tier_fits(cfg.checkpoint, 21)  # 3 x 21 bytes fit in 64
    with pytest.raises(
        CheckpointError,
        match=r"a version is .* GiB \(22 bytes\) and the cache tier holds "
        r"keep_last \+ 1 = 3",
    ):
        check_tier_fits(cfg.checkpoint, 22)


def test_the_cache_tiers_room_is_counted_in_engine_bytes_not_trainer_state(
    s3_server, durable: str, tmp_path: Path
) -> None:
    """`check_tier_fits` counts what the cache tier holds of a version: its engine weights, not
    its `trainer/` state (which only the durable store holds), however large that is."""
    from moerl.store.runs import ENGINE_EXCLUDE
    from moerl.store.tiers import held_bytes
    from tests.store.test_tiers import with_state

    s3_server.client().create_bucket(Bucket=(cache_bucket := f"cache-{uuid.uuid4().hex[:10]}"))
    src = with_state(make_checkpoint(tmp_path / "s1", seed=1))
    engine = sum(
        p.stat().st_size
        for p in src.rglob("*")
        if p.is_file() and not p.relative_to(src).as_posix().startswith("trainer/")
    )
    whole = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    assert held_bytes(src, ENGINE_EXCLUDE) == engine and held_bytes(src) == whole > 2 * engine
    for room, fits in ((3 * engine, True), (3 * engine - 1, False)):  # keep_last 2 + 1 versions
        cfg = _cfg(
            s3_server, durable, s3_server.endpoint_url, cache_bucket, capacity_gb=room / 2**30
        )
        tiers = run_tiers(cfg, f"r{room}", epoch=1)
        tiers.publish_servable(1, src, {}, exclusive=True)
        assert tiers.cache_too_small is not fits
        assert (tiers.cache.latest() == 1) is fits and (tiers.durable.latest() == 1) is not fits


def test_a_finished_runs_cache_prefix_is_deleted_and_its_durable_copy_kept(
    s3_server, durable: str, tmp_path: Path
) -> None:
    s3_server.client().create_bucket(Bucket=(cache_bucket := f"cache-{uuid.uuid4().hex[:10]}"))
    cfg = _cfg(s3_server, durable, s3_server.endpoint_url, cache_bucket)
    for run in ("done", "live"):
        tiers = run_tiers(cfg, run, epoch=1)
        for v in (0, 1):
            tiers.publish(v, make_checkpoint(tmp_path / run / f"s{v}", seed=v), {}, exclusive=True)
    assert drop_cache_run(cfg, "done") > 0  # what finish_run calls
    done, live = run_tiers(cfg, "done"), run_tiers(cfg, "live")
    assert done.cache._list("") == []
    # another run's prefix untouched
    assert live.cache.versions() == [0, 1] and live.cache.latest() == 1
    assert done.durable.versions() == [0, 1] and done.durable.latest() == 1
    done.durable.fetch(1, tmp_path / "check")  # the durable copy verifies, every byte
    assert drop_cache_run(cfg, "done") == 0  # nothing left; a second close is harmless


def test_the_first_tasks_preflight_accepts_a_cache_server_with_no_bucket_yet(
    s3_server,
    durable: str,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A fresh or restarted cache server holds no bucket (it keeps them in memory), and
    `start_run` holds only the reader's keys, which may not create one: its preflight passes,
    saying the first publication creates it. Refused keys are still refused."""
    from moerl.errors import ConfigError
    from moerl.preflight import _check_cache_tier

    cache = S3Process(tmp_path_factory.mktemp("ct"), reader=True)
    server = cache.start()
    try:
        cfg = parse_config(
            {
                "checkpoint": _cfg(
                    s3_server, durable, server.endpoint_url, "moerl-cache"
                ).model_dump()
            }
        )
        monkeypatch.setenv("MOERL_CACHE_TIER_ACCESS_KEY_ID", server.reader[0])
        monkeypatch.setenv("MOERL_CACHE_TIER_SECRET_ACCESS_KEY", server.reader[1])
        with caplog.at_level("WARNING"):
            _check_cache_tier(cfg)
        assert (
            "does not exist yet" in caplog.text
            and "the first publication creates it" in caplog.text
        )
        monkeypatch.setenv("MOERL_CACHE_TIER_SECRET_ACCESS_KEY", "wrong")
        with pytest.raises(ConfigError, match="is not usable"):
            _check_cache_tier(cfg)
    finally:
        cache.stop()
