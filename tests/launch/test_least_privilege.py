"""Least privilege on the cluster, checked offline: which task pods hold which API token (the
compiled pipelines read back through kfp-kubernetes' protos, and the pods moerl.launch builds),
what the run's and the launcher's accounts may do, the admission policies evaluated in cel-python
on moerl's own objects (admitted) and on each abusive variant (denied), and the sandbox's
Localhost seccomp profile loaded with libseccomp as the container runtime loads it, around the
real `unshare`.

Limitations: no API server, kubelet or containerd here: that the KFP launcher and Argo's
executor need no more than the run account's Role, and that AL2023 nodes allow unprivileged
user namespaces under the profile, is read from their sources and documentation (docs/eks.md).
"""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from moerl.config import RunConfig, parse_config
from moerl.launch import fleet, objects
from moerl.launch.podsecrets import (
    LAUNCHER_TOKEN,
    LAUNCHER_TOKEN_ENV,
    admitted_secret_keys,
    launcher_token_dir,
    scaler_secret_name,
)
from moerl.launch.task import launch_env
from tests.launch.admission import LAUNCHER, NS, policies, refused

ROOT = Path(__file__).resolve().parents[2]
RUN = "0a1b2c3d4e5f60718293a4b5c6d7e8f9"
OTHER = "ffeeddccbbaa99887766554433221100"
K8S_VERSION = "1.37.0"
WORKER = f"system:serviceaccount:{NS}:moerl-worker"
PROFILE = ROOT / "manifests" / "seccomp" / "sandbox.json"


def _cfg(**over: dict) -> RunConfig:
    """Every feature that adds a credential on: Valkey, the cache tier, MLflow; launched."""
    doc: dict[str, dict] = {
        "checkpoint": {
            "uri": "s3://moerl-runs/p",
            "cache_tier": {"uri": "s3://moerl-cache/c", "endpoint_url": "http://cache:8333"},
        },
        "pipeline": {"mode": "async", "base_image": "registry.example/moerl:1"},
        "valkey": {"url": "redis://moerl-valkey.moerl.svc:6379/0", "username": "moerl"},
        "tracking": {"uri": "http://moerl-mlflow.moerl.svc:5000"},
        "rollout": {"workers": 2},
        "cluster": {"launch": {"mode": "kubernetes"}},
    }
    for section, values in over.items():
        doc.setdefault(section, {}).update(values)
    return parse_config(doc)


def _pod(meta: dict, spec: dict) -> dict:
    spec = copy.deepcopy(spec)
    for c in spec["containers"]:
        c.setdefault("image", "registry.example/moerl:1")
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", **meta}, "spec": spec}


def _launched_pods(cfg) -> dict[str, dict]:
    """What moerl.launch makes of every launched stage, as the pods the API server admits."""
    out = {}
    for stage in ("rollout", "rollout_worker"):
        pod = objects.rollout_pod(cfg, RUN, "rollout-0", ["python"], launch_env(cfg, stage, {}))
        out[stage] = pod | {"spec": _pod({}, pod["spec"])["spec"]}
    for stage in ("policy_update", "async_trainer"):
        tj = objects.trainjob(cfg, RUN, "tj", ["python"], launch_env(cfg, stage, {}), stage=stage)
        (rjob,) = tj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
            "replicatedJobs"
        ]
        tpl = rjob["template"]["spec"]["template"]
        out[stage] = _pod(tpl["metadata"], tpl["spec"])
    grouped = _cfg(cluster={"launch": {"mode": "kubernetes", "rollout_nodes_per_worker": 2}})
    js = objects.rollout_group(grouped, RUN, "rollout-1", ["python"], [])
    for job in js["spec"]["replicatedJobs"]:
        tpl = job["template"]["spec"]["template"]
        out[f"group-{job['name']}"] = _pod(tpl["metadata"], tpl["spec"])
    return out


# ---- which task pods hold which token -----------------------------------------------------------


