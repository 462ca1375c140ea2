"""The async fault runs' harness (tests/pipelines/test_async_faults*.py): one async run as local
processes (vLLM rollout workers, scorers, the trainer, a real Valkey, the checkpoint store and
MLflow), bounded by a clock that scales with what the run measures, with a hook to inject a
fault; and the checks every fault test makes.

In every case the run finishes all its versions and the counters balance:

    trained + filtered + stale_dropped + failed + samples_dead == generated - duplicates

(`filtered`: samples of groups with no reward variance, which GRPO drops; see moerl/bus/run.py).
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

from moerl import tracking
from moerl.bus import EmbeddedValkey
from moerl.config import load_config
from moerl.orchestrate.async_run import (
    LocalAsyncRun,
    publish_initial,
    stage_zygotes,
    start_valkey,
)
from moerl.store.runs import run_store
from tests.support.async_runs import RunClock, assert_balanced
from tests.support.s3server import S3Process
from tests.support.sandbox import sandboxed

ROOT = Path(__file__).resolve().parents[2]
FLOOR_S = 240  # the least time a run is given; its limit scales with what it measures (RunClock)


def fault_config(tmp: Path, *overrides: str):
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

    def __init__(
        self, tmp: Path, *overrides: str, sandboxes: Path | None = None, zygote: bool = False
    ):
        """`zygote`: the stages forked from a zygote, as `moerl run` starts them (closed by `go`)."""
        self.cfg = fault_config(tmp, *overrides)
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
        self.zygotes = stage_zygotes(self.cfg) if zygote else {}
        self.run = LocalAsyncRun(self.cfg, self.run_id, work, self.valkey, zygotes=self.zygotes)
        self.sandboxes = sandboxes

    def go(self, on_tick=None, floor_s: float = FLOOR_S) -> dict[str, int]:
        self.clock = RunClock(self.cfg.pipeline.versions, floor_s)

        def tick(run) -> None:
            self.clock.watch(run)
            if on_tick is not None:
                on_tick(run)

        try:
            with sandboxed(self.sandboxes) if self.sandboxes is not None else nullcontext():
                self.run.start()
                self.run.supervise(every_s=10, on_tick=tick)
            return self.run.bus.counters()
        except BaseException:
            for name in self.run.children:
                print(f"--- {name} ---\n{self.run.tail(name, 40)}")
            raise
        finally:
            self.run.stop()
            self.valkey.stop()
            for z in self.zygotes.values():
                z.close()

    def holds_unit(self, name: str) -> bool:
        info = self.run.bus.r.xpending(self.run.bus.key("units"), "rollout")
        return any(c["name"] == name and int(c["pending"]) > 0 for c in info.get("consumers") or [])


def balanced(c: dict[str, int], cfg) -> None:
    assert (
        c["trained"] + c["filtered"] + c["stale_dropped"] + c["failed"] + c["samples_dead"]
        == c["generated"] - c["duplicates"]
    ), c
    used = cfg.pipeline.versions * cfg.task.prompts_per_iteration
    assert c["groups_used"] == used  # every version took exactly B groups, none twice
    assert c["trained"] + c["filtered"] == used * cfg.rollout.samples_per_prompt


def mlflow_balanced(h: Harness) -> None:
    """The run's last `async/*` values in MLflow balance too: logged after the last commit."""
    from mlflow.tracking import MlflowClient

    m = MlflowClient(h.uri).get_run(h.run_id).data.metrics
    assert_balanced(m)
    assert m["async/groups_used"] == h.cfg.pipeline.versions * h.cfg.task.prompts_per_iteration


def versions_of(h: Harness) -> list[int]:
    return run_store(h.cfg.checkpoint, h.run_id).versions()


def trained_groups(h: Harness) -> list[str]:
    """Every group the run's published versions trained on, as their manifests record them."""
    store = run_store(h.cfg.checkpoint, h.run_id)
    return [
        g
        for v in range(1, h.cfg.pipeline.versions + 1)
        for g in json.loads(store.manifest(v).meta["groups"])
    ]


def cache_server(tmp_path: Path, monkeypatch) -> S3Process:
    """A second S3 server as the checkpoint cache tier (the buffer group's SeaweedFS on EKS), with
    identities of its own, given to the stages as the Secret would: in the environment."""
    cache = S3Process(tmp_path / "cache-server")
    server = cache.start()
    server.client().create_bucket(Bucket="moerl-cache")
    monkeypatch.setenv("MOERL_CACHE_TIER_ACCESS_KEY_ID", server.access_key)
    monkeypatch.setenv("MOERL_CACHE_TIER_SECRET_ACCESS_KEY", server.secret_key)
    return cache
