"""`moerl compile`: a run config as KFP IR YAML, for kfp.local or for EKS.

The sync pipeline (`pipelines/grpo.py`), the async one (`pipelines/grpo_async.py`) or the
reward-model one (`pipelines/reward_model.py`), each through `_for_target`: credentials out of
`tracking.uri`, and on `eks` the cluster-safety checks (`pipelines/eks.py`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from moerl import provenance, tracking
from moerl.config import RunConfig
from moerl.errors import ConfigError


def compile_pipeline(
    cfg: RunConfig,
    out: Path,
    target: str = "local",
    resume: str | None = None,
    start_iteration: int = 0,
) -> Path:
    """Write the pipeline of `pipeline.mode` (sync: `pipelines/grpo.py`; async:
    `pipelines/grpo_async.py`) as KFP IR YAML.

    `target` `eks` first refuses a config that is not cluster-safe (`pipelines/eks.py`:
    local checkpoint, cache, model, dataset or tracking paths; async without `valkey.url`) and
    adds every task's pod settings. A sync pipeline is capped at
    `pipelines.grpo.MAX_COMPILED_ITERATIONS` iterations (its size grows with each); `resume`
    and `start_iteration` compile the continuation of run `resume` from its published version
    `start_iteration`, to chain runs past the cap.

    Credentials in `tracking.uri` are never written: they are stripped, and stderr says which
    variables the cluster must provide instead. The async pipeline needs `valkey.url`: its
    tasks run on separate pods, and the embedded Valkey that `moerl run --mode async` starts
    exists only on the machine that runs it."""
    from kfp import compiler

    from moerl.pipelines.grpo import TARGETS, check_compiled_size

    if target not in TARGETS:
        raise ConfigError(f"--target: must be one of {', '.join(TARGETS)}, got {target!r}")
    if cfg.pipeline.kind == "reward_model":
        return _compile_reward_model(cfg, out, target, resume, start_iteration)
    if cfg.pipeline.mode == "async" and not cfg.valkey.url:
        raise ConfigError(
            "valkey.url: the async pipeline needs a Valkey its pods can reach; set it to "
            "redis://, rediss://, valkey:// or valkeys://host:port/db of a Valkey Service (password from "
            "$VALKEY_PASSWORD). Unset is allowed only for `moerl run --mode async`, which starts "
            "an embedded server on this machine"
        )
    if cfg.pipeline.mode == "async" and (resume or start_iteration):
        raise ConfigError(
            "--resume/--start-iteration: the async pipeline resumes by itself (a restarted trainer "
            "continues from the last published version); they apply to the sync pipeline only"
        )
    if cfg.pipeline.mode == "sync":
        if start_iteration and not resume:
            raise ConfigError(
                "--start-iteration: needs --resume RUN_ID (the run whose published version it continues)"
            )
        if not 0 <= start_iteration < cfg.pipeline.iterations:
            raise ConfigError(
                f"--start-iteration: must be in [0, pipeline.iterations = {cfg.pipeline.iterations}), "
                f"got {start_iteration}"
            )
        check_compiled_size(cfg, start_iteration)
    cfg = _for_target(cfg, target)
    if cfg.pipeline.mode == "async":
        from moerl.pipelines.grpo_async import build_async_pipeline

        pipeline = build_async_pipeline(cfg, git_sha=provenance.git_sha(), target=target)
    else:
        from moerl.pipelines.grpo import build_pipeline

        pipeline = build_pipeline(
            cfg,
            git_sha=provenance.git_sha(),
            start_iteration=start_iteration,
            resume=bool(resume),
            target=target,
            run_id=resume or "",
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(pipeline, str(out))
    return out


def _for_target(cfg: RunConfig, target: str) -> RunConfig:
    """What every compiled pipeline goes through: credentials out of tracking.uri (stderr says
    which variables the cluster must provide), and on `eks` the cluster-safety checks."""
    cfg, secret_env = tracking.split_credentials(cfg)
    if target == "eks":
        from moerl.pipelines.eks import check_cluster_safe

        check_cluster_safe(cfg)
    if secret_env:
        print(
            f"moerl: compile: removed the credentials in tracking.uri from the pipeline; give its tasks "
            f"{' and '.join(sorted(secret_env))} from a Kubernetes Secret",
            file=sys.stderr,
        )
    return cfg


def _compile_reward_model(
    cfg: RunConfig, out: Path, target: str, resume: str | None, start_iteration: int
) -> Path:
    """`pipeline.kind: reward_model`: pipelines/reward_model.py, with the GRPO pipelines'
    credential stripping and cluster-safety checks."""
    from kfp import compiler

    from moerl.pipelines.grpo import TARGETS
    from moerl.pipelines.reward_model import build_reward_model_pipeline

    if target not in TARGETS:
        raise ConfigError(f"--target: must be one of {', '.join(TARGETS)}, got {target!r}")
    if resume or start_iteration:
        raise ConfigError(
            "--resume/--start-iteration: a reward-model run has no iterations to continue; run it again"
        )
    cfg = _for_target(cfg, target)
    out.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(
        build_reward_model_pipeline(cfg, git_sha=provenance.git_sha(), target=target), str(out)
    )
    return out
