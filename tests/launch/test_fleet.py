"""An elastic async run's rollout fleet on Kubernetes (moerl/launch/fleet.py), checked offline:
the Deployment against Kubernetes 1.37's schema (kubernetes-validate strict), the ScaledObject and
TriggerAuthentication against KEDA v2.20.2's CRD schemas (tests/data/k8s, NOTICE there) with
unknown fields refused, the per-run Role and RoleBinding; the selectors (only this run's fleet
pods), the bounds and lagCount as configured, the credentials only by reference, the launcher's
Role holding what the fleet's creation and the per-run Role's grant need; and, on a real Valkey
(the embedded server, the run's own ACL user), what KEDA's redis-streams lag trigger reads.

No API server and no KEDA operator: what a live HPA does with the metric is KEDA's and
Kubernetes' documented behaviour, not exercised here (docs/eks.md).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from moerl.config import config_from_json, parse_config
from moerl.errors import ConfigError
from moerl.launch import fleet, objects
from moerl.launch.podsecrets import (
    VALKEY_SCALER_KEYS,
    VALKEY_SECRET_KEYS,
    run_secret_name,
    scaler_secret_name,
)
from moerl.launch.runsecret import run_secret_body, scaler_secret_body
from moerl.launch.task import launch_env
from tests.unit.test_launch import K8S_VERSION, NS, RFC1035, RUN, _crd_schema, _env

ROOT = Path(__file__).resolve().parents[2]
OTHER_RUN = "ffeeddccbbaa99887766554433221100"
VALKEY = "redis://moerl-valkey.moerl.svc:6379/0"


def _cfg(workers=2, lo=1, hi=8, **over) -> object:
    doc = {
        "checkpoint": {"uri": "s3://moerl-ckpt/prod"},
        "pipeline": {"base_image": "registry.example/moerl:1", "mode": "async"},
        "valkey": {"url": VALKEY, "username": "moerl"},
        "task": {"prompts_per_iteration": 64},
        "units": {"max_prompts": 8},
        "rollout": {
            "device": "cuda",
            "workers": workers,
            "min_workers": lo,
            "max_workers": hi,
            "grace_seconds": 90,
            "fleet_interval_s": 2.5,
            "fleet_scale_down_after_s": 45.5,
        },
        "cluster": {
            "launch": {
                "mode": "kubernetes",
                "service_account": "moerl-worker",
                "gpus_per_node": 8,
                "efa_per_node": 16,
            }
        },
    }
    for section, values in over.items():
        doc.setdefault(section, {}).update(values)
    return parse_config(doc)


@pytest.fixture(scope="module")
def scaledobject_schema() -> dict:
    return _crd_schema("keda.sh_scaledobjects.v2.20.2.yaml.gz", "v1alpha1")


@pytest.fixture(scope="module")
def triggerauth_schema() -> dict:
    return _crd_schema("keda.sh_triggerauthentications.v2.20.2.yaml.gz", "v1alpha1")


def _objs(cfg=None, run_id=RUN, **kw) -> dict[str, dict]:
    env = launch_env(cfg or _cfg(), fleet.STAGE, environ={"AWS_REGION": "us-east-2"})
    return {o["kind"]: o for o in fleet.fleet_objects(cfg or _cfg(), run_id, NS, env=env, **kw)}


def _pod(dep: dict, name: str = "p") -> dict:
    tpl = dep["spec"]["template"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, **tpl["metadata"]},
        "spec": tpl["spec"],
    }


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


# ---- the objects against their schemas -----------------------------------------------------------


def test_every_fleet_object_validates_strictly(scaledobject_schema, triggerauth_schema):
    objs = _objs()
    assert list(objs) == [
        "Deployment",
        "Role",
        "RoleBinding",
        "TriggerAuthentication",
        "ScaledObject",
    ]
    for kind in ("Deployment", "Role", "RoleBinding"):
        assert kubernetes_validate.validate(objs[kind], K8S_VERSION, strict=True), kind
    # the pod template as a Pod too: strict on every pod field
    assert kubernetes_validate.validate(_pod(objs["Deployment"]), K8S_VERSION, strict=True)
    jsonschema.Draft7Validator(scaledobject_schema).validate(objs["ScaledObject"])
    jsonschema.Draft7Validator(triggerauth_schema).validate(objs["TriggerAuthentication"])
    # one name for all: a DNS label with room for the pods the ReplicaSet derives from it
    names = {o["metadata"]["name"] for o in objs.values()}
    (name,) = names
    assert RFC1035.match(name) and len(f"{name}-0123456789-abcde") <= 63
    assert fleet.fleet_name(RUN) != fleet.fleet_name(RUN)  # a retried launcher never collides


def test_strict_schemas_catch_a_misspelled_keda_field(scaledobject_schema, triggerauth_schema):
    so = _objs()["ScaledObject"]
    bad = copy.deepcopy(so)
    bad["spec"]["minReplicas"] = bad["spec"].pop("minReplicaCount")
    with pytest.raises(jsonschema.ValidationError, match="minReplicas"):
        jsonschema.Draft7Validator(scaledobject_schema).validate(bad)
    bad = copy.deepcopy(so)
    bad["spec"]["triggers"][0]["authRef"] = bad["spec"]["triggers"][0].pop("authenticationRef")
    with pytest.raises(jsonschema.ValidationError, match="authRef"):
        jsonschema.Draft7Validator(scaledobject_schema).validate(bad)
    ta = copy.deepcopy(_objs()["TriggerAuthentication"])
    ta["spec"]["secretTargetRef"][0]["secret"] = ta["spec"]["secretTargetRef"][0].pop("name")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(triggerauth_schema).validate(ta)


# ---- the Deployment: the rollout pod's spec, one worker per pod --------------------------------


def test_the_deployment_runs_the_rollout_pods_spec_one_worker_named_after_its_pod():
    cfg = _cfg(workers=3, lo=2, hi=6)
    owner = {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": "task",
        "uid": "u",
        "blockOwnerDeletion": False,
        "controller": False,
    }
    dep = _objs(cfg, owner=owner)["Deployment"]
    assert dep["spec"]["replicas"] == 3  # rollout.workers: the fleet's start
    assert dep["metadata"]["ownerReferences"] == [owner]  # goes with the launching task's pod
    spec = dep["spec"]["template"]["spec"]
    ref = objects.rollout_pod(cfg, RUN, "rollout-0", ["true"], [], engines=1)["spec"]
    for k in (
        "nodeSelector",
        "tolerations",
        "securityContext",
        "automountServiceAccountToken",
        "enableServiceLinks",
        "serviceAccountName",
        "priorityClassName",
        "terminationGracePeriodSeconds",
    ):
        assert spec[k] == ref[k], k
    # a Deployment's pods restart in place; a ReplicaSet refuses activeDeadlineSeconds
    assert spec["restartPolicy"] == "Always" and "activeDeadlineSeconds" not in spec
    # the drain fits in the grace period: rollout.grace_seconds plus the publish margin
    assert spec["terminationGracePeriodSeconds"] == 90 + objects.GRACE_MARGIN_S
    assert spec["serviceAccountName"] == "moerl-rollout"
    (c,) = spec["containers"]
    (rc,) = ref["containers"]
    for k in ("image", "securityContext", "workingDir", "terminationMessagePolicy"):
        assert c[k] == rc[k], k
    # one engine's GPUs (TP x DP = 1 here) and the node's EFA devices in proportion
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert c["resources"] == objects.resources(cfg, objects.rollout_gpus(cfg, 1))
    # the pod's Secret volumes as a launched worker's, plus the config from the annotation
    assert [v for v in spec["volumes"] if v["name"] != "moerl-config"] == ref["volumes"]
    # its consumer name: rollout-<the pod's own name>, expanded by the kubelet into the command
    # (the run's counters and controllers count workers by the `rollout` prefix)
    env = _env(c)
    assert env[fleet.ENV_POD_NAME] == {"fieldRef": {"fieldPath": "metadata.name"}}
    i = c["command"].index("--name")
    assert c["command"][i + 1] == f"rollout-$({fleet.ENV_POD_NAME})"
    names = [e["name"] for e in c["env"]]
    assert names.index(fleet.ENV_POD_NAME) >= 0 and len(set(names)) == len(names)
    assert c["command"][:3] == ["python", "-m", "moerl.components.rollout.worker"]
    assert c["command"][c["command"].index("--run-id") + 1] == RUN
    # Valkey credentials as files of the run's own Secret; the region passed on; no values
    assert env["VALKEY_PASSWORD_FILE"].endswith("/moerl-run/VALKEY_PASSWORD")
    assert env["AWS_REGION"] == "us-east-2"
    secret_vols = [v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v]
    assert run_secret_name(RUN) in secret_vols
    # the config file is the run's config, from the pod template's annotation
    (cfg_vol,) = [v for v in spec["volumes"] if v["name"] == "moerl-config"]
    (item,) = cfg_vol["downwardAPI"]["items"]
    key = item["fieldRef"]["fieldPath"].split("'")[1]
    path = f"{fleet.CONFIG_DIR}/{item['path']}"
    assert c["command"][c["command"].index("--config") + 1] == path
    assert {"name": "moerl-config", "mountPath": fleet.CONFIG_DIR, "readOnly": True} in c[
        "volumeMounts"
    ]
    text = dep["spec"]["template"]["metadata"]["annotations"][key]
    assert config_from_json(text) == cfg
    assert len(text.encode()) < 256 * 1024  # the API server's limit on a pod's annotations


def test_the_deployment_and_the_scaledobject_select_only_this_runs_fleet_pods():
    objs = _objs()
    dep, so = objs["Deployment"], objs["ScaledObject"]
    name = dep["metadata"]["name"]
    sel = dep["spec"]["selector"]
    tpl_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert _selects(sel, tpl_labels)  # the API server refuses a selector its template misses
    assert sel["matchLabels"] == fleet.selector(RUN, name)
    # the fan-out's and Valkey's NetworkPolicies admit the pods by these
    assert tpl_labels[objects.LABEL_GROUP] == "rollout"
    assert tpl_labels[objects.LABEL_MANAGED] == "moerl"
    # not this run's other rollout pods, not another fleet of this run, not another run's
    cfg = _cfg()
    fixed = objects.rollout_pod(cfg, RUN, "rollout-0", ["true"], [])
    again = _objs()["Deployment"]
    other = _objs(run_id=OTHER_RUN)["Deployment"]
    for pod_labels in (
        fixed["metadata"]["labels"],
        again["spec"]["template"]["metadata"]["labels"],
        other["spec"]["template"]["metadata"]["labels"],
    ):
        assert not _selects(sel, pod_labels)
    # the ScaledObject scales exactly this Deployment, with this fleet's credentials
    assert so["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": name,
    }
    assert so["spec"]["triggers"][0]["authenticationRef"] == {"name": name}
    assert objs["TriggerAuthentication"]["metadata"]["name"] == name


# ---- the ScaledObject: bounds, lagCount, timing ---------------------------------------------------


@pytest.mark.parametrize(("workers", "lo", "hi"), [(2, 1, 8), (4, 4, 16), (1, 1, 3)])
def test_the_scaledobject_scales_within_the_bounds_on_the_units_lag(workers, lo, hi):
    cfg = _cfg(workers=workers, lo=lo, hi=hi)
    so = _objs(cfg)["ScaledObject"]["spec"]
    assert (so["minReplicaCount"], so["maxReplicaCount"]) == cfg.rollout.fleet_bounds == (lo, hi)
    t, busy = so["triggers"]
    assert (t["type"], t["metricType"]) == ("redis-streams", "AverageValue")
    # the busy floor: the units leased and not done, units_in_flight per worker (XPENDING)
    assert busy["type"] == "redis-streams" and busy["metadata"]["pendingEntriesCount"] == str(
        cfg.rollout.units_in_flight
    )
    assert "lagCount" not in busy["metadata"]
    assert {k: busy["metadata"][k] for k in ("stream", "consumerGroup", "address")} == {
        k: t["metadata"][k] for k in ("stream", "consumerGroup", "address")
    }
    assert busy["authenticationRef"] == t["authenticationRef"]
    m = t["metadata"]
    # the consumer group's lag on the run's units stream (lagCount set: KEDA reads XINFO GROUPS)
    assert m["stream"] == f"moerl:{RUN}:units" and m["consumerGroup"] == "rollout"
    assert m["address"] == "moerl-valkey.moerl.svc:6379"
    assert "databaseIndex" not in m and "enableTLS" not in m  # db 0, plain TCP
    # default lagCount: one version's units (64 prompts / 8 per unit)
    assert m["lagCount"] == "8" == str(fleet.default_lag_count(cfg))
    # every metadata value is a string (the CRD's map of strings)
    assert all(isinstance(v, str) for v in m.values())
    # fleet_interval_s 2.5 -> a 3 s poll; fleet_scale_down_after_s 45.5 -> 46 s, up at once
    assert so["pollingInterval"] == 3 and so["cooldownPeriod"] == 46
    behavior = so["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior == {
        "scaleUp": {"stabilizationWindowSeconds": 0},
        "scaleDown": {"stabilizationWindowSeconds": 46},
    }


def test_a_measured_lag_count_replaces_the_default_and_the_controller_patch_sets_it():
    so = _objs(lag_count=37)["ScaledObject"]
    assert so["spec"]["triggers"][0]["metadata"]["lagCount"] == "37"
    assert _objs(lag_count=0)["ScaledObject"]["spec"]["triggers"][0]["metadata"]["lagCount"] == "1"
    # the controller's JSON patch: the path exists, and applied it sets only lagCount
    (op,) = fleet.lag_count_patch(12)
    assert op["op"] == "replace"
    keys = op["path"].strip("/").split("/")
    node = so
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]
    assert keys[-1] in node
    before = copy.deepcopy(so)
    node[keys[-1]] = op["value"]
    assert so["spec"]["triggers"][0]["metadata"]["lagCount"] == "12"
    before["spec"]["triggers"][0]["metadata"]["lagCount"] = "12"
    assert so == before
    assert fleet.scale_patch(5) == {"spec": {"replicas": 5}}


def test_kedas_rule_adds_a_worker_only_for_a_backlog_longer_than_a_load_time():
    """KEDA's AverageValue target: desired = ceil(lag / lagCount), clamped to the bounds. With
    lagCount = units one worker drains in one load time, a backlog one worker clears within a
    load time never asks for a second worker."""
    per = 10  # units one worker drains in one engine load time, as the controller measures it
    so = _objs(lag_count=per)["ScaledObject"]["spec"]
    lo, hi = so["minReplicaCount"], so["maxReplicaCount"]
    target = int(so["triggers"][0]["metadata"]["lagCount"])

    def desired(lag: int) -> int:
        return min(hi, max(lo, math.ceil(lag / target)))

    assert [desired(lag) for lag in (0, 1, per, per + 1, 3 * per, 1000)] == [1, 1, 1, 2, 3, 8]


def test_the_valkey_url_sets_the_address_database_and_tls():
    cfg = _cfg(valkey={"url": "rediss://valkey.cache.example:6380/2"})
    m = _objs(cfg)["ScaledObject"]["spec"]["triggers"][0]["metadata"]
    assert (m["address"], m["databaseIndex"], m["enableTLS"]) == (
        "valkey.cache.example:6380",
        "2",
        "true",
    )
    bad = _cfg(valkey={"url": "redis://h:6379/x"})  # the config takes it; KEDA could not
    with pytest.raises(ConfigError, match="valkey.url .*database index"):
        fleet.fleet_objects(bad, RUN, NS, env=[])


# ---- credentials and RBAC -------------------------------------------------------------------------


def test_the_trigger_reads_the_runs_scaler_secret_by_reference_never_inlined():
    """KEDA's keys live in their own Secret, which no pod mounts: a KFP task mounts the run's
    Secret whole (kfp-kubernetes has no `items`), so there they would reach every async task."""
    objs = _objs()
    ta = objs["TriggerAuthentication"]["spec"]
    assert ta == {
        "secretTargetRef": [
            {
                "parameter": "username",
                "name": scaler_secret_name(RUN),
                "key": "VALKEY_SCALER_USERNAME",
            },
            {
                "parameter": "password",
                "name": scaler_secret_name(RUN),
                "key": "VALKEY_SCALER_PASSWORD",
            },
        ]
    }
    assert scaler_secret_name(RUN) != run_secret_name(RUN)
    # the keys each Secret holds (moerl/launch/runsecret.py): the run's has no scaler key
    body = run_secret_body(RUN, "moerl-run-x", "s3cr3t-value")
    scaler = scaler_secret_body(RUN, "moerl-run-x-scaler", "s3cr3t-2")
    assert {r["key"] for r in ta["secretTargetRef"]} == set(VALKEY_SCALER_KEYS)
    assert set(body["data"]) == set(VALKEY_SECRET_KEYS)
    assert set(scaler["data"]) == set(VALKEY_SCALER_KEYS)
    assert scaler["metadata"]["name"] == scaler_secret_name(RUN)
    text = json.dumps(list(objs.values()))
    assert "s3cr3t" not in text and '"password":' not in text.replace(" ", "")
    m = objs["ScaledObject"]["spec"]["triggers"][0]["metadata"]
    assert not {"password", "username", "passwordFromEnv", "usernameFromEnv"} & set(m)


def test_the_per_run_role_lets_the_trainer_scale_only_this_fleet():
    objs = _objs()
    name = objs["Deployment"]["metadata"]["name"]
    role, binding = objs["Role"], objs["RoleBinding"]
    assert role["rules"] == [
        {
            "apiGroups": ["apps"],
            "resources": ["deployments/scale"],
            "resourceNames": [name],
            "verbs": ["get", "patch"],
        },
        {
            "apiGroups": ["keda.sh"],
            "resources": ["scaledobjects"],
            "resourceNames": [name],
            "verbs": ["get", "patch"],
        },
    ]
    # every rule names only this fleet's objects: no create, list, delete, no other resource
    for rule in role["rules"]:
        assert rule["resourceNames"] == [name] and set(rule["verbs"]) <= {"get", "patch"}
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    # the run's own trainer account, named as the fleet: not the account every run's trainer
    # shares (cluster.launch.service_account), so no other run's controller may patch this fleet
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": NS}]


def test_without_keda_the_fleet_is_the_deployment_and_the_scale_role_only():
    objs = _objs(keda=False)
    assert list(objs) == ["Deployment", "Role", "RoleBinding"]
    name = objs["Deployment"]["metadata"]["name"]
    assert objs["Role"]["rules"] == [
        {
            "apiGroups": ["apps"],
            "resources": ["deployments/scale"],
            "resourceNames": [name],
            "verbs": ["get", "patch"],
        }
    ]
    assert kubernetes_validate.validate(objs["Role"], K8S_VERSION, strict=True)


def test_the_launchers_role_may_create_the_fleet_and_grant_its_per_run_role():
    """manifests/base/rbac.yaml: create (and for the Deployment get/list/delete, as the other
    launched workloads) on every kind the fleet is; and every verb the per-run Role grants,
    which Kubernetes requires of whoever creates a Role (no escalation)."""
    docs = list(yaml.safe_load_all((ROOT / "manifests" / "base" / "rbac.yaml").read_text()))
    (role,) = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "moerl-launcher"]
    held = {
        (g, r): set(rule["verbs"])
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
    }
    plural = {
        "Deployment": ("apps", "deployments"),
        "Role": ("rbac.authorization.k8s.io", "roles"),
        "RoleBinding": ("rbac.authorization.k8s.io", "rolebindings"),
        "TriggerAuthentication": ("keda.sh", "triggerauthentications"),
        "ScaledObject": ("keda.sh", "scaledobjects"),
    }
    objs = _objs()
    for kind in objs:
        assert "create" in held[plural[kind]], kind
    assert {"get", "list", "delete"} <= held[("apps", "deployments")]
    for rule in objs["Role"]["rules"]:
        for g in rule["apiGroups"]:
            for r in rule["resources"]:
                assert set(rule["verbs"]) <= held[(g, r)], (g, r)


# ---- what the fleet cannot be ---------------------------------------------------------------------


def test_a_fixed_fleet_or_engines_across_nodes_are_refused():
    with pytest.raises(ConfigError, match="not elastic"):
        fleet.fleet_objects(_cfg(workers=2, lo=2, hi=2), RUN, NS, env=[])
    cfg = _cfg(cluster={"launch": {"mode": "kubernetes", "rollout_nodes_per_worker": 2}})
    with pytest.raises(ConfigError, match="rollout_nodes_per_worker"):
        fleet.fleet_objects(cfg, RUN, NS, env=[])


# ---- what KEDA's redis-streams lag trigger reads, on a real Valkey --------------------------------


def _kedas_lag(r, stream: str, group: str) -> int:
    """The calls KEDA v2.20.2's redis-streams scaler makes with lagCount set
    (pkg/scalers/redis_streams_scaler.go, lagFactor): INFO for redis_version >= 7, XINFO GROUPS
    for the group's lag; XLEN when the group does not exist yet; 0 when the stream does not."""
    info = r.execute_command("INFO")
    version = info["redis_version"] if isinstance(info, dict) else None
    assert version and int(str(version).split(".")[0]) >= 7, version
    try:
        groups = r.xinfo_groups(stream)
    except Exception as e:  # noqa: BLE001 (KEDA's own test: the message)
        if str(e) == "no such key":
            return 0
        raise
    for g in groups:
        if g["name"] == group:
            return int(g["lag"])
    return int(r.xlen(stream))


