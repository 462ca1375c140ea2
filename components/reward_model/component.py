"""KFP components of the reward-model pipeline (pipelines/reward_model.py): thin wrappers over
components/reward_model/stage.py. The model travels between tasks as a KFP artifact (an HF
directory); the published version goes to the checkpoint store and MLflow's model registry."""

from kfp.dsl import Artifact, Input, Output


def prepare_preferences(
    config_json: str, run_id: str, train: Output[Artifact], held_out: Output[Artifact]
) -> dict:
    """Validate `reward_model.data` (malformed rows skipped and counted; more than
    `task.max_bad_fraction` fails the run) and write the seeded train / held-out split."""
    from moerl.launch.podenv import enter_pod

    # the pod's scratch: cwd, HOME, TMPDIR (moerl/launch/podenv.py)
    enter_pod("prepare_preferences", config_json)
    from moerl.components.reward_model.stage import prepare_data
    from moerl.config import config_from_json
    from moerl.provenance import stage_start

    cfg = config_from_json(config_json)
    stage_start(cfg, "prepare_preferences", run_id, enforce=False)
    return prepare_data(cfg, train.path, held_out.path, run_id=run_id)


def train_reward_model(
    config_json: str, run_id: str, train: Input[Artifact], model: Output[Artifact]
) -> dict:
    """Train a fresh reward model (the `model` backbone with a one-logit head) on `train` with
    the Bradley-Terry loss; `model` is the HF directory."""
    from moerl.launch.podenv import enter_pod

    # the pod's scratch: cwd, HOME, TMPDIR (moerl/launch/podenv.py)
    enter_pod("train_reward_model", config_json)
    from moerl.components.reward_model.stage import train as run_train
    from moerl.config import config_from_json
    from moerl.provenance import stage_start

    cfg = config_from_json(config_json)
    stage_start(cfg, "train_reward_model", run_id, enforce=cfg.trainer.parallelism.device == "cuda")
    return run_train(cfg, train.path, model.path, run_id=run_id)


def evaluate_reward_model(
    config_json: str, run_id: str, model: Input[Artifact], held_out: Input[Artifact]
) -> dict:
    """Pairwise accuracy on the held-out split; below `reward_model.min_accuracy` the run fails
    before anything is published."""
    from moerl.launch.podenv import enter_pod

    # the pod's scratch: cwd, HOME, TMPDIR (moerl/launch/podenv.py)
    enter_pod("evaluate_reward_model", config_json)
    from moerl.components.reward_model.stage import evaluate
    from moerl.config import config_from_json
    from moerl.provenance import stage_start

    cfg = config_from_json(config_json)
    stage_start(cfg, "evaluate_reward_model", run_id, enforce=False)
    return evaluate(cfg, model.path, held_out.path, run_id=run_id)


def publish_reward_model(
    config_json: str, run_id: str, model: Input[Artifact], eval_metrics: dict
) -> str:
    """Publish the model to the checkpoint store with a manifest, register it in MLflow's
    model registry, and return the published version as a PolicyVersion JSON (for finish_run)."""
    from moerl.launch.podenv import enter_pod

    # the pod's scratch: cwd, HOME, TMPDIR (moerl/launch/podenv.py)
    enter_pod("publish_reward_model", config_json)
    from moerl.components.reward_model.stage import policy_json, publish
    from moerl.config import config_from_json
    from moerl.provenance import stage_start

    cfg = config_from_json(config_json)
    stage_start(cfg, "publish_reward_model", run_id, enforce=False)
    return policy_json(publish(cfg, run_id, model.path, eval_metrics))
