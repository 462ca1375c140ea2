"""manifests/install/kfp: the patch to Argo's workflowDefaults that gives every KFP task pod's
`main` container the sandbox's seccomp profile and an unmasked /proc (in a user namespace), and
the profile on every node group that runs KFP's pods. Offline: `kubectl kustomize` applies the
patch to a stand-in for KFP's ConfigMap (the install's base is remote); Argo's strategic merge
of the podSpecPatch onto the pod is reproduced here (`_merge`: maps merged, `containers` by name,
as k8s.io's strategicpatch does for PodSpec) on the pod KFP 2.17's compiler makes.

Limitations: not run on a cluster: the node's kernel and containerd with user namespaces, the
kubelet loading the profile, Argo's controller applying the patch."""

from __future__ import annotations

import base64
import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import yaml

from tests.launch.admission import policies, refused

ROOT = Path(__file__).resolve().parents[2]
KFP = ROOT / "manifests" / "install" / "kfp"
PROFILE = ROOT / "manifests" / "seccomp" / "sandbox.json"
SANDBOX = {"type": "Localhost", "localhostProfile": "moerl/sandbox.json"}
RUNTIME_DEFAULT = {"type": "RuntimeDefault"}
K8S = "1.35.0"  # manifests/cluster/eksctl.yaml's version
ARGO = "system:serviceaccount:kubeflow:argo"  # the controller that creates the task pods


def _patch_doc() -> dict:
    kust = yaml.safe_load((KFP / "kustomization.yaml").read_text())
    (patch,) = [p["path"] for p in kust["patches"]]
    return yaml.safe_load((KFP / patch).read_text())


