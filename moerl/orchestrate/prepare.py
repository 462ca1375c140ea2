"""What every run does before its stages start, whatever runs them (`moerl run`, sync or
async, and a resumed run), after `moerl.preflight.preflight` has checked the config:
`absolutize`, since tasks run as separate processes in other working directories; `begin_run`,
the MLflow run with its provenance (or the resumed run marked running again), and
`resume_point`, the version a resumed run continues from.
"""

from __future__ import annotations

import time
from pathlib import Path

from moerl import provenance, tracking
from moerl.config import RunConfig
from moerl.errors import CheckpointError, MoerlError
from moerl.store.tiers import run_tiers


def absolutize(cfg: RunConfig) -> RunConfig:
    """Make every local path absolute, so tasks in other processes and cwds agree."""

    def ab(p: str) -> str:  # a URI (s3://, hf://) stays as it is
        return p if "://" in p else str(Path(p).expanduser().resolve())

    ck = cfg.checkpoint
    updates = {
        "checkpoint": ck.model_copy(
            update={
                "uri": ck.uri if ck.uri.startswith("s3://") else ab(ck.uri),
                "cache_dir": ab(ck.cache_dir),
            }
        ),
        "pipeline": cfg.pipeline.model_copy(
            update={
                "pipeline_root": ab(cfg.pipeline.pipeline_root),
                "work_dir": ab(cfg.pipeline.work_dir),
            }
        ),
        "tracking": cfg.tracking.model_copy(update={"uri": tracking.resolve_uri(cfg.tracking)}),
    }
    if cfg.model.path:
        updates["model"] = cfg.model.model_copy(update={"path": ab(cfg.model.path)})
    if not cfg.task.dataset.startswith("builtin:"):
        updates["task"] = cfg.task.model_copy(update={"dataset": ab(cfg.task.dataset)})
    if not cfg.reward_model.data.startswith("builtin:"):
        updates["reward_model"] = cfg.reward_model.model_copy(
            update={"data": ab(cfg.reward_model.data)}
        )
    return cfg.model_copy(update=updates)


def resume_point(cfg: RunConfig, uri: str, run_id: str) -> int:
    """The version run `run_id` continues from: its store's `latest`, which only ever points
    at a complete, verified version, after `recover` repaired what a publish killed before
    moving `latest` left above it (adopting a verified version, deleting an incomplete one)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        MlflowClient(uri).get_run(run_id)
    except MlflowException:
        raise MoerlError(
            f"--resume: no MLflow run {run_id!r} at {uri}; pass the run id `moerl run` printed"
        ) from None
    ck = cfg.checkpoint
    # a fresh server each session: nothing there to repair
    if ck.cache_tier.endpoint_url == "embedded":
        ck = ck.model_copy(
            update={
                "cache_tier": ck.cache_tier.model_copy(update={"uri": None, "endpoint_url": None})
            }
        )
    tiers = run_tiers(ck, run_id)
    before = tiers.durable.latest()
    # nothing publishes now: the run is dead or this is its only writer. Across tiers: a version
    # complete in the cache tier above the durable `latest` (publication died between the two)
    # is promoted, so the cache tier never keeps a version under a number the run trains again
    latest = tiers.recover()
    if latest != before:
        print(
            f"[moerl] --resume: version {latest} was published but `latest` still said "
            f"{'nothing' if before is None else before}; adopted it",
            flush=True,
        )
    if latest is None:
        raise CheckpointError(
            f"--resume: run {run_id} has no published version under {cfg.checkpoint.uri}/runs/{run_id}; "
            "check checkpoint.uri"
        )
    return latest


def begin_run(
    cfg: RunConfig, uri: str, mode: str, resume: str | None = None, resumed_from: str = ""
) -> str:
    """A new MLflow run with the provenance tags and `moerl.mode`, or run `resume` marked running
    again (tagged with when, from where, and this checkout's git sha). Returns the run id."""
    shown = tracking.redact(uri)
    if resume:
        from mlflow.tracking import MlflowClient

        MlflowClient(uri).update_run(resume, status="RUNNING")
        tracking.set_tags(
            uri,
            resume,
            {
                "moerl.status": "running",
                f"moerl.resumed_at.{int(time.time())}": resumed_from or mode,
                "moerl.resume_git_sha": provenance.git_sha(),
            },
        )
        print(
            f"[moerl] resuming MLflow run {resume}{f' from version {resumed_from}' if resumed_from else ''} "
            f"({mode}) at {shown}",
            flush=True,
        )
        return resume
    tags = provenance.collect()
    tags["moerl.mode"] = mode
    tc = cfg.trainer  # how the policy trains: its mesh and precision, in words
    tags["moerl.trainer.mesh"] = (
        f"dp {tc.parallelism.data_parallel_shard} x ep {tc.parallelism.expert_parallel_size}"
        + (" (FSDP2)" if tc.parallelism.on_mesh else " (FSDP2, one rank in the stage's process)")
    )
    tags["moerl.trainer.precision"] = tc.parallelism.precision_policy(cfg.model.dtype)
    tags["moerl.rollout.engine"] = cfg.rollout.layout_summary()
    tags["moerl.rollout.weight_sync"] = cfg.rollout.resolved.weight_sync
    run_id = tracking.start_run(cfg, uri, tags)
    print(
        f"[moerl] MLflow run {run_id} (experiment {cfg.tracking.experiment!r}) at {shown}",
        flush=True,
    )
    return run_id
