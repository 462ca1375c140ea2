"""KFP components: GRPO policy update (sync: one task per iteration; async: the long-lived trainer)."""

from typing import NamedTuple

from kfp.dsl import Artifact, Input


# Its outputs: a NamedTuple(...) call, the form KFP reads them from (mypy takes no call there).
def policy_update(
    config_json: str,
    batch: Input[Artifact],
    policy_json: str,
    iteration: int,
    run_id: str = "",
) -> NamedTuple("Updated", [("policy_json", str), ("metrics", dict)]):  # type: ignore[valid-type]
    """Train one version from the published `policy_json` on `batch` and publish the next.

    No trainer state passes through the pipeline: the trainer lays the version out from the
    checkpoint store (each rank fetching only its shards of the optimizer state), runs the
    version's GRPO steps (`trainer.optimizer`) on its mesh (this process as a one-rank mesh
    when `trainer.parallelism.world_size` is 1), every rank writes its own part of the next
    version, weights and state, and it is published to both tiers (`latest` moves once it is
    verified). Non-finite losses skip their step and are counted; too many in a row fail the
    run. A retry after the version was published returns it without training again.
    Returns the new PolicyVersion JSON and the `train/*`, `weights/*` and timing metrics.

    With `cluster.launch.mode: kubernetes` the steps run in a Kubeflow Trainer TrainJob that
    this task launches, watches and deletes (docs/launch.md): only the batch goes through it.
    """
    from moerl.launch.podenv import enter_pod

    # the pod's scratch: cwd, HOME, TMPDIR (moerl/launch/podenv.py)
    enter_pod("policy_update", config_json)
    from collections import namedtuple

    from moerl.config import config_from_json

    cfg = config_from_json(config_json)
    Updated = namedtuple("Updated", ["policy_json", "metrics"])
    if cfg.cluster.launch.mode == "kubernetes":
        from moerl.launch import run_remote

        out = run_remote(
            cfg,
            "policy_update",
            run_id,
            args={"iteration": iteration, "policy_json": policy_json},
            inputs={"batch": batch.path},
        )
        return Updated(out["policy_json"], out["metrics"])
    from moerl.components.policy_update.update import run_sync_update
    from moerl.records import PolicyVersion

    done = run_sync_update(
        cfg, run_id, PolicyVersion.model_validate_json(policy_json), batch.path, iteration
    )
    assert done is not None  # one node: this one reports
    return Updated(done[0].model_dump_json(), done[1])


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
