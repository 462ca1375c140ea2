"""The reward-model pipeline (`pipeline.kind: reward_model`): RLHF's first half.

The graph and what each task does:
docs/pipelines.md#the-reward-model-pipeline-pipelinesreward_modelpy.
"""

# No `from __future__ import annotations` here: KFP reads the pipeline signature's real types.

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moerl.components.reward_model.component import (
    evaluate_reward_model,
    prepare_preferences,
    publish_reward_model,
    train_reward_model,
)
from moerl.config import RunConfig, config_to_json
from moerl.pipelines.grpo import (  # caching off, display name, EKS pods
    components,
    run_form,
    start_task,
    task_settings,
    with_exit_handler,
)
from moerl.pipelines.tracking import close_run, finish_run, start_run

STAGE_FUNCS: dict[str, Callable[..., Any]] = {
    f.__name__: f
    for f in (
        start_run,
        prepare_preferences,
        train_reward_model,
        evaluate_reward_model,
        publish_reward_model,
        finish_run,
        close_run,
    )
}


@dataclass(frozen=True)
class RewardModelOps:
    start_run: Any
    prepare_preferences: Any
    train_reward_model: Any
    evaluate_reward_model: Any
    publish_reward_model: Any
    finish_run: Any
    close_run: Any


def make_rm_ops(base_image: str) -> RewardModelOps:
    return RewardModelOps(**components(STAGE_FUNCS, base_image))


def build_reward_model_pipeline(
    cfg: RunConfig, git_sha: str = "unknown", target: str = "local", run_id: str = ""
):
    ops = make_rm_ops(cfg.pipeline.base_image)
    _task = task_settings(cfg, target)

    def _body(inputs: dict) -> None:
        start = start_task(ops, _task, cfg, inputs, target)
        # the run's merged config
        rid, config_json = (
            start.outputs["run_id"],
            start.outputs["config_json"],
        )
        data = _task(
            ops.prepare_preferences(config_json=config_json, run_id=rid), "prepare-preferences"
        )
        fit = _task(
            ops.train_reward_model(
                config_json=config_json, run_id=rid, train=data.outputs["train"]
            ),
            "train-reward-model",
        )
        ev = _task(
            ops.evaluate_reward_model(
                config_json=config_json,
                run_id=rid,
                model=fit.outputs["model"],
                held_out=data.outputs["held_out"],
            ),
            "evaluate-reward-model",
        )
        pub = _task(
            ops.publish_reward_model(
                config_json=config_json,
                run_id=rid,
                model=fit.outputs["model"],
                eval_metrics=ev.output,
            ),
            "publish-reward-model",
        )
        _task(
            ops.finish_run(config_json=config_json, run_id=rid, policy_json=pub.output),
            "finish-run",
        )

    return run_form(
        cfg,
        cfg.pipeline.name,
        "moerl reward model: Bradley-Terry on preference pairs, held-out "
        "pairwise accuracy, publication to the checkpoint store, MLflow model registry",
        {"config_json": config_to_json(cfg), "run_id": run_id, "git_sha": git_sha},
        lambda inputs: with_exit_handler(ops, _task, inputs, lambda: _body(inputs)),
    )