@pytest.fixture
def run_bus(tmp_path):
    """A real Valkey, the run's own ACL user (as start_run makes it), and the run's bus."""
    from moerl.bus.client import EmbeddedValkey, connect, create_run_user
    from moerl.bus.run import RunBus

    server = EmbeddedValkey(tmp_path / "valkey", appendonly=False).start()
    try:
        user, password = create_run_user(connect(server.url), RUN)
        bus = RunBus(connect(server.url, username=user, password=password), RUN)
        yield server, user, password, bus
    finally:
        server.stop()


def test_the_trigger_names_the_streams_and_group_the_workers_lease_from(run_bus):
    """The lag of consumer group `rollout` on the stream the ScaledObject names is the number
    of units issued and not yet leased (`RunBus.units_waiting`), through leases and a requeue."""
    import valkey

    server, _user, _password, bus = run_bus
    m = _objs()["ScaledObject"]["spec"]["triggers"][0]["metadata"]
    assert m["stream"] == bus.key("units") == fleet.units_stream(RUN)
    admin = valkey.Valkey.from_url(server.url, decode_responses=True)
    bus.ensure_groups()
    assert m["consumerGroup"] in {g["name"] for g in admin.xinfo_groups(m["stream"])}
    for i in range(5):
        bus.issue_unit([{"prompt_id": f"p{i}", "text": "x"}])
    leases = [bus.lease_unit("w1"), bus.lease_unit("w2")]
    (g,) = [g for g in admin.xinfo_groups(m["stream"]) if g["name"] == m["consumerGroup"]]
    assert g["lag"] == bus.units_waiting() == 3
    bus.requeue_unit(leases[0], [0])  # back on the queue: lag grows by one
    (g,) = [g for g in admin.xinfo_groups(m["stream"]) if g["name"] == m["consumerGroup"]]
    assert g["lag"] == bus.units_waiting() == 4


