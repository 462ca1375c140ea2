"""KFP component: experience buffer (grouping, advantages, batch assembly)."""

from kfp.dsl import Artifact, Input, Output


def buffer(config_json: str, scored: Input[Artifact], trainer_version: int, batch: Output[Artifact]) -> dict:
    """Group scored samples by prompt and compute GRPO advantages.

    Drops and counts zero-variance groups and samples staler than `buffer.max_staleness`
    versions behind `trainer_version`. Writes TrainSample records (JSONL) to `batch`;
    returns `buffer/*` metrics.
    """
    from moerl.podenv import enter_pod

    enter_pod()  # the pod's scratch: cwd, HOME, TMPDIR (moerl/podenv.py)
    from moerl.components.buffer.stage import run_buffer
    from moerl.config import config_from_json

    return run_buffer(config_from_json(config_json).buffer, scored.path, trainer_version, batch.path)
