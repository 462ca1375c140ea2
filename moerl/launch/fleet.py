"""An elastic async run's rollout fleet on Kubernetes: one Deployment the cluster scales.

`fleet_objects` builds (pure: dicts in, dicts out) the Deployment of rollout worker pods (one
worker, one engine per pod; its Valkey consumer name is `rollout-<pod name>`), the per-run Role and
RoleBinding that let the trainer's account scale only that Deployment (and keep the
ScaledObject's lagCount current), and, where KEDA runs, a TriggerAuthentication on the run's own
Secret and a ScaledObject with a redis-streams trigger on the run's units stream:
replicas = ceil(lag / lagCount) within rollout.fleet_bounds. Design, keys, the rule and what has
not run on a real cluster: docs/eks.md, "KEDA: the elastic rollout fleet".
"""

from __future__ import annotations

import math
from typing import Any
from urllib.parse import urlsplit

from moerl.bus.run import GROUPS, UNITS
from moerl.config import RunConfig
from moerl.errors import ConfigError
from moerl.launch import objects
from moerl.launch.podsecrets import VALKEY_SCALER_KEYS, scaler_secret_name

DEPLOYMENT_API = ("apps", "v1", "deployments")
KEDA_GROUP, KEDA_VERSION = "keda.sh", "v1alpha1"
SCALEDOBJECT_API = (KEDA_GROUP, KEDA_VERSION, "scaledobjects")
TRIGGERAUTH_API = (KEDA_GROUP, KEDA_VERSION, "triggerauthentications")
STAGE = "rollout_worker"
WORKER_MODULE = "moerl.components.rollout.worker"
ENV_POD_NAME = "MOERL_FLEET_POD"  # the pod's own name (downward API)
# the fleet's Deployment's name, in the async trainer's env: its controller scales that one
ENV_FLEET_NAME = "MOERL_FLEET_NAME"
# A worker's Valkey consumer name: `rollout-<its pod's name>`, unique per pod; the run's
# counters and controllers count workers by the `rollout` prefix.
WORKER_NAME = f"rollout-$({ENV_POD_NAME})"  # expanded by the kubelet from the container's env
# The run's config reaches every pod of the fleet as a file from a pod annotation (downward API
# volume): no object besides the Deployment, nothing the pods must fetch before they start.
CONFIG_ANNOTATION = "moerl.ai/config"
CONFIG_DIR, CONFIG_FILE = "/etc/moerl/run", "config.json"
_MAX_NAME = 63
# what the Deployment and ReplicaSet controllers append: -<pod-template-hash, <= 10>-<5>
_POD_SUFFIX = len("-0123456789-abcde")
# What of the trainer's account gives its pods their cloud identity (IRSA): copied onto the run's
# own trainer account (`trainer_account`), so the trainer keeps its S3 access.
IRSA_ANNOTATIONS = (
    "eks.amazonaws.com/role-arn",
    "eks.amazonaws.com/sts-regional-endpoints",
    "eks.amazonaws.com/token-expiration",
    "eks.amazonaws.com/audience",
)


def fleet_name(run_id: str, suffix: str | None = None) -> str:
    """The Deployment's name (and its ScaledObject's, TriggerAuthentication's, Role's and
    RoleBinding's), with room for the pod names derived from it within 63 characters."""
    return objects.workload_name(
        STAGE, run_id, extra="fleet", budget=_MAX_NAME - _POD_SUFFIX, suffix=suffix
    )


def units_stream(run_id: str) -> str:
    """The run's units stream, as `moerl.bus.run.RunBus.key(UNITS)` names it."""
    return f"moerl:{run_id}:{UNITS}"


def valkey_address(cfg: RunConfig) -> tuple[str, int, bool]:
    """(host:port, database index, TLS) of `valkey.url`, as KEDA's redis-streams trigger takes
    them; the host must resolve from KEDA's namespace (a Service's namespaced DNS name)."""
    url = cfg.valkey.url
    parts = urlsplit(url or "")
    if parts.scheme not in ("redis", "rediss", "valkey", "valkeys") or not parts.hostname:
        raise ConfigError(
            f"valkey.url {url!r}: an elastic fleet's ScaledObject needs redis://, rediss://, "
            "valkey:// or valkeys://host:port/db (KEDA connects to it from its own namespace)"
        )
    path = parts.path.strip("/")
    if path and not path.isdigit():
        raise ConfigError(f"valkey.url {url!r}: the path must be a database index, got {path!r}")
    return (
        f"{parts.hostname}:{parts.port or 6379}",
        int(path or 0),
        parts.scheme in ("rediss", "valkeys"),
    )


