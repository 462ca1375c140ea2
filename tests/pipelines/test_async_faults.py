"""Fault tests of the async mode: real processes (vLLM rollout workers, scorers, the trainer),
a real Valkey, the checkpoint store and MLflow, each run bounded in time.

In every case the run finishes all its versions and the counters balance:

    trained + filtered + stale_dropped + failed + samples_dead == generated - duplicates

(`filtered`: samples of groups with no reward variance, which GRPO drops; see moerl/bus/run.py).

The SIGTERM test runs cluster-shaped, as the async pipeline runs on EKS: every process in its
own empty directory (`MOERL_SANDBOX_ROOT`, moerl/launch/podenv.py; a restarted worker gets a new one,
like a new pod), sharing only real servers on 127.0.0.1: Valkey, S3 (`weed mini`) and an MLflow
tracking server (and torch's compile cache, see tests/support/sandbox.py).
"""

from __future__ import annotations

import json
import signal
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest

from moerl import tracking
from moerl.bus import EmbeddedValkey
from moerl.components.rollout.worker import EXIT_DRAINED
from moerl.config import load_config
from moerl.orchestrate.async_run import LocalAsyncRun, publish_initial, start_valkey
from moerl.store.runs import run_store
from moerl.store.s3server import S3Process
from moerl.store.tiers import run_tiers
from tests.support.async_runs import assert_balanced
from tests.support.sandbox import sandboxed

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240


def _config(tmp: Path, *overrides: str):
    base = [
        f"checkpoint.uri={tmp / 'ckpt'}",
        f"checkpoint.cache_dir={tmp / 'cache'}",
        f"pipeline.work_dir={tmp / 'work'}",
        f"pipeline.pipeline_root={tmp / 'root'}",
        f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}",
        "pipeline.versions=3",
        "task.prompts_per_iteration=8",
        "rollout.samples_per_prompt=4",
        "trainer.optimizer.optimizer_steps_per_iteration=2",
        "units.max_prompts=2",
        "units.visibility_timeout_s=4",
        "buffer.max_staleness=1",
        "rollout.workers=1",
        "reward.scorers=1",
        "checkpoint.keep_last=20",  # keep every version, so the test can read each manifest
        "valkey.reconnect_s=60",  # a process left behind by a failing test gives up within a minute
    ]
    return load_config(ROOT / "configs/tiny-moe-grpo.yaml", base + list(overrides), mode="async")


class Harness:
    """One async run as local processes, with a hook to inject a fault."""

    def __init__(self, tmp: Path, *overrides: str, sandboxes: Path | None = None):
        self.cfg = _config(tmp, *overrides)
        self.uri = tracking.resolve_uri(self.cfg.tracking)
        self.run_id = tracking.start_run(self.cfg, self.uri, {"moerl.mode": "async-test"})
        work = Path(self.cfg.pipeline.work_dir) / self.run_id
        if sandboxes is not None:  # cluster-shaped: a Valkey of its own, as a Service would be
            self.valkey = EmbeddedValkey(tmp / "valkey-service", appendonly=True).start()
            self.cfg = self.cfg.model_copy(
                update={"valkey": self.cfg.valkey.model_copy(update={"url": self.valkey.url})}
            )
        else:
            self.cfg, self.valkey = start_valkey(self.cfg, work, self.run_id)
        publish_initial(self.cfg, self.run_id, work)
        self.run = LocalAsyncRun(self.cfg, self.run_id, work, self.valkey)
        self.sandboxes = sandboxes

    def go(self, on_tick=None, timeout_s: float = TIMEOUT_S) -> dict[str, int]:
        try:
            with sandboxed(self.sandboxes) if self.sandboxes is not None else nullcontext():
                self.run.start()
                self.run.supervise(timeout_s=timeout_s, every_s=10, on_tick=on_tick)
            return self.run.bus.counters()
        except BaseException:
            for name in self.run.children:
                print(f"--- {name} ---\n{self.run.tail(name, 40)}")
            raise
        finally:
            self.run.stop()
            self.valkey.stop()

    def holds_unit(self, name: str) -> bool:
        info = self.run.bus.r.xpending(self.run.bus.key("units"), "rollout")
        return any(c["name"] == name and int(c["pending"]) > 0 for c in info.get("consumers") or [])


