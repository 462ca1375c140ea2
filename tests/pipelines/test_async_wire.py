"""An async run with `rollout.weight_sync` collective (docs/weights.md, "Weights over the wire"),
end to end with real processes (vLLM rollout workers, a scorer, the trainer's mesh, Valkey, the
store, MLflow), every version after 0 sent by session over gloo groups:

- a (2, 2) trainer mesh and two rollout workers: every version reaches both engines over the
  wire, none from files; the task learns; the counters balance;
- faults: a worker SIGTERMed mid-session finishes the session (the others with it), then drains
  and comes back; a worker SIGKILLed mid-session fails that session within its deadline, the
  live engine takes the version from files, and the next sessions deliver again; a trainer rank
  SIGKILLed mid-send fails the session, the mesh resumes, nothing is trained twice;
- a worker that joins mid-run gets its first version over the wire (a catch-up).

Nightly: each is a whole run (docs/testing.md). What these do not show: NCCL, EFA, several
machines (docs/verified.md)."""

from __future__ import annotations

import pytest

from moerl.components.policy_update.mesh import FAULT_ENV as MESH_FAULT_ENV
from moerl.components.rollout.wire_receive import FAULT_ENV
from tests.support.async_runs import assert_balanced, history, run_async_cli
from tests.support.fault_runs import Harness, balanced, mlflow_balanced, trained_groups, versions_of

pytestmark = pytest.mark.nightly  # whole runs: a learning curve and a second-order fault


def test_a_mesh_sends_every_version_to_every_engine_over_the_wire_and_learns(tmp_path):
    versions = 8
    uri, run = run_async_cli(
        tmp_path,
        "tiny-moe-grpo.yaml",
        "moerl-tiny-grpo",
        versions,
        "trainer.parallelism.expert_parallel_size=2",
        "trainer.parallelism.data_parallel_shard=2",
        "rollout.workers=2",
        "rollout.weight_sync=collective",
        timeout=1500,
    )
    run_id, m = run.info.run_id, run.data.metrics
    assert run.data.tags["moerl.rollout.weight_sync"] == "collective"
    # every version after 0 over the wire to both engines; none swapped in from files
    assert history(uri, run_id, "weights/wire_delivered") == [1.0] * versions
    assert history(uri, run_id, "weights/wire_engines") == [2.0] * versions
    assert m["async/weight_sessions"] == versions
    assert m.get("async/weight_sessions_failed", 0) == 0
    assert m["async/swaps_wire"] == 2 * versions and m["async/swaps"] == 0
    # checked against the durable copy by one engine per version, when idle on it: equal
    assert m["async/wire_verified"] >= 1 and m.get("async/wire_verify_mismatch", 0) == 0, m
    assert_balanced(m)
    assert m["async/failed"] == 0 and m["async/stale_dropped"] == 0  # all on-policy
    reward = history(uri, run_id, "reward/mean")
    assert len(reward) == versions
    assert sum(reward[-3:]) / 3 >= reward[0] + 0.05, reward  # it learns


def test_an_engine_signalled_mid_session_costs_at_most_that_session(tmp_path, monkeypatch):
    versions, timeout_s = 5, 20
    kill, term = tmp_path / "kill", tmp_path / "term"
    # rollout-0 dies in version 2's session; rollout-1 gets a Spot notice in version 4's
    monkeypatch.setenv(FAULT_ENV, f"rollout-0:2:KILL:{kill};rollout-1:4:TERM:{term}")
    h = Harness(
        tmp_path,
        f"pipeline.versions={versions}",
        "rollout.workers=2",
        "rollout.weight_sync=collective",
        f"rollout.weight_sync_timeout_s={timeout_s}",
    )
    c = h.go()
    assert kill.is_file() and term.is_file()
    w0, w1 = h.run.children["rollout-0"], h.run.children["rollout-1"]
    assert w0.exits[0] == -9 and w0.starts >= 2
    assert w1.exits[0] == 75  # it finished the session, then drained
    engines = history(h.uri, h.run_id, "weights/wire_engines")
    delivered = history(h.uri, h.run_id, "weights/wire_delivered")
    took = history(h.uri, h.run_id, "weights/wire_to_serving_s")
    # version 2's session (both engines) failed within its deadline; the live engine took
    # version 2 from files
    assert engines[1] == 2.0 and delivered[1] == 0.0 and took[1] < timeout_s + 10, took
    assert c["weight_sessions_failed"] == 1 and c["swaps"] >= 1, c
    # rollout-0's successor, up while that session failed, caught up over the wire
    assert c["weight_catchups"] >= 1, c
    # version 4's session delivered, to the SIGTERMed engine too (it drained after it)
    assert delivered[3] == 1.0 and delivered[0] == 1.0, delivered
    # every version had a session, or none (no engine enrolled: both restarting)
    assert (
        c["weight_sessions"] + c["weight_sessions_failed"] + c.get("weight_sessions_empty", 0)
        == versions
    ), c
    assert versions_of(h) == list(range(versions + 1))
    groups = trained_groups(h)
    assert len(groups) == len(set(groups))  # nothing trained twice
    balanced(c, h.cfg)
    mlflow_balanced(h)


