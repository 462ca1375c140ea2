"""KFP components: GRPO policy update (sync: one task per iteration; async: the long-lived trainer)."""

from kfp.dsl import Artifact, Input, Output


def policy_update(
    config_json: str,
    batch: Input[Artifact],
    state_in: Input[Artifact],
    iteration: int,
    state_out: Output[Artifact],
    run_id: str = "",
) -> dict:
    """Run the version's GRPO steps (`trainer.optimizer`) on `batch`.

    `state_in` / `state_out` are trainer-state directories: `model/` (HF checkpoint) and
    `trainer/` (optimizer state, counters). Non-finite losses skip their step and are
    counted; too many in a row (`trainer.optimizer`) fail the run.
    Returns `train/*` metrics and `timing/policy_update_s`.

    With `cluster.launch.mode: kubernetes` the steps run in a Kubeflow Trainer TrainJob that
    this task launches, watches and deletes (docs/launch.md); `run_id` labels it.
    """
    from moerl.launch.podenv import enter_pod

    # the pod's scratch: cwd, HOME, TMPDIR (moerl/launch/podenv.py)
    enter_pod("policy_update", config_json)
    from moerl.config import config_from_json

    cfg = config_from_json(config_json)
    if cfg.cluster.launch.mode == "kubernetes":
        from moerl.launch import run_remote

        return run_remote(
            cfg,
            "policy_update",
            run_id,
            args={"iteration": iteration},
            inputs={"batch": batch.path, "state_in": state_in.path},
            outputs={"state_out": state_out.path},
        )
    from moerl.components.policy_update.trainer import run_policy_update

    return run_policy_update(
        cfg, batch.path, state_in.path, state_out.path, iteration, run_id=run_id
    )


def async_trainer(config_json: str, run_id: str) -> str:
    """Async mode: the trainer, for the whole run.

    Takes batches of complete, scored groups from the Valkey buffer as they become ready
    (admission by staleness, `buffer.max_staleness`), runs the GRPO steps, publishes each new
    version through the checkpoint store, then bumps the version registry the rollout workers
    watch. After `pipeline.versions` versions it sets the run's done flag, so every worker and
    scorer drains and exits. Killed and restarted (a KFP retry), it resumes from the last
    published version. Returns the final PolicyVersion as JSON.
    """
    from moerl.launch.podenv import enter_pod

    # the pod's scratch: cwd, HOME, TMPDIR (moerl/launch/podenv.py)
    enter_pod("async_trainer", config_json)
    from moerl.config import config_from_json

    cfg = config_from_json(config_json)
    if cfg.cluster.launch.mode == "kubernetes":  # in a launched TrainJob (docs/launch.md)
        from moerl.launch import run_remote

        return run_remote(cfg, "async_trainer", run_id)
    from moerl.components.policy_update.worker import run_async_trainer

    # on a mesh, its ranks for the whole run (rank 0 runs the trainer's loop)
    return run_async_trainer(cfg, run_id)
