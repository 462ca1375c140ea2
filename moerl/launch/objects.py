"""Kubernetes objects for the GPU stages, built from a `RunConfig` (pure: dicts in, dicts out).

Design, details and limitations: docs/launch.md#moerllaunchobjectspy.
"""

from __future__ import annotations

import math
import re
import secrets
from dataclasses import dataclass
from typing import Any

from moerl.config import GroupConfig, RunConfig
from moerl.launch.podenv import SCRATCH_ENV

TRAINJOB_API = ("trainer.kubeflow.org", "v1alpha1", "trainjobs")
JOBSET_API = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
PATCH_MANAGER = "moerl.ai/launcher"
TRAINER_CONTAINER = "node"  # the container (and replicated job) of Trainer's torch runtimes
ROLLOUT_CONTAINER = "rollout"

LABEL_RUN, LABEL_STAGE, LABEL_WORKLOAD = "moerl.ai/run-id", "moerl.ai/stage", "moerl.ai/workload"
LABEL_MANAGED = "app.kubernetes.io/managed-by"
# The worker group, as the compiled tasks carry it (pipelines/eks.py): the fan-out's
# NetworkPolicy (manifests/base/ckpt-cache.yaml) admits rollout pods to rollout pods by it, so a
# launched rollout pod without it could neither reach its peers' chunk servers nor be reached.
LABEL_GROUP = "moerl.ai/group"
# The rank of a pod in its multi-node group, for the stage code (0 = the leader).
ENV_NODE_RANK, ENV_GROUP_SIZE, ENV_LEADER = (
    "MOERL_NODE_RANK",
    "MOERL_GROUP_SIZE",
    "MOERL_LEADER_ADDRESS",
)

# The label the JobSet controller puts on every pod of a JobSet (its headless Service selects
# on it too): a rollout group's NetworkPolicy admits the group's own pods by it.
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
# The replicated jobs of a rollout group: the leader (node rank 0) and the Indexed workers.
GROUP_LEADER, GROUP_WORKER = "leader", "worker"
ENV_WORKER_INDEX = "MOERL_WORKER_INDEX"

ENV_POD_IP = "MOERL_POD_IP"

# Beyond `rollout.grace_seconds` (the worker's drain), time for the publish and the exit.
GRACE_MARGIN_S = 30
_MAX_NAME = 63
_SUFFIX_LEN = (
    5  # the random suffix of a generated name; also what the Job controller appends to pod names
)
_ZERO = re.compile(r"^0+(\.0+)?[a-zA-Z]*$")


def label_value(text: str) -> str:
    """`text` as a valid label value: [A-Za-z0-9._-], alphanumeric at both ends, <= 63."""
    v = re.sub(r"[^A-Za-z0-9._-]+", "-", text)[:_MAX_NAME]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", v)


def _dns(text: str) -> str:
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]+", "-", text.lower())).strip("-")


def workload_name(
    stage: str, run_id: str, extra: str = "", budget: int = _MAX_NAME, suffix: str | None = None
) -> str:
    """`moerl-<stage>[-<extra>]-<run id, first 8>-<random>`: an RFC 1035 label (starts with a
    letter, [a-z0-9-], <= `budget` characters). The stage part is cut first, never the
    run id or the random suffix that makes retries unique."""
    suffix = suffix if suffix is not None else secrets.token_hex(3)[:_SUFFIX_LEN]
    tail = "-".join(p for p in (_dns(extra), _dns(run_id)[:8], _dns(suffix)) if p)
    room = budget - len("moerl-") - len(tail) - 1
    if room < 1:
        raise ValueError(f"no room for a name within {budget} characters (tail {tail!r})")
    head = _dns(stage)[:room].strip("-") or "w"
    return f"moerl-{head}-{tail}"


def labels(run_id: str, stage: str, name: str) -> dict[str, str]:
    """The stage label is spelled as on the KFP tasks (pipelines/eks.py): hyphens."""
    return {
        LABEL_RUN: label_value(run_id),
        LABEL_STAGE: label_value(stage.replace("_", "-")),
        LABEL_WORKLOAD: name,
        LABEL_MANAGED: "moerl",
    }