def _compiled_tasks(tmp_path, cfg) -> dict[str, tuple[dict, dict]]:
    """stage -> (its kfp-kubernetes executor config, its container), from the compiled YAML."""
    from google.protobuf import json_format
    from kfp.kubernetes import kubernetes_executor_config_pb2 as kpb

    from moerl.orchestrate.compile import compile_pipeline

    path = compile_pipeline(cfg, tmp_path / "p.yaml", target="eks")
    pipeline_doc, platform_doc = yaml.safe_load_all(path.read_text())
    execs = platform_doc["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    out = {}
    for label, doc in execs.items():
        msg = kpb.KubernetesExecutorConfig()
        json_format.ParseDict(doc, msg)  # rejects unknown fields
        stage = dict(msg.pod_metadata.labels)["moerl.ai/stage"].replace("-", "_")
        container = pipeline_doc["deploymentSpec"]["executors"][label]["container"]
        out[stage] = (json_format.MessageToDict(msg), container)
    return out


def _holds_launcher_token(k8s: dict, container: dict) -> bool:
    vols = [v for v in k8s.get("secretAsVolume", []) if v.get("secretName") == LAUNCHER_TOKEN]
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    if vols:
        assert vols[0]["mountPath"] == launcher_token_dir() == env[LAUNCHER_TOKEN_ENV]
    else:
        assert LAUNCHER_TOKEN_ENV not in env
    return bool(vols)


@pytest.mark.parametrize("launch", ["in_task", "kubernetes"])
def test_scorer_and_rollout_worker_tasks_hold_no_launcher_token_and_their_own_may_do_nothing(
    tmp_path, launch
):
    """The launcher's token reaches only the tasks that launch or make and delete a run's
    objects; every other task (the scorer, an in-task rollout worker, the trainer run in its
    task) holds only the token every KFP task pod carries, the run account's, whose Role grants
    nothing of moerl's: no pods, Secrets, NetworkPolicies, Roles or scales (the old Role, bound
    to that account, granted all of them). The pods launched for rollout and the trainer mount no
    token at all (the elastic trainer's projected one aside, tests/launch/test_fleet.py)."""
    cfg = _cfg(cluster={"launch": {"mode": launch}}, reward={"kind": "rules"})
    tasks = _compiled_tasks(tmp_path, cfg)
    holders = {s for s, (k8s, c) in tasks.items() if _holds_launcher_token(k8s, c)}
    want = {"start_run", "close_run"}
    if launch == "kubernetes":
        want |= {"rollout_worker", "async_trainer"}  # their tasks are the launchers
    assert holders == want
    for scorer in (
        ("reward_scorer", "rollout_worker") if launch == "in_task" else ("reward_scorer",)
    ):
        assert scorer in tasks and scorer not in holders
    # the run account's Role, the only one the token of every other task pod is bound to
    docs = list(yaml.safe_load_all((ROOT / "manifests" / "base" / "rbac.yaml").read_text()))
    (binding,) = [
        d
        for d in docs
        if d["kind"] == "RoleBinding" and d["subjects"][0]["name"] == "moerl-pipeline"
    ]
    (role,) = [
        d
        for d in docs
        if d["kind"] == "Role" and d["metadata"]["name"] == binding["roleRef"]["name"]
    ]
    writes = {"create", "update", "patch", "delete", "deletecollection", "*", "escalate", "bind"}
    for rule in role["rules"]:
        assert "*" not in rule["resources"] and "secrets" not in rule["resources"], rule
        if set(rule["verbs"]) & writes:
            assert rule["resources"] == ["workflowtaskresults"], rule
    if launch == "kubernetes":
        for name, pod in _launched_pods(cfg).items():
            spec = pod["spec"]
            account = spec["serviceAccountName"]
            assert account in ("moerl-worker", "moerl-rollout"), name
            assert spec.get("automountServiceAccountToken") in (None, False), name
            projected = [v for v in spec["volumes"] if "projected" in v]
            assert projected == [] or name == "async_trainer", name
        sas = {
            d["metadata"]["name"]: d
            for d in yaml.safe_load_all((ROOT / "manifests/base/serviceaccounts.yaml").read_text())
            if d["kind"] == "ServiceAccount"
        }
        for account in ("moerl-worker", "moerl-rollout", "moerl-launcher"):
            assert sas[account]["automountServiceAccountToken"] is False


def test_the_launchers_client_uses_the_launcher_token_when_its_task_has_it(tmp_path, monkeypatch):
    """`moerl.launch.watch.connect` in a launching task: the launcher's token and CA from its
    Secret volume, not the pod's own account (which may do nothing of moerl's)."""
    from kubernetes import client

    from moerl.launch.watch import connect

    (tmp_path / "token").write_text("launcher-token-value")
    (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    monkeypatch.setenv(LAUNCHER_TOKEN_ENV, str(tmp_path))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    saved = client.Configuration.get_default_copy()
    try:
        connect()
        conf = client.Configuration.get_default_copy()
    finally:
        client.Configuration.set_default(saved)  # the process-wide default, for other tests
    assert conf.host == "https://10.0.0.1:443"
    assert conf.api_key["authorization"].lower() == "bearer launcher-token-value"
    assert conf.ssl_ca_cert == str(tmp_path / "ca.crt")


# ---- admission: moerl's objects admitted, each abusive one denied --------------------------------


def test_the_policy_admits_exactly_the_secret_keys_pod_secret_env_gives_each_stage():
    """The literal in the policy is `admitted_secret_keys()`, and every pod moerl launches passes
    the pods' policy; the same pod mounting another stage's keys does not."""
    pods_policy = policies()["moerl-launched-pods"]
    (var,) = [v for v in pods_policy["spec"]["variables"] if v["name"] == "admitted"]
    import celpy

    env = celpy.Environment()
    literal = env.program(env.compile(var["expression"])).evaluate({})
    assert {k: sorted(v) for k, v in literal.items()} == admitted_secret_keys()
    pods = _launched_pods(_cfg())
    for name, pod in pods.items():
        assert refused(pods_policy, pod, "pods") == [], name
        assert kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    # a rollout pod given the trainer's Secret volumes: the cache writer's keys
    swapped = copy.deepcopy(pods["rollout_worker"])
    swapped["spec"]["volumes"] = pods["async_trainer"]["spec"]["volumes"]
    swapped["spec"]["volumes"] = [v for v in swapped["spec"]["volumes"] if "projected" not in v]
    assert refused(pods_policy, swapped, "pods") == [
        "moerl's pods mount only the Secret keys their stage gets, each by key at 0400"
    ]


def _secret_volume(name: str, keys: list[str] | None, mode: int = 0o400) -> dict:
    src: dict = {"secretName": name, "defaultMode": mode}
    if keys is not None:
        src["items"] = [{"key": k, "path": k} for k in keys]
    return {"name": "x", "secret": src}


POD_ABUSES = {  # what a pod of moerl's (or one its accounts create) may not be
    "the Valkey admin's Secret": lambda s: s["volumes"].append(
        _secret_volume("moerl-valkey", ["VALKEY_ADMIN_PASSWORD"])
    ),
    "a whole Secret": lambda s: s["volumes"].append(_secret_volume("moerl-mlflow", None)),
    "a Secret at 0444": lambda s: s["volumes"].append(
        _secret_volume("moerl-mlflow", ["MLFLOW_TRACKING_PASSWORD"], 0o444)
    ),
    "another run's Secret": lambda s: s["volumes"].append(
        _secret_volume(f"moerl-run-{OTHER}", ["VALKEY_PASSWORD"])
    ),
    "the run's scaler Secret": lambda s: s["volumes"].append(
        _secret_volume(scaler_secret_name(RUN), ["VALKEY_SCALER_PASSWORD"])
    ),
    "a secretKeyRef": lambda s: s["containers"][0]["env"].append(
        {"name": "P", "valueFrom": {"secretKeyRef": {"name": "moerl-valkey", "key": "K"}}}
    ),
    "an envFrom Secret": lambda s: s["containers"][0].update(
        envFrom=[{"secretRef": {"name": "moerl-valkey"}}]
    ),
    "the run account": lambda s: s.update(serviceAccountName="moerl-pipeline"),
    "the launcher account": lambda s: s.update(serviceAccountName="moerl-launcher"),
    "an automounted token": lambda s: s.update(automountServiceAccountToken=True),
    "a container running as root": lambda s: s["containers"][0]["securityContext"].update(
        runAsUser=0
    ),
    "a container without seccomp": lambda s: s["containers"][0]["securityContext"].update(
        seccompProfile={"type": "Unconfined"}
    ),
    "a projected Secret": lambda s: s["volumes"].append(
        {"name": "y", "projected": {"sources": [{"secret": {"name": "moerl-valkey"}}]}}
    ),
    "a projected API token": lambda s: s["volumes"].append(objects.api_token_volume()),
    "another Localhost profile": lambda s: s["securityContext"].update(
        seccompProfile={"type": "Localhost", "localhostProfile": "moerl/../unconfined.json"}
    ),
}


@pytest.mark.parametrize("abuse", sorted(POD_ABUSES))
def test_each_abusive_pod_is_denied(abuse):
    pol = policies()["moerl-launched-pods"]
    pod = copy.deepcopy(_launched_pods(_cfg())["rollout_worker"])
    assert refused(pol, pod, "pods") == []
    POD_ABUSES[abuse](pod["spec"])
    assert len(refused(pol, pod, "pods")) == 1, abuse
    # created by the launcher's account without moerl's label: matched all the same
    pod["metadata"]["labels"] = {}
    assert refused(pol, pod, "pods", LAUNCHER)


def test_the_sandbox_profile_is_admitted_for_rollout_pods_only():
    pol = policies()["moerl-launched-pods"]
    sandboxed = _cfg(task={"environment": "moerl.tasks.tools:Lookup"})
    pods = _launched_pods(sandboxed)
    assert pods["rollout_worker"]["spec"]["securityContext"]["seccompProfile"] == {
        "type": "Localhost",
        "localhostProfile": "moerl/sandbox.json",
    }
    # and an unmasked /proc for the sandbox's own, in a user namespace of its own
    spec = pods["rollout_worker"]["spec"]
    assert spec["hostUsers"] is False
    assert spec["containers"][0]["securityContext"]["procMount"] == "Unmasked"
    assert all(refused(pol, p, "pods") == [] for p in pods.values())
    unmasked = (
        "only a sandboxed rollout pod (moerl/sandbox.json) in its own user namespace unmasks /proc"
    )
    for strip in ("hostUsers", "seccompProfile"):
        pod = copy.deepcopy(pods["rollout_worker"])
        if strip == "hostUsers":
            del pod["spec"]["hostUsers"]
        else:
            pod["spec"]["securityContext"]["seccompProfile"] = {"type": "RuntimeDefault"}
        assert refused(pol, pod, "pods") == [unmasked], strip
    for name, p in _launched_pods(_cfg()).items():  # not sandboxed: masked, the node's users
        assert "hostUsers" not in p["spec"], name
        assert all("procMount" not in c["securityContext"] for c in p["spec"]["containers"])
    trainer = copy.deepcopy(pods["policy_update"])
    trainer["spec"]["securityContext"]["seccompProfile"] = pods["rollout_worker"]["spec"][
        "securityContext"
    ]["seccompProfile"]
    assert refused(pol, trainer, "pods") == [
        "moerl's pods use seccomp RuntimeDefault, or a rollout pod moerl/sandbox.json"
    ]
    trainer["spec"]["hostUsers"] = False
    trainer["spec"]["containers"][0]["securityContext"]["procMount"] = "Unmasked"
    assert unmasked in refused(pol, trainer, "pods")


def _fleet() -> dict[str, dict]:
    cfg = _cfg(rollout={"workers": 2, "min_workers": 1, "max_workers": 4})
    return {o["kind"]: o for o in fleet.fleet_objects(cfg, RUN, NS, env=[])}


def _owned_policy() -> dict:
    js = objects.rollout_group(
        _cfg(cluster={"launch": {"mode": "kubernetes", "rollout_nodes_per_worker": 2}}),
        RUN,
        "rollout-1",
        ["python"],
        [],
    )
    return objects.rollout_group_policy(js, objects.jobset_owner(js["metadata"]["name"], "u1"))


def _secret(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "data": {}}


def test_moerls_own_objects_pass_the_launcher_objects_policy():
    pol = policies()["moerl-launcher-objects"]
    for name in (f"moerl-run-{RUN}", scaler_secret_name(RUN)):
        for op in ("CREATE", "UPDATE"):
            assert refused(pol, _secret(name), "secrets", operation=op) == []
        assert refused(pol, None, "secrets", operation="DELETE", old=_secret(name)) == []
    netpol = _owned_policy()
    assert refused(pol, netpol, "networkpolicies") == []
    assert kubernetes_validate.validate(netpol, K8S_VERSION, strict=True)
    objs = _fleet()
    so, ta, dep = objs["ScaledObject"], objs["TriggerAuthentication"], objs["Deployment"]
    assert refused(pol, so, "scaledobjects") == []
    assert refused(pol, ta, "triggerauthentications") == []
    # the trainer's controller patches its own fleet: lagCount, and the scale without KEDA
    assert refused(pol, so, "scaledobjects", WORKER, operation="UPDATE", old=so) == []
    scale = {
        "kind": "Scale",
        "metadata": {"name": dep["metadata"]["name"]},
        "spec": {"replicas": 3},
    }
    assert refused(pol, scale, "deployments", WORKER, operation="UPDATE", sub="scale") == []
    assert refused(pol, None, "deployments", operation="DELETE", old=dep) == []
    pod = _launched_pods(_cfg())["rollout_worker"]
    assert refused(pol, None, "pods", operation="DELETE", old=pod) == []
    # KEDA's operator and the HPA are not moerl's accounts: not matched
    keda = "system:serviceaccount:keda:keda-operator"
    assert refused(pol, so, "scaledobjects", keda, operation="UPDATE", old=so) is None


def _mlflow_deployment() -> dict:
    docs = yaml.safe_load_all((ROOT / "manifests" / "base" / "mlflow.yaml").read_text())
    return next(d for d in docs if d and d["kind"] == "Deployment")


def _valkey_pod() -> dict:
    docs = yaml.safe_load_all((ROOT / "manifests" / "base" / "valkey.yaml").read_text())
    sts = next(d for d in docs if d and d["kind"] == "StatefulSet")
    return {"metadata": {"name": "moerl-valkey-0", **sts["spec"]["template"]["metadata"]}}


def _abusive_objects():
    """(what, resource, object, operation, old object, subresource): each one a compromised
    launching task (or the trainer's account) could try."""
    objs = _fleet()
    so, ta = objs["ScaledObject"], objs["TriggerAuthentication"]
    netpol = _owned_policy()
    allow_all = copy.deepcopy(netpol)
    allow_all["spec"] = {"podSelector": {}, "ingress": [{}], "policyTypes": ["Ingress"]}
    unowned = copy.deepcopy(netpol)
    del unowned["metadata"]["ownerReferences"]
    wider = copy.deepcopy(netpol)
    wider["spec"]["podSelector"]["matchLabels"] = {"moerl.ai/group": "rollout"}
    from_ns = copy.deepcopy(netpol)
    from_ns["spec"]["ingress"][0]["from"].append({"namespaceSelector": {}})
    from_ip = copy.deepcopy(netpol)
    from_ip["spec"]["ingress"][0]["from"] = [{"ipBlock": {"cidr": "0.0.0.0/0"}}]
    egress = copy.deepcopy(netpol)
    egress["spec"]["egress"] = [{}]
    at_valkey = copy.deepcopy(so)
    at_valkey["spec"]["scaleTargetRef"] = {"kind": "StatefulSet", "name": "moerl-valkey"}
    at_mlflow = copy.deepcopy(so)
    at_mlflow["spec"]["scaleTargetRef"]["name"] = "moerl-mlflow"
    admin_auth = copy.deepcopy(ta)
    admin_auth["spec"]["secretTargetRef"][1]["name"] = "moerl-valkey"
    mlflow = _mlflow_deployment()
    return [
        ("the Valkey admin's Secret", "secrets", _secret("moerl-valkey"), "UPDATE", None, ""),
        ("the MLflow Secret, deleted", "secrets", None, "DELETE", _secret("moerl-mlflow"), ""),
        ("a Secret named like no run", "secrets", _secret("moerl-run-x"), "CREATE", None, ""),
        ("an allow-all NetworkPolicy", "networkpolicies", allow_all, "CREATE", None, ""),
        ("a NetworkPolicy no JobSet owns", "networkpolicies", unowned, "CREATE", None, ""),
        ("a group's policy on all rollout pods", "networkpolicies", wider, "CREATE", None, ""),
        ("a group's policy open to all namespaces", "networkpolicies", from_ns, "CREATE", None, ""),
        ("a group's policy open to any address", "networkpolicies", from_ip, "CREATE", None, ""),
        ("a group's policy with egress rules", "networkpolicies", egress, "CREATE", None, ""),
        ("a ScaledObject on Valkey", "scaledobjects", at_valkey, "CREATE", None, ""),
        ("a ScaledObject on MLflow", "scaledobjects", at_mlflow, "UPDATE", so, ""),
        (
            "a trigger on the admin's Secret",
            "triggerauthentications",
            admin_auth,
            "CREATE",
            None,
            "",
        ),
        (
            "MLflow scaled to zero",
            "deployments",
            {"kind": "Scale", "metadata": {"name": "moerl-mlflow"}, "spec": {"replicas": 0}},
            "UPDATE",
            None,
            "scale",
        ),
        ("MLflow deleted", "deployments", None, "DELETE", mlflow, ""),
        ("Valkey's pod deleted", "pods", None, "DELETE", _valkey_pod(), ""),
    ]


@pytest.mark.parametrize("user", [LAUNCHER, WORKER])
def test_each_abusive_object_is_denied(user):
    pol = policies()["moerl-launcher-objects"]
    for what, resource, obj, op, old, sub in _abusive_objects():
        got = refused(pol, obj, resource, user, operation=op, old=old, sub=sub)
        assert got is not None and len(got) == 1, (what, got)
    # an admin (not an account of the namespace) is not bound by it
    what, resource, obj, op, old, sub = _abusive_objects()[0]
    assert refused(pol, obj, resource, "kubernetes-admin", operation=op, old=old) is None


def test_the_policies_validate_as_kubernetes_objects():
    """Both policies and their bindings against Kubernetes 1.37's schema, strictly."""
    docs = [
        d
        for d in yaml.safe_load_all(
            (ROOT / "manifests" / "base" / "launched-pods-policy.yaml").read_text()
        )
        if d
    ]
    names = {d["metadata"]["name"] for d in docs if d["kind"] == "ValidatingAdmissionPolicy"}
    assert names == {"moerl-launched-pods", "moerl-launched-fleets", "moerl-launcher-objects"}
    for d in docs:
        assert kubernetes_validate.validate(d, K8S_VERSION, strict=True), d["metadata"]["name"]
    bindings = {d["spec"]["policyName"] for d in docs if d["kind"].endswith("Binding")}
    assert bindings == names


# ---- the sandbox's seccomp profile ------------------------------------------------------------

_ALLOW, _ERRNO_EPERM = 0x7FFF0000, 0x00050001


def _filter_loader(profile: dict):
    """A preexec function that installs `profile` in the child with libseccomp, as runc does for
    a Localhost profile (its deny-list rules, every name resolved: a typo fails here)."""
    lib = ctypes.CDLL(ctypes.util.find_library("seccomp") or "libseccomp.so.2", use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    assert profile["defaultAction"] == "SCMP_ACT_ALLOW"
    (rule,) = profile["syscalls"]
    assert (rule["action"], rule["errnoRet"]) == ("SCMP_ACT_ERRNO", 1)
    numbers = []
    for name in rule["names"]:
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        assert nr != -1, f"{name}: no such syscall (libseccomp)"
        numbers.append(nr)

    def load() -> None:
        ctx = ctypes.c_void_p(lib.seccomp_init(_ALLOW))
        for nr in numbers:
            if lib.seccomp_rule_add(ctx, _ERRNO_EPERM, nr, 0) not in (0, -17):  # -EEXIST
                os._exit(90)
        if lib.seccomp_load(ctx) != 0:
            os._exit(91)

    return load


_INSIDE = """
import ctypes, errno, os, sys
libc = ctypes.CDLL(None, use_errno=True)
# the sandbox's own steps: a private mount tree and a tmpfs, as root of its user namespace
assert libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None) == 0, os.strerror(ctypes.get_errno())
assert libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 0, b"size=1m") == 0, os.strerror(ctypes.get_errno())
denied = {}
for name, nr in (("bpf", 321), ("keyctl", 250), ("setns", 308), ("ptrace", 101)):
    ret = libc.syscall(nr, 0, 0, 0, 0)
    denied[name] = ctypes.get_errno() if ret == -1 else 0
print(denied)
sys.exit(0 if all(v == errno.EPERM for v in denied.values()) else 3)
"""


@pytest.mark.skipif(
    sys.platform != "linux" or os.uname().machine != "x86_64" or not shutil.which("unshare"),
    reason="libseccomp, x86_64 syscall numbers and util-linux unshare",
)
def test_the_sandbox_profile_lets_the_sandboxs_namespaces_through_and_refuses_the_rest():
    """Loaded as containerd loads a Localhost profile: `unshare` into user, network, pid, mount
    and IPC namespaces and the sandbox's mounts work under it (RuntimeDefault refuses them
    without CAP_SYS_ADMIN), while bpf, keyctl, setns and ptrace fail with EPERM. Every rollout
    node installs this very file (eksctl's rollout group and Karpenter's GPU node class)."""
    import base64
    import re

    profile = json.loads(PROFILE.read_text())
    cmd = [
        shutil.which("unshare"),
        "--user",
        "--map-root-user",
        "--net",
        "--pid",
        "--mount",
        "--ipc",
        "--fork",
        "--kill-child",
        sys.executable,
        "-c",
        _INSIDE,
    ]
    probe = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if probe.returncode != 0 and "Operation not permitted" in probe.stderr:
        pytest.skip(f"this machine refuses user namespaces: {probe.stderr.strip()}")
    got = subprocess.run(
        cmd, capture_output=True, text=True, timeout=60, preexec_fn=_filter_loader(profile)
    )
    assert got.returncode == 0, (got.stdout, got.stderr)
    assert "'bpf': 1" in got.stdout and "'setns': 1" in got.stdout
    # the denied set is not empty of what matters, nor does it refuse what the sandbox needs
    names = set(profile["syscalls"][0]["names"])
    assert {"bpf", "keyctl", "kexec_load", "init_module", "ptrace", "setns", "userfaultfd"} <= names
    assert not names & {"unshare", "clone", "clone3", "mount", "umount2", "execve"}
    # installed on the rollout nodes from the same bytes
    want = json.loads(PROFILE.read_text())
    lines = [
        *yaml.safe_load((ROOT / "manifests/cluster/eksctl.yaml").read_text())["managedNodeGroups"],
    ]
    (rollout,) = [g for g in lines if g["name"] == "rollout"]
    node_classes = yaml.safe_load_all(
        (ROOT / "manifests/components/karpenter/ec2nodeclasses.yaml").read_text()
    )
    (gpu,) = [c for c in node_classes if c["metadata"]["name"] == "moerl-gpu"]
    for where, text in (
        ("eksctl rollout", "\n".join(rollout["preBootstrapCommands"])),
        ("karpenter moerl-gpu", gpu["spec"]["userData"]),
    ):
        m = re.search(
            r"mkdir -p /var/lib/kubelet/seccomp/moerl && echo ([A-Za-z0-9+/=]+) \| base64 -d > "
            r"/var/lib/kubelet/seccomp/moerl/sandbox\.json",
            text,
        )
        assert m, where
        assert json.loads(base64.b64decode(m.group(1))) == want, (
            f"{where}: the installed profile differs from {PROFILE}; re-encode it"
        )


# ---- an elastic run's own trainer account ---------------------------------------------------------


def test_an_elastic_runs_trainer_runs_as_its_own_account_which_alone_its_fleets_role_binds(
    monkeypatch,
):
    """The launcher creates the run's trainer account before the trainer (named as the fleet,
    no token, the shared account's IRSA annotation and nothing else, owned by the task's pod);
    the trainer runs as it; the fleet's RoleBinding binds it alone. Admission admits exactly that
    and denies a binding to the account every run's trainer shares (the old subject), the account
    on a rollout pod, and an account that is not a trainer's."""
    from moerl.launch.task import build, open_trainer_account
    from moerl.launch.watch import LaunchError
    from tests.unit.test_launch import _api

    monkeypatch.setenv("KFP_POD_NAME", "trainer-task")
    monkeypatch.setenv("KFP_POD_UID", "uid-7")
    monkeypatch.setenv("MOERL_POD_NAMESPACE", NS)
    cfg = _cfg(rollout={"workers": 2, "min_workers": 1, "max_workers": 4})
    name = fleet.fleet_name(RUN)
    path = f"/api/v1/namespaces/{NS}/serviceaccounts"
    arn = "arn:aws:iam::111122223333:role/moerl-worker"
    shared = {
        "kind": "ServiceAccount",
        "metadata": {
            "name": "moerl-worker",
            "annotations": {"eks.amazonaws.com/role-arn": arn, "team": "x"},
        },
    }
    api, replay = _api(
        [
            ("GET", f"{path}/moerl-worker", 200, shared),
            ("POST", path, 201, {"kind": "ServiceAccount", "metadata": {"name": name}}),
        ]
    )
    assert open_trainer_account(cfg, RUN, NS, name, api) == name
    account = replay.calls[1][3]
    assert account["metadata"]["name"] == name
    assert account["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": arn}
    assert account["automountServiceAccountToken"] is False
    assert account["metadata"]["ownerReferences"][0]["name"] == "trainer-task"
    assert kubernetes_validate.validate(account, K8S_VERSION, strict=True)
    forbidden = {"kind": "Status", "status": "Failure", "message": "forbidden", "code": 403}
    api, _ = _api([("GET", f"{path}/moerl-worker", 403, forbidden)])
    with pytest.raises(LaunchError, match=r"needs get on that account.*rbac.yaml"):
        open_trainer_account(cfg, RUN, NS, name, api)

    pols = policies()
    objs_pol, pods_pol, fleets_pol = (
        pols["moerl-launcher-objects"],
        pols["moerl-launched-pods"],
        pols["moerl-launched-fleets"],
    )
    assert refused(objs_pol, account, "serviceaccounts") == []
    for change in (
        {"automountServiceAccountToken": True},
        {"metadata": {**account["metadata"], "name": "moerl-valkey"}},
        {"metadata": {**account["metadata"], "annotations": {"team": "x"}}},
    ):
        assert len(refused(objs_pol, account | change, "serviceaccounts")) == 1, change
    # the trainer's pods run as it, and pass the pods' policy
    tj = build(cfg, "async_trainer", RUN, "tj", ["python"], None, None, name, fleet=name)
    (rjob,) = tj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
        "replicatedJobs"
    ]
    tpl = rjob["template"]["spec"]["template"]
    trainer = _pod(tpl["metadata"], tpl["spec"])
    assert trainer["spec"]["serviceAccountName"] == name
    assert refused(pods_pol, trainer, "pods") == []
    rollout = copy.deepcopy(_launched_pods(cfg)["rollout_worker"])
    rollout["spec"]["serviceAccountName"] = name
    assert len(refused(pods_pol, rollout, "pods")) == 1
    # the fleet's RoleBinding: its own account only, not the one every run's trainer shares
    binding = {o["kind"]: o for o in fleet.fleet_objects(cfg, RUN, NS, env=[], name=name)}[
        "RoleBinding"
    ]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": NS}]
    assert refused(fleets_pol, binding, "rolebindings") == []
    shared_binding = copy.deepcopy(binding)
    shared_binding["subjects"][0]["name"] = "moerl-worker"
    assert len(refused(fleets_pol, shared_binding, "rolebindings")) == 1
