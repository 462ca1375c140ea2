"""KFP components: publish the initial policy (version 0) and each new version."""

from typing import NamedTuple

from kfp.dsl import Artifact, Input, Output


def init_policy(
    config_json: str, run_id: str, state: Output[Artifact], stages_beside: bool = False
) -> str:
    """Build version 0 (the tiny model from its seed, or a copy of `model.path`; with
    `model.warm_start: previous`, the verified final checkpoint of the newest FINISHED run in
    `tracking.experiment`, recorded in this run's `moerl.warm_start.*` tags), publish it to the
    checkpoint store, and return its PolicyVersion as JSON. `state` is the trainer state the
    first policy update starts from. `stages_beside` (the async pipeline, whose rollout
    workers and scorers start beside this task): a failure also marks the run failed on its
    Valkey bus, so they stop at once."""
    from moerl.launch.podenv import enter_pod

    # the pod's scratch: cwd, HOME, TMPDIR (moerl/launch/podenv.py)
    enter_pod("init_policy", config_json)
    from moerl.components.publish_checkpoint.stage import prepare_initial, run_publish
    from moerl.config import config_from_json
    from moerl.provenance import stage_start

    cfg = config_from_json(config_json)
    try:
        # build-info and runtime probe on the run
        stage_start(cfg, "init_policy", run_id, enforce=False)
        prepare_initial(cfg, state.path, run_id=run_id)
        policy, _ = run_publish(cfg, run_id, state.path, 0)
    except BaseException as err:
        if stages_beside and cfg.valkey.url:
            from moerl.bus import abandon_run

            abandon_run(
                cfg.valkey.url,
                cfg.valkey.username,
                run_id,
                f"init_policy failed: {type(err).__name__}: {err}"[:2000],
            )
        raise
    return policy.model_dump_json()


def resume_policy(config_json: str, run_id: str, version: int, state: Output[Artifact]) -> str:
    """Continue run `run_id` from its published `version`: fetch the weights and the trainer
    state (optimizer, counters) from the checkpoint store, verified against the manifest,
    into `state`, and return the version's PolicyVersion as JSON."""
    from moerl.launch.podenv import enter_pod

    # the pod's scratch: cwd, HOME, TMPDIR (moerl/launch/podenv.py)
    enter_pod("resume_policy", config_json)
    from moerl.components.publish_checkpoint.stage import prepare_resume
    from moerl.config import config_from_json
    from moerl.provenance import stage_start

    cfg = config_from_json(config_json)
    # build-info and runtime probe on the run
    stage_start(cfg, "resume_policy", run_id, enforce=False)
    return prepare_resume(cfg, run_id, version, state.path).model_dump_json()


# Its outputs: a NamedTuple(...) call, the form KFP reads them from (mypy takes no call there).
def publish_checkpoint(
    config_json: str, run_id: str, state: Input[Artifact], version: int
) -> NamedTuple("Published", [("policy_json", str), ("metrics", dict)]):  # type: ignore[valid-type]
    """Publish the model in `state` as `version` (HF safetensors + config + tokenizer + a
    manifest with every file's sha256). `latest` moves only after the manifest is verified.
    Returns the PolicyVersion JSON and `weights/*` metrics."""
    from moerl.launch.podenv import enter_pod

    # the pod's scratch: cwd, HOME, TMPDIR (moerl/launch/podenv.py)
    enter_pod("publish_checkpoint", config_json)
    from collections import namedtuple

    from moerl.components.publish_checkpoint.stage import run_publish
    from moerl.config import config_from_json
    from moerl.provenance import stage_start

    cfg = config_from_json(config_json)
    # build-info and runtime probe on the run
    stage_start(cfg, "publish_checkpoint", run_id, enforce=False)
    policy, metrics = run_publish(cfg, run_id, state.path, version)
    Published = namedtuple("Published", ["policy_json", "metrics"])
    return Published(policy.model_dump_json(), metrics)
