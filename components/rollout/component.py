"""KFP components: rollout generation with vLLM (sync: one task per iteration; async: long-lived workers)."""

from kfp.dsl import Artifact, Output


def rollout(
    config_json: str, run_id: str, policy_json: str, iteration: int, samples: Output[Artifact]
) -> dict:
    """Generate `rollout.samples_per_prompt` samples for each of this iteration's prompts.

    Serves the policy version in `policy_json` (fetched into the node-local checkpoint cache
    and verified against its manifest) with vLLM, and writes one Sample record per line to
    `samples` (JSONL): tokens, the engine's token logprobs, finish reason, policy version.
    Returns the stage's metrics (`timing/rollout_s`, `throughput/rollout_tokens_per_s`, ...).
    """
    from moerl.launch.podenv import enter_pod

    # the pod's scratch: cwd, HOME, TMPDIR (moerl/launch/podenv.py)
    enter_pod("rollout", config_json)
    from moerl.config import config_from_json

    cfg = config_from_json(config_json)
    if cfg.cluster.launch.mode == "kubernetes":  # in a launched pod (docs/launch.md)
        from moerl.launch import run_remote

        return run_remote(
            cfg,
            "rollout",
            run_id,
            args={"policy_json": policy_json, "iteration": iteration},
            outputs={"samples": samples.path},
            worker=f"it{iteration}",
            engines=1,  # one engine: the pod gets its TP x DP GPUs on cuda
        )
    from moerl.components.rollout.stage import run_rollout
    from moerl.records import PolicyVersion

    return run_rollout(
        cfg, run_id, PolicyVersion.model_validate_json(policy_json), iteration, samples.path
    )


def rollout_worker(config_json: str, run_id: str, worker_index: int) -> None:
    """Async mode: rollout pod `worker_index` for the whole run, hosting its long-lived rollout
    workers: one, or on cuda GPUs per pod / (TP x DP) of them, `rollout-<i>` for consecutive i
    (moerl.launch.layout.pod_workers), each an engine on its own GPUs.

    Each worker starts one vLLM engine (on dummy weights before version 0 exists,
    `rollout.early_engine`: this task starts beside init_policy), leases work units from the
    Valkey work queue, publishes every finished group at once, and moves to each new version
    with the in-place hot swap. Returns when the trainer marks the run done, or the run is
    abandoned.

    On SIGTERM (a Spot interruption) the workers stop leasing, finish their active requests
    within `rollout.grace_seconds`, publish them, requeue the rest, and this task FAILS with
    the drain code: KFP's retry then starts a replacement in the same slot. Exiting 0 would mark
    the slot done and lose it for the rest of the run.
    """
    from moerl.launch.podenv import enter_pod

    # the pod's scratch: cwd, HOME, TMPDIR (moerl/launch/podenv.py)
    enter_pod("rollout_worker", config_json)
    from moerl.config import config_from_json

    cfg = config_from_json(config_json)
    # in a launched pod (docs/launch.md); same exit codes
    if cfg.cluster.launch.mode == "kubernetes":
        from moerl.launch import run_remote
        from moerl.launch.layout import pod_workers, rollout_pod_layout

        engines = len(
            pod_workers(cfg.rollout.workers, rollout_pod_layout(cfg).engines, worker_index)
        )
        code = run_remote(
            cfg,
            "rollout_worker",
            run_id,
            args={"worker": f"rollout-{worker_index}", "pod": worker_index},
            worker=f"rollout-{worker_index}",
            engines=engines,
        )
    else:
        from moerl.components.rollout.pod import run_rollout_pod

        code = run_rollout_pod(cfg, run_id, worker_index)
    if code != 0:
        raise SystemExit(code)
