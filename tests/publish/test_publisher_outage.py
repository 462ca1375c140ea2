"""An S3 brownout under the async publisher (components/publish_checkpoint/publisher.py and
outage.py): a real `weed mini` stopped in the middle of a version's upload and started again
seconds later. The publisher waits on it (a line per retry), tidies what its failed attempt
left, and the version is published complete; nothing else is in the store under it."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from moerl.components.publish_checkpoint.outage import retrying
from moerl.components.publish_checkpoint.publisher import Publisher
from moerl.config import RunConfig
from moerl.errors import CheckpointError, StoreUnavailable
from moerl.store.base import MANIFEST
from moerl.store.fence import CLAIM
from moerl.store.runs import run_store
from moerl.store.s3 import S3Store
from tests.support.s3server import S3Process


@pytest.fixture
def weed(tmp_path, monkeypatch):
    s3 = S3Process(tmp_path / "weed")
    server = s3.start()
    server.client().create_bucket(Bucket="outage")
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    try:
        yield s3
    finally:
        s3.stop()


def _state(d: Path, mb: int) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"model_type": "qwen3_moe"}')
    (d / "weights.bin").write_bytes(os.urandom(mb * 2**20))
    return d


def test_a_store_stopped_mid_upload_and_restarted_costs_time_not_the_publication(
    weed, tmp_path, monkeypatch, capfd
):
    cfg = RunConfig.model_validate(
        {
            "checkpoint": {
                "uri": "s3://outage/ckpt",
                "endpoint_url": weed.server.endpoint_url,
                "region": "us-east-1",
                "cache_dir": str(tmp_path / "node"),
                "chunk_mb": 5,
                "multipart_chunk_mb": 5,
                "max_attempts": 2,
                "outage_s": 180,
            }
        }
    )
    stopped = threading.Event()
    put = S3Store._put

    def stop_at_first_put(self, stage: str, rel: str, src: Path) -> None:
        # the fault, timed: the server goes away as version 2's first file starts uploading
        if "v000002" in stage and not stopped.is_set():
            weed.stop()
            stopped.set()
        put(self, stage, rel, src)

    monkeypatch.setattr(S3Store, "_put", stop_at_first_put)
    durable: list[int] = []
    publisher = Publisher(
        cfg, "r1", on_servable=lambda p: None, on_durable=lambda j: durable.append(j.version)
    )
    try:
        publisher.submit(1, _state(tmp_path / "s1", 1), {})
        publisher.submit(2, _state(tmp_path / "s2", 12), {})
        assert stopped.wait(60)
        time.sleep(3)  # failed attempts while it is away
        assert publisher.error is None and [j.version for j in publisher.in_flight()] == [2]
        weed.start()
        weed.wait_writable("outage")
        publisher.drain(timeout_s=180)
    finally:
        publisher.close()
    assert durable == [1, 2]
    assert (
        "publisher: version 2's first copy: waiting on the checkpoint store"
        in capfd.readouterr().out
    )
    store = run_store(cfg.checkpoint, "r1")
    assert store.latest() == 2
    manifest = store.manifest(2)
    got = store.fetch(2, tmp_path / "fetched")  # every file verified against the manifest
    assert (got / "weights.bin").read_bytes() == (tmp_path / "s2" / "weights.bin").read_bytes()
    # what the failed attempt uploaded (under an object folder of its own) was removed
    keys = store._list("versions/v000002/")
    left = [k for k in keys if not k.endswith((f"/{MANIFEST}", f"/{CLAIM}"))]
    assert sorted(left) == sorted(
        f"versions/v000002/{manifest.objects}/{f.path}" for f in manifest.files
    ), keys


def test_the_wait_is_bounded_and_only_an_unavailable_store_is_waited_on():
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    def away():
        raise StoreUnavailable("cannot reach S3 endpoint http://x")

    with pytest.raises(StoreUnavailable, match=r"v7: .* past checkpoint.outage_s \(60 s\)"):
        retrying("v7", away, 60, sleep=sleep, clock=lambda: now[0])
    assert sum(slept) == pytest.approx(60) and max(slept) <= 30
    assert slept[:3] == sorted(slept[:3])  # backing off

    calls = []

    def refused():
        calls.append(1)
        raise CheckpointError("refused: this writer's trainer epoch 1 is older")

    with pytest.raises(CheckpointError, match="refused"):
        retrying("v7", refused, 60, sleep=sleep, clock=lambda: now[0])
    assert calls == [1]  # raised at once


def test_a_restarted_trainers_recovery_waits_for_the_store_naming_what_it_waits_on(
    weed, tmp_path, capfd
):
    from moerl.bus import EmbeddedValkey, RunBus, connect
    from moerl.components.policy_update.worker import _take_over
    from moerl.store.tiers import run_tiers

    cfg = RunConfig.model_validate(
        {
            "checkpoint": {
                "uri": "s3://outage/ckpt",
                "endpoint_url": weed.server.endpoint_url,
                "region": "us-east-1",
                "cache_dir": str(tmp_path / "node"),
                "max_attempts": 2,
                "outage_s": 120,
            }
        }
    )
    run_tiers(cfg.checkpoint, "r2").publish(0, _state(tmp_path / "s0", 1), {})
    valkey = EmbeddedValkey(tmp_path / "valkey").start()
    try:
        bus = RunBus(connect(valkey.url, 5), "r2")
        weed.stop()  # the trainer restarts into a brownout
        back = threading.Timer(4.0, weed.start)
        back.start()
        try:
            epoch, _, latest = _take_over(cfg, "r2", bus)
        finally:
            back.join()
    finally:
        valkey.stop()
    assert latest == 0 and epoch >= 1
    out = capfd.readouterr().out
    assert "trainer recovery: reading the store's trainer epoch: waiting on the checkpoint" in out


def test_a_manifest_put_whose_reply_was_lost_is_not_taken_for_another_writers(
    s3_server, tmp_path, monkeypatch
):
    """A server that goes away as it answers: the manifest's create-only PUT landed, its reply
    was lost, the client's retry met the object (412). The publish finds its own text there and
    completes, instead of stopping as if another writer had raced it."""
    from moerl.config import CheckpointConfig

    try:
        s3_server.client().create_bucket(Bucket="lost")
    except s3_server.client().exceptions.BucketAlreadyOwnedByYou:
        pass
    cfg = CheckpointConfig(
        uri="s3://lost/x", endpoint_url=s3_server.endpoint_url, region="us-east-1"
    )
    store = run_store(cfg, tmp_path.name)
    real = store._write_if

    def reply_lost(key: str, text: str, tag: str | None) -> bool:
        if key.endswith(f"/{MANIFEST}"):
            assert real(key, text, tag)  # it landed; the client never heard
        return real(key, text, tag)

    monkeypatch.setattr(store, "_write_if", reply_lost)
    m = store.publish(1, _state(tmp_path / "s1", 1), exclusive=True, epoch=1)
    assert store.latest() == 1 and store.manifest(1).sha256() == m.sha256()


def test_a_mesh_publication_waits_when_another_nodes_upload_meets_the_outage(
    weed, tmp_path, monkeypatch, capfd
):
    """A trainer on several nodes (the seed's 16): node 1's uploader puts its own files into the
    version rank 0's publisher runs (`NodeParts`). The store goes away as node 1 starts; its
    failure comes back marked as the store's, so rank 0's publisher waits and asks again, and
    the version holds both nodes' files."""
    from tests.store.test_parts import RUN, Mesh, node0, node1

    cfg = RunConfig.model_validate(
        {
            "checkpoint": {
                "uri": "s3://outage/mesh",
                "endpoint_url": weed.server.endpoint_url,
                "region": "us-east-1",
                "cache_dir": str(tmp_path / "node"),
                "max_attempts": 2,
                "outage_s": 120,
            }
        }
    )
    stopped = threading.Event()
    put_parts = S3Store.put_parts

    def stop_at_node1(self, *args, **kwargs):  # the fault, timed: node 1's upload begins
        if not stopped.is_set():
            weed.stop()
            stopped.set()
        return put_parts(self, *args, **kwargs)

    monkeypatch.setattr(S3Store, "put_parts", stop_at_node1)
    mesh = Mesh(tmp_path)
    try:
        mesh.start_uploader(cfg)
        durable: list[int] = []
        publisher = Publisher(
            cfg,
            RUN,
            on_servable=lambda p: None,
            on_durable=lambda j: durable.append(j.version),
            epoch=1,
            parts=mesh.parts(timeout_s=60),
        )
        try:
            node1(mesh.base, 1, seed=1)
            publisher.submit(1, node0(tmp_path / "node0", seed=1), {})
            assert stopped.wait(60)
            time.sleep(3)
            assert publisher.error is None
            weed.start()
            weed.wait_writable("outage")
            publisher.drain(timeout_s=120)
        finally:
            publisher.close()
    finally:
        mesh.close()
    assert durable == [1]
    assert "node 1 could not put its files" in capfd.readouterr().out
    store = run_store(cfg.checkpoint, RUN)
    assert store.latest() == 1
    assert "model-r1-p0.safetensors" in {f.path for f in store.manifest(1).files}
    store.fetch(1, tmp_path / "fetched")  # every file verified
