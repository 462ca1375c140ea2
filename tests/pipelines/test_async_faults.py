"""Fault tests of the async mode: a streamed trainer killed mid-version gates every change; a Spot
drain mid-generation (cluster-shaped) and a worker SIGKILLed are nightly here, as are
test_async_faults_stages.py and test_async_faults_servers.py. Real processes (vLLM
rollout workers, scorers, the trainer), a real Valkey, the checkpoint store and MLflow, each run
bounded by a clock that scales with what it measures (tests/support/fault_runs.py, which says
what balances).

The SIGTERM test runs cluster-shaped, as the async pipeline runs on EKS: every process in its
own empty directory (`MOERL_SANDBOX_ROOT`, moerl/launch/podenv.py; a restarted worker gets a new one,
like a new pod), sharing only real servers on 127.0.0.1: Valkey, S3 (`weed mini`) and an MLflow
tracking server (and torch's compile cache, see tests/support/sandbox.py).
"""

from __future__ import annotations

import signal
import time

import pytest

from moerl import tracking
from moerl.components.rollout.worker import EXIT_DRAINED
from moerl.store.tiers import run_tiers
from tests.support.fault_runs import (
    Harness,
    balanced,
    cache_server,
    mlflow_balanced,
    trained_groups,
    versions_of,
)

pytestmark = pytest.mark.slow


@pytest.mark.nightly  # the drain gates at the bus (requeue) and the pod (exit 75) levels
def test_sigterm_drains_a_worker_mid_generation_and_others_finish_its_unit(
    tmp_path, s3_server, monkeypatch
):
    # slow units (2 sequences at a time, long responses, 8 groups) so the signal lands
    # mid-generation; a grace far shorter than a group, so part of the unit must be requeued (with
    # 4 groups and 0.3 s, a loaded machine twice saw the unit finish inside the grace). Cluster-shaped: S3, an
    # MLflow server, a Valkey server, the checkpoint cache tier (a second S3 server), every process
    # sandboxed (see the module docstring); the two workers fan new versions out to each other.
    import boto3

    from tests.support.mlflow_server import mlflow_server

    boto3.client("s3", endpoint_url=s3_server.endpoint_url).create_bucket(Bucket="moerl-async")
    cache = cache_server(tmp_path, monkeypatch)
    try:
        with mlflow_server(tmp_path) as url:
            h = Harness(
                tmp_path,
                "rollout.workers=2",
                "rollout.max_num_seqs=2",
                "rollout.max_new_tokens=24",
                "units.max_prompts=8",
                "rollout.grace_seconds=0.05",
                "checkpoint.uri=s3://moerl-async/runs",
                f"checkpoint.endpoint_url={s3_server.endpoint_url}",
                "checkpoint.region=us-east-1",
                "checkpoint.cache_dir=.moerl/cache",
                f"tracking.uri={url}",
                "checkpoint.cache_tier.uri=s3://moerl-cache/ckpt",
                f"checkpoint.cache_tier.endpoint_url={cache.server.endpoint_url}",
                "checkpoint.fanout=true",
                "checkpoint.chunk_mb=1",
                sandboxes=tmp_path / "sandboxes",
            )
            c = _sigterm_drain(h)
            from mlflow.tracking import MlflowClient

            metrics = MlflowClient(url).get_run(h.run_id).data.metrics
            assert metrics  # the trainer logged to the server
            # every version, not only the last, went to the cache tier first (logged at its
            # iteration's step, version - 1), none to S3 first; that each was servable before S3
            # had it is checked against the tiers themselves in tests/publish/test_publish_tiers.py. Every
            # engine fetch came from the cache tier or a peer: S3 was never read for weights
            n = h.cfg.pipeline.versions
            assert tracking.metric_history(url, h.run_id, "weights/version") == [
                (s, s + 1.0) for s in range(n)
            ]
            for key, want in (("weights/cache_tier", 1.0), ("weights/cache_tier_failed", 0.0)):
                assert tracking.metric_history(url, h.run_id, key) == [
                    (s, want) for s in range(n)
                ], key
            for key in ("weights/published_to_servable_s", "weights/published_to_durable_s"):
                assert [s for s, x in tracking.metric_history(url, h.run_id, key) if x > 0] == list(
                    range(n)
                ), key
            assert c["weights_from_durable"] == 0
            assert c["weights_from_cache"] + c["weights_from_peers"] + c["weights_from_node"] >= 3
            # every fetch went through the fan-out (whether a peer had a chunk first is timing;
            # tests/store/test_tiers.py checks peer serving and refusal chunk by chunk)
            assert (
                c["fanout_chunks_cache"] + c["fanout_chunks_peer"] >= 3
                and c["fanout_chunks_refused"] == 0
            )
            assert c["fanout_chunks_durable"] == 0
            tiers = run_tiers(h.cfg.checkpoint, h.run_id)
            v = h.cfg.pipeline.versions
            assert tiers.cache.latest() == tiers.durable.latest() == v
            assert tiers.cache.manifest(v).sha256() == tiers.durable.manifest(v).sha256()
    finally:
        cache.stop()
    # every process (trainer, scorer, two workers, and the drained worker's replacement if the run
    # was not done by the time it was due) ran in a fresh directory of its own; both first rollout
    # workers served, each from its own cache
    boxes = list((tmp_path / "sandboxes").iterdir())
    assert len(boxes) == sum(c.starts for c in h.run.children.values()) >= 4
    assert len([b for b in boxes if (b / ".moerl" / "cache").is_dir()]) >= 2
    assert not (tmp_path / "ckpt").exists()  # no local store: versions went to S3
    assert not {p.name for p in (tmp_path / "sandboxes").rglob("*")} & {
        "mlflow.db",
        "mlruns",
        "ckpt",
    }


