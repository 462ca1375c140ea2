"""In the KFP task: run one GPU stage in a pod launched through the Kubernetes API.

Design, details and limitations: docs/launch.md#moerllaunchtaskpy.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from moerl.config import GroupConfig, RunConfig, config_to_json
from moerl.errors import CheckpointError, ConfigError
from moerl.launch import objects
from moerl.launch.exchange import RESULT, SPEC, Exchange, exchange_uri, node_result
from moerl.launch.podsecrets import (
    LAUNCHED_ASYNC_STAGES as ASYNC_STAGES,  # the ones that talk to Valkey
)
from moerl.launch.remote import STAGES
from moerl.launch.watch import (
    KINDS,
    PENDING_TIMEOUT_S,
    KubeApi,
    Launcher,
    LaunchError,
    connect,
    delete_retrying,
    own_pod_owner,
    resolve_namespace,
    short_error,
    workload,
)

log = logging.getLogger(__name__)

# Environment the task passes on to the pods it launches: where MLflow is, which AWS region.
# Never credentials (MLFLOW_TRACKING_URI goes through `tracking_uri_env`): the pods get those
# from their own service account (IRSA) and Secrets.
PASS_ENV = ("MLFLOW_TRACKING_URI", "AWS_REGION", "AWS_DEFAULT_REGION")

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
        raise ConfigError(
            "cluster.launch.mode kubernetes needs an s3:// checkpoint.uri: the launched pods get "
            f"their inputs through it and cannot see the task's folders (got {cfg.checkpoint.uri!r})"
        )
    if not run_id or "/" in run_id:
        raise LaunchError(
            f"{stage}: cluster.launch.mode kubernetes needs the run id (got {run_id!r}); "
            "the pipeline passes it to the component"
        )
    check_launchable(cfg, stage)


def check_launchable(cfg: RunConfig, stage: str) -> None:
    """What `moerl compile --target eks` refuses too: a workload shape moerl cannot run.
    A rollout worker over `cluster.launch.rollout_nodes_per_worker` > 1 nodes is one engine
    group (a JobSet, `objects.rollout_group`): its TP x DP must be the GPUs of all its nodes
    (`layout.pod_layout`); the sync `rollout` stage runs on one node only."""
    la = cfg.cluster.launch
    if STAGES[stage].group == "trainer":
        _check_trainer_nodes(cfg, stage)
    if stage == "rollout" and la.rollout_nodes_per_worker > 1:
        raise ConfigError(
            f"cluster.launch.rollout_nodes_per_worker {la.rollout_nodes_per_worker}: the sync "
            "pipeline's rollout stage starts one engine per iteration on one node; engines across "
            "nodes (a leader and follower nodes, one JobSet per worker) run in the async pipeline "
            "(pipeline.mode async); set pipeline.mode async, or rollout_nodes_per_worker 1"
        )
    if STAGES[stage].group == "rollout":
        from moerl.launch.layout import rollout_pod_layout

        rollout_pod_layout(cfg)  # TP x DP must divide the rollout pod's GPUs
    if stage == "async_trainer" and cfg.rollout.elastic:
        from moerl.launch.fleet import check_fleet

        check_fleet(cfg)  # the trainer's launcher creates the elastic fleet (`fleet_workload`)


def _check_trainer_nodes(cfg: RunConfig, stage: str) -> None:
    """The trainer's ranks over its nodes: an equal share on each, at most one rank per GPU;
    across nodes only through torchrun, and only for the sync policy update."""
    la, world = cfg.cluster.launch, cfg.trainer.parallelism.world_size
    nodes = objects.trainer_nodes(cfg)
    mesh = (
        f"trainer.parallelism.data_parallel_shard x trainer.parallelism.expert_parallel_size = {cfg.trainer.parallelism.data_parallel_shard} x "
        f"{cfg.trainer.parallelism.expert_parallel_size} = {world} ranks"
    )
    if world % nodes:
        raise ConfigError(
            f"trainer mesh: {mesh} do not split evenly over {nodes} nodes "
            "(cluster.launch.trainer_nodes); every node runs the same number of ranks"
        )
    if cfg.trainer.parallelism.device == "cuda" and world // nodes > la.gpus_per_node:
        raise ConfigError(
            f"trainer mesh: {mesh}, but the trainer gets cluster.launch.gpus_per_node x trainer_nodes "
            f"= {la.gpus_per_node} x {nodes} = {la.gpus_per_node * nodes} GPUs; one rank per GPU"
        )
    if nodes > 1 and stage == "async_trainer" and not cfg.trainer.parallelism.persistent_ranks:
        raise ConfigError(
            f"trainer on {nodes} nodes: trainer.parallelism.persistent_ranks false restarts the "
            "mesh's ranks every version from one node; set it true (the ranks then live for the run "
            "on every node), or use a mesh of at most cluster.launch.gpus_per_node ranks"
        )
    if nodes > 1 and cfg.trainer.parallelism.launcher != "torchrun":
        raise ConfigError(
            f"trainer on {nodes} nodes: trainer.parallelism.launcher {cfg.trainer.parallelism.launcher!r} starts ranks on one "
            "machine only; set trainer.parallelism.launcher torchrun (it joins the nodes' ranks)"
        )


def tracking_uri_env(uri: str) -> str | None:
    """$MLFLOW_TRACKING_URI as a launched pod may get it: without `user:password@` (an http(s)
    server's credentials reach the pod from `cluster.mlflow_secret`); None for another scheme
    that carries them (a database URI cannot work without its password, which never goes into
    an object)."""
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    if parts.scheme in ("http", "https"):
        return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    return None


def launch_env(
    cfg: RunConfig, stage: str, environ: Mapping[str, str] | None = None
) -> list[dict[str, Any]]:
    """The launched container's environment (see the module docstring); Secrets as the
    compiled tasks get them (pipelines/eks.py): optional, Valkey's only for the async stages."""
    environ = os.environ if environ is None else environ
    env: list[dict[str, Any]] = [{"name": "PYTHONUNBUFFERED", "value": "1"}]
    for k in PASS_ENV:
        value = environ.get(k)
        if value and k == "MLFLOW_TRACKING_URI":
            value = tracking_uri_env(value)
            if value is None:
                log.warning(
                    "not passing MLFLOW_TRACKING_URI to the launched pods: it carries credentials; "
                    "they use tracking.uri from the config"
                )
        if value:
            env.append({"name": k, "value": value})
    from moerl.launch.podsecrets import pod_secret_files  # the one mapping `place` mounts too

    # the credentials' files (moerl.launch.objects mounts the Secret volumes), never their values
    for name, path in pod_secret_files(cfg, stage, async_mode=stage in ASYNC_STAGES).items():
        env.append({"name": name, "value": path})
    if cfg.checkpoint.fanout and stage == "rollout_worker":
        env += [
            {"name": "MOERL_FANOUT_BIND", "value": "0.0.0.0"},
            {
                "name": "MOERL_FANOUT_ADVERTISE",
                "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
            },
        ]
    if cfg.rollout.resolved.weight_sync == "collective" and STAGES[stage].group == "trainer":
        # each trainer rank hosts its weight group's rendezvous on its own address, which the
        # engines read from the session (components/policy_update/mesh.py, `send_weights`)
        env.append(
            {"name": objects.ENV_POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
        )
    return env


def launch_service_account(
    cfg: RunConfig, namespace: str, stage: str = "policy_update"
) -> str | None:
    """The launched pods' service account: `cluster.launch.service_account` (`moerl-worker` by
    default: S3 only, no API token). Never the task's own: that account's Role may create pods,
    and a launched stage has no business with the Kubernetes API. Unset: None, with a warning:
    the namespace's `default` account usually has no S3 access, so the stage would fail late,
    at its first S3 request. Rollout stages get `cluster.launch.rollout_service_account` when set
    (`moerl-rollout`: S3 read, and writes to pins and the exchange only)."""
    la = cfg.cluster.launch
    if stage.startswith("rollout") and la.rollout_service_account:
        return la.rollout_service_account
    if la.service_account:
        return la.service_account
    log.warning(
        "the launched pods get namespace %s's default service account: cluster.launch.service_account is "
        "unset; set it to one with S3 access (moerl-worker)",
        namespace,
    )
    return None


def remote_command(cfg: RunConfig, spec_uri: str) -> list[str]:
    cmd = ["python", "-m", "moerl.launch.remote", spec_uri]
    if cfg.checkpoint.endpoint_url:
        cmd += ["--endpoint-url", cfg.checkpoint.endpoint_url]
    if cfg.checkpoint.region:
        cmd += ["--region", cfg.checkpoint.region]
    return cmd


def is_group(cfg: RunConfig, stage: str) -> bool:
    """Whether `stage` launches as a rollout engine group over several nodes (a JobSet)."""
    return stage == "rollout_worker" and cfg.cluster.launch.rollout_nodes_per_worker > 1


def workload_name_for(cfg: RunConfig, stage: str, run_id: str, worker: str | None) -> str:
    """The launched object's name, with room for the pod names its controller derives."""
    if STAGES[stage].group == "trainer":
        return objects.trainjob_name(stage, run_id, objects.trainer_nodes(cfg))
    if is_group(cfg, stage):
        return objects.rollout_group_name(
            stage, run_id, worker or "rollout", cfg.cluster.launch.rollout_nodes_per_worker
        )
    return objects.workload_name(stage, run_id, extra=worker or "")


def build(
    cfg: RunConfig,
    stage: str,
    run_id: str,
    name: str,
    command: list[str],
    worker: str | None,
    owner: dict[str, Any] | None,
    service_account: str | None = None,
    engines: int | None = None,
    fleet: str | None = None,
) -> dict[str, Any]:
    """The object that runs `stage`: a TrainJob for the trainer group, a Pod for rollout
    (`engines`: the rollout engines it runs, which size its GPUs), a JobSet for a rollout
    worker over several nodes (`is_group`; every pod gets all its node's GPUs). `fleet`: the
    name of an elastic run's fleet, which the async trainer's controller scales."""
    env = launch_env(cfg, stage)
    if fleet is not None:
        from moerl.launch.fleet import ENV_FLEET_NAME

        env = [*env, {"name": ENV_FLEET_NAME, "value": fleet}]
    if is_group(cfg, stage):
        return objects.rollout_group(
            cfg,
            run_id,
            worker or "rollout",
            command,
            env,
            stage=stage,
            name=name,
            owner=owner,
            service_account=service_account,
        )
    if STAGES[stage].group == "trainer":
        return objects.trainjob(
            cfg,
            run_id,
            name,
            command,
            env,
            stage=stage,
            owner=owner,
            service_account=service_account,
        )
    return objects.rollout_pod(
        cfg,
        run_id,
        worker or "rollout",
        command,
        env,
        stage=stage,
        name=name,
        owner=owner,
        service_account=service_account,
        engines=engines,
    )


def fleet_workload(
    cfg: RunConfig, run_id: str, namespace: str, api: KubeApi, name: str | None = None
) -> Any:
    """An elastic async run's rollout fleet (`moerl.launch.fleet`), which the trainer's launcher
    creates beside the TrainJob and deletes with it: the Deployment (owned by this task's pod)
    and what it owns. `name`: the fleet's, as the trainer was told (`build(fleet=...)`)."""
    from moerl.launch.fleet import fleet_objects

    dep, *owned = fleet_objects(
        cfg,
        run_id,
        namespace,
        name=name,
        env=launch_env(cfg, "rollout_worker"),
        keda=cfg.cluster.launch.fleet_scaler == "keda",  # else the trainer scales it itself
        owner=own_pod_owner(namespace),
        service_account=launch_service_account(cfg, namespace, "rollout_worker"),
    )
    return workload(api, namespace, dep, owned)


def open_trainer_account(
    cfg: RunConfig, run_id: str, namespace: str, name: str, api: KubeApi
) -> str:
    """Create the run's own trainer account `name` (`fleet.trainer_account`), before the
    trainer, with the IRSA annotations of `cluster.launch.service_account`'s account (read by
    name: the launcher's Role may get only that one), owned by this task's pod (the garbage
    collector deletes it with the task; once the fleet is gone it is bound to nothing)."""
    from kubernetes.client.exceptions import ApiException

    from moerl.launch.fleet import fleet_labels, trainer_account

    shared = cfg.cluster.launch.service_account
    annotations: dict[str, str] = {}
    try:
        if shared:
            resp = api.core.read_namespaced_service_account(
                shared, namespace, _preload_content=False
            )
            annotations = json.loads(resp.data).get("metadata", {}).get("annotations") or {}
        body = trainer_account(
            name, fleet_labels(run_id, name), annotations, own_pod_owner(namespace)
        )
        api.core.create_namespaced_service_account(namespace, body, _preload_content=False)
    except ApiException as e:
        raise LaunchError(
            f"the run's trainer account {namespace}/{name} (copying {shared!r}'s cloud identity): "
            f"{short_error(e)}; the launcher's Role needs get on that account and create on "
            "serviceaccounts (manifests/base/rbac.yaml)"
        ) from None
    log.info("created ServiceAccount %s/%s for the trainer of run %s", namespace, name, run_id)
    return name


def run_remote(
    cfg: RunConfig,
    stage: str,
    run_id: str,
    *,
    args: dict[str, Any] | None = None,
    inputs: dict[str, str | Path] | None = None,
    outputs: dict[str, str | Path] | None = None,
    worker: str | None = None,
    api: KubeApi | None = None,
    launcher: Launcher | None = None,
    engines: int | None = None,
) -> Any:
    """Run `stage` in a launched pod and return its value; outputs land at the given paths.

    `args`: the stage's scalar arguments (JSON). `inputs` / `outputs`: artifact name -> local
    path (file or directory). `engines`: the rollout engines the pod runs (its GPUs on cuda). `api` and `launcher` are for tests (recorded API responses, a
    fake clock); by default the in-cluster client and `cluster.launch.poll_s`.
    """
    t_start = time.monotonic()
    args, inputs, outputs = dict(args or {}), dict(inputs or {}), dict(outputs or {})
    # 1. settings
    check(cfg, stage, run_id)
    la, spec_group = cfg.cluster.launch, STAGES[stage].group
    namespace = resolve_namespace(la.namespace)
    name = workload_name_for(cfg, stage, run_id, worker)
    group = cfg.cluster.groups.trainer if spec_group == "trainer" else cfg.cluster.groups.rollout
    ex = Exchange(cfg.checkpoint, exchange_uri(cfg.checkpoint, run_id, name))
    try:
        # 2. inputs and spec
        _write_spec(ex, cfg, stage, run_id, args, inputs, outputs)
        # 3-4. launch, watch, delete
        elastic = stage == "async_trainer" and cfg.rollout.elastic
        fleet_name = None
        kube = api or connect()
        account = None
        if elastic:  # named once: the Deployment and the trainer's controller agree on it
            from moerl.launch.fleet import fleet_name as new_fleet_name

            fleet_name = new_fleet_name(run_id)
            # the trainer runs as the run's own account, the only one its fleet's Role binds
            account = open_trainer_account(cfg, run_id, namespace, fleet_name, kube)
        body = build(
            cfg,
            stage,
            run_id,
            name,
            remote_command(cfg, f"{ex.uri}/{SPEC}"),
            worker,
            own_pod_owner(namespace),
            account or launch_service_account(cfg, namespace, stage),
            engines=engines,
            fleet=fleet_name,
        )
        if launcher is None:
            launcher = _task_launcher(cfg, group, t_start)
        # a rollout group's pods reach each other on every TCP port (its NetworkPolicy, owned
        # by the JobSet: it goes with it)
        owned = [objects.rollout_group_policy(body)] if body["kind"] == "JobSet" else None
        # an elastic run's fleet lives as long as its trainer: created beside it, not watched
        # to an end (it has none), deleted with it
        fleet = [fleet_workload(cfg, run_id, namespace, kube, fleet_name)] if elastic else None
        launcher.run([workload(kube, namespace, body, owned)], companions=fleet)
        # 5. outputs and value
        return _collect(ex, f"{body['kind']} {name}", outputs)
    finally:
        # 6. the exchange, whatever happened
        try:
            log.info("deleted %d exchange objects under %s", ex.clear(), ex.uri)
        except CheckpointError as e:
            log.warning("could not delete the exchange %s: %s", ex.uri, e)


def _write_spec(
    ex: Exchange,
    cfg: RunConfig,
    stage: str,
    run_id: str,
    args: dict[str, Any],
    inputs: dict[str, str | Path],
    outputs: dict[str, str | Path],
) -> None:
    """The task's input artifacts and the pod's spec into the exchange; an input that does not
    exist in the task is refused before anything is launched."""
    descs = {n: ex.put(f"inputs/{n}", Path(p)) for n, p in inputs.items()}
    if missing := [n for n, d in descs.items() if d["kind"] == "missing"]:
        raise LaunchError(f"{stage}: input artifacts {missing} do not exist in the task")
    ex.write_json(
        SPEC,
        {
            "stage": stage,
            "run_id": run_id,
            "config_json": config_to_json(cfg),
            "args": args,
            "inputs": descs,
            "outputs": sorted(outputs),
        },
    )


def _task_launcher(cfg: RunConfig, group: GroupConfig, t_start: float) -> Launcher:
    """The default launcher: `cluster.launch.poll_s`, watching for the time left of the task's
    deadline (started at `t_start`), less the margin for cleanup."""
    la = cfg.cluster.launch
    left = (
        cfg.cluster.timeout_s(group, cfg.pipeline.mode)
        - CLEANUP_MARGIN_S
        - (time.monotonic() - t_start)
    )
    return Launcher(
        la.poll_s,
        max(left, la.poll_s),
        pending_timeout_s=getattr(la, "pending_timeout_s", PENDING_TIMEOUT_S),
    )


def _collect(ex: Exchange, what: str, outputs: dict[str, str | Path]) -> Any:
    """A finished workload's value, its outputs (every node's, merged) fetched to their paths;
    `what`: the workload, for the errors."""
    result = ex.read_json(RESULT)
    if not isinstance(result, dict):
        raise LaunchError(f"{what} succeeded but wrote no {RESULT} under {ex.uri}")
    parts = _node_parts(ex, result, what)
    for n, path in outputs.items():
        desc = merge_outputs(n, [result, *parts], what)
        ex.get(f"outputs/{n}", desc, Path(path))
    return result.get("value")


def _node_parts(ex: Exchange, result: dict[str, Any], what: str) -> list[dict[str, Any]]:
    """The results of nodes 1..N-1 of a multi-node workload (node 0's `result` says N)."""
    nodes = int(result.get("nodes", 1))
    parts = []
    for k in range(1, nodes):
        part = ex.read_json(node_result(k))
        if not isinstance(part, dict):
            raise LaunchError(
                f"{what} succeeded but node {k} of {nodes} wrote no {node_result(k)} under {ex.uri}"
            )
        parts.append(part)
    return parts


def merge_outputs(name: str, results: list[dict[str, Any]], what: str) -> dict[str, Any]:
    """Output `name` as one description: node 0's, with the other nodes' files added to a
    directory. A file that two nodes wrote is refused (one would have overwritten the other)."""
    desc = results[0].get("outputs", {}).get(name, {"kind": "missing"})
    if desc.get("kind") == "missing":
        raise LaunchError(f"the launched {what} did not produce output {name!r}")
    if len(results) == 1:
        return desc
    if desc.get("kind") != "dir":
        raise LaunchError(
            f"output {name!r} of the multi-node {what} is a {desc.get('kind')}; only directories merge"
        )
    owner = {rel: 0 for rel in desc["files"]}
    for k, part in enumerate(results[1:], start=1):
        for rel in part.get("outputs", {}).get(name, {}).get("files", []):
            if rel in owner:
                raise LaunchError(
                    f"output {name!r} of {what}: nodes {owner[rel]} and {k} both wrote {rel}"
                )
            owner[rel] = k
    return {"kind": "dir", "files": sorted(owner)}


# ----------------------------------------------------------------------- the exit task's sweep


def _list(api: KubeApi, namespace: str, kind: str, selector: str) -> list[dict[str, Any]]:
    if kind == "Pod":
        resp = api.core.list_namespaced_pod(
            namespace, label_selector=selector, _preload_content=False
        )
    elif kind == "Deployment":
        resp = api.apps().list_namespaced_deployment(
            namespace, label_selector=selector, _preload_content=False
        )
    else:
        g, v, p = KINDS[kind].api_ref  # type: ignore[attr-defined]
        resp = api.custom.list_namespaced_custom_object(
            g, v, namespace, p, label_selector=selector, _preload_content=False
        )
    return json.loads(resp.data).get("items", [])


def _controlled(obj: dict[str, Any]) -> bool:
    """Made by a controller (a TrainJob's JobSet, a Job's pod): it goes when its owner goes,
    and deleting it alone would only have the controller make it again."""
    return any(o.get("controller") for o in obj.get("metadata", {}).get("ownerReferences") or [])


def sweep(
    run_id: str,
    namespace: str | None = None,
    api: KubeApi | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> list[str]:
    """Delete every TrainJob, JobSet, Deployment (an elastic run's fleet, with what it owns) and
    Pod that moerl's launcher created for `run_id` in
    `namespace` (default: the task's own), found by the labels `moerl.ai/run-id` and
    `app.kubernetes.io/managed-by=moerl`; objects a controller made (the pods of a TrainJob)
    go with their owner. Returns "<Kind> <namespace>/<name>" of each one deleted. Deletes are
    retried as in the launcher's cleanup; an API that is not installed (404 on the list) has
    nothing to sweep. Raises LaunchError, after trying everything, if something could not be
    listed or deleted."""
    if not objects.label_value(run_id):
        raise LaunchError(
            f"sweep needs a run id (got {run_id!r}): an empty one would match nothing, or every run"
        )
    ns = resolve_namespace(namespace)
    api = api or connect()
    selector = f"{objects.LABEL_RUN}={objects.label_value(run_id)},{objects.LABEL_MANAGED}=moerl"
    deleted: list[str] = []
    problems: list[str] = []
    # owners first: their children go with them
    for kind in ("TrainJob", "JobSet", "Deployment", "Pod"):
        try:
            items = _list(api, ns, kind, selector)
        except Exception as e:  # noqa: BLE001 (sweep the other kinds; reported at the end)
            if getattr(e, "status", None) == 404:
                continue  # the API is not installed: nothing of that kind to sweep
            problems.append(f"listing {kind}s: {short_error(e)}")
            continue
        for item in items:
            if _controlled(item):
                continue
            w = KINDS[kind](api, ns, item)
            try:
                if delete_retrying(w, sleep):
                    deleted.append(str(w))
                    log.info("swept %s", w)
            except Exception as e:  # noqa: BLE001 (keep sweeping; reported at the end)
                problems.append(f"deleting {w}: {short_error(e)}")
    if problems:
        raise LaunchError(
            f"sweeping run {run_id} in {ns}: "
            + "; ".join(problems)
            + (f" (deleted {', '.join(deleted)})" if deleted else "")
        )
    return deleted
