"""The async GRPO pipeline: long-lived stages that run concurrently in one KFP run, joined by Valkey.

    ExitHandler(close_run):           marks the MLflow run FAILED however the run fails
      start_run -> concurrently, each for the whole run:
             ParallelFor(start_run's worker_slots): rollout_worker(i)   (rollout.workers)
             ParallelFor(start_run's scorer_slots): reward_scorer(j)    (reward.scorers)
             init_policy (v0) -> async_trainer  (publishes v1..v_N, N = pipeline.versions,
                                                 then sets the done flag)
        -> finish_run (after the trainer)

No data flows between the long-lived tasks through KFP: work units, generated and scored
samples and the version registry live in the Valkey at `valkey.url` (run-prefixed keys), and
weights in the checkpoint store. So the graph is the same for 3 versions or 100,000: its
compiled size does not grow with `pipeline.versions` (unlike the sync pipeline, which unrolls
every iteration). The run ends when every task exits: the trainer's done flag is what stops
the workers and scorers.

Why each setting:
- `ParallelFor` over `start_run`'s `worker_slots` / `scorer_slots` (one item per worker or
  scorer of the run's merged config), with no parallelism limit: the counts are run
  parameters (`rollout_workers`, `reward_scorers` on the run form), and every slot runs at
  once, since a long-lived worker that waited for another to finish would wait for the run's
  end. (With a limit, Argo's template parallelism, slots past it would start only then.)
- Caching is off on every task: each one is stateful and side-effecting (Valkey, the store,
  MLflow); a cache hit would skip a worker or replay a stale run id.
- Rollout workers and scorers get `set_retry(pipeline.worker_retries, backoff '10s' constant,
  backoff_max_duration = pipeline.retry_max_duration_s)`. A worker drained by SIGTERM (Spot)
  exits non-zero on purpose so that the retry starts a replacement in its slot. Argo counts
  `maxDuration` from the FIRST attempt's start, and KFP defaults it to 3600 s: with the default,
  a worker preempted after the first hour would never be replaced.
- The trainer gets `TRAINER_RETRIES` retries under the same deadline: a restarted trainer
  resumes from the last published version.
- Rollout workers and scorers start beside `init_policy`, not after it (issue 24, fast start):
  the worker's pod start, image pull and engine start on dummy weights (`rollout.early_engine`)
  overlap version 0's publication, and it hot-swaps version 0 in when the trainer registers
  it. A failing `init_policy` marks the run failed on the bus (`stages_beside`), so they stop
  at once; were that mark lost, they stop after `pipeline.trainer_lost_s` without a trainer.

Credentials never enter the compiled spec: `valkey.url` cannot embed a password, and `moerl
compile` strips those of `tracking.uri` as for the sync pipeline. On EKS the tasks read them from
Secret files; the stages log in to Valkey as the run's own user, whose Secret start_run makes
and names in its output `valkey_secret`, and close_run deletes (moerl/launch/runsecret.py).

Limitations:
- kfp.local runs tasks one after another, so it cannot run this graph (a worker would wait
  forever for a trainer that never starts). `moerl run --mode async` runs the same stage
  entrypoints as local processes with an embedded Valkey instead (`moerl.orchestrate.async_run`).
- `target="eks"` adds every task's pod settings (`pipelines/eks.py`). KFP cannot set a
  task pod's terminationGracePeriodSeconds (it must cover `rollout.grace_seconds`); the
  default 30 s is what an in-task worker gets. With `cluster.launch.mode: kubernetes` the
  workers run in launched pods whose grace period moerl sets (moerl/launch).
- KFP's `set_retry` compiles to Argo's default retryPolicy (OnFailure). An evicted or deleted
  pod is an Argo *Error*, retried only under OnError/Always (kubeflow/pipelines#4333); check
  what the cluster's workflow-controller `templateDefaults.retryStrategy` merges in.
- The backoff is constant (factor 1): KFP exposes no cap on a growing backoff, and with
  doubling a slot's n-th retry would wait 10 * 2^(n-1) s, so within 7 days at most ~16 retries
  could start, whatever `worker_retries` says. A Spot replacement waits for a node anyway.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# No `from __future__ import annotations` here: KFP reads the pipeline signature's real types.
from kfp import dsl

from moerl.components.policy_update.component import async_trainer
from moerl.components.publish_checkpoint.component import init_policy
from moerl.components.reward.component import reward_scorer
from moerl.components.rollout.component import rollout_worker
from moerl.components.tracking.component import close_run, finish_run, start_run
from moerl.config import RunConfig, config_to_json
from moerl.pipelines.grpo import (  # caching off, display name, EKS pods
    components,
    run_form,
    start_task,
    task_settings,
    with_exit_handler,
)

STAGE_FUNCS: dict[str, Callable[..., Any]] = {
    f.__name__: f
    for f in (
        start_run,
        init_policy,
        rollout_worker,
        reward_scorer,
        async_trainer,
        finish_run,
        close_run,
    )
}

RETRY_BACKOFF = "10s"  # between attempts of one slot; a Spot replacement waits for a node anyway
RETRY_BACKOFF_FACTOR = 1.0
TRAINER_RETRIES = 3  # a crash loop in the trainer is a bug, not capacity: fail the run soon


@dataclass(frozen=True)
class AsyncOps:
    """The async pipeline's stage functions as KFP components on one base image."""

    start_run: Any
    init_policy: Any
    rollout_worker: Any
    reward_scorer: Any
    async_trainer: Any
    finish_run: Any
    close_run: Any