def _balanced(c: dict[str, int], cfg) -> None:
    assert (
        c["trained"] + c["filtered"] + c["stale_dropped"] + c["failed"] + c["samples_dead"]
        == c["generated"] - c["duplicates"]
    ), c
    used = cfg.pipeline.versions * cfg.task.prompts_per_iteration
    assert c["groups_used"] == used  # every version took exactly B groups, none twice
    assert c["trained"] + c["filtered"] == used * cfg.rollout.samples_per_prompt


def _mlflow_balanced(h: Harness) -> None:
    """The run's last `async/*` values in MLflow balance too: logged after the last commit."""
    from mlflow.tracking import MlflowClient

    m = MlflowClient(h.uri).get_run(h.run_id).data.metrics
    assert_balanced(m)
    assert m["async/groups_used"] == h.cfg.pipeline.versions * h.cfg.task.prompts_per_iteration


def _versions(h: Harness) -> list[int]:
    return run_store(h.cfg.checkpoint, h.run_id).versions()


def _trained_groups(h: Harness) -> list[str]:
    """Every group the run's published versions trained on, as their manifests record them."""
    store = run_store(h.cfg.checkpoint, h.run_id)
    return [
        g
        for v in range(1, h.cfg.pipeline.versions + 1)
        for g in json.loads(store.manifest(v).meta["groups"])
    ]


def _cache_server(tmp_path: Path, monkeypatch) -> S3Process:
    """A second S3 server as the checkpoint cache tier (the buffer group's SeaweedFS on EKS), with
    identities of its own, given to the stages as the Secret would: in the environment."""
    cache = S3Process(tmp_path / "cache-server")
    server = cache.start()
    server.client().create_bucket(Bucket="moerl-cache")
    monkeypatch.setenv("MOERL_CACHE_TIER_ACCESS_KEY_ID", server.access_key)
    monkeypatch.setenv("MOERL_CACHE_TIER_SECRET_ACCESS_KEY", server.secret_key)
    return cache


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
    cache = _cache_server(tmp_path, monkeypatch)
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
    assert c["drains"] >= 1 and c["units_requeued"] >= 1
    assert _versions(h)[-1] == h.cfg.pipeline.versions
    _balanced(c, h.cfg)
    return c


def test_a_cache_server_killed_and_restarted_mid_run_sends_engines_to_s3_and_the_run_completes(
    tmp_path, monkeypatch
):
    cache = _cache_server(tmp_path, monkeypatch)
    try:
        h = Harness(
            tmp_path,
            "pipeline.versions=8",
            "checkpoint.cache_tier.uri=s3://moerl-cache/ckpt",
            f"checkpoint.cache_tier.endpoint_url={cache.server.endpoint_url}",
        )
        state: dict[str, int] = {}

        def fault(run):
            # the servable pointer, not the registry: a version is committed (and counted
            # failed) only once durable, well after its servable copy, so on a fast run the
            # registry lags the publisher by versions
            cur = run.bus.servable()
            if cur is None:
                return
            if "killed" not in state and cur.version >= 1:
                cache.kill()
                state["killed"] = cur.version
            elif (
                "killed" in state
                and "restarted" not in state
                and (
                    run.bus.counters()["cache_tier_failed"] >= 1
                    or cur.version >= state["killed"] + 2
                )
            ):
                # down until a version begun after the kill was published to S3 first; the
                # trainer is paused while the server comes back (seconds on a loaded machine),
                # so versions remain to be published to it afterwards
                run.signal("trainer", signal.SIGSTOP)
                try:
                    cache.start()
                    cache.wait_writable("moerl-cache")
                finally:
                    run.signal("trainer", signal.SIGCONT)
                state["restarted"] = cur.version
                state["cache_reads_before"] = run.bus.counters()["weights_from_cache"]

        c = h.go(fault)
        assert state.keys() == {"killed", "restarted", "cache_reads_before"}
        assert _versions(h)[-1] == h.cfg.pipeline.versions  # every version durable
        _balanced(c, h.cfg)
        # while it was down the publisher went to S3 first, counted per version and on the bus;
        # after the restart the cache tier is used again (an engine that met the outage read S3
        # or kept its version: tests/store/test_tiers.py covers the reader's fallback itself)
        by_version = {
            step + 1: v
            for step, v in tracking.metric_history(h.uri, h.run_id, "weights/cache_tier_failed")
        }
        # every version says where it went
        assert sorted(by_version) == list(range(1, h.cfg.pipeline.versions + 1))
        assert c["cache_tier_failed"] == sum(by_version.values()) >= 1
        # every version begun after the restart (the trainer was stopped while the server came
        # back) went to the cache tier first; there are such versions
        after = [v for version, v in by_version.items() if version >= state["restarted"] + 2]
        assert after and all(v == 0.0 for v in after), by_version
        # engines read the cache tier again after its restart (it held versions before the kill
        # too, so a count from before proves nothing about after)
        assert c["weights_from_cache"] > state["cache_reads_before"]
        assert all(code == 0 for code in h.run.children["rollout-0"].exits)
    finally:
        cache.stop()


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
    _balanced(c, h.cfg)


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
    assert _versions(h) == list(range(h.cfg.pipeline.versions + 1))
    groups = _trained_groups(h)
    assert len(groups) == len(set(groups))  # no group in two versions
    _balanced(c, h.cfg)
    _mlflow_balanced(h)
    # 2-prompt units, rollout.units_in_flight 2: the worker took a second unit while one was
    # generating (the valkey-restart test below runs with 1 and none overlap)
    assert c["units_overlapped"] >= 1
    # the worker's time from its start to its first generated group, on the run
    first = tracking.metric_history(h.uri, h.run_id, "async/first_sample_s/rollout-0")
    assert first and 0 < first[-1][1] < TIMEOUT_S


