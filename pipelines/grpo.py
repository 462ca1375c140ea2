"""The sync GRPO pipeline: one task per stage per iteration, iterations unrolled at compile time.

`moerl run` executes this function with kfp.local's SubprocessRunner; `moerl compile` writes it
as KFP IR YAML. The graph and the iteration cap:
docs/pipelines.md#the-sync-pipeline-pipelinesgrpopy.
"""

import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

# No `from __future__ import annotations` here: KFP reads the pipeline signature's real types.
from kfp import dsl

from moerl.components.buffer.component import buffer
from moerl.components.policy_update.component import policy_update
from moerl.components.publish_checkpoint.component import init_policy, resume_policy
from moerl.components.redistribute_weights.component import redistribute_weights
from moerl.components.reward.component import reward
from moerl.components.rollout.component import rollout
from moerl.config import RunConfig, config_to_json
from moerl.errors import ConfigError
from moerl.pipelines.tracking import (
    check_user_code,
    close_run,
    finish_run,
    log_iteration,
    start_run,
)

STAGE_FUNCS: dict[str, Callable[..., Any]] = {
    f.__name__: f
    for f in (
        start_run,
        check_user_code,
        init_policy,
        resume_policy,
        rollout,
        reward,
        buffer,
        policy_update,
        redistribute_weights,
        log_iteration,
        finish_run,
        close_run,
    )
}
TARGETS = ("local", "eks")
# Measured (kfp 2.17.3): each iteration adds about 26.6 KB of YAML, 36.9 KB on the EKS target
# (every task reads the run's merged config from start_run's output); 26 iterations on the EKS
# target are about 1.00 MB. tests/pipelines/test_compile_eks.py checks the size
# at the cap stays under COMPILED_SIZE_BUDGET, which leaves room under etcd's 1.5 MiB per
# object for what the KFP backend adds when it turns the IR into an Argo Workflow.
MAX_COMPILED_ITERATIONS = 26
COMPILED_SIZE_BUDGET = 1_050_000  # bytes of compiled IR YAML


@dataclass(frozen=True)
class Ops:
    """The stage functions as KFP components on one base image."""

    start_run: Any
    check_user_code: Any
    init_policy: Any
    resume_policy: Any
    rollout: Any
    reward: Any
    buffer: Any
    policy_update: Any
    redistribute_weights: Any
    log_iteration: Any
    finish_run: Any
    close_run: Any


def components(funcs: dict[str, Callable[..., Any]], base_image: str) -> dict[str, Any]:
    """Each stage function as a KFP component on `base_image`, by name (every pipeline's ops).
    install_kfp_package=False: the moerl image already carries kfp; it also cuts the per-task
    overhead in kfp.local from ~0.4 s to ~0.04 s (docs/architecture.md)."""
    return {
        name: dsl.component(func=f, base_image=base_image, install_kfp_package=False)
        for name, f in funcs.items()
    }


FIXED_INPUTS = {
    "config_json": "The compiled run config as JSON: the base that the fields below and overrides change for this run.",
    "run_id": "An MLflow run to continue (a resumed run); empty: the first task creates one.",
    "git_sha": "The moerl commit the pipeline was compiled from (provenance).",
}


