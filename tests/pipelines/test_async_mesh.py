"""The async trainer as a mesh whose ranks live for the whole run (components/policy_update/
mesh.py), end to end with real processes (vLLM rollout worker, scorer, Valkey, the store, MLflow):

- (2, 2) over two simulated trainer nodes (two trainer processes, each torchrun with two ranks,
  each its own scratch, meeting at a rendezvous port as a TrainJob's nodes do): the ranks start
  once and serve every version without reloading anything; node 1's ranks put their part of
  each version into the store themselves; the task learns; the counters balance.
- (2, 2) on one node, the trainer's state with every second version (checkpoint.state_every),
  a non-zero rank SIGKILLed as a version starts: every rank fails, the trainer's retry claims a
  new epoch and resumes from the newest durable version with state (each rank reading its
  shard), no group is trained twice, and `latest` verifies.

What these do not show: NCCL, several machines, EFA (docs/verified.md)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from moerl import tracking
from moerl.components.policy_update.mesh import FAULT_ENV
from moerl.store.manifest import MANIFEST
from moerl.store.runs import run_store
from tests.support.async_runs import assert_balanced, history, run_async_cli
from tests.support.fault_runs import Harness, balanced, mlflow_balanced, versions_of

pytestmark = pytest.mark.nightly  # a learning run and a second-order fault (docs/testing.md)
MESH = ("trainer.parallelism.expert_parallel_size=2", "trainer.parallelism.data_parallel_shard=2")


def _joins(logs: Path) -> list[tuple[int, int, int]]:
    """(rank, pid, node) of every rank that joined a trainer mesh, in order, from every trainer
    node's log."""
    out = []
    for log in sorted(logs.glob("trainer*.log")):
        for m in re.finditer(
            r"rank (\d+) of \d+ \(pid (\d+), node (\d+)\) joined the trainer mesh", log.read_text()
        ):
            out.append((int(m[1]), int(m[2]), int(m[3])))
    return out


def test_a_two_node_mesh_keeps_its_ranks_for_the_run_and_learns(tmp_path):
    """The embedded default, as a user runs it (`moerl run --mode async`), on a (2, 2) mesh over
    two simulated trainer nodes."""
    versions = 8
    uri, run = run_async_cli(
        tmp_path,
        "tiny-moe-grpo.yaml",
        "moerl-tiny-grpo",
        versions,
        *(f"trainer.parallelism.{k}" for k in ("expert_parallel_size=2", "data_parallel_shard=2")),
        "trainer.parallelism.launcher=torchrun",
        "cluster.launch.trainer_nodes=2",
        # every version with the trainer's state (null resolves to keep_last on two nodes)
        "checkpoint.state_every=1",
        timeout=1200,
    )
    run_id = run.info.run_id
    logs = next((tmp_path / ".moerl" / "work").glob(f"{run_id}/logs"))
    joins = _joins(logs)
    # four ranks, two on each node, each started once for the whole run
    assert sorted((r, n) for r, _, n in joins) == [(0, 0), (1, 0), (2, 1), (3, 1)], joins
    assert len({pid for _, pid, _ in joins}) == 4
    # nothing reloaded per version: the one load is version 0's, at the first version
    assert history(uri, run_id, "trainer/mesh_loads") == [1.0] * versions
    assert len(history(uri, run_id, "timing/trainer_load_s")) == 1
    uptime = history(uri, run_id, "trainer/mesh_uptime_s")
    assert uptime == sorted(uptime) and uptime[-1] > uptime[0]
    # node 1's ranks wrote their part of each version on node 1 and put it into the store
    # (the versions retention kept: checkpoint.keep_last)
    kept = sorted((tmp_path / "checkpoints" / "runs" / run_id / "versions").glob("v*"))[1:]
    assert kept and kept[-1].name == f"v{versions:06d}"
    for v in kept:
        m = json.loads((v / MANIFEST).read_text())
        paths = {f["path"] for f in m["files"]}
        assert any(p.startswith("model-r00002-") for p in paths), sorted(paths)
        assert {"trainer/model/__2_0.distcp", "trainer/optimizer/__3_0.distcp"} <= paths
    m = run.data.metrics
    assert_balanced(m)
    assert m["async/failed"] == 0
    reward = [v for _, v in tracking.metric_history(uri, run_id, "reward/mean")]
    assert len(reward) == versions
    assert sum(reward[-3:]) / 3 >= reward[0] + 0.05, reward  # it learns


def test_a_rank_killed_mid_version_fails_the_mesh_and_the_retry_resumes(tmp_path, monkeypatch):
    versions = 4
    marker = tmp_path / "killed"
    # rank 1 dies as it starts on the batch that makes version 3 (its iteration index 2)
    monkeypatch.setenv(FAULT_ENV, f"1:2:{marker}")
    # the trainer's state with every second version (and the last): v2 and v4
    h = Harness(
        tmp_path,
        *MESH,
        f"pipeline.versions={versions}",
        "buffer.max_staleness=2",
        "checkpoint.state_every=2",
    )
    c = h.go()
    assert marker.is_file()
    trainer = h.run.children["trainer"]
    # 1 (rank 0 failed in the broadcast, or was stopped before it did), not the SIGKILLed -9
    assert trainer.starts == 2 and trainer.exits[0] == 1
    assert trainer.exits[-1] == 0
    joins = _joins(Path(h.run.logs))
    assert len(joins) == 8 and len({pid for _, pid, _ in joins}) == 8  # two meshes of four
    # each mesh loaded once: the first at version 0, the retry at the newest durable version
    # (a version trained but not yet durable at the kill is trained again: logged twice)
    loads = history(h.uri, h.run_id, "trainer/mesh_loads")
    assert set(loads) == {1.0} and len(loads) >= versions
    assert len(history(h.uri, h.run_id, "timing/trainer_load_s")) == 2
    assert versions_of(h) == list(range(versions + 1))
    store = run_store(h.cfg.checkpoint, h.run_id)
    groups = [
        g for v in range(1, versions + 1) for g in json.loads(store.manifest(v).meta["groups"])
    ]
    assert len(groups) == len(set(groups))  # no group trained twice
    balanced(c, h.cfg)
    mlflow_balanced(h)
    for v in range(1, versions + 1):
        paths = {f.path for f in store.manifest(v).files}
        assert ("trainer/model/.metadata" in paths) == (v % 2 == 0), (v, sorted(paths))
        assert "trainer/state.json" in paths and any(p.startswith("model-r") for p in paths)
    # the retry continued from the newest version with state: what it lost is on the run
    lost = history(h.uri, h.run_id, "trainer/resumed_versions_lost")
    assert len(lost) == 2 and lost[0] == 0 and lost[1] in (0.0, 1.0)
    latest = store.latest()
    assert latest == versions
    store.fetch(latest, tmp_path / "verify")  # every file against the manifest