def resources(cfg: RunConfig, gpus: int | None = None) -> dict[str, dict[str, str]]:
    """requests = limits per node: GPUs, EFA devices, 2 MiB hugepages, cpu, memory. Zero or
    unset ones are left out (a CPU-only test cluster, a node without EFA). `gpus`: a pod of
    that many GPUs of a node of `gpus_per_node` (a rollout pod, `rollout_gpus`), with the
    node's EFA devices in proportion (p5en: 2 per GPU)."""
    la = cfg.cluster.launch
    efa = la.efa_per_node
    if gpus is not None and la.gpus_per_node and gpus < la.gpus_per_node:
        efa = max(1, efa * gpus // la.gpus_per_node) if efa else 0
    wanted = {
        "nvidia.com/gpu": str(la.gpus_per_node if gpus is None else gpus),
        "vpc.amazonaws.com/efa": str(efa),
        "hugepages-2Mi": la.hugepages_2mi,
        "cpu": la.cpu_per_node,
        "memory": la.memory_per_node,
    }
    amounts = {k: v for k, v in wanted.items() if v is not None and not _ZERO.match(v)}
    return {"requests": dict(amounts), "limits": dict(amounts)}


def image(cfg: RunConfig, group: GroupConfig) -> str:
    return group.image or cfg.pipeline.base_image


def _tolerations(group: GroupConfig) -> list[dict[str, Any]]:
    return [t.model_dump(exclude_none=True) for t in group.tolerations]


def _volumes(
    cfg: RunConfig, group: GroupConfig, stage: str, run_id: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The volumes (scratch emptyDir, memory-backed /dev/shm, the stage's Secrets as files) and
    their mounts."""
    from moerl.launch.podsecrets import launched_secret_volumes

    cl = cfg.cluster
    volumes: list[dict[str, Any]] = [
        {"name": "scratch", "emptyDir": {"sizeLimit": cl.scratch_of(group)}}
    ]
    mounts: list[dict[str, Any]] = [{"name": "scratch", "mountPath": cl.scratch_dir}]
    if group.shm:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": group.shm}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    secret_volumes, secret_mounts = launched_secret_volumes(cfg, stage, run_id)
    volumes, mounts = volumes + secret_volumes, mounts + secret_mounts
    if stage == "async_trainer" and cfg.rollout.elastic:
        volumes.append(api_token_volume())
        mounts.append({"name": API_TOKEN, "mountPath": API_TOKEN_DIR, "readOnly": True})
    return volumes, mounts


API_TOKEN, API_TOKEN_DIR = "kube-api-token", "/var/run/secrets/kubernetes.io/serviceaccount"


def api_token_volume(expiration_s: int = 3600) -> dict[str, Any]:
    """The one exception to "no stage calls the API": an elastic fleet's controller in the async
    trainer (components/rollout/fleet.py) patches its own fleet's scale or ScaledObject, which
    the run's scaler Role alone allows (moerl/launch/fleet.py). Its account mounts no token, and
    a TrainJob's runtime patch cannot set automountServiceAccountToken, so the token is projected
    where in-cluster clients read it: short-lived, audience the API server, refreshed by the
    kubelet."""
    return {
        "name": API_TOKEN,
        "projected": {
            "sources": [
                {"serviceAccountToken": {"path": "token", "expirationSeconds": expiration_s}},
                {
                    "configMap": {
                        "name": "kube-root-ca.crt",
                        "items": [{"key": "ca.crt", "path": "ca.crt"}],
                    }
                },
                {
                    "downwardAPI": {
                        "items": [
                            {"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}
                        ]
                    }
                },
            ]
        },
    }


# The launched GPU pods get the least privilege their stage needs: a non-root user (the images'
# numeric USER 1000, which the kubelet can check), no privilege escalation, every Linux
# capability dropped but IPC_LOCK (EFA pins the memory it registers with the NIC), the runtime's
# default seccomp profile, a read-only root filesystem (a stage writes only to the scratch
# emptyDir, HOME and TMPDIR under it, and /dev/shm), and no Kubernetes API token: a stage never
# calls the API, only its launcher does.
# The user, group and seccomp profile are the pod's alone: a container that overrides them is
# refused by the admission policy (manifests/base/launched-pods-policy.yaml). `unmasked`: a
# sandboxed rollout pod's /proc, where the sandbox mounts a proc of its own (moerl.tasks.isolation);
# the API server admits it only in a pod with its own user namespace (hostUsers false).
def _security(unmasked: bool = False) -> dict[str, Any]:
    sc: dict[str, Any] = {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]},
    }
    if unmasked:
        sc["procMount"] = "Unmasked"
    return sc


# fsGroup: the group the kubelet gives the pod's volumes; a Secret volume's root-owned 0400
# files become 0440 for it, so the non-root stage can read its credentials and others cannot
POD_FS_GROUP = 1000


# The Localhost seccomp profile of a rollout pod whose environments run in the sandbox's
# namespaces: RuntimeDefault's refusals but unshare, clone and mount (manifests/seccomp/, which
# the rollout nodes' user data installs under /var/lib/kubelet/seccomp; docs/eks.md).
SANDBOX_SECCOMP = "moerl/sandbox.json"


def sandboxed(cfg: RunConfig) -> bool:
    """Whether a rollout pod of `cfg` runs environments in the sandbox's namespaces."""
    t = cfg.task
    return bool(t.environment or t.environments) and t.sandbox.isolation == "namespaces"


def _pod_security(localhost: str | None = None) -> dict[str, Any]:
    profile = {"type": "Localhost", "localhostProfile": localhost} if localhost else None
    return {
        "runAsNonRoot": True,
        "seccompProfile": profile or {"type": "RuntimeDefault"},
        "fsGroup": POD_FS_GROUP,
    }


def scratch_env(cfg: RunConfig) -> list[dict[str, Any]]:
    """The scratch emptyDir as `moerl.launch.podenv` expects it (MOERL_SCRATCH; HOME and TMPDIR under
    it, which `enter_pod` creates): the image's own directories may be read-only."""
    scratch = cfg.cluster.scratch_dir
    return [
        {"name": SCRATCH_ENV, "value": scratch},
        {"name": "HOME", "value": f"{scratch}/home"},
        {"name": "TMPDIR", "value": f"{scratch}/tmp"},
    ]


def _owner(owner: dict[str, Any] | None) -> dict[str, Any]:
    return {"ownerReferences": [owner]} if owner else {}


def trainer_nodes(cfg: RunConfig) -> int:
    """The trainer's node count: `cluster.launch.trainer_nodes`, or from the mesh: its ranks at
    `gpus_per_node` per node on GPUs (ceil), one node on CPU."""
    la = cfg.cluster.launch
    if la.trainer_nodes is not None:
        return la.trainer_nodes
    if cfg.trainer.parallelism.device == "cuda" and la.gpus_per_node > 0:
        return max(1, math.ceil(cfg.trainer.parallelism.world_size / la.gpus_per_node))
    return 1


def trainjob(
    cfg: RunConfig,
    run_id: str,
    name: str,
    command: list[str],
    env: list[dict[str, Any]],
    stage: str = "policy_update",
    owner: dict[str, Any] | None = None,
    service_account: str | None = None,
) -> dict[str, Any]:
    """A TrainJob running `command` on `trainer_nodes(cfg)` trainer nodes.
    `service_account`: its pods' (default `cluster.launch.service_account`; none: the namespace's)."""
    la, group = cfg.cluster.launch, cfg.cluster.groups.trainer
    meta = labels(run_id, stage, name)
    volumes, mounts = _volumes(cfg, group, stage, run_id)
    pod_spec: dict[str, Any] = {
        "nodeSelector": dict(group.node_selector),
        "tolerations": _tolerations(group),
        "volumes": volumes,
        "containers": [
            {"name": TRAINER_CONTAINER, "volumeMounts": mounts, "securityContext": _security()}
        ],
        # no automountServiceAccountToken here: a runtime patch cannot set it (Trainer v2.3's
        # schema); the service account itself (moerl-worker) has automountServiceAccountToken false
        "securityContext": _pod_security(),
    }
    if sa := service_account or la.service_account:
        pod_spec["serviceAccountName"] = sa
    patch = {
        "manager": PATCH_MANAGER,
        "trainingRuntimeSpec": {
            "template": {
                "metadata": {"labels": dict(meta)},
                "spec": {
                    "replicatedJobs": [
                        {
                            "name": TRAINER_CONTAINER,
                            "template": {
                                "spec": {
                                    "template": {
                                        "metadata": {"labels": dict(meta)},
                                        "spec": pod_spec,
                                    }
                                }
                            },
                        }
                    ]
                },
            }
        },
    }
    return {
        "apiVersion": "/".join(TRAINJOB_API[:2]),
        "kind": "TrainJob",
        "metadata": {"name": name, "labels": meta, **_owner(owner)},
        "spec": {
            "runtimeRef": {
                "name": la.trainer_runtime,
                "apiGroup": TRAINJOB_API[0],
                "kind": "ClusterTrainingRuntime",
            },
            "trainer": {
                "image": image(cfg, group),
                "command": list(command),
                "env": [*env, *scratch_env(cfg)],
                "numNodes": trainer_nodes(cfg),
                "resourcesPerNode": resources(cfg),
            },
            "runtimePatches": [patch],
            "activeDeadlineSeconds": cfg.cluster.timeout_s(group, cfg.pipeline.mode),
        },
    }


def trainjob_name(stage: str, run_id: str, nodes: int, suffix: str | None = None) -> str:
    """Room for the pod names the JobSet under a TrainJob derives: <name>-node-0-<n-1>-xxxxx."""
    return workload_name(
        stage,
        run_id,
        budget=_MAX_NAME - len(f"-{TRAINER_CONTAINER}-0-{nodes - 1}-xxxxx"),
        suffix=suffix,
    )


def grace_seconds(cfg: RunConfig) -> int:
    """The rollout pod's terminationGracePeriodSeconds: the worker's drain plus a margin."""
    return int(math.ceil(cfg.rollout.grace_seconds)) + GRACE_MARGIN_S


def rollout_gpus(cfg: RunConfig, engines: int | None = None) -> int:
    """GPUs of a launched rollout pod: `cluster.launch.rollout_gpus_per_node` (null:
    `gpus_per_node`), or on cuda only those of the `engines` it runs (the last pod of a run whose
    rollout.workers is not a multiple of the engines per pod; a sync rollout's one engine)."""
    from moerl.launch.layout import rollout_pod_layout

    full = cfg.cluster.launch
    gpus = full.gpus_per_node if full.rollout_gpus_per_node is None else full.rollout_gpus_per_node
    if engines is None or cfg.rollout.device != "cuda" or not gpus:
        return gpus
    layout = rollout_pod_layout(cfg)
    return min(gpus, engines * layout.devices_per_engine)


def _rollout_pod_spec(
    cfg: RunConfig,
    command: list[str],
    env: list[dict[str, Any]],
    restart: str,
    service_account: str | None,
    stage: str,
    run_id: str,
    engines: int | None = None,
) -> dict[str, Any]:
    la, group, sandbox = cfg.cluster.launch, cfg.cluster.groups.rollout, sandboxed(cfg)
    volumes, mounts = _volumes(cfg, group, stage, run_id)
    spec: dict[str, Any] = {
        "restartPolicy": restart,
        "nodeSelector": dict(group.node_selector),
        "tolerations": _tolerations(group),
        "terminationGracePeriodSeconds": grace_seconds(cfg),
        "enableServiceLinks": False,  # no env variable per Service of the namespace
        "securityContext": _pod_security(SANDBOX_SECCOMP if sandbox else None),
        "automountServiceAccountToken": False,
        "volumes": volumes,
        "containers": [
            {
                "name": ROLLOUT_CONTAINER,
                "image": image(cfg, group),
                "command": list(command),
                "workingDir": cfg.cluster.scratch_dir,
                "env": [*env, *scratch_env(cfg)],
                "resources": resources(cfg, rollout_gpus(cfg, engines)),
                "volumeMounts": mounts,
                "securityContext": _security(unmasked=sandbox),
                # the stage's one-line error (moerl.launch.remote), else the log tail
                "terminationMessagePolicy": "FallbackToLogsOnError",
            }
        ],
    }
    if sandbox:  # its own user namespace: root in it is no one on the node
        spec["hostUsers"] = False
    if sa := service_account or la.rollout_service_account or la.service_account:
        spec["serviceAccountName"] = sa
    if la.rollout_priority_class:
        spec["priorityClassName"] = la.rollout_priority_class
    return spec


def rollout_pod(
    cfg: RunConfig,
    run_id: str,
    worker: str,
    command: list[str],
    env: list[dict[str, Any]],
    stage: str = "rollout_worker",
    name: str | None = None,
    owner: dict[str, Any] | None = None,
    service_account: str | None = None,
    engines: int | None = None,
) -> dict[str, Any]:
    """One rollout pod `worker` (e.g. rollout-3) as a Pod (`service_account` as in `trainjob`);
    `engines`: the engines it runs, which size its GPUs on cuda (`rollout_gpus`)."""
    name = name or workload_name(stage, run_id, extra=worker)
    spec = _rollout_pod_spec(
        cfg, command, env, "Never", service_account, stage, run_id, engines=engines
    )
    spec["activeDeadlineSeconds"] = cfg.cluster.timeout_s(
        cfg.cluster.groups.rollout, cfg.pipeline.mode
    )
    meta = {**labels(run_id, stage, name), LABEL_GROUP: "rollout"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": meta, **_owner(owner)},
        "spec": spec,
    }


def rollout_group_name(
    stage: str, run_id: str, worker: str, nodes: int, suffix: str | None = None
) -> str:
    """Room for <name>-worker-0-<n-2>-xxxxx, the longest pod name the JobSet derives."""
    return workload_name(
        stage,
        run_id,
        extra=worker,
        suffix=suffix,
        budget=_MAX_NAME - len(f"-worker-0-{max(nodes - 2, 0)}-xxxxx"),
    )


def rollout_group(
    cfg: RunConfig,
    run_id: str,
    worker: str,
    command: list[str],
    env: list[dict[str, Any]],
    stage: str = "rollout_worker",
    name: str | None = None,
    owner: dict[str, Any] | None = None,
    service_account: str | None = None,
    follower_command: list[str] | None = None,
    nodes: int | None = None,
) -> dict[str, Any]:
    """One rollout worker spanning `cluster.launch.rollout_nodes_per_worker` nodes, as a JobSet.

    Every pod gets MOERL_NODE_RANK (leader 0, workers 1..N-1 from their completion index),
    MOERL_GROUP_SIZE and MOERL_LEADER_ADDRESS (the leader pod's stable DNS name), all the GPUs
    and EFA devices of its node (`rollout_gpus`: a group's engine spans whole nodes) and the
    rollout pod's grace period. The JobSet succeeds when the leader's job does (the run's end
    or a drain, which the leader reports in its result), and fails when any pod fails (a
    follower's failure or drain fails the group; KFP's retry relaunches it as a unit).
    Its NetworkPolicy: `rollout_group_policy`.
    `follower_command`: the workers' command (default `command`); `nodes`: the group's size in
    place of the config's (the wide-EP bench's engine sizes), 1 a leader job alone.
    """
    nodes = _group_nodes(cfg, nodes)
    name = name or rollout_group_name(stage, run_id, worker, nodes)
    meta = {**labels(run_id, stage, name), LABEL_GROUP: "rollout"}
    group_env = [
        *env,
        {"name": ENV_GROUP_SIZE, "value": str(nodes)},
        {"name": ENV_LEADER, "value": leader_address(name)},
        # the leader binds its engine's RPC on its own address, not on its DNS name (which the
        # headless Service may not resolve yet when the engine starts)
        {"name": ENV_POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    group = _Group(cfg, run_id, stage, meta, group_env, service_account)
    follower = command if follower_command is None else follower_command
    jobs = [group.job(GROUP_LEADER, 1, command, {"name": ENV_NODE_RANK, "value": "0"})]
    if nodes > 1:
        jobs.append(group.job(GROUP_WORKER, nodes - 1, follower, _worker_rank_env()))
    return {
        "apiVersion": "/".join(JOBSET_API[:2]),
        "kind": "JobSet",
        "metadata": {"name": name, "labels": meta, **_owner(owner)},
        "spec": {
            "replicatedJobs": jobs,
            "network": {
                "enableDNSHostnames": True,
                "subdomain": name,
                "publishNotReadyAddresses": True,
            },
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [GROUP_LEADER]},
            "failurePolicy": {"maxRestarts": 0},  # KFP retries the task, which relaunches the group
        },
    }


def _group_nodes(cfg: RunConfig, nodes: int | None) -> int:
    """A rollout group's size: `nodes`, else `cluster.launch.rollout_nodes_per_worker`, which a
    group needs at 2 or more (one node is `rollout_pod`'s)."""
    if nodes is None:
        nodes = cfg.cluster.launch.rollout_nodes_per_worker
        if nodes < 2:
            raise ValueError(
                "rollout_group is for cluster.launch.rollout_nodes_per_worker >= 2; use rollout_pod"
            )
    elif nodes < 1:
        raise ValueError(f"rollout_group needs nodes >= 1, got {nodes}")
    return nodes


def _worker_rank_env() -> dict[str, Any]:
    """Worker i's rank variable, from its completion index i: node rank i + 1
    (moerl.launch.remote adds the one)."""
    return {
        "name": ENV_WORKER_INDEX,
        "valueFrom": {
            "fieldRef": {
                "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"
            }
        },
    }


@dataclass(frozen=True)
class _Group:
    """What every replicated job of one rollout group shares: its labels, its env (without the
    rank) and its pods' service account."""

    cfg: RunConfig
    run_id: str
    stage: str
    meta: dict[str, str]
    env: list[dict[str, Any]]
    service_account: str | None

    def job(
        self, role: str, count: int, cmd: list[str], rank_env: dict[str, Any]
    ) -> dict[str, Any]:
        """The replicated job `role`: `count` pods running `cmd`, each with `rank_env`."""
        cfg = self.cfg
        spec = _rollout_pod_spec(
            cfg, cmd, [*self.env, rank_env], "Never", self.service_account, self.stage, self.run_id
        )
        job_spec: dict[str, Any] = {
            "parallelism": count,
            "completions": count,
            "backoffLimit": 0,
            "activeDeadlineSeconds": cfg.cluster.timeout_s(
                cfg.cluster.groups.rollout, cfg.pipeline.mode
            ),
            "template": {"metadata": {"labels": dict(self.meta)}, "spec": spec},
        }
        if role == GROUP_WORKER:
            job_spec["completionMode"] = "Indexed"
        return {
            "name": role,
            "replicas": 1,
            "template": {"metadata": {"labels": dict(self.meta)}, "spec": job_spec},
        }


def leader_address(name: str) -> str:
    """The leader pod's DNS name in rollout group `name`: JobSet's
    <jobset>-<replicatedJob>-<job index>-<pod index>.<subdomain>, subdomain = the JobSet's name
    (its headless Service, which resolves the pods' hostnames in the namespace)."""
    return f"{name}-{GROUP_LEADER}-0-0.{name}"


def jobset_owner(name: str, uid: str) -> dict[str, Any]:
    """An ownerReference to the JobSet `name` (`uid` from its create): what it owns is deleted
    with it by the garbage collector."""
    return {
        "apiVersion": "/".join(JOBSET_API[:2]),
        "kind": "JobSet",
        "name": name,
        "uid": uid,
        "blockOwnerDeletion": False,
        "controller": False,
    }


def rollout_group_policy(
    group: dict[str, Any], owner: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The NetworkPolicy of rollout group `group` (a `rollout_group` JobSet): its pods admit TCP
    on every port from the group's own pods, found by the label the JobSet controller gives
    them (`JOBSET_NAME_LABEL`): vLLM's data-parallel RPC (rollout.group_rpc_port) and the
    NCCL, gloo and DeepEP bootstraps, which listen on ephemeral ports. It admits nothing from
    any other pod: what the group's pods get from elsewhere (fan-out peers, metrics) comes from
    the namespace's policies for rollout pods (manifests/base/ckpt-cache.yaml); policies add up.
    Named as the JobSet, with its labels; `owner`: `jobset_owner`, so it goes with the group."""
    name = group["metadata"]["name"]
    members = {"matchLabels": {JOBSET_NAME_LABEL: name}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "labels": dict(group["metadata"]["labels"]), **_owner(owner)},
        "spec": {
            "podSelector": members,
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": members}], "ports": [{"protocol": "TCP"}]}],
        },
    }
