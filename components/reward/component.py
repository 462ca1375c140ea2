"""KFP components: reward scoring with rule verifiers (sync: one task per iteration; async: long-lived scorers)."""

from kfp.dsl import Artifact, Input, Output


def reward(
    config_json: str, samples: Input[Artifact], scored: Output[Artifact], run_id: str = ""
) -> dict:
    """Score every sample (`reward.kind`: its task's verifier, the registered reward model in
    batches, or both mixed; components/reward/stage.py).

    A verifier, or a reward-model batch, that raises marks its samples failed and counts them
    in `reward/failed_samples`; more than `reward.max_failed_fraction` failures stop the run.
    Writes ScoredSample records (JSONL) to `scored`; returns `reward/mean`, `reward/std`, ...
    `run_id`: the MLflow run this task records its image and runtime on.
    """
    from moerl.launch.podenv import enter_pod

    # the pod's scratch: cwd, HOME, TMPDIR (moerl/launch/podenv.py)
    enter_pod("reward", config_json)
    from moerl.components.reward.stage import load_model_scorer, run_reward
    from moerl.config import config_from_json
    from moerl.provenance import stage_start

    cfg = config_from_json(config_json)
    model = cfg.reward.model  # set unless kind is rules (RewardConfig)
    on_gpu = cfg.reward.kind != "rules" and model is not None and model.device == "cuda"
    stage_start(cfg, "reward", run_id, enforce=on_gpu)  # build-info and runtime probe on the run
    return run_reward(cfg.reward, samples.path, scored.path, load_model_scorer(cfg, run_id))


def reward_scorer(config_json: str, run_id: str, scorer_index: int) -> None:
    """Async mode: one long-lived reward scorer, `scorer-<scorer_index>`, for the whole run.

    Consumes generated groups from Valkey, scores every sample with its task's verifier
    (`reward.verifier`), and publishes the scored groups for the trainer. A verifier that
    raises marks its sample failed, never a silent 0. Scorers scale apart from rollout
    (`reward.scorers`). Returns when the run is done and nothing is left to score.

    On SIGTERM the scorer stops and this task FAILS with its drain code, so that KFP's retry
    replaces it (a group being scored is reclaimed by another scorer meanwhile).
    """
    from moerl.launch.podenv import enter_pod

    # the pod's scratch: cwd, HOME, TMPDIR (moerl/launch/podenv.py)
    enter_pod("reward_scorer", config_json)
    from moerl.components.reward.worker import run_reward_scorer
    from moerl.config import config_from_json

    code = run_reward_scorer(config_from_json(config_json), run_id, f"scorer-{scorer_index}")
    if code != 0:
        raise SystemExit(code)