def test_the_runs_scaler_user_reads_what_kedas_lag_trigger_reads_and_nothing_else(run_bus):
    """KEDA reads as the run's scaler user (`create_scaler_user`, the Secret's VALKEY_SCALER_*):
    INFO and the units stream's groups, read-only; the stages' own user still may not run INFO
    (tests/bus/test_bus.py), and the scaler may neither write nor read another key or run."""
    import valkey

    from moerl.bus.client import connect, create_scaler_user

    server, user, password, bus = run_bus
    bus.ensure_groups()
    bus.issue_unit([{"prompt_id": "p0", "text": "x"}])
    s_user, s_password = create_scaler_user(connect(server.url), RUN)
    r = valkey.Valkey.from_url(
        server.url, username=s_user, password=s_password, decode_responses=True
    )
    assert _kedas_lag(r, fleet.units_stream(RUN), "rollout") == bus.units_waiting() == 1
    for cmd in (
        ("XADD", fleet.units_stream(RUN), "*", "k", "v"),
        ("XREADGROUP", "GROUP", "rollout", "x", "STREAMS", fleet.units_stream(RUN), ">"),
        ("GET", f"moerl:{RUN}:registry"),
        ("XINFO", "GROUPS", f"moerl:{RUN}:scored"),
        ("XINFO", "GROUPS", "moerl:another-run:units"),
        ("KEYS", "*"),
        ("CONFIG", "GET", "*"),
        ("FLUSHALL",),
    ):
        with pytest.raises(valkey.exceptions.NoPermissionError):
            r.execute_command(*cmd)
    mine = valkey.Valkey.from_url(server.url, username=user, password=password)
    with pytest.raises(valkey.exceptions.NoPermissionError):
        mine.execute_command("INFO")