def _kustomized(tmp_path) -> dict:
    """The patch applied by `kubectl kustomize` to a ConfigMap shaped as KFP's (its other keys
    must survive: the patch replaces workflowDefaults only)."""
    base = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "workflow-controller-configmap", "namespace": "kubeflow"},
        "data": {
            "artifactRepository": "s3: {bucket: stand-in}\n",
            "executor": "imagePullPolicy: IfNotPresent\n",
            "workflowDefaults": "spec: {}\n",
        },
    }
    (tmp_path / "cm.yaml").write_text(yaml.safe_dump(base))
    (tmp_path / "patch.yaml").write_text(yaml.safe_dump(_patch_doc()))
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump({"resources": ["cm.yaml"], "patches": [{"path": "patch.yaml"}]})
    )
    kubectl = Path(sys.executable).parent / "kubectl"
    out = subprocess.run(
        [str(kubectl), "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    (cm,) = list(yaml.safe_load_all(out.stdout))
    return cm


def _merge(base, patch):
    """A strategic merge patch on a PodSpec, for what the patches here hold."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if k in ("containers", "initContainers") and k in out:
                named = {c["name"]: c for c in v}
                out[k] = [
                    _merge(c, named.pop(c["name"])) if c["name"] in named else c for c in out[k]
                ]
                out[k] += list(named.values())
            else:
                out[k] = _merge(out.get(k), v)
        return out
    return copy.deepcopy(patch)


def _kfp_pod() -> dict:
    """A task pod as Argo builds it from KFP 2.17's executor template: the pod-level profile and
    each container's, RuntimeDefault (argocompiler/security_context.go), Argo's init and wait."""
    hardened = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": dict(RUNTIME_DEFAULT),
    }

    def c(name: str) -> dict:
        return {
            "name": name,
            "image": "ecr.example/moerl:1",
            "securityContext": copy.deepcopy(hardened),
        }

    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "check-user-code-abc",
            "namespace": "moerl",
            "labels": {"app.kubernetes.io/part-of": "moerl", "moerl.ai/stage": "check-user-code"},
        },
        "spec": {
            "securityContext": {"seccompProfile": dict(RUNTIME_DEFAULT)},
            "initContainers": [c("init"), c("kfp-launcher")],
            "containers": [c("wait"), c("main")],
        },
    }


def test_every_kfp_task_pods_main_container_gets_the_sandbox_profile_and_an_unmasked_proc(
    tmp_path,
):
    cm = _kustomized(tmp_path)
    assert cm["data"]["artifactRepository"] == "s3: {bucket: stand-in}\n"  # kept
    defaults = yaml.safe_load(cm["data"]["workflowDefaults"])["spec"]
    # KFP 2.17.0's own defaults, kept as they were
    assert defaults["ttlStrategy"] == {
        "secondsAfterCompletion": 3600,
        "secondsAfterSuccess": 3600,
        "secondsAfterFailure": 3600,
    }
    assert defaults["templateDefaults"] == {
        "retryStrategy": {"limit": "2", "retryPolicy": "OnError"}
    }
    patch = yaml.safe_load(defaults["podSpecPatch"])
    # Argo: the workflow's podSpecPatch (the defaults'), then the template's (KFP's driver: the
    # image, command and resources, no profile), each merged onto the pod the template made
    driver = {"containers": [{"name": "main", "image": "ecr.example/moerl:2", "command": ["sh"]}]}
    pod = _kfp_pod()
    pod["spec"] = _merge(_merge(pod["spec"], patch), driver)
    spec = pod["spec"]
    main = next(c for c in spec["containers"] if c["name"] == "main")
    assert main["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": SANDBOX,
        "procMount": "Unmasked",  # which the API server admits only with hostUsers false
    }
    assert spec["hostUsers"] is False and main["image"] == "ecr.example/moerl:2"
    for c in spec["initContainers"] + [c for c in spec["containers"] if c["name"] != "main"]:
        assert c["securityContext"]["seccompProfile"] == RUNTIME_DEFAULT, c["name"]
        assert "procMount" not in c["securityContext"], c["name"]
    assert kubernetes_validate.validate(pod, K8S, strict=True)
    # the profile it names is the file every node installs (kubelet's seccomp root)
    assert SANDBOX["localhostProfile"] == "moerl/" + PROFILE.name
    # Argo's controller creates it: moerl's launched-pods policy, which refuses a container's own
    # profile, is not about KFP's task pods; the same pod from moerl's run account is refused
    pol = policies()["moerl-launched-pods"]
    assert refused(pol, pod, "pods", ARGO) is None  # not matched
    assert refused(pol, pod, "pods", "system:serviceaccount:moerl:moerl-pipeline")


def _install_commands() -> dict[str, str]:
    """Where -> the commands that prepare a node of that group before the kubelet starts."""
    out = {}
    for path in ("eksctl.yaml", "eksctl-karpenter.yaml"):
        doc = yaml.safe_load((ROOT / "manifests" / "cluster" / path).read_text())
        for g in doc.get("managedNodeGroups", []):
            out[f"{path} {g['name']}"] = "\n".join(g.get("preBootstrapCommands", []))
    karpenter = ROOT / "manifests" / "components" / "karpenter"
    classes = {
        d["metadata"]["name"]: d
        for d in yaml.safe_load_all((karpenter / "ec2nodeclasses.yaml").read_text())
    }
    for pool in yaml.safe_load_all((karpenter / "nodepools.yaml").read_text()):
        ref = pool["spec"]["template"]["spec"]["nodeClassRef"]["name"]
        out[f"NodePool {pool['metadata']['name']}"] = classes[ref]["spec"].get("userData", "")
    return out


def test_every_node_group_installs_the_sandbox_profile_from_the_same_bytes():
    """KFP's pods (tasks on the five groups, its drivers on the system group) name the profile:
    a node without the file would fail every such container at its start."""
    want = json.loads(PROFILE.read_text())
    places = _install_commands()
    assert {"eksctl.yaml system", "eksctl.yaml cpu", "eksctl-karpenter.yaml system"} <= set(places)
    assert len([p for p in places if p.startswith("NodePool")]) == 5
    for where, text in places.items():
        m = re.search(
            r"mkdir -p /var/lib/kubelet/seccomp/moerl && echo ([A-Za-z0-9+/=]+) \| base64 -d > "
            r"/var/lib/kubelet/seccomp/moerl/sandbox\.json",
            text,
        )
        assert m, f"{where}: does not install the sandbox's seccomp profile"
        assert json.loads(base64.b64decode(m.group(1))) == want, f"{where}: re-encode {PROFILE}"