def test_a_streamed_trainer_killed_mid_version_trains_it_again_and_nothing_twice(tmp_path):
    """`trainer.optimizer.stream` (staleness 0): the trainer takes a step per minibatch as its groups
    arrive, so a kill mid-version loses steps that live only in its memory. Its successor
    trains that version again from the newest durable one, from the groups its predecessor
    held; nothing is trained twice and the counters balance."""
    h = Harness(tmp_path, "pipeline.versions=4", "buffer.max_staleness=0")
    assert h.cfg.streams
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
    assert _versions(h) == list(range(h.cfg.pipeline.versions + 1))
    groups = _trained_groups(h)
    assert len(groups) == len(set(groups))  # no group in two versions
    _balanced(c, h.cfg)
    _mlflow_balanced(h)
    # every version streamed: B / steps groups a minibatch, each its own step
    steps = h.cfg.trainer.optimizer.optimizer_steps_per_iteration
    streamed = tracking.metric_history(h.uri, h.run_id, "trainer/streamed_minibatches")
    assert streamed and {v for _, v in streamed} == {float(steps)}, streamed
    # (a version published before the kill may have died with its metrics unlogged)
    assert h.cfg.pipeline.versions - 1 in {s for s, _ in streamed}


def test_a_valkey_outage_longer_than_the_visibility_timeout_is_survived_by_every_stage(tmp_path):
    """Valkey crashes while the worker holds a unit and comes back after 1.5 visibility
    timeouts: on its return every lease looks idle. Nobody takes a live holder's unit (the
    worker, leasing its next unit beside the held one, touches it instead of claiming it back:
    before, it claimed its own unit and crashed on the first attempt's request ids), nothing
    acknowledged is lost, and every stage ends cleanly."""
    h = Harness(tmp_path, "rollout.units_in_flight=2")
    sent = []
    outage_s = 1.5 * h.cfg.units.visibility_timeout_s

    def fault(run):
        reg = run.bus.registry()
        # any unit held, from version 0 on
        if not sent and reg is not None and h.holds_unit("rollout-0"):
            h.valkey.kill()  # a crash: only the fsynced append-only file survives
            time.sleep(outage_s)
            h.valkey.start()
            sent.append(True)

    c = h.go(fault)
    assert sent
    # no stage crashed, every one ended cleanly
    assert all(ch.exits == [0] for ch in h.run.children.values())
    assert _versions(h)[-1] == h.cfg.pipeline.versions
    _balanced(c, h.cfg)
    assert c["units_reclaimed"] == 0  # the held unit stayed with its live holder


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
    _balanced(c, h.cfg)
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
    _balanced(c, h.cfg)
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
    groups = _trained_groups(h)
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


