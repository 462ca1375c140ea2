"""KFP component: experience buffer (grouping, advantages, batch assembly)."""

from kfp.dsl import Artifact, Input, Output


def buffer(
    config_json: str,
    scored: Input[Artifact],
    trainer_version: int,
    batch: Output[Artifact],
    run_id: str = "",
) -> dict:
    """Group scored samples by prompt and compute GRPO advantages.

    Drops and counts zero-variance groups and samples staler than `buffer.max_staleness`
    versions behind `trainer_version`. Writes TrainSample records (JSONL) to `batch`;
    returns `buffer/*` metrics. `run_id`: the MLflow run this task records its image and runtime on.
    """
    from moerl.launch.podenv import enter_pod

    # the pod's scratch: cwd, HOME, TMPDIR (moerl/launch/podenv.py)
    enter_pod("buffer", config_json)
    from moerl.components.buffer.stage import run_buffer
    from moerl.config import config_from_json
    from moerl.provenance import stage_start

    cfg = config_from_json(config_json)
    stage_start(cfg, "buffer", run_id, enforce=False)  # build-info and runtime probe on the run
    return run_buffer(cfg.buffer, scored.path, trainer_version, batch.path)