def run_form(
    cfg: RunConfig, name: str, description: str, fixed: dict[str, str], body: Callable[[dict], None]
):
    """The KFP pipeline function for `cfg` whose inputs are the run form: `fixed` (name ->
    default) and the typed run parameters of `pipelines/params.py` with the config's values as
    defaults and a description each. `body` gets every input's channel by name."""
    from moerl.pipelines import params

    sig = params.signature(
        cfg,
        [
            inspect.Parameter(k, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str, default=v)
            for k, v in fixed.items()
        ],
    )

    def pipeline_func(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        body(dict(bound.arguments))

    pipeline_func.__signature__ = sig  # type: ignore[attr-defined]  # read by inspect.signature; typeshed's functions do not declare it
    pipeline_func.__name__ = pipeline_func.__qualname__ = name.replace("-", "_")
    pipeline_func.__doc__ = params.docstring(description, {k: FIXED_INPUTS[k] for k in fixed}, cfg)
    return dsl.pipeline(name=name, description=description)(pipeline_func)


def start_task(
    ops: Any, settle: Callable[[Any, str], Any], cfg: RunConfig, inputs: dict, target: str
):
    """The run's first task: merges and validates the run form (pipelines/tracking.py)."""
    from moerl.pipelines.params import params_for

    form = {p.name: inputs[p.name] for p in params_for(cfg)}
    return settle(
        ops.start_run(
            config_json=inputs["config_json"],
            run_id=inputs["run_id"],
            git_sha=inputs["git_sha"],
            kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
            target=target,
            overrides=inputs["overrides"],
            **form,
        ),
        "start-run",
    )


def user_code_task(ops: Any, settle: Callable[[Any, str], Any], config_json: Any):
    """The task that calls the run's verifiers and environments once each (its pod holds no
    credential: pipelines/eks.py), on start_run's merged config; every stage waits for it, so
    one that fails stops the run before any work."""
    return settle(ops.check_user_code(config_json=config_json), "check-user-code")


def with_exit_handler(
    ops: Any, settle: Callable[[Any, str], Any], inputs: dict, body: Callable[[], None]
) -> None:
    """`body` inside an ExitHandler whose exit task marks the MLflow run FAILED however the run
    fails. An exit task may not consume other tasks' outputs: it reads the compiled config and
    finds the MLflow run by the KFP run id."""
    close = settle(
        ops.close_run(
            config_json=inputs["config_json"],
            run_id=inputs["run_id"],
            kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
        ),
        "close-run",
    )
    with dsl.ExitHandler(close, name="moerl-run"):
        body()


def make_ops(base_image: str) -> Ops:
    return Ops(**components(STAGE_FUNCS, base_image))


def task_settings(
    cfg: RunConfig, target: str, async_mode: bool = False
) -> Callable[[Any, str], Any]:
    """`settle(task, display_name)`: what every task of a pipeline gets. Caching off (RL stages
    are stochastic and side-effecting: MLflow, the store, Valkey; a cache hit would replay a
    stale run), a display name, and on the EKS target its pod settings (`pipelines/eks.py`)."""
    if target not in TARGETS:
        raise ConfigError(f"--target: must be one of {', '.join(TARGETS)}, got {target!r}")

    def settle(t, name: str, run_secret: Any = None):
        # run_secret: the async stages' run Secret name (start_run's `valkey_secret`), for `place`
        with cheap_setter_checks():
            t.set_caching_options(False)
            t.set_display_name(name)
            if target == "eks":
                from moerl.pipelines.eks import place

                place(
                    t,
                    cfg,
                    t.component_spec.name.replace("-", "_"),
                    async_mode=async_mode,
                    run_secret=run_secret,
                )
        return t

    return settle


@contextmanager
def cheap_setter_checks() -> Iterator[None]:
    """kfp's PipelineTask setters (set_cpu_request, set_env_variable, ...) check that the task
    has a container with `_ensure_container_spec_exists`, which calls `inspect.stack()` only to
    name the setter in its error. inspect.stack() reads the source of every frame on the stack
    and scans sys.modules for each: in a process that has imported vLLM (tests, notebooks) that
    is most of a compile (measured: a 28-iteration EKS pipeline took 24 s alone, 133 s inside
    the test suite; 2.5 s with this). For our own setter calls, the same check names the setter from its frame."""
    from kfp.dsl import pipeline_task

    cls = pipeline_task.PipelineTask
    original = cls.__dict__["_ensure_container_spec_exists"]

    def ensure(self) -> None:
        if self.container_spec is None:
            raise ValueError(
                f"{sys._getframe(1).f_code.co_name} can only be used on single-step components, not "
                f"pipelines used as components, or special components like importers."
            )

    cls._ensure_container_spec_exists = ensure
    try:
        yield
    finally:
        cls._ensure_container_spec_exists = original


def check_compiled_size(cfg: RunConfig, start_iteration: int = 0) -> None:
    """Refuse a sync pipeline too long to submit (see the module docstring)."""
    n = cfg.pipeline.iterations - start_iteration
    if n > MAX_COMPILED_ITERATIONS:
        raise ConfigError(
            f"pipeline.iterations: a compiled sync run unrolls every iteration (26-36 KB of YAML each) and is "
            f"capped at {MAX_COMPILED_ITERATIONS} per run, got {n}. Use the async pipeline (--mode async; its size does "
            f"not grow with pipeline.versions), or chain runs: compile {MAX_COMPILED_ITERATIONS} iterations, then "
            f"`moerl compile --resume RUN_ID --start-iteration {start_iteration + MAX_COMPILED_ITERATIONS} "
            f"--set pipeline.iterations=...` for the next {MAX_COMPILED_ITERATIONS}"
        )


def build_pipeline(
    cfg: RunConfig,
    git_sha: str = "unknown",
    start_iteration: int = 0,
    resume: bool = False,
    target: str = "local",
    run_id: str = "",
):
    """The pipeline function for `cfg`, with iterations `start_iteration`..`pipeline.iterations`-1
    unrolled. `resume` (implied by `start_iteration` > 0) continues run `run_id` from its
    published version `start_iteration`, version 0 included, instead of publishing version 0:
    weights, optimizer, counters; the data cursor and seeds follow the iteration. `target`
    `eks` adds the pod settings; `run_id` is the default of the pipeline's run_id parameter
    (an MLflow run to continue; empty: start_run creates one)."""
    ops = make_ops(cfg.pipeline.base_image)
    _task = task_settings(cfg, target)
    n_iter = cfg.pipeline.iterations
    if not 0 <= start_iteration < n_iter:
        raise ValueError(f"start_iteration must be in [0, {n_iter}), got {start_iteration}")

    def _body(inputs: dict) -> None:
        start = start_task(ops, _task, cfg, inputs, target)
        # the run's merged config
        rid, config_json = (
            start.outputs["run_id"],
            start.outputs["config_json"],
        )
        checked = user_code_task(ops, _task, config_json)
        if resume or start_iteration > 0:  # version 0 already exists when a run resumes from it
            init = _task(
                ops.resume_policy(config_json=config_json, run_id=rid, version=start_iteration),
                f"resume-policy-v{start_iteration}",
            )
        else:
            init = _task(ops.init_policy(config_json=config_json, run_id=rid), "init-policy-v0")
        init.after(checked)  # every other stage follows init (its published version)
        policy = init.outputs["Output"]
        logs: list[dsl.PipelineTask] = []
        for i in range(start_iteration, n_iter):
            log, policy = _iteration(ops, _task, config_json, rid, policy, i, logs[-1:])
            logs.append(log)
        # after every log, so the reward curve it plots is complete
        _task(
            ops.finish_run(config_json=config_json, run_id=rid, policy_json=policy), "finish-run"
        ).after(*logs)

    return run_form(
        cfg,
        cfg.pipeline.name,
        "moerl sync GRPO for MoE LLMs: rollout (vLLM), reward, buffer, policy "
        "update, checkpoint publication, weight redistribution",
        {"config_json": config_to_json(cfg), "run_id": run_id, "git_sha": git_sha},
        lambda inputs: with_exit_handler(ops, _task, inputs, lambda: _body(inputs)),
    )


def _iteration(
    ops: Ops,
    settle: Callable[[Any, str], Any],
    config_json: Any,
    rid: Any,
    policy: Any,
    i: int,
    previous: list[dsl.PipelineTask],
) -> tuple[dsl.PipelineTask, Any]:
    """Iteration `i`'s tasks, from rollout to its log, on the published `policy` (version i),
    after `previous` (the last iteration's log, if any): its log task and version i+1."""
    ro = settle(
        ops.rollout(config_json=config_json, run_id=rid, policy_json=policy, iteration=i),
        f"rollout-{i}",
    )
    if (
        previous
    ):  # iterations log in order (progress reads top to bottom; MLflow steps arrive in order)
        ro.after(*previous)
    rw = settle(
        ops.reward(config_json=config_json, samples=ro.outputs["samples"], run_id=rid),
        f"reward-{i}",
    )
    bf = settle(
        ops.buffer(
            config_json=config_json,
            scored=rw.outputs["scored"],
            trainer_version=i,
            run_id=rid,
        ),
        f"buffer-{i}",
    )
    # trains version i+1 from the published version i and publishes it: no trainer
    # state passes between tasks
    up = settle(
        ops.policy_update(
            config_json=config_json,
            batch=bf.outputs["batch"],
            policy_json=policy,
            iteration=i,
            run_id=rid,
        ),
        f"policy-update-v{i + 1}",
    )
    rd = settle(
        ops.redistribute_weights(
            config_json=config_json, run_id=rid, policy_json=up.outputs["policy_json"]
        ),
        f"redistribute-weights-v{i + 1}",
    )
    log = settle(
        ops.log_iteration(
            config_json=config_json,
            run_id=rid,
            iteration=i,
            rollout=ro.outputs["Output"],
            reward=rw.outputs["Output"],
            buffer=bf.outputs["Output"],
            policy_update=up.outputs["metrics"],
            redistribute=rd.outputs["metrics"],
        ),
        f"log-iteration-{i}",
    )
    return log, rd.outputs["policy_json"]