def default_lag_count(cfg: RunConfig) -> int:
    """lagCount before anything is measured: the units of one version's batch
    (ceil(task.prompts_per_iteration / units.max_prompts)), so a worker is added only for a
    backlog of more than a whole version's units per worker. The controller replaces it with
    the measured units one worker drains in one engine load time (the bus's `fleet` hash)."""
    return max(1, math.ceil(cfg.task.prompts_per_iteration / cfg.units.max_prompts))


def check_fleet(cfg: RunConfig) -> None:
    """What an elastic fleet on Kubernetes cannot be (ConfigError naming the keys)."""
    if not cfg.rollout.elastic:
        raise ConfigError(
            f"rollout.min_workers / max_workers {cfg.rollout.fleet_bounds}: the fleet is not "
            "elastic; fixed workers launch one pod each"
        )
    if cfg.cluster.launch.rollout_nodes_per_worker > 1:
        raise ConfigError(
            f"cluster.launch.rollout_nodes_per_worker {cfg.cluster.launch.rollout_nodes_per_worker}: "
            "an elastic fleet scales one-node workers (a Deployment); engines across nodes run as "
            "fixed workers (set rollout.min_workers = max_workers = workers)"
        )
    valkey_address(cfg)


def deployment(
    cfg: RunConfig,
    run_id: str,
    name: str,
    env: list[dict[str, Any]],
    owner: dict[str, Any] | None = None,
    service_account: str | None = None,
) -> dict[str, Any]:
    """The fleet's Deployment: `rollout.workers` replicas of the rollout pod's spec (image,
    resources of one engine, node selector, tolerations, security, Secret volumes, env, grace),
    each running one worker named after its pod (`WORKER_NAME`)."""
    from moerl.config import config_to_json

    spec = objects._rollout_pod_spec(  # one pod spec for every rollout pod
        cfg, [], [], "Always", service_account, STAGE, run_id, engines=1
    )
    (c,) = spec["containers"]
    c["command"] = [
        "python",
        "-m",
        WORKER_MODULE,
        "--config",
        f"{CONFIG_DIR}/{CONFIG_FILE}",
        "--run-id",
        run_id,
        "--name",
        WORKER_NAME,
    ]
    c["env"] = [
        *env,
        {"name": ENV_POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        *c["env"],
    ]
    spec["volumes"].append(
        {
            "name": "moerl-config",
            "downwardAPI": {
                "items": [
                    {
                        "path": CONFIG_FILE,
                        "fieldRef": {"fieldPath": f"metadata.annotations['{CONFIG_ANNOTATION}']"},
                    }
                ]
            },
        }
    )
    c["volumeMounts"].append({"name": "moerl-config", "mountPath": CONFIG_DIR, "readOnly": True})
    meta = fleet_labels(run_id, name)
    return {
        "apiVersion": "/".join(DEPLOYMENT_API[:2]),
        "kind": "Deployment",
        "metadata": {"name": name, "labels": meta, **objects._owner(owner)},
        "spec": {
            "replicas": cfg.rollout.workers,
            "selector": {"matchLabels": selector(run_id, name)},
            "template": {
                "metadata": {
                    "labels": dict(meta),
                    "annotations": {CONFIG_ANNOTATION: config_to_json(cfg)},
                },
                "spec": spec,
            },
        },
    }


def selector(run_id: str, name: str) -> dict[str, str]:
    """The labels that select this fleet's pods and nothing else: the run and the Deployment's
    own (random-suffixed) name."""
    return {objects.LABEL_RUN: objects.label_value(run_id), objects.LABEL_WORKLOAD: name}


def trigger_authentication(run_id: str, name: str, labels: dict[str, str]) -> dict[str, Any]:
    """KEDA's credentials for the trigger: the run's scaler user (read-only on the units stream,
    `moerl.bus.client.create_scaler_user`), read from the run's scaler Secret
    (`moerl-run-<run_id>-scaler`, which no pod mounts) by KEDA's operator; never inlined."""
    secret = scaler_secret_name(run_id)
    user_key, password_key = VALKEY_SCALER_KEYS
    return {
        "apiVersion": f"{KEDA_GROUP}/{KEDA_VERSION}",
        "kind": "TriggerAuthentication",
        "metadata": {"name": name, "labels": dict(labels)},
        "spec": {
            "secretTargetRef": [
                {"parameter": "username", "name": secret, "key": user_key},
                {"parameter": "password", "name": secret, "key": password_key},
            ]
        },
    }


def scaled_object(
    cfg: RunConfig, run_id: str, name: str, labels: dict[str, str], lag_count: int
) -> dict[str, Any]:
    """The ScaledObject on the fleet's Deployment: a redis-streams trigger on the consumer group
    `rollout`'s lag of the run's units stream (XINFO GROUPS: units issued, not yet delivered),
    AverageValue lagCount, so replicas = ceil(lag / lag_count) within rollout.fleet_bounds, and
    one on its pending units (pendingEntriesCount rollout.units_in_flight: the workers busy), the
    larger wish winning; scale-ups at once, scale-downs after rollout.fleet_scale_down_after_s."""
    ro = cfg.rollout
    lo, hi = ro.fleet_bounds
    address, db, tls = valkey_address(cfg)
    meta = {
        "address": address,
        "stream": units_stream(run_id),
        "consumerGroup": GROUPS[UNITS],
        "lagCount": str(lag_count),
        # only scaling from/to zero reads it; min_workers >= 1 keeps the fleet above zero
        "activationLagCount": "0",
    }
    if db:
        meta["databaseIndex"] = str(db)
    if tls:
        meta["enableTLS"] = "true"
    down = int(math.ceil(ro.fleet_scale_down_after_s))
    return {
        "apiVersion": f"{KEDA_GROUP}/{KEDA_VERSION}",
        "kind": "ScaledObject",
        "metadata": {"name": name, "labels": dict(labels)},
        "spec": {
            "scaleTargetRef": {
                "apiVersion": "/".join(DEPLOYMENT_API[:2]),
                "kind": "Deployment",
                "name": name,
            },
            "pollingInterval": max(1, int(math.ceil(ro.fleet_interval_s))),
            "cooldownPeriod": down,
            "minReplicaCount": lo,
            "maxReplicaCount": hi,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {
                        "scaleUp": {"stabilizationWindowSeconds": 0},
                        "scaleDown": {"stabilizationWindowSeconds": down},
                    }
                }
            },
            "triggers": [
                {
                    "type": "redis-streams",
                    "metricType": "AverageValue",
                    "metadata": meta,
                    "authenticationRef": {"name": name},
                },
                # the units leased and not yet done (XPENDING), rollout.units_in_flight a
                # worker: the HPA takes the larger of the two wishes, so a fleet whose workers
                # all generate is not shrunk for having nothing waiting (the rule's busy floor)
                {
                    "type": "redis-streams",
                    "metricType": "AverageValue",
                    "metadata": {
                        **{
                            k: v
                            for k, v in meta.items()
                            if k not in ("lagCount", "activationLagCount")
                        },
                        "pendingEntriesCount": str(ro.units_in_flight),
                    },
                    "authenticationRef": {"name": name},
                },
            ],
        },
    }


