"""The run's own KFP tasks, beside its stages: the MLflow run (start, with the run form merged and
preflight; one log per iteration; finish; close on any exit) and the check of the user's code."""

# mypy: implicit-optional
# start_run's run-form fields default to None as `str = None`: KFP reads these annotations, strips
# typing.Optional but rejects `str | None`, and ruff (UP045) rewrites Optional[str] to `str | None`.

from typing import NamedTuple

from kfp import dsl


# Its outputs: a NamedTuple(...) call, the form KFP reads them from (mypy takes no call there).
def start_run(
    config_json: str,
    run_id: str,
    git_sha: str,
    kfp_run_id: str,
    target: str = "local",
    model: str = None,
    warm_start: str = None,
    dataset: str = None,
    versions: int = 0,
    epochs: int = 0,
    learning_rate: float = 0.0,
    prompts_per_iteration: int = 0,
    samples_per_prompt: int = 0,
    rollout_workers: int = 0,
    reward_scorers: int = 0,
    reward_kind: str = None,
    reward_model: str = None,
    run_name: str = None,
    overrides: list = None,
) -> NamedTuple(  # type: ignore[valid-type]
    "Outputs", run_id=str, config_json=str, worker_slots=list, scorer_slots=list, valkey_secret=str
):
    """The run's first task. Merges the run form's typed parameters and `overrides` into the
    compiled config and validates the result as `moerl run` does (`pipelines/params.py`: the
    fields on this pipeline's form, which the pipeline always passes; the others are not read.
    Numbers default to 0, not None, because kfp.local casts every integer input); a bad value
    fails here, before any work, with one line naming the key, also written to the MLflow run.
    Then creates the MLflow run (params: the merged config; tags: provenance and
    `moerl.run_parameters`, what the parameters changed), or, when `run_id` is given (the CLI
    pre-creates it, a resumed run continues it), adds this image's provenance to it. Tags it
    with `kfp_run_id`, by which `close_run` finds it.

    Returns:
        run_id: the MLflow run every other task logs to.
        config_json: the merged config every other task runs.
        worker_slots: one item per rollout pod (the async pipeline's fan-out): a pod hosts one
            worker, or on cuda GPUs per pod / (TP x DP) of them (moerl/launch/layout.py).
        scorer_slots: one item per reward scorer (the async pipeline's fan-out).
        valkey_secret: the async pipeline on EKS: the name of the Kubernetes Secret holding the
            run's own Valkey user, which this task made (moerl/launch/runsecret.py) and the
            run's tasks mount; "" otherwise. A name only: the password never is a parameter.
    """
    given = dict(locals())  # the run form's fields by name (and the inputs above)
    from moerl.launch.podenv import enter_pod

    # the pod's scratch: cwd, HOME, TMPDIR (moerl/launch/podenv.py)
    enter_pod("start_run", config_json)
    from collections import namedtuple

    from moerl.pipelines.start import open_run

    Outputs = namedtuple(
        "Outputs", ["run_id", "config_json", "worker_slots", "scorer_slots", "valkey_secret"]
    )
    return Outputs(*open_run(config_json, run_id, git_sha, kfp_run_id, target, given, overrides))


def check_user_code(config_json: str):
    """The run's second task, before any stage: calls the merged config's verifiers and
    environments once each in the sandbox, as `moerl run`'s preflight does; one that fails
    stops the run here with one line naming the key. `start_run` leaves this to a task of its
    own because it holds the Valkey admin's password and the launcher's token: this task's pod
    mounts no Secret and no token (pipelines/eks.py)."""
    from moerl.launch.podenv import enter_pod

    # the pod's scratch: cwd, HOME, TMPDIR (moerl/launch/podenv.py)
    enter_pod("check_user_code", config_json)
    from moerl.pipelines.start import user_code_check

    user_code_check(config_json)


def log_iteration(
    config_json: str,
    run_id: str,
    iteration: int,
    rollout: dict,
    reward: dict,
    buffer: dict,
    policy_update: dict,
    redistribute: dict,
) -> dict:
    """Log one iteration's metrics from every stage to MLflow under stable names, at
    step=iteration, and print one progress line. Returns the merged metrics."""
    from moerl.launch.podenv import enter_pod

    # the pod's scratch: cwd, HOME, TMPDIR (moerl/launch/podenv.py)
    enter_pod("log_iteration", config_json)
    from moerl import tracking
    from moerl.config import config_from_json
    from moerl.provenance import stage_start

    cfg = config_from_json(config_json)
    # build-info and runtime probe on the run
    stage_start(cfg, "log_iteration", run_id, enforce=False)
    # policy_update: the version's training and its publication (one task)
    merged = {**rollout, **reward, **buffer, **policy_update, **redistribute}
    # each stage's own time (timing/trainer_*: parts of timing/policy_update_s, not stages)
    stage_keys = [
        k
        for k in merged
        if k.startswith("timing/")
        and k.endswith("_s")
        and k.count("/") == 1
        and not k.startswith("timing/trainer_")
    ]
    merged["timing/iteration_s"] = sum(merged[k] for k in stage_keys)
    tracking.log_metrics(tracking.resolve_uri(cfg.tracking), run_id, iteration, merged)
    if merged.get("moe/ep_fallback"):  # a slower path taken is recorded loudly, never silently
        tag = f"{cfg.trainer.parallelism.ep_backend} unavailable -> all_to_all"
        tracking.set_tags(tracking.resolve_uri(cfg.tracking), run_id, {"moerl.ep_fallback": tag})
    times = " ".join(f"{k[7:-2]}={merged[k]:.1f}s" for k in sorted(stage_keys))
    print(
        f"[moerl] iteration {iteration + 1}/{cfg.pipeline.iterations} reward/mean={merged.get('reward/mean', 0):.3f} "
        f"exact={merged.get('reward/exact_fraction', 0):.2f} loss={merged.get('train/loss', 0):+.4f} "
        f"dropped_groups={int(merged.get('buffer/dropped_zero_variance_groups', 0))} | {times}",
        flush=True,
    )
    return merged


