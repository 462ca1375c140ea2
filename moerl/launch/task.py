"""In the KFP task: run one GPU stage in a pod launched through the Kubernetes API.

`run_remote(cfg, stage, run_id, ...)` is what a component calls instead of the stage function
when `cluster.launch.mode` is `kubernetes`:
(1) check the settings; (2) upload the task's input artifacts and a spec to the run's S3
exchange (`moerl.launch.exchange`); (3) build the workload: a TrainJob for the trainer stages,
a Pod for the rollout stages (`moerl.launch.objects`); (4) create it, watch it, delete it
(`moerl.launch.watch.Launcher`); (5) download the outputs into the task's own output paths and
return the stage's value; (6) delete the exchange prefix, whatever happened (a failed attempt's
inputs can be a whole trainer state, and a KFP retry uploads them again under a new key).

What the launched pods get besides the stage: the non-secret environment the task itself was
given for MLflow and AWS (`PASS_ENV`), the Secrets named in `cluster.mlflow_secret` and
`cluster.valkey_secret` as secretKeyRef variables (never their values), and the service
account `cluster.launch.service_account` (IRSA: their S3 access).

Limitations: needs an s3:// `checkpoint.uri` (the exchange). Refuses
`cluster.launch.trainer_nodes` > 1 and `rollout_nodes_per_worker` > 1: the objects for them
exist (`objects.trainjob`, `objects.rollout_group`), but moerl's trainer and rollout engine
do not yet join ranks across nodes, so every node would run the whole stage on its own.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from moerl.config import RunConfig, config_to_json
from moerl.errors import CheckpointError, ConfigError
from moerl.launch import objects
from moerl.launch.exchange import RESULT, SPEC, Exchange, exchange_uri
from moerl.launch.remote import STAGES
from moerl.launch.watch import KubeApi, Launcher, LaunchError, connect, own_pod_owner, resolve_namespace, workload

log = logging.getLogger(__name__)

# Environment the task passes on to the pods it launches: where MLflow is, which AWS region.
# Never credentials: the pods get those from their own service account (IRSA) and Secrets.
PASS_ENV = ("MLFLOW_TRACKING_URI", "AWS_REGION", "AWS_DEFAULT_REGION")
ASYNC_STAGES = frozenset({"async_trainer", "rollout_worker"})  # the ones that talk to Valkey
# The task's own deadline (set_timeout, the GPU group's timeout_s, pipelines/eks.py) counts from
# its start; the watch gives up this long before it, so the launcher reports a timeout and
# deletes its workload itself rather than being killed.
CLEANUP_MARGIN_S = 120


def check(cfg: RunConfig, stage: str, run_id: str) -> None:
    """Everything that would make the launch pointless, before anything is uploaded."""
    la = cfg.cluster.launch
    if la.mode != "kubernetes":
        raise ConfigError(f"run_remote needs cluster.launch.mode kubernetes, got {la.mode!r}")
    if stage not in STAGES:
        raise ConfigError(f"no remote stage {stage!r}; known: {', '.join(sorted(STAGES))}")
    if not cfg.checkpoint.uri.startswith("s3://"):
        raise ConfigError("cluster.launch.mode kubernetes needs an s3:// checkpoint.uri: the launched pods get "
                          f"their inputs through it and cannot see the task's folders (got {cfg.checkpoint.uri!r})")
    if not run_id or "/" in run_id:
        raise LaunchError(f"{stage}: cluster.launch.mode kubernetes needs the run id (got {run_id!r}); "
                          "the pipeline passes it to the component")
    check_launchable(cfg, stage)


def check_launchable(cfg: RunConfig, stage: str) -> None:
    """What `moerl compile --target eks` refuses too: a workload shape moerl cannot run yet."""
    la = cfg.cluster.launch
    if STAGES[stage].group == "trainer" and la.trainer_nodes > 1:
        raise ConfigError(f"cluster.launch.trainer_nodes {la.trainer_nodes}: moerl's trainer runs on one node "
                          "(its expert-parallel ranks do not join across nodes yet); set 1")
    if STAGES[stage].group == "rollout" and la.rollout_nodes_per_worker > 1:
        raise ConfigError(f"cluster.launch.rollout_nodes_per_worker {la.rollout_nodes_per_worker}: moerl's rollout "
                          "engine runs on one node (no multi-node join yet); set 1")


def launch_env(cfg: RunConfig, stage: str, environ: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The launched container's environment (see the module docstring); Secrets as the
    compiled tasks get them (pipelines/eks.py): optional, Valkey's only for the async stages."""
    environ = os.environ if environ is None else environ
    env: list[dict[str, Any]] = [{"name": "PYTHONUNBUFFERED", "value": "1"}]
    env += [{"name": k, "value": environ[k]} for k in PASS_ENV if environ.get(k)]
    secrets = [(cfg.cluster.mlflow_secret, ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"))]
    if stage in ASYNC_STAGES:
        secrets.append((cfg.cluster.valkey_secret, ("VALKEY_PASSWORD",)))
    for secret, keys in secrets:
        if secret:
            env += [{"name": k, "valueFrom": {"secretKeyRef": {"name": secret, "key": k, "optional": True}}}
                    for k in keys]
    return env


def remote_command(cfg: RunConfig, spec_uri: str) -> list[str]:
    cmd = ["python", "-m", "moerl.launch.remote", spec_uri]
    if cfg.checkpoint.endpoint_url:
        cmd += ["--endpoint-url", cfg.checkpoint.endpoint_url]
    if cfg.checkpoint.region:
        cmd += ["--region", cfg.checkpoint.region]
    return cmd


def build(cfg: RunConfig, stage: str, run_id: str, name: str, command: list[str], worker: str | None,
          owner: dict[str, Any] | None) -> dict[str, Any]:
    """The object that runs `stage`: a TrainJob for the trainer group, a Pod for rollout."""
    env = launch_env(cfg, stage)
    if STAGES[stage].group == "trainer":
        return objects.trainjob(cfg, run_id, name, command, env, stage=stage, owner=owner)
    return objects.rollout_pod(cfg, run_id, worker or "rollout", command, env, stage=stage, name=name, owner=owner)


def run_remote(cfg: RunConfig, stage: str, run_id: str, *, args: dict[str, Any] | None = None,
               inputs: dict[str, str | Path] | None = None, outputs: dict[str, str | Path] | None = None,
               worker: str | None = None, api: KubeApi | None = None, launcher: Launcher | None = None) -> Any:
    """Run `stage` in a launched pod and return its value; outputs land at the given paths.

    `args`: the stage's scalar arguments (JSON). `inputs` / `outputs`: artifact name -> local
    path (file or directory). `api` and `launcher` are for tests (recorded API responses, a
    fake clock); by default the in-cluster client and `cluster.launch.poll_s`.
    """
    t_start = time.monotonic()
    args, inputs, outputs = dict(args or {}), dict(inputs or {}), dict(outputs or {})
    # 1. settings
    check(cfg, stage, run_id)
    la, spec_group = cfg.cluster.launch, STAGES[stage].group
    namespace = resolve_namespace(la.namespace)
    if spec_group == "trainer":
        name = objects.trainjob_name(stage, run_id, la.trainer_nodes)
    else:
        name = objects.workload_name(stage, run_id, extra=worker or "")
    group = cfg.cluster.groups.trainer if spec_group == "trainer" else cfg.cluster.groups.rollout
    ex = Exchange(cfg.checkpoint, exchange_uri(cfg.checkpoint, run_id, name))
    try:
        # 2. inputs and spec
        descs = {n: ex.put(f"inputs/{n}", Path(p)) for n, p in inputs.items()}
        if missing := [n for n, d in descs.items() if d["kind"] == "missing"]:
            raise LaunchError(f"{stage}: input artifacts {missing} do not exist in the task")
        ex.write_json(SPEC, {"stage": stage, "run_id": run_id, "config_json": config_to_json(cfg), "args": args,
                             "inputs": descs, "outputs": sorted(outputs)})
        # 3-4. launch, watch, delete
        body = build(cfg, stage, run_id, name, remote_command(cfg, f"{ex.uri}/{SPEC}"), worker,
                     own_pod_owner(namespace))
        if launcher is None:  # the time left of the task's deadline, less the margin for cleanup
            left = group.timeout_s - CLEANUP_MARGIN_S - (time.monotonic() - t_start)
            launcher = Launcher(la.poll_s, max(left, la.poll_s))
        launcher.run([workload(api or connect(), namespace, body)])
        # 5. outputs and value
        result = ex.read_json(RESULT)
        if not isinstance(result, dict):
            raise LaunchError(f"{body['kind']} {name} succeeded but wrote no {RESULT} under {ex.uri}")
        for n, path in outputs.items():
            desc = result.get("outputs", {}).get(n, {"kind": "missing"})
            if desc.get("kind") == "missing":
                raise LaunchError(f"{stage}: the launched {body['kind']} {name} did not produce output {n!r}")
            ex.get(f"outputs/{n}", desc, Path(path))
        return result.get("value")
    finally:
        # 6. the exchange, whatever happened
        try:
            log.info("deleted %d exchange objects under %s", ex.clear(), ex.uri)
        except CheckpointError as e:
            log.warning("could not delete the exchange %s: %s", ex.uri, e)