def scaler_role(name: str, labels: dict[str, str], keda: bool) -> dict[str, Any]:
    """The per-run Role: get/patch the scale subresource of this fleet's Deployment only (the
    controller's replica count where KEDA is not installed) and, with KEDA, get/patch this
    fleet's ScaledObject only (the controller keeps its lagCount current)."""
    rules = [
        {
            "apiGroups": [DEPLOYMENT_API[0]],
            "resources": ["deployments/scale"],
            "resourceNames": [name],
            "verbs": ["get", "patch"],
        }
    ]
    if keda:
        rules.append(
            {
                "apiGroups": [KEDA_GROUP],
                "resources": ["scaledobjects"],
                "resourceNames": [name],
                "verbs": ["get", "patch"],
            }
        )
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": name, "labels": dict(labels)},
        "rules": rules,
    }


def fleet_labels(run_id: str, name: str) -> dict[str, str]:
    """The labels of the fleet's Deployment, its pods and everything that goes with it."""
    return {**objects.labels(run_id, STAGE, name), objects.LABEL_GROUP: "rollout"}


def trainer_account(
    name: str, labels: dict[str, str], annotations: dict[str, str], owner: dict | None = None
) -> dict[str, Any]:
    """The run's own account for its trainer's pods, named as the fleet: the per-run Role's only
    subject, so no other run's trainer (they share `cluster.launch.service_account`) can patch
    this fleet. No automounted token (the trainer projects one, `objects.api_token_volume`);
    `annotations`: the IRSA ones of the trainer's shared account (`IRSA_ANNOTATIONS`)."""
    meta: dict[str, Any] = {"name": name, "labels": dict(labels), **objects._owner(owner)}
    if annotations:
        meta["annotations"] = {k: v for k, v in annotations.items() if k in IRSA_ANNOTATIONS}
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": meta,
        "automountServiceAccountToken": False,
    }