def finish_run(config_json: str, run_id: str, policy_json: str) -> str:
    """Log the final checkpoint URI and the reward-curve plot, close the MLflow run, and delete
    the run's prefix from the checkpoint cache tier (the durable store keeps every version).
    Returns the run id."""
    from moerl.launch.podenv import enter_pod

    # the pod's scratch: cwd, HOME, TMPDIR (moerl/launch/podenv.py)
    enter_pod("finish_run", config_json)
    import json
    import tempfile
    from pathlib import Path

    from moerl import tracking
    from moerl.config import config_from_json
    from moerl.provenance import stage_start

    cfg = config_from_json(config_json)
    stage_start(cfg, "finish_run", run_id, enforce=False)  # build-info and runtime probe on the run
    final_uri = json.loads(policy_json)["uri"]
    from moerl.registry.policy import register_final

    # tracking.registry_name: the policy in MLflow's model registry
    register_final(cfg, run_id, final_uri)
    with tempfile.TemporaryDirectory() as tmp:
        tracking.finish_run(tracking.resolve_uri(cfg.tracking), run_id, final_uri, Path(tmp))
    # the cache tier is memory: a finished run's versions there serve no one (the durable store
    # keeps them). Housekeeping: a failure is printed, never fails a finished run.
    from moerl.errors import CheckpointError
    from moerl.store.tiers import drop_cache_run

    try:
        if dropped := drop_cache_run(cfg.checkpoint, run_id):
            print(
                f"[moerl] finish_run: deleted the run's {dropped} objects from the checkpoint cache tier",
                flush=True,
            )
    except CheckpointError as e:
        print(
            f"[moerl] finish_run: could not delete the run's prefix from the checkpoint cache tier: {e}",
            flush=True,
        )
    return run_id


def close_run(
    config_json: str, run_id: str, kfp_run_id: str, status: dsl.PipelineTaskFinalStatus
) -> str:
    """The pipeline's exit task (`dsl.ExitHandler`): runs however the run ends. If it did not
    succeed, mark the MLflow run FAILED with the failing task's message, so no failed run stays
    RUNNING forever. An exit task cannot consume another task's output, so the MLflow run is
    `run_id` when the caller pre-created it, else the one `start_run` tagged with
    `kfp_run_id`. With `cluster.launch.mode: kubernetes` it first deletes any workload the run
    launched and left behind (labelled with the run id). On EKS the async run's own Valkey user
    and its Secret go too (`moerl.launch.runsecret`). Returns the MLflow run's final status
    ("" when no run was started)."""
    from moerl.launch.podenv import enter_pod

    # the pod's scratch: cwd, HOME, TMPDIR (moerl/launch/podenv.py)
    enter_pod("close_run", config_json)
    from moerl import tracking
    from moerl.config import config_from_json

    cfg = config_from_json(config_json)
    uri = tracking.resolve_uri(cfg.tracking)
    run_id = run_id or tracking.find_kfp_run(uri, cfg.tracking.experiment, kfp_run_id) or ""
    if run_id:
        from moerl.provenance import stage_start

        # build-info and runtime probe on the run
        stage_start(cfg, "close_run", run_id, enforce=False)
    sweep_error = None
    if run_id and cfg.cluster.launch.mode == "kubernetes":
        # the backstop for launched GPU workloads whose launcher died before deleting them
        from moerl.errors import MoerlError
        from moerl.launch.task import sweep

        try:
            swept = sweep(run_id, cfg.cluster.launch.namespace)
            if swept:
                print(
                    f"[moerl] close_run: deleted launched workloads left behind: {', '.join(swept)}",
                    flush=True,
                )
        except (
            MoerlError
        ) as err:  # close the run first; then fail this task, so the leak shows in the UI
            sweep_error = err
    from moerl.launch.runsecret import holds_admin  # a cheap import: no kubernetes client

    if run_id and cfg.pipeline.mode == "async" and cfg.valkey.url and holds_admin():
        # the async run's own Valkey user and its Secret (start_run made them): gone with the run
        from moerl.errors import MoerlError
        from moerl.launch.runsecret import close_run_identity

        try:
            print(
                f"[moerl] close_run: deleted {', '.join(close_run_identity(cfg, run_id)) or 'nothing'}",
                flush=True,
            )
        except MoerlError as err:
            sweep_error = sweep_error or err
    final = tracking.close_run(
        uri,
        cfg.tracking.experiment,
        run_id,
        kfp_run_id,
        succeeded=status.state == "SUCCEEDED" and sweep_error is None,
        error=f"{status.pipeline_task_name}: {status.error_message or status.state}"
        if sweep_error is None
        else f"close_run: {sweep_error}",
    )
    if sweep_error is not None:
        raise sweep_error
    return final