def make_async_ops(base_image: str) -> AsyncOps:
    return AsyncOps(**components(STAGE_FUNCS, base_image))


def _retry(t, num_retries: int, cfg: RunConfig):
    return t.set_retry(
        num_retries=num_retries,
        backoff_duration=RETRY_BACKOFF,
        backoff_factor=RETRY_BACKOFF_FACTOR,
        backoff_max_duration=f"{cfg.pipeline.retry_max_duration_s}s",
    )


def build_async_pipeline(cfg: RunConfig, git_sha: str = "unknown", target: str = "local"):
    """The async pipeline function for `cfg`: one trainer, `rollout.workers` rollout workers and
    `reward.scorers` reward scorers, all long-lived; its shape does not depend on
    `pipeline.versions`. The stages reach Valkey at `valkey.url` (required on the cluster;
    `moerl compile` checks it). `target` `eks` adds the pod settings."""
    ops = make_async_ops(cfg.pipeline.base_image)
    _task = task_settings(cfg, target, async_mode=True)

    def _body(inputs: dict) -> None:
        start = start_task(ops, _task, cfg, inputs, target)
        rid, config_json = (
            start.outputs["run_id"],
            start.outputs["config_json"],
        )  # the run's merged config
        # the run's own Valkey identity (EKS): each task mounts the Secret start_run made, by name
        secret = start.outputs["valkey_secret"]
        init = _task(
            ops.init_policy(config_json=config_json, run_id=rid, stages_beside=True),
            "init-policy-v0",
            run_secret=secret,
        )
        # one slot per worker / scorer of the merged config (the run form's rollout_workers and
        # reward_scorers): no parallelism limit, so every slot runs at once. They start beside
        # init_policy, not after it: a worker's pod scheduling, image pull and engine start
        # (rollout.early_engine: on dummy weights) overlap version 0's publication
        with dsl.ParallelFor(start.outputs["worker_slots"], name="rollout-workers") as i:
            ro = _task(
                ops.rollout_worker(config_json=config_json, run_id=rid, worker_index=i),
                "rollout-worker",
                run_secret=secret,
            )
            _retry(ro, cfg.pipeline.worker_retries, cfg)
        with dsl.ParallelFor(start.outputs["scorer_slots"], name="reward-scorers") as j:
            sc = _task(
                ops.reward_scorer(config_json=config_json, run_id=rid, scorer_index=j),
                "reward-scorer",
                run_secret=secret,
            )
            _retry(sc, cfg.pipeline.worker_retries, cfg)
        tr = _task(
            ops.async_trainer(config_json=config_json, run_id=rid), "trainer", run_secret=secret
        )
        _retry(tr.after(init), TRAINER_RETRIES, cfg)
        _task(
            ops.finish_run(config_json=config_json, run_id=rid, policy_json=tr.output),
            "finish-run",
            run_secret=secret,
        )

    return run_form(
        cfg,
        cfg.pipeline.name,
        "moerl async GRPO for MoE LLMs: long-lived rollout workers (vLLM, hot "
        "swap), reward scorers and trainer joined by a Valkey buffer and work queue",
        {"config_json": config_to_json(cfg), "run_id": "", "git_sha": git_sha},
        lambda inputs: with_exit_handler(ops, _task, inputs, lambda: _body(inputs)),
    )