def test_a_worker_on_the_asyncllm_core_swaps_in_flight_and_the_run_balances(tmp_path):
    """rollout.engine_api async (vLLM's AsyncLLM, the core a data-parallel engine needs), in the
    real worker: early start on dummy weights, version 0 swapped in, later versions swapped with
    sequences running (pause "keep", swap by name, resume); every sample accounted for."""
    h = Harness(
        tmp_path,
        "rollout.engine_api=async",
        "rollout.weight_update=in_flight",
        "rollout.max_new_tokens=24",
        "pipeline.versions=4",
    )
    c = h.go()
    _balanced(c, h.cfg)
    # measured: 2 swaps, both with sequences running (whether one is in flight depends on
    # timing; tests/rollout/test_async_engine.py checks the in-flight swap on this core itself)
    assert c["swaps"] >= 1 and c["failed"] == 0, c
    log = h.run.tail("rollout-0", 400)
    assert "hot-swapped to version" in log
    assert "Traceback" not in log


def test_an_elastic_fleet_grows_loses_a_worker_and_drains_one_and_the_run_balances(tmp_path):
    """rollout.min_workers 1, max_workers 2 (components/rollout/fleet.py): generation made slow
    (one sequence at a time, longer answers), so the units issued for a version would outlast a
    new engine's load time and the controller adds a worker on its own. The joined worker is
    SIGKILLed while it holds a unit (restarted, its unit reclaimed); once it runs again the
    fleet is resized down to one (the rule's shrink decisions are unit-tested; here the drain
    itself): it drains with SIGTERM, exits 75 and is not restarted, and the controller
    may grow the fleet again with a new worker. Nothing is trained twice."""
    h = Harness(
        tmp_path,
        "pipeline.versions=8",
        "task.prompts_per_iteration=16",
        "rollout.max_num_seqs=1",
        # long answers and up to four versions' units issued ahead: a backlog that outlasts a
        # new engine's load time however slow the machine is (the rule scales with both, but a
        # loaded machine stretches an engine's load more than a unit's generation: with 24
        # tokens and three versions ahead, a CI run under load finished before it grew)
        "rollout.max_new_tokens=48",
        "buffer.max_staleness=3",
        "rollout.min_workers=1",
        "rollout.max_workers=2",
        "rollout.fleet_interval_s=1",
        "rollout.fleet_scale_down_after_s=600",  # no automatic shrink: the test drains one below
        "units.visibility_timeout_s=4",
    )
    seen: dict[str, Any] = {}

    def tick(run):
        if "killed" not in seen and "rollout-1" in run.children and h.holds_unit("rollout-1"):
            run.signal("rollout-1", signal.SIGKILL)
            seen["killed"] = time.time()
        st = run.bus.stats().get("rollout-1", {})
        if (
            "killed" in seen
            and "shrunk" not in seen
            and run.children["rollout-1"].starts > 1
            # restarted and running again: its heartbeat thread, started once its SIGTERM drain
            # is installed, reports the new process's start (its name still holds the killed
            # one's lease until the visibility timeout, so the pending list alone would not say)
            and st.get("started_unix", 0.0) > seen["killed"]
        ):
            run.resize(1, "the test's scale-down")
            seen["shrunk"] = [c.name for c in run.children.values() if c.retired]
        if run.fleet is not None:  # read while the run's Valkey is up
            seen["kept"] = run.bus.fleet()
            seen["metrics"] = run.fleet.metrics(run.bus, time.perf_counter())

    c = h.go(tick, timeout_s=2 * TIMEOUT_S)  # two engines and a restart on two shared cores
    f = h.run.fleet
    assert f is not None and f.ups >= 1, "the controller never grew the fleet"
    assert "killed" in seen and -signal.SIGKILL in h.run.children["rollout-1"].exits
    assert seen.get("shrunk"), "the run ended before the test's scale-down"
    retired = [h.run.children[n] for n in seen["shrunk"]]
    # drained, not failed and not restarted
    exits = {ch.name: (ch.exits, ch.starts) for ch in retired}
    assert all(ch.exits[-1:] in ([EXIT_DRAINED], [0]) and ch.handled for ch in retired), exits
    kept = seen["kept"]
    assert kept["lag_count"] >= 1 and kept["load_s"] > 0  # measured, on the bus
    groups = _trained_groups(h)
    assert len(groups) == len(set(groups))  # no group in two versions
    _balanced(c, h.cfg)
    _mlflow_balanced(h)
    m = seen["metrics"]
    assert m["fleet/workers_max"] == 2 and m["fleet/scale_downs"] >= 1
    assert 0 < m["fleet/idle_worker_s"] < m["fleet/worker_s"]
