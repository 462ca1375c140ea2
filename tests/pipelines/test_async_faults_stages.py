"""Second-order fault tests of the async mode, about the stages (nightly tier): a killed
whole-batch trainer resumes; samples whose scoring fails are counted; a user's environment and
verifier by import path run multi-turn; a second trainer is fenced off. The harness and the
balance every test checks: tests/support/fault_runs.py.
"""

from __future__ import annotations

import json
import signal
import time

import pytest

from moerl import tracking
from moerl.store.runs import run_store
from tests.support.fault_runs import (
    ROOT,
    Harness,
    balanced,
    mlflow_balanced,
    trained_groups,
    versions_of,
)

pytestmark = pytest.mark.nightly


def test_a_killed_trainer_resumes_from_the_last_version_without_training_anything_twice(tmp_path):
    """Killed while it holds more than one version's groups (one publishing, the next being
    gathered), as an S3 outage during a publication leaves it: its successor takes all of them
    back, B per version. Before, it took one page into its first version and left the rest
    pending for good, and the run hung once the last prompts were out."""
    # staleness 2: with the trainer frozen, the workers may run two versions ahead of it, so
    # more than one version's groups pile up however fast the machine is (at 1 they stop at B)
    h = Harness(tmp_path, "pipeline.versions=4", "buffer.max_staleness=2")
    sent = []
    B = h.cfg.task.prompts_per_iteration

    stopped = []

    def fault(run):
        reg = run.bus.registry()
        if sent or reg is None or reg.version < 1:
            return
        if not stopped:
            # frozen first, so the groups scored from now on pile up whatever the machine's
            # speed (a trainer that keeps up would never hold more than one version's groups)
            run.signal("trainer", signal.SIGSTOP)
            stopped.append(time.monotonic())
        held = run.bus.pending_count("scored", "trainer") + run.bus.backlog()
        if held <= B and time.monotonic() - stopped[0] < 60:
            return  # not yet more than one version's groups scored
        # then more groups delivered to it than one version takes (what it was gathering for
        # the next version, or a reply it never saw: the same entries in its pending list),
        # then killed
        run.bus.r.xreadgroup("trainer", "trainer", {run.bus.key("scored"): ">"}, count=B)
        sent.append(run.bus.pending_count("scored", "trainer"))
        run.signal("trainer", signal.SIGKILL)

    c = h.go(fault)
    assert sent and sent[0] > B  # the kill landed while it held more than one version
    assert (
        h.run.children["trainer"].exits[0] == -signal.SIGKILL
        and h.run.children["trainer"].starts == 2
    )
    assert versions_of(h) == list(range(h.cfg.pipeline.versions + 1))
    groups = trained_groups(h)
    assert len(groups) == len(set(groups))  # no group in two versions
    balanced(c, h.cfg)
    mlflow_balanced(h)
    # 2-prompt units, rollout.units_in_flight 2: the worker took a second unit while one was
    # generating (the valkey-restart test below runs with 1 and none overlap)
    assert c["units_overlapped"] >= 1
    # the worker's time from its start to its first generated group, on the run
    first = tracking.metric_history(h.uri, h.run_id, "async/first_sample_s/rollout-0")
    assert first and 0 < first[-1][1] < h.clock.elapsed_s()


