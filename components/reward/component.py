"""KFP component: reward scoring with rule verifiers."""

from kfp.dsl import Artifact, Input, Output


def reward(config_json: str, samples: Input[Artifact], scored: Output[Artifact]) -> dict:
    """Score every sample with its task's verifier (`reward.verifier`).

    A verifier that raises marks its sample failed (reward 0) and is counted in
    `reward/failed_samples`; more than `reward.max_failed_fraction` failures stop the run.
    Writes ScoredSample records (JSONL) to `scored`; returns `reward/mean`, `reward/std`, ...
    """
    from moerl.components.reward.stage import run_reward
    from moerl.config import config_from_json

    return run_reward(config_from_json(config_json).reward, samples.path, scored.path)
