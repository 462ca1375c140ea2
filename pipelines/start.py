"""The work of a pipeline's first tasks, `start_run` and `check_user_code` (pipelines/tracking.py),
as plain functions: KFP ships a lightweight component's source alone, so what it calls lives
here, in the image's installed package, imported inside the component once the pod's scratch
is entered."""

from __future__ import annotations

import json
import sys
from typing import Any

from moerl import provenance, tracking
from moerl.config import RunConfig, config_from_json, config_to_json
from moerl.errors import MoerlError
from moerl.launch.layout import rollout_pod_layout, rollout_pods
from moerl.launch.runsecret import open_run_identity, uses_run_identity
from moerl.pipelines.params import changed, merge, params_for
from moerl.preflight import check_user_code, preflight


def open_run(
    config_json: str,
    run_id: str,
    git_sha: str,
    kfp_run_id: str,
    target: str,
    given: dict[str, Any],
    overrides: list | None,
) -> tuple[str, str, list[int], list[int], str]:
    """`start_run`'s outputs (run_id, config_json, worker_slots, scorer_slots, valkey_secret),
    from its inputs; `given`: its arguments by name, the run form's fields among them."""
    base = config_from_json(config_json)
    uri = tracking.resolve_uri(base.tracking)
    tags = provenance.collect(with_cuda=base.trainer.parallelism.device == "cuda")
    tags["moerl.git_sha"] = git_sha or tags["moerl.git_sha"]
    tags["moerl.kfp_run_id"] = kfp_run_id
    # 1. the run form and overrides merged into the compiled config, checked before any work
    cfg = merged_config(base, given, overrides, target, uri, run_id, tags)
    # 2. the MLflow run: created, or the given one continued
    run_id = mlflow_run(base, cfg, uri, run_id, tags)
    # 3. build-info and runtime probe on the run
    provenance.stage_start(cfg, "start_run", run_id, enforce=False)
    valkey_secret = ""
    # 4. last: once the run surely starts (close_run deletes it however it ends)
    if cfg.pipeline.mode == "async":
        valkey_secret = open_run_identity(cfg, run_id) if uses_run_identity(cfg, target) else ""
    slots = worker_slots(cfg)
    return run_id, config_to_json(cfg), slots, list(range(cfg.reward.scorers)), valkey_secret


def merged_config(
    base: RunConfig,
    given: dict[str, Any],
    overrides: list | None,
    target: str,
    uri: str,
    run_id: str,
    tags: dict[str, str],
) -> RunConfig:
    """`base` with the run form's set fields and `overrides`, preflighted as `moerl run` does;
    a bad value exits the task (SystemExit) with one line naming the key, also written to the
    MLflow run."""
    try:
        cfg = merge(
            base,
            {p.name: given[p.name] for p in params_for(base) if given[p.name] is not None},
            list(overrides or []),
            target,
        )
        # this pod is not where the GPU stages run: no requirement probe; and it may hold the
        # Valkey admin's password and the launcher's token: the user's code is check_user_code's
        preflight(cfg, here=False, user_code=False)
    except MoerlError as err:
        message = tracking.redact(str(err))
        print(f"moerl: error: {message}", file=sys.stderr, flush=True)
        tracking.record_refusal(base, uri, run_id, tags, message)
        raise SystemExit(err.exit_code) from None
    return cfg


def mlflow_run(base: RunConfig, cfg: RunConfig, uri: str, run_id: str, tags: dict[str, str]) -> str:
    """The MLflow run's id: a new run with `tags`, or `run_id` reopened with this image's tags
    added; what the run form changed from `base` is tagged on it and printed."""
    diff = changed(base, cfg)
    if run_id:  # a run continued (--resume) is running again until finish_run or close_run ends it
        tracking.reopen_run(uri, run_id)
        tracking.set_tags(uri, run_id, {f"task.{k}": v for k, v in tags.items()})
    else:
        run_id = tracking.start_run(cfg, uri, tags)
    if diff:
        tracking.set_tags(
            uri, run_id, {"moerl.run_parameters": json.dumps(diff, sort_keys=True)[:4000]}
        )
        print(
            f"[moerl] run parameters changed {', '.join(f'{k}={v}' for k, v in sorted(diff.items()))}",
            flush=True,
        )
    return run_id


def worker_slots(cfg: RunConfig) -> list[int]:
    """One item per rollout pod (the async pipeline's fan-out); none for an elastic fleet, which
    is one Deployment the trainer's launcher creates."""
    slots = list(range(rollout_pods(cfg.rollout.workers, rollout_pod_layout(cfg).engines)))
    if cfg.rollout.elastic:
        slots = []
    return slots


def user_code_check(config_json: str) -> None:
    """`check_user_code`'s work: the merged config's verifiers and environments, each called
    once in the sandbox (moerl.preflight.check_user_code); one that fails exits the task
    (SystemExit) with one line naming the key. Its pod holds no Secret and no launcher token
    (pipelines/eks.py), so it records nothing on the MLflow run: close_run marks the run FAILED,
    naming this task."""
    cfg = config_from_json(config_json)
    try:
        check_user_code(cfg)
    except MoerlError as err:
        print(f"moerl: error: {tracking.redact(str(err))}", file=sys.stderr, flush=True)
        raise SystemExit(err.exit_code) from None
    print("[moerl] check_user_code: the run's verifiers and environments passed", flush=True)