# ---- admission: what the pipeline's account may create is the fleet, and only it -----------------

PIPELINE = "system:serviceaccount:moerl:moerl-launcher"  # the account that creates the fleet


def _policies() -> dict[str, dict]:
    from tests.launch.admission import policies

    return policies()


def _refused(policy: dict, obj: dict, resource: str, user: str = PIPELINE) -> list[str] | None:
    """The messages of `policy`'s failed validations for creating `obj` (a `resource`) as
    `user`, evaluated with cel-python as the API server evaluates them; None: not matched."""
    from tests.launch.admission import refused

    return refused(policy, obj, resource, user, namespace=NS)


def test_admission_lets_the_pipeline_create_the_fleet_and_refuses_anything_broader():
    pols = _policies()
    fleets, pods = pols["moerl-launched-fleets"], pols["moerl-launched-pods"]
    objs = _objs()
    plural = {"Deployment": "deployments", "Role": "roles", "RoleBinding": "rolebindings"}
    for kind, resource in plural.items():
        assert _refused(fleets, objs[kind], resource) == [], kind
        assert _refused(fleets, objs[kind], resource, "system:serviceaccount:kube-system:x") is None
    # the fleet's pods, as the ReplicaSet controller creates them, pass the pods' policy
    pod = _pod(objs["Deployment"])
    assert (
        _refused(pods, pod, "pods", "system:serviceaccount:kube-system:replicaset-controller") == []
    )
    # a Deployment whose pods would escape the pods' policy (no managed-by label) is refused
    bare = copy.deepcopy(objs["Deployment"])
    del bare["spec"]["template"]["metadata"]["labels"][objects.LABEL_MANAGED]
    assert len(_refused(fleets, bare, "deployments")) == 1
    # a Role broader than one fleet's scale and ScaledObject, by name
    name = objs["Role"]["metadata"]["name"]
    assert name.startswith("moerl-rollout-worker-fleet-")
    for rule in (
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": [name], "verbs": ["get"]},
        {"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": ["patch"]},
        {
            "apiGroups": ["apps"],
            "resources": ["deployments/scale"],
            "resourceNames": [name],
            "verbs": ["create"],
        },
        {
            "apiGroups": ["apps"],
            "resources": ["deployments/scale"],
            "resourceNames": ["moerl-valkey"],
            "verbs": ["patch"],
        },
    ):
        broad = copy.deepcopy(objs["Role"])
        broad["rules"].append(rule)
        assert len(_refused(fleets, broad, "roles")) == 1, rule
    # a RoleBinding of another Role (the launcher's own), or to another namespace's account
    other = copy.deepcopy(objs["RoleBinding"])
    other["roleRef"]["name"] = "moerl-launcher"
    assert len(_refused(fleets, other, "rolebindings")) == 1
    other = copy.deepcopy(objs["RoleBinding"])
    other["roleRef"]["kind"] = "ClusterRole"
    assert len(_refused(fleets, other, "rolebindings")) == 1
    other = copy.deepcopy(objs["RoleBinding"])
    other["subjects"][0]["namespace"] = "kube-system"
    assert len(_refused(fleets, other, "rolebindings")) == 1