def test_an_engine_that_joins_mid_run_catches_up_over_the_wire(tmp_path):
    versions = 30
    h = Harness(
        tmp_path,
        f"pipeline.versions={versions}",
        "rollout.workers=1",
        "rollout.min_workers=1",
        "rollout.max_workers=2",
        "rollout.weight_sync=collective",
        "rollout.weight_sync_timeout_s=20",
        # on-policy (streamed), and enough versions for the worker to join while they go on
        "buffer.max_staleness=0",
        "task.prompts_per_iteration=32",
        "units.max_prompts=4",
        "checkpoint.keep_last=50",  # every version's manifest is read below
    )
    joined: list[int] = []

    def tick(run) -> None:
        run.fleet.next_at = float("inf")  # this test sizes the fleet, not the controller
        if not joined and run.bus.counters().get("weight_sessions", 0) >= 1:
            joined.append(run.bus.counters()["weight_sessions"])
            run.resize(2, "a worker joins mid-run (test)")

    c = h.go(on_tick=tick)
    assert joined and "rollout-1" in h.run.children
    log = (h.run.logs / "rollout-1.log").read_text()
    # its engine started on dummy weights, and its first version came over the wire: a catch-up
    # (the trainer's kept share of the version the fleet serves) when it enrolled inside a
    # version, else that version's session; never from files
    assert "engine started on dummy weights" in log, log[-3000:]
    first = log.index(" over the wire (")
    assert "hot-swapped to version" not in log[:first] and "engine loaded on" not in log[:first]
    assert c.get("weight_catchups_failed", 0) == 0, c
    # a catch-up is checked against the durable copy when its files are servable: equal
    assert c["wire_verified"] >= 1 and c.get("wire_verify_mismatch", 0) == 0, c
    assert versions_of(h) == list(range(versions + 1))
    groups = trained_groups(h)
    assert len(groups) == len(set(groups))
    balanced(c, h.cfg)
    mlflow_balanced(h)


def test_a_trainer_rank_killed_mid_send_fails_the_session_and_nothing_is_trained_twice(
    tmp_path, monkeypatch
):
    versions = 4
    marker = tmp_path / "killed"
    # trainer rank 1 dies once it has joined its weight group for version 2, before sending
    monkeypatch.setenv(MESH_FAULT_ENV, f"send:1:2:{marker}")
    h = Harness(
        tmp_path,
        "trainer.parallelism.expert_parallel_size=2",
        f"pipeline.versions={versions}",
        "rollout.workers=2",
        "rollout.weight_sync=collective",
        "rollout.weight_sync_timeout_s=20",
    )
    c = h.go()
    assert marker.is_file()
    trainer = h.run.children["trainer"]
    assert trainer.starts == 2 and trainer.exits[-1] == 0  # the mesh failed, its retry resumed
    # the engines' receive failed (the session never completed), they were unlabelled and took
    # a version from files (beyond each worker's version 0); the retried trainer's sessions
    # delivered again
    from_files = sum(v for k, v in c.items() if k.startswith("weights_from_"))
    assert c["weight_sessions_missed"] >= 1 and from_files > 2, c
    assert c["weight_sessions"] >= 1, c
    assert versions_of(h) == list(range(versions + 1))
    groups = trained_groups(h)
    assert len(groups) == len(set(groups))  # nothing trained twice
    balanced(c, h.cfg)
    mlflow_balanced(h)
