"""The async publisher (components/publish_checkpoint/publisher.py) on real parts: a cache tier
and a durable store on S3 (`weed mini`), the servable pointer on a real Valkey. Each version is
servable (complete in the cache tier, named by the bus's servable pointer) while the durable
store's `latest` is still on the version before it, and only then durable; each version's
metrics are present and agree with the order in which those events were seen."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moerl.bus import EmbeddedValkey, RunBus, connect
from moerl.components.publish_checkpoint.publisher import Job, Publisher
from moerl.config import RunConfig
from moerl.errors import CheckpointError
from moerl.records import PolicyVersion
from moerl.store.tiers import run_tiers

VERSIONS = 3


@pytest.fixture(scope="module")
def buckets(s3_server):
    client = s3_server.client()
    for b in ("pub-cache", "pub-durable"):
        try:
            client.create_bucket(Bucket=b)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
    return s3_server


def _state(d: Path, seed: int) -> Path:
    """A trainer state: HF files with finite weights (the publisher checks them) and trainer/."""
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"model_type": "qwen3_moe"}')
    (d / "trainer").mkdir()
    (d / "trainer" / "state.json").write_text(f'{{"step": {seed}}}')
    save_file({"lm_head.weight": torch.full((64, 64), float(seed))}, d / "model.safetensors")
    (d / "big.bin").write_bytes(os.urandom(2 * 2**20 + seed))  # a few chunks at chunk_mb=1
    return d


def _has_manifest(store, version: int) -> bool:
    try:
        store.manifest(version)
        return True
    except CheckpointError:
        return False


def test_each_version_is_servable_before_it_is_durable_and_its_metrics_follow_that_order(
    buckets, tmp_path
):
    name = tmp_path.name
    cfg = RunConfig.model_validate(
        {
            "checkpoint": {
                "uri": f"s3://pub-durable/{name}",
                "endpoint_url": buckets.endpoint_url,
                "region": "us-east-1",
                "cache_dir": str(tmp_path / "node"),
                "chunk_mb": 1,
                "max_unpublished": 2,
                "cache_tier": {
                    "uri": f"s3://pub-cache/{name}",
                    "endpoint_url": buckets.endpoint_url,
                },
            }
        }
    )
    tiers = run_tiers(cfg.checkpoint, "r1")
    tiers.publish(0, _state(tmp_path / "s0", 0), {})
    valkey = EmbeddedValkey(tmp_path / "valkey").start()
    try:
        bus = RunBus(connect(valkey.url, 5), "r1")
        epoch = bus.claim_trainer("t")
        events: list[dict] = []

        def on_servable(p: PolicyVersion) -> None:  # as the trainer's: the engines' pointer moves
            entered = time.perf_counter()
            bus.set_servable(epoch, p.version, p.uri, p.manifest_sha256)
            pointer = bus.servable()
            # read after the pointer moved: the durable store must not have this version yet
            events.append(
                {
                    "event": "servable",
                    "version": p.version,
                    "entered": entered,
                    "sha": p.manifest_sha256,
                    "pointer": (pointer.version, pointer.manifest_sha256),
                    "cache_latest": tiers.cache.latest(),
                    "cache_sha": tiers.cache.manifest(p.version).sha256(),
                    "durable_latest": tiers.durable.latest(),
                    "durable_has_it": _has_manifest(tiers.durable, p.version),
                    "left": time.perf_counter(),
                }
            )

        def on_durable(job: Job) -> None:  # as the trainer's commit
            events.append(
                {
                    "event": "durable",
                    "version": job.version,
                    "entered": time.perf_counter(),
                    "durable_latest": tiers.durable.latest(),
                    "durable_sha": tiers.durable.manifest(job.version).sha256(),
                    "pointer": bus.servable().version,
                }
            )

        publisher = Publisher(cfg, "r1", on_servable=on_servable, on_durable=on_durable)
        try:
            for v in range(1, VERSIONS + 1):
                publisher.submit(v, _state(tmp_path / f"s{v}", v), {"groups": f'["g{v}"]'})
            publisher.drain(timeout_s=120)
            jobs = publisher.take_finished()
        finally:
            publisher.close()
    finally:
        valkey.stop()

    # one servable event, then one durable event, per version, in order
    assert [(e["event"], e["version"]) for e in events] == [
        (ev, v) for v in range(1, VERSIONS + 1) for ev in ("servable", "durable")
    ]
    assert [j.version for j in jobs] == list(range(1, VERSIONS + 1))
    for job, servable, durable in zip(jobs, events[0::2], events[1::2]):
        v, sha = job.version, servable["sha"]
        # servable: complete in the cache tier and named by the bus's pointer, while the durable
        # store's latest is the version before and holds no manifest of this one
        assert servable["cache_latest"] == v and servable["cache_sha"] == sha
        assert servable["pointer"] == (v, sha)
        assert servable["durable_latest"] == v - 1 and not servable["durable_has_it"]
        # durable: the same manifest, latest moved, the pointer still on it when it is committed
        assert (
            durable["durable_latest"] == v
            and durable["durable_sha"] == sha
            and durable["pointer"] == v
        )
        assert job.policy.version == v and job.policy.manifest_sha256 == sha
        # the version's own metrics, each present, agree with that order: the servable time was
        # taken before the pointer moved, the durable time after the pointer moved and before
        # the commit
        m = job.metrics
        assert m["weights/version"] == float(v)
        assert m["weights/cache_tier"] == 1.0 and m["weights/cache_tier_failed"] == 0.0
        assert job.handed + m["weights/published_to_servable_s"] <= servable["entered"]
        assert (
            servable["left"]
            <= job.handed + m["weights/published_to_durable_s"]
            <= durable["entered"]
        )
        assert 0.0 < m["weights/published_to_servable_s"] < m["weights/published_to_durable_s"]
        assert m["weights/publish_mb"] > 2.0