def test_the_keda_schemas_are_recorded_with_their_source_and_digest():
    import gzip
    import hashlib

    data = ROOT / "tests" / "data" / "k8s"
    notice = (data / "NOTICE").read_text()
    for f in (
        "keda.sh_scaledobjects.v2.20.2.yaml.gz",
        "keda.sh_triggerauthentications.v2.20.2.yaml.gz",
    ):
        digest = hashlib.sha256(gzip.decompress((data / f).read_bytes())).hexdigest()
        block = notice.split(f + "\n", 1)[1].split("\n\n", 1)[0]
        assert digest in block and "v2.20.2" in block and "Apache License 2.0" in block, f


# ---- manifests: KEDA's install, pinned, and its way to Valkey --------------------------------------


def test_keda_is_pinned_and_its_operator_alone_reaches_valkey_in_the_keda_overlay():
    from tests.launch.test_manifests import MANIFESTS, _build

    k = yaml.safe_load((MANIFESTS / "install" / "keda" / "kustomization.yaml").read_text())
    assert k["resources"] == [
        "https://github.com/kedacore/keda/releases/download/v2.20.2/keda-2.20.2.yaml"
    ]
    objs = _build(MANIFESTS / "overlays" / "prod-keda")
    sts = next(
        o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "moerl-valkey"
    )
    valkey_labels = sts["spec"]["template"]["metadata"]["labels"]
    admitting = [
        o
        for o in objs
        if o["kind"] == "NetworkPolicy" and _selects(o["spec"]["podSelector"], valkey_labels)
    ]
    keda = {"namespace": {"kubernetes.io/metadata.name": "keda"}, "pod": {"app": "keda-operator"}}

    def admits(pol: dict, ns: dict, pod: dict) -> bool:
        for rule in pol["spec"]["ingress"]:
            if {"protocol": "TCP", "port": 6379} not in rule["ports"]:
                continue
            for peer in rule["from"]:
                ns_ok = (
                    _selects(peer["namespaceSelector"], ns)
                    if "namespaceSelector" in peer
                    else ns == {"kubernetes.io/metadata.name": "moerl"}
                )
                if ns_ok and _selects(peer.get("podSelector", {"matchLabels": {}}), pod):
                    return True
        return False

    assert any(admits(p, keda["namespace"], keda["pod"]) for p in admitting)
    # not another pod of KEDA's namespace, nor that label in another namespace
    other_ns = {"kubernetes.io/metadata.name": "default"}
    assert not any(
        admits(p, keda["namespace"], {"app": "keda-metrics-apiserver"}) for p in admitting
    )
    assert not any(admits(p, other_ns, keda["pod"]) for p in admitting)
    # prod itself has no such policy: without KEDA nothing outside moerl reaches Valkey
    prod = _build(MANIFESTS / "overlays" / "prod")
    assert "moerl-valkey-from-keda" not in {o["metadata"]["name"] for o in prod}


