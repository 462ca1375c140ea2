"""The async GRPO pipeline: long-lived stages that run concurrently in one KFP run, joined by Valkey.

The graph, why each setting (slots, retries, fast start) and the limitations:
docs/pipelines.md#the-async-pipeline-pipelinesgrpo_asyncpy; the stages' design: docs/async.md.
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
from moerl.config import RunConfig, config_to_json
from moerl.pipelines.grpo import (  # caching off, display name, EKS pods
    components,
    run_form,
    start_task,
    task_settings,
    user_code_task,
    with_exit_handler,
)
from moerl.pipelines.tracking import check_user_code, close_run, finish_run, start_run

STAGE_FUNCS: dict[str, Callable[..., Any]] = {
    f.__name__: f
    for f in (
        start_run,
        check_user_code,
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
    check_user_code: Any
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
        # the run's merged config
        rid, config_json = (
            start.outputs["run_id"],
            start.outputs["config_json"],
        )
        # the run's own Valkey identity (EKS): each task mounts the Secret start_run made, by name
        secret = start.outputs["valkey_secret"]
        # the user's code, called once each in a task that holds no credential: every stage
        # waits for it, so a verifier or environment that fails stops the run before any work
        checked = user_code_task(ops, _task, config_json)
        init = _task(
            ops.init_policy(config_json=config_json, run_id=rid, stages_beside=True),
            "init-policy-v0",
            run_secret=secret,
        ).after(checked)
        # one slot per worker / scorer of the merged config (the run form's rollout_workers and
        # reward_scorers): no parallelism limit, so every slot runs at once. They start beside
        # init_policy, not after it: a worker's pod scheduling, image pull and engine start
        # (rollout.early_engine: on dummy weights) overlap version 0's publication
        with dsl.ParallelFor(start.outputs["worker_slots"], name="rollout-workers") as i:
            ro = _task(
                ops.rollout_worker(config_json=config_json, run_id=rid, worker_index=i),
                "rollout-worker",
                run_secret=secret,
            ).after(checked)
            _retry(ro, cfg.pipeline.worker_retries, cfg)
        with dsl.ParallelFor(start.outputs["scorer_slots"], name="reward-scorers") as j:
            sc = _task(
                ops.reward_scorer(config_json=config_json, run_id=rid, scorer_index=j),
                "reward-scorer",
                run_secret=secret,
            ).after(checked)
            _retry(sc, cfg.pipeline.worker_retries, cfg)
        tr = _task(
            ops.async_trainer(config_json=config_json, run_id=rid), "trainer", run_secret=secret
        )
        _retry(tr.after(init), TRAINER_RETRIES, cfg)  # init waits for the check
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