def scaler_binding(
    name: str, labels: dict[str, str], namespace: str, service_account: str
) -> dict[str, Any]:
    """Binds the per-run Role to the run's trainer account (its controller runs there)."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": name, "labels": dict(labels)},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": service_account, "namespace": namespace}],
    }


def fleet_objects(
    cfg: RunConfig,
    run_id: str,
    namespace: str,
    *,
    name: str | None = None,
    env: list[dict[str, Any]] | None = None,
    keda: bool = True,
    lag_count: int | None = None,
    owner: dict[str, Any] | None = None,
    service_account: str | None = None,
) -> list[dict[str, Any]]:
    """Run `run_id`'s elastic fleet in `namespace`: [Deployment, Role, RoleBinding] and, with
    `keda`, [TriggerAuthentication, ScaledObject], all named `name` (default `fleet_name`).
    Create the Deployment first; the others then get `deployment_owner` to it, so they go with
    it. `env`: the pods' environment (the launcher's `moerl.launch.task.launch_env`); `lag_count`: the
    measured one (default `default_lag_count`); `owner`: the Deployment's ownerReference (the
    launching task's pod); `service_account`: the pods' (default the rollout account). The Role's
    subject is the run's trainer account, named as the fleet (`trainer_account`), which the
    launcher creates before the trainer."""
    check_fleet(cfg)
    name = name or fleet_name(run_id)
    dep = deployment(cfg, run_id, name, env or [], owner, service_account)
    labels = dict(dep["metadata"]["labels"])
    out = [dep, scaler_role(name, labels, keda), scaler_binding(name, labels, namespace, name)]
    if keda:
        count = default_lag_count(cfg) if lag_count is None else max(1, int(lag_count))
        out += [
            trigger_authentication(run_id, name, labels),
            scaled_object(cfg, run_id, name, labels, count),
        ]
    return out


def deployment_owner(name: str, uid: str) -> dict[str, Any]:
    """An ownerReference to the fleet's Deployment `name` (`uid` from its create): the garbage
    collector deletes what it owns with it."""
    return {
        "apiVersion": "/".join(DEPLOYMENT_API[:2]),
        "kind": "Deployment",
        "name": name,
        "uid": uid,
        "blockOwnerDeletion": False,
        "controller": False,
    }


def lag_count_patch(lag_count: int) -> list[dict[str, Any]]:
    """The JSON patch (application/json-patch+json) that sets the ScaledObject's lagCount: what
    the controller applies as its measurement changes."""
    return [
        {
            "op": "replace",
            "path": "/spec/triggers/0/metadata/lagCount",
            "value": str(max(1, int(lag_count))),
        }
    ]


def scale_patch(replicas: int) -> dict[str, Any]:
    """The merge patch of the Deployment's scale subresource (no KEDA: the controller's size)."""
    return {"spec": {"replicas": int(replicas)}}


__all__ = [
    "IRSA_ANNOTATIONS",
    "check_fleet",
    "default_lag_count",
    "deployment_owner",
    "fleet_name",
    "fleet_objects",
    "lag_count_patch",
    "scale_patch",
    "trainer_account",
    "units_stream",
]