# ---- the launcher: the fleet beside the trainer, deleted with it (replayed API responses) --------

DEP_PATH = f"/apis/apps/v1/namespaces/{NS}/deployments"
ROLE_PATH = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/roles"
BINDING_PATH = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/rolebindings"
TA_PATH = f"/apis/keda.sh/v1alpha1/namespaces/{NS}/triggerauthentications"
SO_PATH = f"/apis/keda.sh/v1alpha1/namespaces/{NS}/scaledobjects"
DEP_UID = "9f8e7d6c-5b4a-4392-8170-6f5e4d3c2b1a"


def _fleet_workload(api, **kw):
    from moerl.launch.watch import workload

    dep, *owned = fleet.fleet_objects(_cfg(), RUN, NS, env=[], **kw)
    return workload(api, NS, dep, owned), dep


def test_the_trainers_launcher_creates_the_fleet_beside_it_and_deletes_it_with_it():
    from moerl.launch.watch import Launcher
    from tests.unit.test_launch import TJ, TJ_PATH, Clock, _api, _trainjob_workload, tj

    name = fleet.fleet_name(RUN, suffix="abcde")
    api, replay = _api(
        [
            tj("POST", "trainjob_created", 201),
            (
                "POST",
                DEP_PATH,
                201,
                {"kind": "Deployment", "metadata": {"name": name, "uid": DEP_UID}},
            ),
            ("POST", ROLE_PATH, 201, {"kind": "Role"}),
            ("POST", BINDING_PATH, 201, {"kind": "RoleBinding"}),
            ("POST", TA_PATH, 201, {"kind": "TriggerAuthentication"}),
            ("POST", SO_PATH, 201, {"kind": "ScaledObject"}),
            tj("GET", "trainjob_complete"),
            tj("DELETE", "deleted_trainjob"),
            ("DELETE", f"{DEP_PATH}/{name}", 200, {"kind": "Status"}),
        ]
    )
    w, dep = _fleet_workload(api, name=name)
    clock = Clock()
    Launcher(5.0, 3600, clock, clock.sleep).run([_trainjob_workload(api)], companions=[w])
    assert w.keda is True and not replay.script
    sent = {path: body for m, path, _, body in replay.calls if m == "POST"}
    assert sent[DEP_PATH] == dep  # the Deployment as built; owned by the task's pod, if any
    owner = fleet.deployment_owner(name, DEP_UID)
    for path, kind in (
        (ROLE_PATH, "Role"),
        (BINDING_PATH, "RoleBinding"),
        (TA_PATH, "TriggerAuthentication"),
        (SO_PATH, "ScaledObject"),
    ):
        assert sent[path]["kind"] == kind
        # owned by the Deployment: the garbage collector deletes them with it
        assert sent[path]["metadata"]["ownerReferences"] == [owner], kind
    # the trainer first, then the fleet; nothing else (what the fleet owns goes with it)
    assert replay.deletes() == [
        (f"{TJ_PATH}/{TJ}", {"propagationPolicy": "Background"}),
        (f"{DEP_PATH}/{name}", {"propagationPolicy": "Background"}),
    ]