def _sigterm_drain(h: Harness) -> None:
    sent = []

    def fault(run):
        if not sent and run.bus.counters()["groups_generated"] >= 1 and h.holds_unit("rollout-0"):
            run.signal("rollout-0", signal.SIGTERM)
            sent.append(time.monotonic())

    c = h.go(fault)
    assert sent, "the worker never held a unit"
    # drained, non-zero: the slot is retried
    assert EXIT_DRAINED in h.run.children["rollout-0"].exits
    # and no worker crashed: a swap refused from the node cache (a relative cache_dir) used to
    # crash-loop every worker, which a run that keeps making progress would otherwise hide
    exits = {n: ch.exits for n, ch in h.run.children.items() if n.startswith("rollout")}
    assert all(x in (0, EXIT_DRAINED) for xs in exits.values() for x in xs), exits
    assert c["drains"] >= 1 and c["units_requeued"] >= 1
    assert versions_of(h)[-1] == h.cfg.pipeline.versions
    balanced(c, h.cfg)
    return c


@pytest.mark.nightly  # the reclaim is gated at the bus level (tests/bus/test_bus.py)
def test_sigkill_of_a_worker_returns_its_unit_after_the_visibility_timeout(tmp_path):
    h = Harness(
        tmp_path,
        "rollout.workers=2",
        "rollout.max_num_seqs=2",
        "rollout.max_new_tokens=24",
        "units.max_prompts=4",
        "units.visibility_timeout_s=3",
    )
    sent = []

    def fault(run):
        if not sent and run.bus.counters()["groups_generated"] >= 1 and h.holds_unit("rollout-0"):
            run.signal("rollout-0", signal.SIGKILL)
            sent.append(True)

    c = h.go(fault)
    assert sent
    assert -signal.SIGKILL in h.run.children["rollout-0"].exits
    assert c["units_reclaimed"] >= 1
    balanced(c, h.cfg)


def test_a_streamed_trainer_killed_mid_version_trains_it_again_and_nothing_twice(tmp_path):
    """`trainer.schedule.stream` (staleness 0): the trainer takes a step per minibatch as its groups
    arrive, so a kill mid-version loses steps that live only in its memory. Its successor
    trains that version again from the newest durable one, from the groups its predecessor
    held; nothing is trained twice and the counters balance."""
    h = Harness(tmp_path, "pipeline.versions=4", "buffer.max_staleness=0")
    assert h.cfg.resolved.stream
    held = []

    def fault(run):
        reg = run.bus.registry()
        if held or reg is None or reg.version < 1:
            return
        pending = run.bus.pending_count("scored", "trainer")
        if pending >= 1:  # it holds groups it took (and stepped on) for a version not committed
            held.append(pending)
            run.signal("trainer", signal.SIGKILL)

    c = h.go(fault)
    assert held, "the trainer was never caught holding groups"
    trainer = h.run.children["trainer"]
    assert trainer.exits[0] == -signal.SIGKILL and trainer.starts == 2
    assert versions_of(h) == list(range(h.cfg.pipeline.versions + 1))
    groups = trained_groups(h)
    assert len(groups) == len(set(groups))  # no group in two versions
    balanced(c, h.cfg)
    mlflow_balanced(h)
    # every version streamed: B / steps groups a minibatch, each its own step
    steps = h.cfg.trainer.optimizer.optimizer_steps_per_iteration
    streamed = tracking.metric_history(h.uri, h.run_id, "trainer/streamed_minibatches")
    assert streamed and {v for _, v in streamed} == {float(steps)}, streamed
    # (a version published before the kill may have died with its metrics unlogged)
    assert h.cfg.pipeline.versions - 1 in {s for s, _ in streamed}