def test_samples_whose_scoring_fails_are_counted_failed_never_scored_zero(tmp_path):
    """A user's verifier (by import path, in the sandbox) that sleeps forever on some rows,
    busy-loops on others, allocates without bound or raises on others: each sample is cut off
    or failed, counted, never scored 0; the scorer never restarts and the run completes."""
    hostile = ["1111", "2222", "3333", "4444"]  # tests/support/hostile_verifiers.py: by_answer
    rows = []
    for i in range(30):
        # (the first row of the task is a benign one: preflight calls the verifier on it)
        answer = hostile[(i // 3) % 4] if i % 3 == 1 else str(1000 + i)
        rows.append({"id": f"r{i}", "task": "copy", "prompt": f"copy {answer}=", "answer": answer})
    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    h = Harness(
        tmp_path,
        f"task.dataset={data}",
        "reward.max_failed_fraction=0.9",
        "reward.verifier=tests.support.hostile_verifiers:by_answer",
        "reward.sandbox.sample_timeout_s=1",
        "reward.sandbox.memory_mb=512",
        "reward.sandbox.workers=2",
    )
    c = h.go()
    # every sample whose scoring failed was dropped, never trained: counted failed, or stale when
    # its group reached the trainer after the versions it could serve (classify checks staleness
    # first; which happens depends on timing)
    assert (
        c["score_failed"] > 0
        and c["failed"] > 0
        and c["failed"] + c["stale_dropped"] >= c["score_failed"]
    ), c
    assert c["sample_timeouts"] > 0 and c["sample_memory"] > 0  # sleeps and spins; allocates
    assert c["score_failed"] > c["sample_timeouts"] + c["sample_memory"]  # and the ones that raised
    assert c["failed"] % h.cfg.rollout.samples_per_prompt == 0  # whole groups
    # no group deadline, no restart
    assert c["score_timeouts"] == 0 and h.run.children["scorer-0"].starts == 1
    balanced(c, h.cfg)
    # the sync pipeline's metric names, one point per version, at the step sync logs its iteration
    for key in tracking.SHARED_METRICS:
        assert [s for s, _ in tracking.metric_history(h.uri, h.run_id, key)] == list(
            range(h.cfg.pipeline.versions)
        ), key
    failed = [v for _, v in tracking.metric_history(h.uri, h.run_id, "reward/failed_samples")]
    assert sum(failed) == c["failed"]


def test_a_users_environment_and_verifier_by_import_path_run_multi_turn_in_async_mode(
    tmp_path, monkeypatch
):
    """examples/my_tasks on PYTHONPATH, as README runs it: `guess` rows are multi-turn episodes
    of its GuessNumber environment (async `step`, in the rollout worker's sandboxed pool), `copy`
    rows are scored by its async verifier; the run completes and the counters balance."""
    examples = str(ROOT / "examples")
    monkeypatch.setenv("PYTHONPATH", examples)
    rows = [
        json.loads(line)
        for line in (ROOT / "examples" / "my_tasks" / "guess.jsonl").read_text().splitlines()
    ]
    for i in range(len(rows)):
        rows.insert(
            2 * i,
            {"id": f"c{i}", "task": "copy", "prompt": f"copy {1000 + i}=", "answer": str(1000 + i)},
        )
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    h = Harness(
        tmp_path,
        f"task.dataset={data}",
        'reward.verifiers={"copy": "my_tasks:copy_async"}',
        'task.environments={"guess": "my_tasks.guess:GuessNumber"}',
        "task.max_turns=3",
        "rollout.max_new_tokens=4",
    )
    c = h.go()
    balanced(c, h.cfg)
    guess_episodes = c["generated"] // 2  # half the rows are guess rows: one episode per sample
    assert (
        c["env_calls"] >= 3 * guess_episodes * 0.5
        and c["env_timeouts"] == 0
        and c["env_errors"] == 0
    ), c
    assert c["score_failed"] == 0 and c["env_ms"] > 0
    # the tail: each unit's last episode against its median one (GuessNumber runs 1-3 turns)
    tail = [
        v for _, v in tracking.metric_history(h.uri, h.run_id, "async/unit_tail_ratio/rollout-0")
    ]
    assert tail and all(v >= 1.0 for v in tail), tail


def test_a_second_trainer_for_the_run_is_fenced_off_and_nothing_is_published_or_trained_twice(
    tmp_path,
):
    """A KFP retry starts a trainer while the first one still runs: the newer one claims the run
    (a new epoch), the older one stops at its next commit or settle with a clear error, the
    supervised slot restarts (as KFP's retry would) and fences the intruder off in turn. Every
    version is published once, `latest` and every manifest match the bytes stored, and no group
    is trained twice."""
    h = Harness(tmp_path, "pipeline.versions=4")
    intruder = []

    def fault(run):
        # as soon as the first trainer took the run (it registers version 0): the second one
        # starts while every version is still to train
        if not intruder and run.bus.registry() is not None:
            intruder.append(run._spawn("trainer-2", "trainer"))  # not supervised: a stale TrainJob

    try:
        c = h.go(fault)
        assert intruder
        code = intruder[0].wait(timeout=60)
    finally:
        for p in intruder:
            p.kill()
    logs = (
        h.run.tail("trainer", 400)
        + "\n"
        + (h.run.logs / "trainer-2.log").read_text(errors="replace")
    )
    assert (
        "superseded" in logs
        or "another trainer" in logs
        or "another writer" in logs
        or "already claimed" in logs
    )
    assert code != 0  # the intruder did not finish the run: it stopped, fenced
    # the supervised trainer was fenced once and came back
    assert h.run.children["trainer"].starts >= 2
    store = run_store(h.cfg.checkpoint, h.run_id)
    assert (
        store.versions() == list(range(h.cfg.pipeline.versions + 1))
        and store.latest() == h.cfg.pipeline.versions
    )
    for v in range(1, h.cfg.pipeline.versions + 1):
        store.fetch(v, tmp_path / "verify")  # every object matches its manifest's sha256
    groups = trained_groups(h)
    assert (
        len(groups)
        == len(set(groups))
        == h.cfg.pipeline.versions * h.cfg.task.prompts_per_iteration
    )
    assert c["groups_used"] == len(groups)
    # two issuers ran for a while: some extra groups may be left unconsumed, never counted twice
    assert (
        c["trained"] + c["filtered"] + c["stale_dropped"] + c["failed"] + c["samples_dead"]
        <= c["generated"] - c["duplicates"]
    )