def test_without_keda_the_fleet_is_launched_for_the_controller_to_scale(caplog):
    from moerl.launch.watch import Launcher
    from tests.unit.test_launch import Clock, _api, _trainjob_workload, tj

    name = fleet.fleet_name(RUN, suffix="abcde")
    missing = {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404}
    api, replay = _api(
        [
            tj("POST", "trainjob_created", 201),
            (
                "POST",
                DEP_PATH,
                201,
                {"kind": "Deployment", "metadata": {"name": name, "uid": DEP_UID}},
            ),
            ("POST", ROLE_PATH, 201, {"kind": "Role"}),
            ("POST", BINDING_PATH, 201, {"kind": "RoleBinding"}),
            ("POST", TA_PATH, 404, missing),  # KEDA is not installed: no ScaledObject either
            tj("GET", "trainjob_complete"),
            tj("DELETE", "deleted_trainjob"),
            ("DELETE", f"{DEP_PATH}/{name}", 200, {"kind": "Status"}),
        ]
    )
    w, _ = _fleet_workload(api, name=name)
    clock = Clock()
    Launcher(5.0, 3600, clock, clock.sleep).run([_trainjob_workload(api)], companions=[w])
    assert w.keda is False and not replay.script
    assert "KEDA's API (keda.sh/v1alpha1) is not installed" in caplog.text


def test_a_fleet_object_the_task_may_not_create_fails_the_launch_and_deletes_everything():
    from moerl.launch.watch import Launcher, LaunchError
    from tests.unit.test_launch import TJ, TJ_PATH, Clock, _api, _trainjob_workload, tj

    name = fleet.fleet_name(RUN, suffix="abcde")
    forbidden = {"kind": "Status", "status": "Failure", "message": "forbidden", "code": 403}
    api, replay = _api(
        [
            tj("POST", "trainjob_created", 201),
            (
                "POST",
                DEP_PATH,
                201,
                {"kind": "Deployment", "metadata": {"name": name, "uid": DEP_UID}},
            ),
            ("POST", ROLE_PATH, 403, forbidden),
            tj("DELETE", "deleted_trainjob"),
            ("DELETE", f"{DEP_PATH}/{name}", 200, {"kind": "Status"}),
        ]
    )
    w, _ = _fleet_workload(api, name=name)
    clock = Clock()
    with pytest.raises(LaunchError, match=r"needs create on Roles .*manifests/base/rbac.yaml"):
        Launcher(5.0, 3600, clock, clock.sleep).run([_trainjob_workload(api)], companions=[w])
    assert [p for p, _ in replay.deletes()] == [f"{TJ_PATH}/{TJ}", f"{DEP_PATH}/{name}"]


def test_the_trainers_launch_builds_the_fleet_with_the_runs_accounts_and_checks_it_first(
    monkeypatch,
):
    from moerl.launch.task import check_launchable, fleet_workload

    monkeypatch.setenv("KFP_POD_NAME", "trainer-task")
    monkeypatch.setenv("KFP_POD_UID", "uid-7")
    monkeypatch.setenv("MOERL_POD_NAMESPACE", NS)
    w = fleet_workload(_cfg(), RUN, NS, api=None)
    assert w.kind == "Deployment" and [o["kind"] for o in w.owned] == [
        "Role",
        "RoleBinding",
        "TriggerAuthentication",
        "ScaledObject",
    ]
    spec = w.body["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == "moerl-rollout"  # the rollout pods' own account
    (binding,) = [o for o in w.owned if o["kind"] == "RoleBinding"]
    assert binding["subjects"][0]["name"] == w.body["metadata"]["name"]  # the run's trainer
    assert w.body["metadata"]["ownerReferences"][0]["name"] == "trainer-task"
    # the trainer's stage refuses a fleet that cannot be built, before anything is uploaded
    check_launchable(_cfg(), "async_trainer")
    bad = _cfg(valkey={"url": "redis://h:6379/x"})
    with pytest.raises(ConfigError, match="valkey.url"):
        check_launchable(bad, "async_trainer")
    # a fixed fleet: nothing of the fleet is checked (its workers launch one pod each)
    check_launchable(
        _cfg(workers=2, lo=2, hi=2, valkey={"url": "redis://h:6379/x"}), "async_trainer"
    )


def test_only_an_elastic_runs_async_trainer_gets_a_projected_api_token():
    """Its controller patches its own fleet (the per-run Role above); no other stage and no
    fixed-fleet trainer gets a token. The trainer's pod, token volume included, validates as a
    Pod against Kubernetes' schema."""
    from moerl.launch import objects

    def pod_of(cfg, stage):
        tj = objects.trainjob(cfg, RUN, "tj", ["python"], [], stage=stage)
        (rjob,) = tj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
            "replicatedJobs"
        ]
        spec = rjob["template"]["spec"]["template"]["spec"]
        spec["containers"][0] |= {"image": "moerl", "command": ["python"]}
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": spec}

    elastic = pod_of(_cfg(), "async_trainer")
    vols = {v["name"]: v for v in elastic["spec"]["volumes"]}
    token = vols[objects.API_TOKEN]["projected"]["sources"]
    assert token[0]["serviceAccountToken"]["expirationSeconds"] <= 3600
    (mount,) = [
        m
        for m in elastic["spec"]["containers"][0]["volumeMounts"]
        if m["name"] == objects.API_TOKEN
    ]
    assert mount["mountPath"] == objects.API_TOKEN_DIR and mount["readOnly"]
    assert kubernetes_validate.validate(elastic, K8S_VERSION, strict=True)
    for cfg, stage in ((_cfg(), "policy_update"), (_cfg(lo=2, hi=2), "async_trainer")):
        names = {v["name"] for v in pod_of(cfg, stage)["spec"]["volumes"]}
        assert objects.API_TOKEN not in names, stage


def test_the_trainer_is_told_the_name_of_the_fleet_its_launcher_creates(monkeypatch):
    """The fleet's name carries a random suffix per try: the launcher picks it once, names the
    Deployment with it and gives it to the trainer ($MOERL_FLEET_NAME), whose controller
    (`KubeActuator`) patches exactly that Deployment."""
    from moerl.components.rollout.fleet import KubeActuator
    from moerl.launch.fleet import ENV_FLEET_NAME
    from moerl.launch.task import build, fleet_workload

    monkeypatch.setenv("MOERL_POD_NAMESPACE", NS)
    name = fleet.fleet_name(RUN)
    tj = build(_cfg(), "async_trainer", RUN, "tj", ["python"], None, None, fleet=name)
    (rjob,) = tj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
        "replicatedJobs"
    ]
    envs = [
        c.get("env", []) for c in rjob["template"]["spec"]["template"]["spec"]["containers"]
    ] + [tj["spec"]["trainer"].get("env", [])]
    told = [e["value"] for env in envs for e in env if e["name"] == ENV_FLEET_NAME]
    assert told == [name]
    assert fleet_workload(_cfg(), RUN, NS, api=None, name=name).body["metadata"]["name"] == name
    # cluster.launch.fleet_scaler trainer: no KEDA objects at all, the Role only for the scale
    own = fleet_workload(
        _cfg(cluster={"launch": {"mode": "kubernetes", "fleet_scaler": "trainer"}}),
        RUN,
        NS,
        api=None,
        name=name,
    )
    assert [o["kind"] for o in own.owned] == ["Role", "RoleBinding"]
    monkeypatch.setenv(ENV_FLEET_NAME, name)
    assert KubeActuator(RUN, namespace=NS, apps=object(), custom=object()).name == name
    monkeypatch.delenv(ENV_FLEET_NAME)
    with pytest.raises(ConfigError, match=ENV_FLEET_NAME):
        KubeActuator(RUN, namespace=NS, apps=object(), custom=object())
