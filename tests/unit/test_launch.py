"""moerl.launch's pure parts: the launched objects against their published schemas, the
watch-and-cleanup logic on API responses replayed through the real kubernetes client, node
groups and merged node outputs. The S3 exchange round trip with a real stage in a subprocess
is in tests/launch/test_launch.py.

No API server runs here: the schemas are Kubeflow Trainer v2.3.0's and JobSet v0.12.0's CRDs
(tests/data/k8s, see NOTICE) and Kubernetes 1.37's (kubernetes-validate, strict), and the
API responses are hand-written in the server's shapes (tests/data/k8s/api_responses.json).
"""

from __future__ import annotations

import copy
import gzip
import json
import os
import re
import signal
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import jsonschema
import kubernetes_validate
import pytest
import urllib3
import yaml
from kubernetes import client as k8s

from moerl.config import parse_config
from moerl.errors import ConfigError
from moerl.launch import objects
from moerl.launch.state import PULL_BACKOFF_S, State, condition_state
from moerl.launch.task import (
    build,
    launch_env,
    launch_service_account,
    remote_command,
    run_remote,
    sweep,
)
from moerl.launch.watch import (
    DELETE_BACKOFF_S,
    DELETE_TRIES,
    PENDING_TIMEOUT_S,
    KubeApi,
    Launcher,
    LaunchError,
    LaunchInterrupted,
    WorkloadDeleted,
    WorkloadFailed,
    WorkloadPending,
    WorkloadTimeout,
    own_pod_owner,
    resolve_namespace,
    workload,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "k8s"
K8S_VERSION = "1.37.0"
RUN = "0a1b2c3d4e5f60718293a4b5c6d7e8f9"
NS = "moerl-runs"
TJ = "moerl-policy-update-0a1b2c3d-abcde"
POD = "moerl-rollout-worker-rollout-0-0a1b2c3d-abcde"
RFC1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
RESPONSES = json.loads((DATA / "api_responses.json").read_text())


def _cfg(**launch) -> object:
    return parse_config(
        {
            "checkpoint": {"uri": "s3://moerl-ckpt/prod"},
            "pipeline": {"base_image": "registry.example/moerl:1"},
            "cluster": {"launch": {"mode": "kubernetes", "service_account": "moerl-gpu", **launch}},
        }
    )


# ---- objects against their schemas ---------------------------------------------------------


def _strict(node):
    """additionalProperties: false on every object schema that lists its properties (the CRDs
    leave it out; the API server prunes unknown fields silently, which would hide a typo)."""
    if isinstance(node, dict):
        if (
            node.get("type") == "object"
            and "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
        for v in node.values():
            _strict(v)
    elif isinstance(node, list):
        for v in node:
            _strict(v)
    return node


def _crd_schema(file: str, version: str) -> dict:
    crd = yaml.safe_load(gzip.open(DATA / file))
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return _strict(v["schema"]["openAPIV3Schema"])


@pytest.fixture(scope="module")
def trainjob_schema() -> dict:
    return _crd_schema("trainer.kubeflow.org_trainjobs.v2.3.0.yaml.gz", "v1alpha1")


@pytest.fixture(scope="module")
def jobset_schema() -> dict:
    return _crd_schema("jobset.x-k8s.io_jobsets.v0.12.0.yaml.gz", "v1alpha2")


def _trainjob_cel(obj: dict) -> None:
    """The TrainJob CRD's two CEL rules on the name (jsonschema does not run CEL)."""
    name = obj["metadata"]["name"]
    assert RFC1035.match(name) and len(name) <= 63, name


def _pod_of(template: dict, name: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, **template.get("metadata", {})},
        "spec": template["spec"],
    }


def _env(container: list[dict] | dict) -> dict:
    env = container if isinstance(container, list) else container["env"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in env}


def test_trainjob_validates_against_the_trainer_v2_3_crd(trainjob_schema):
    cfg = _cfg(trainer_nodes=2)
    name = objects.trainjob_name("policy_update", RUN, nodes=2)
    tj = objects.trainjob(
        cfg,
        RUN,
        name,
        ["python", "-m", "moerl.launch.remote", "s3://b/x/spec.json"],
        [{"name": "PYTHONUNBUFFERED", "value": "1"}],
    )
    jsonschema.Draft7Validator(trainjob_schema).validate(tj)
    _trainjob_cel(tj)
    # the controllers' derived names stay valid: <name>-node-<job>-<pod>-xxxxx
    assert RFC1035.match(f"{name}-node-0-1-abcde") and len(f"{name}-node-0-1-abcde") <= 63
    spec = tj["spec"]
    assert spec["runtimeRef"] == {
        "name": "moerl-torch-distributed",
        "apiGroup": "trainer.kubeflow.org",
        "kind": "ClusterTrainingRuntime",
    }
    assert (
        spec["trainer"]["numNodes"] == 2 and spec["trainer"]["image"] == "registry.example/moerl:1"
    )
    want = {
        "nvidia.com/gpu": "8",
        "vpc.amazonaws.com/efa": "16",
        "hugepages-2Mi": "5120Mi",
        "cpu": "96",
        "memory": "1024Gi",
    }
    assert spec["trainer"]["resourcesPerNode"] == {"requests": want, "limits": want}
    assert _env(spec["trainer"]["env"])["HOME"] == "/scratch/home"
    (patch,) = spec["runtimePatches"]
    assert patch["manager"] == "moerl.ai/launcher"
    (rjob,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = rjob["template"]["spec"]["template"]
    assert rjob["name"] == "node" and pod["metadata"]["labels"]["moerl.ai/workload"] == name
    ps = pod["spec"]
    assert (
        ps["nodeSelector"] == {"moerl.ai/group": "trainer"}
        and ps["serviceAccountName"] == "moerl-gpu"
    )
    assert ps["tolerations"] == [
        {"key": "moerl.ai/group", "operator": "Equal", "value": "trainer", "effect": "NoSchedule"}
    ]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}} in ps["volumes"]
    (node,) = ps["containers"]
    # least privilege: non-root, no escalation, every capability dropped but IPC_LOCK (EFA), read-only root
    assert node["name"] == "node" and node["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]},
    }
    # fsGroup: the stage's user reads its Secret files (0400 root-owned, 0440 for the group)
    assert ps["securityContext"] == {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
        "fsGroup": 1000,
    }
    assert {"name": "dshm", "mountPath": "/dev/shm"} in node["volumeMounts"]
    assert tj["metadata"]["labels"] == {
        "moerl.ai/run-id": RUN,
        "moerl.ai/stage": "policy-update",
        "moerl.ai/workload": name,
        "app.kubernetes.io/managed-by": "moerl",
    }


def test_strict_crd_schema_catches_a_misspelled_field(trainjob_schema):
    tj = objects.trainjob(_cfg(), RUN, TJ, ["true"], [])
    bad = copy.deepcopy(tj)
    bad["spec"]["trainer"]["numNode"] = bad["spec"]["trainer"].pop("numNodes")
    with pytest.raises(jsonschema.ValidationError, match="numNode"):
        jsonschema.Draft7Validator(trainjob_schema).validate(bad)
    bad = copy.deepcopy(tj)  # a pod-spec field Trainer's PodSpecPatch does not allow
    bad["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][
        0
    ]["template"]["spec"]["template"]["spec"]["hostNetwork"] = True
    with pytest.raises(jsonschema.ValidationError, match="hostNetwork"):
        jsonschema.Draft7Validator(trainjob_schema).validate(bad)


def test_zero_and_unset_resources_are_left_out(trainjob_schema):
    cfg = _cfg(gpus_per_node=0, efa_per_node=0, hugepages_2mi=None)
    tj = objects.trainjob(cfg, RUN, TJ, ["true"], [])
    jsonschema.Draft7Validator(trainjob_schema).validate(tj)
    assert tj["spec"]["trainer"]["resourcesPerNode"]["limits"] == {"cpu": "96", "memory": "1024Gi"}
    pod = objects.rollout_pod(cfg, RUN, "rollout-0", ["true"], [])
    assert pod["spec"]["containers"][0]["resources"]["requests"] == {
        "cpu": "96",
        "memory": "1024Gi",
    }


def test_names_are_dns_labels_whatever_the_run_id():
    for run_id, stage, extra in [
        ("Run_ID with spaces/and:colons", "policy_update", ""),
        ("x" * 200, "rollout_worker", "rollout-1023"),
        ("", "async_trainer", ""),
    ]:
        name = objects.workload_name(stage, run_id, extra=extra)
        assert RFC1035.match(name) and len(name) <= 63, name
        assert (
            LABEL_VALUE.match(objects.label_value(run_id))
            and len(objects.label_value(run_id)) <= 63
        )
    a, b = objects.workload_name("rollout", RUN), objects.workload_name("rollout", RUN)
    assert a != b  # a KFP retry never collides with the attempt before it


def test_rollout_pod_validates_strictly_against_kubernetes(tmp_path):
    cfg = _cfg()  # an async run's worker: it logs in to Valkey as the run's own user
    cfg = cfg.model_copy(
        update={"valkey": cfg.valkey.model_copy(update={"url": "redis://moerl-valkey:6379/0"})}
    )
    env = launch_env(
        cfg,
        "rollout_worker",
        environ={
            "MLFLOW_TRACKING_URI": "http://mlflow:5000",
            "AWS_SECRET_ACCESS_KEY": "must-not-travel",
        },
    )
    pod = objects.rollout_pod(
        cfg,
        RUN,
        "rollout-3",
        remote_command(cfg, "s3://b/x/spec.json"),
        env,
        owner=own_pod_owner(
            NS, {"KFP_POD_NAME": "t", "KFP_POD_UID": "u", "MOERL_POD_NAMESPACE": NS}
        ),
    )
    assert kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    spec, (c,) = pod["spec"], pod["spec"]["containers"]
    # rollout pods get the rollout account (S3 read, pins and exchange writes), not the trainer's
    assert spec["restartPolicy"] == "Never" and spec["serviceAccountName"] == "moerl-rollout"
    assert spec["terminationGracePeriodSeconds"] >= cfg.rollout.grace_seconds + 10
    assert spec["nodeSelector"] == {"moerl.ai/group": "rollout"}
    # below the trainer's (tests/launch/test_manifests.py)
    assert spec["priorityClassName"] == "moerl-rollout"
    assert (
        "priorityClassName"
        not in objects.rollout_pod(
            _cfg(rollout_priority_class=None), RUN, "rollout-3", ["true"], []
        )["spec"]
    )
    assert c["workingDir"] == "/scratch" and c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]},
    }
    assert spec["securityContext"] == {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
        "fsGroup": 1000,
    }
    assert spec["automountServiceAccountToken"] is False  # a stage never calls the Kubernetes API
    e = _env(c)
    assert e["HOME"].startswith("/scratch/") and e["TMPDIR"].startswith("/scratch/")
    assert e["MLFLOW_TRACKING_URI"] == "http://mlflow:5000" and "AWS_SECRET_ACCESS_KEY" not in e
    # credentials as files of Secret volumes (0400, only the stage's keys), never values or secretKeyRefs
    assert not [v for v in c["env"] if "secretKeyRef" in v.get("valueFrom", {})]
    assert e["VALKEY_PASSWORD_FILE"] == "/var/run/secrets/moerl/moerl-run/VALKEY_PASSWORD"
    assert e["VALKEY_USERNAME_FILE"] == "/var/run/secrets/moerl/moerl-run/VALKEY_USERNAME"
    vols = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    run = next(
        v["secret"]
        for v in vols.values()
        if v.get("secret", {}).get("secretName") == f"moerl-run-{RUN}"
    )
    # required: no optional
    assert run == {
        "secretName": f"moerl-run-{RUN}",
        "defaultMode": 0o400,
        "items": [
            {"key": "VALKEY_USERNAME", "path": "VALKEY_USERNAME", "mode": 0o400},
            {"key": "VALKEY_PASSWORD", "path": "VALKEY_PASSWORD", "mode": 0o400},
        ],
    }
    mlflow = next(
        v["secret"]
        for v in vols.values()
        if v.get("secret", {}).get("secretName") == "moerl-mlflow-reader"  # reads only
    )
    assert mlflow["optional"] is True and mlflow["defaultMode"] == 0o400
    assert mounts["/var/run/secrets/moerl/moerl-run"]["readOnly"] is True
    assert mounts["/var/run/secrets/moerl/moerl-mlflow-reader"]["readOnly"] is True
    # the admin's Secret: start_run and close_run only
    assert "moerl-valkey" not in json.dumps(spec)
    # the rollout group's own scratch (p5en's NVMe), not cluster.scratch_size's 200Gi
    assert {"name": "scratch", "emptyDir": {"sizeLimit": "16Ti"}} in spec["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert c["resources"]["limits"]["vpc.amazonaws.com/efa"] == "16"
    assert pod["metadata"]["ownerReferences"][0]["kind"] == "Pod"
    assert "must-not-travel" not in json.dumps(pod)
    bad = copy.deepcopy(pod)  # strict mode rejects what the server would drop
    bad["spec"]["containers"][0]["workdir"] = "/scratch"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_multi_node_rollout_group_is_a_valid_jobset(jobset_schema):
    cfg = _cfg(rollout_nodes_per_worker=4)
    js = objects.rollout_group(
        cfg, RUN, "rollout-17", ["python", "-m", "moerl.launch.remote", "s3://b/s.json"], []
    )
    jsonschema.Draft7Validator(jobset_schema).validate(js)
    name = js["metadata"]["name"]
    assert RFC1035.match(name) and len(f"{name}-worker-0-2-abcde") <= 63
    leader, worker = js["spec"]["replicatedJobs"]
    assert (leader["name"], worker["name"]) == ("leader", "worker")
    assert (
        worker["template"]["spec"]["completions"] == 3
        and worker["template"]["spec"]["completionMode"] == "Indexed"
    )
    assert js["spec"]["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["leader"]}
    assert js["spec"]["failurePolicy"] == {"maxRestarts": 0}
    for rj in (leader, worker):  # their pod templates are valid Pods
        pod = _pod_of(rj["template"]["spec"]["template"], name)
        assert kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
        assert pod["spec"]["priorityClassName"] == "moerl-rollout"
        e = _env(pod["spec"]["containers"][0])
        assert (
            e["MOERL_GROUP_SIZE"] == "4"
            and e["MOERL_LEADER_ADDRESS"] == f"{name}-leader-0-0.{name}"
        )
    assert (
        _env(leader["template"]["spec"]["template"]["spec"]["containers"][0])["MOERL_NODE_RANK"]
        == "0"
    )
    with pytest.raises(ValueError):
        objects.rollout_group(_cfg(), RUN, "rollout-0", ["true"], [])


def test_every_remote_stage_entry_point_names_a_function_that_exists():
    """moerl.launch finds the stages by name (it sits below them): a renamed or moved entry
    point fails here, not in a launched pod. Read from the source, so no engine is imported."""
    import ast
    import importlib.util

    from moerl.launch.remote import ENTRY_POINTS

    for name, target in ENTRY_POINTS.items():
        module, _, function = target.partition(":")
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin, f"{name}: no module {module}"
        tree = ast.parse(Path(spec.origin).read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert function in defined, f"{name}: {module} defines no function {function}"


def test_run_remote_refuses_what_cannot_work_before_uploading_anything():
    with pytest.raises(ConfigError, match="s3:// checkpoint.uri"):
        run_remote(
            parse_config({"cluster": {"launch": {"mode": "kubernetes"}}}), "policy_update", RUN
        )
    with pytest.raises(ConfigError, match="1 ranks do not split evenly over 2 nodes"):
        run_remote(_cfg(trainer_nodes=2), "policy_update", RUN)
    two_nodes = _cfg(trainer_nodes=2)
    two_nodes = two_nodes.model_copy(
        update={
            "trainer": two_nodes.trainer.model_copy(
                update={
                    "parallelism": two_nodes.trainer.parallelism.model_copy(
                        update={"expert_parallel_size": 2, "data_parallel_shard": 2}
                    )
                }
            )
        }
    )
    with pytest.raises(
        ConfigError, match="trainer.parallelism.launcher 'local' starts ranks on one machine"
    ):
        run_remote(two_nodes, "policy_update", RUN)
    # the async trainer's mesh spans nodes as the sync update's does (torchrun joins them) ...
    with pytest.raises(
        ConfigError, match="trainer.parallelism.launcher 'local' starts ranks on one machine"
    ):
        run_remote(two_nodes, "async_trainer", RUN)
    # ... but only with ranks that live for the run: restarting ranks start from one node
    restarting = two_nodes.model_copy(
        update={
            "trainer": two_nodes.trainer.model_copy(
                update={
                    "parallelism": two_nodes.trainer.parallelism.model_copy(
                        update={"persistent_ranks": False, "launcher": "torchrun"}
                    )
                }
            )
        }
    )
    with pytest.raises(ConfigError, match="persistent_ranks false restarts the mesh's ranks"):
        run_remote(restarting, "async_trainer", RUN)
    # an engine over nodes is the async pipeline's (tests/launch/test_rollout_group.py)
    with pytest.raises(ConfigError, match="rollout_nodes_per_worker 2: the sync"):
        run_remote(_cfg(rollout_nodes_per_worker=2), "rollout", RUN)
    big_mesh = parse_config(
        {
            "checkpoint": {"uri": "s3://moerl-ckpt/prod"},
            "pipeline": {"base_image": "r/moerl:1"},
            "trainer": {
                "parallelism": {
                    "device": "cuda",
                    "expert_parallel_size": 8,
                    "data_parallel_shard": 2,
                }
            },
            "cluster": {
                "launch": {"mode": "kubernetes", "service_account": "moerl-gpu", "trainer_nodes": 1}
            },
        }
    )
    with pytest.raises(ConfigError, match=r"trainer mesh: .* = 16 ranks, but .* = 8 x 1 = 8 GPUs"):
        run_remote(big_mesh, "policy_update", RUN)
    uneven = big_mesh.model_copy(
        update={
            "cluster": big_mesh.cluster.model_copy(
                update={"launch": big_mesh.cluster.launch.model_copy(update={"trainer_nodes": 3})}
            )
        }
    )
    with pytest.raises(ConfigError, match="16 ranks do not split evenly over 3 nodes"):
        run_remote(uneven, "policy_update", RUN)
    with pytest.raises(LaunchError, match="needs the run id"):
        run_remote(_cfg(), "policy_update", "")
    with pytest.raises(ConfigError, match="no remote stage 'buffer'"):
        run_remote(_cfg(), "buffer", RUN)


def test_namespace_and_owner_reference(tmp_path):
    assert resolve_namespace("given") == "given"
    (tmp_path / "ns").write_text("kubeflow-user\n")
    assert resolve_namespace(None, str(tmp_path / "ns")) == "kubeflow-user"
    with pytest.raises(LaunchError, match="set cluster.launch.namespace"):
        resolve_namespace(None, str(tmp_path / "missing"))
    # what KFP 2.17 sets in an executor container (no namespace), plus pipelines/eks.py's downward-API one
    kfp_env = {"KFP_POD_NAME": "grpo-abc-123", "KFP_POD_UID": "uid-1"}
    missing = str(tmp_path / "missing")
    owner = own_pod_owner(NS, {**kfp_env, "MOERL_POD_NAMESPACE": NS}, sa_file=missing)
    assert owner == {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": "grpo-abc-123",
        "uid": "uid-1",
        "blockOwnerDeletion": False,
        "controller": False,
    }
    # never across
    assert (
        own_pod_owner("elsewhere", {**kfp_env, "MOERL_POD_NAMESPACE": NS}, sa_file=missing) is None
    )
    # no MOERL_POD_NAMESPACE: the service account's namespace file
    (tmp_path / "sa_ns").write_text(f"{NS}\n")
    assert own_pod_owner(NS, kfp_env, sa_file=str(tmp_path / "sa_ns"))["uid"] == "uid-1"
    # namespace unknown: no owner reference
    assert own_pod_owner(NS, kfp_env, sa_file=missing) is None
    # not in a KFP task
    assert own_pod_owner(NS, {"MOERL_POD_NAMESPACE": NS}, sa_file=missing) is None


# ---- watch and cleanup, on replayed API responses ------------------------------------------


class Replay:
    """Stands in for the urllib3 PoolManager under the real kubernetes client: answers each
    request with the next scripted (method, path, status, response) and records it. A response
    is a key of api_responses.json or, for lists built per test, the object itself."""

    def __init__(self, script: list[tuple[str, str, int, str]]) -> None:
        self.script, self.calls = list(script), []

    def request(
        self,
        method,
        url,
        fields=None,
        body=None,
        headers=None,
        preload_content=True,
        timeout=None,
        **kw,
    ):
        parts = urlsplit(url)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()} | dict(fields or {})
        self.calls.append((method, parts.path, query, json.loads(body) if body else None))
        assert self.script, f"unexpected request {method} {parts.path}"
        want_method, want_path, status, response = self.script.pop(0)
        assert (method, parts.path) == (want_method, want_path), (
            f"expected {want_method} {want_path}"
        )
        response = RESPONSES[response] if isinstance(response, str) else response
        return urllib3.HTTPResponse(
            body=json.dumps(response).encode(),
            status=status,
            reason={200: "OK", 201: "Created"}.get(status, "Error"),
            headers={"Content-Type": "application/json"},
            preload_content=True,
        )

    def deletes(self) -> list[tuple[str, dict]]:
        return [(path, q) for m, path, q, _ in self.calls if m == "DELETE"]


def _api(script) -> tuple[KubeApi, Replay]:
    api_client = k8s.ApiClient(k8s.Configuration(host="https://k8s.test"))
    replay = Replay(script)
    api_client.rest_client.pool_manager = replay
    return KubeApi.from_client(api_client), replay


TJ_PATH = f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{NS}/trainjobs"
POD_PATH = f"/api/v1/namespaces/{NS}/pods"


def tj(method: str, response: str, status: int = 200) -> tuple[str, str, int, str]:
    """A scripted call on the TrainJob: POST creates it, GET reads it, DELETE deletes it."""
    return method, TJ_PATH if method == "POST" else f"{TJ_PATH}/{TJ}", status, response


def pod(method: str, response: str, status: int = 200) -> tuple[str, str, int, str]:
    return method, POD_PATH if method == "POST" else f"{POD_PATH}/{POD}", status, response


def tj_pod(
    phase: str = "Running",
    waiting: tuple[str, str] | None = None,
    unschedulable: str | None = None,
    name: str = f"{TJ}-node-0-0-x7k2p",
    owner: str = f"{TJ}-node-0",
) -> dict:
    """A pod of the TrainJob, as the Job under its JobSet creates it (controller reference)."""
    status: dict = {"phase": phase}
    if waiting:
        status["containerStatuses"] = [
            {
                "name": "node",
                "ready": False,
                "restartCount": 0,
                "image": "x",
                "imageID": "",
                "state": {"waiting": {"reason": waiting[0], "message": waiting[1]}},
            }
        ]
    if unschedulable:
        status["conditions"] = [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": unschedulable,
            }
        ]
    return {
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {
                "moerl.ai/workload": TJ,
                "moerl.ai/run-id": RUN,
                "app.kubernetes.io/managed-by": "moerl",
            },
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": owner,
                    "uid": "j-1",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {"containers": [{"name": "node", "image": "x"}]},
        "status": status,
    }


def pod_list(*items: dict) -> dict:
    return {
        "kind": "PodList",
        "apiVersion": "v1",
        "metadata": {"resourceVersion": "1"},
        "items": list(items),
    }


def tj_pods(*items: dict) -> tuple[str, str, int, dict]:
    """The LIST of the TrainJob's pods (by its moerl.ai/workload label) that each poll makes
    while it has not ended."""
    return "GET", POD_PATH, 200, pod_list(*items)


class Clock:
    def __init__(self) -> None:
        self.t, self.sleeps = 0.0, []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s


def _trainjob_workload(api):
    return workload(api, NS, objects.trainjob(_cfg(), RUN, TJ, ["true"], []))


def _pod_workload(api):
    return workload(api, NS, objects.rollout_pod(_cfg(), RUN, "rollout-0", ["true"], [], name=POD))


def test_trainjob_success_is_watched_then_deleted_in_the_background():
    api, replay = _api(
        [
            tj("POST", "trainjob_created", 201),
            tj("GET", "trainjob_created"),
            tj_pods(),
            tj("GET", "trainjob_running"),
            tj_pods(tj_pod("Running")),
            tj("GET", "trainjob_complete"),
            tj("DELETE", "deleted_trainjob"),
        ]
    )
    clock = Clock()
    launcher = Launcher(poll_s=7.0, timeout_s=3600, clock=clock, sleep=clock.sleep)
    launcher.run([_trainjob_workload(api)])
    assert clock.sleeps == [7.0, 7.0]
    created = replay.calls[0][3]
    assert created["kind"] == "TrainJob" and created["metadata"]["name"] == TJ
    assert replay.deletes() == [(f"{TJ_PATH}/{TJ}", {"propagationPolicy": "Background"})]
    launcher.cleanup()  # idempotent: nothing more is deleted
    assert len(replay.deletes()) == 1 and not replay.script


def test_failed_trainjob_names_the_reason_and_the_failed_pod():
    api, replay = _api(
        [
            tj("POST", "trainjob_created", 201),
            tj("GET", "trainjob_running"),
            tj_pods(tj_pod()),
            tj("GET", "trainjob_failed"),
            ("GET", POD_PATH, 200, "pods_of_failed_trainjob"),
            tj("DELETE", "deleted_trainjob"),
        ]
    )
    clock = Clock()
    with pytest.raises(WorkloadFailed) as err:
        Launcher(1.0, 3600, clock, clock.sleep).run([_trainjob_workload(api)])
    msg = str(err.value)
    assert TJ in msg and "FailedJobs" in msg and "non-finite loss" in msg and "exit code 1" in msg
    assert (
        replay.calls[2][2]["labelSelector"]
        == replay.calls[4][2]["labelSelector"]
        == f"moerl.ai/workload={TJ}"
    )
    assert len(replay.deletes()) == 1


def test_pod_failure_carries_the_container_reason():
    api, replay = _api(
        [
            pod("POST", "pod_created", 201),
            pod("GET", "pod_unschedulable"),
            pod("GET", "pod_running"),
            pod("GET", "pod_oomkilled"),
            pod("DELETE", "deleted_pod"),
        ]
    )
    clock = Clock()
    with pytest.raises(
        WorkloadFailed,
        match=rf"Pod {NS}/{POD} failed: container rollout OOMKilled \(exit code 137\)",
    ):
        Launcher(1.0, 3600, clock, clock.sleep).run([_pod_workload(api)])
    assert replay.deletes() == [(f"{POD_PATH}/{POD}", {"propagationPolicy": "Background"})]


def test_pod_success_and_a_transient_api_error():
    api, replay = _api(
        [
            pod("POST", "pod_created", 201),
            pod("GET", "server_error", 500),
            pod("GET", "pod_running"),
            pod("GET", "pod_succeeded"),
            pod("DELETE", "deleted_pod"),
        ]
    )
    clock = Clock()
    Launcher(1.0, 3600, clock, clock.sleep).run([_pod_workload(api)])
    assert not replay.script


def test_missing_secret_fails_at_once_and_image_pull_backoff_after_a_while():
    api, _ = _api(
        [
            pod("POST", "pod_created", 201),
            pod("GET", "pod_config_error"),
            pod("DELETE", "deleted_pod"),
        ]
    )
    clock = Clock()
    with pytest.raises(
        WorkloadFailed, match='CreateContainerConfigError: secret "moerl-mlflow" not found'
    ):
        Launcher(1.0, 3600, clock, clock.sleep).run([_pod_workload(api)])
    polls = int(PULL_BACKOFF_S / 60) + 1
    api, replay = _api(
        [pod("POST", "pod_created", 201)]
        + [pod("GET", "pod_image_pull_backoff")] * polls
        + [pod("DELETE", "deleted_pod")]
    )
    clock = Clock()
    with pytest.raises(WorkloadFailed, match="ImagePullBackOff"):
        Launcher(60.0, 36000, clock, clock.sleep).run([_pod_workload(api)])
    assert clock.t >= PULL_BACKOFF_S and len(replay.deletes()) == 1 and not replay.script


def test_jobset_conditions():
    def js(*conds):
        conditions = [{"type": t, "status": st, "reason": r, "message": m} for t, st, r, m in conds]
        return {"status": {"conditions": conditions, "restarts": 0}}

    assert condition_state(js(("StartupPolicyCompleted", "True", "x", "")), "Completed") == State(
        summary="StartupPolicyCompleted"
    )
    assert condition_state(
        js(("Completed", "True", "AllJobsCompleted", "jobset completed successfully")), "Completed"
    ).done
    failed = condition_state(
        js(
            ("Completed", "False", "", ""),
            ("Failed", "True", "FailedJobs", "jobset failed due to one or more job failures"),
        ),
        "Completed",
    )
    assert (
        not failed.done
        and failed.failed == "FailedJobs: jobset failed due to one or more job failures"
    )


def test_workload_deleted_underneath_is_a_failure_and_cleanup_tolerates_it():
    api, replay = _api(
        [
            tj("POST", "trainjob_created", 201),
            tj("GET", "trainjob_running"),
            tj_pods(tj_pod()),
            tj("GET", "not_found_trainjob", 404),
            tj("DELETE", "not_found_trainjob", 404),
        ]
    )
    clock = Clock()
    launcher = Launcher(1.0, 3600, clock, clock.sleep)
    with pytest.raises(WorkloadDeleted, match=rf"TrainJob {NS}/{TJ} was deleted while it ran"):
        launcher.run([_trainjob_workload(api)])
    launcher.cleanup()
    assert len(replay.deletes()) == 1 and not replay.script


def test_timeout_deletes_the_workload_and_says_where_it_was_stuck():
    api, replay = _api(
        [pod("POST", "pod_created", 201)]
        + [pod("GET", "pod_unschedulable")] * 4
        + [pod("DELETE", "deleted_pod")]
    )
    clock = Clock()
    with pytest.raises(
        WorkloadTimeout, match="did not finish within 30 s .*Unschedulable: 0/4 nodes are available"
    ):
        Launcher(10.0, 30, clock, clock.sleep).run([_pod_workload(api)])
    assert len(replay.deletes()) == 1 and not replay.script


@pytest.mark.parametrize("when", ["sleeping", "reading"])
def test_sigterm_to_the_task_deletes_what_it_launched(when):
    # "reading": the signal comes before the list
    listed = [tj_pods(tj_pod())] if when == "sleeping" else []
    api, replay = _api(
        [
            tj("POST", "trainjob_created", 201),
            tj("GET", "trainjob_running"),
            *listed,
            tj("DELETE", "deleted_trainjob"),
        ]
    )
    before = signal.getsignal(signal.SIGTERM)

    def sigterm(*_a) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # a real signal, handled by the launcher

    w = _trainjob_workload(api)
    if when == "reading":  # arrives inside an API call, which must not count as an API error
        read = w.read
        w.read = lambda: (read(), sigterm())[0]
    with pytest.raises(
        LaunchInterrupted, match=f"received SIGTERM while running TrainJob {NS}/{TJ}"
    ):
        Launcher(1.0, 3600, sleep=sigterm).run([w])
    assert replay.deletes() == [(f"{TJ_PATH}/{TJ}", {"propagationPolicy": "Background"})]
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is put back


def test_a_create_that_fails_midway_deletes_what_was_created():
    api, replay = _api(
        [
            tj("POST", "trainjob_created", 201),
            pod("POST", "forbidden_pod_create", 403),
            tj("DELETE", "deleted_trainjob"),
        ]
    )
    with pytest.raises(
        LaunchError,
        match=r"creating Pod .* HTTP 403 .*cannot create resource \\?\"pods\\?\".*"
        r"service account needs create/get/delete",
    ):
        Launcher(1.0, 3600).run([_trainjob_workload(api), _pod_workload(api)])
    # not the pod
    assert replay.deletes() == [(f"{TJ_PATH}/{TJ}", {"propagationPolicy": "Background"})]
    assert not replay.script


def test_a_failing_delete_is_retried_with_backoff_and_404_counts_as_done():
    # the 503 went through after all
    api, replay = _api(
        [
            tj("POST", "trainjob_created", 201),
            tj("GET", "trainjob_complete"),
            tj("DELETE", "server_error", 500),
            tj("DELETE", "server_error", 503),
            tj("DELETE", "not_found_trainjob", 404),
        ]
    )
    clock = Clock()
    launcher = Launcher(1.0, 3600, clock, clock.sleep)
    launcher.run([_trainjob_workload(api)])
    assert clock.sleeps == [DELETE_BACKOFF_S, 2 * DELETE_BACKOFF_S] and len(replay.deletes()) == 3
    launcher.cleanup()  # done: nothing more
    assert len(replay.deletes()) == 3 and not replay.script


def test_a_delete_that_keeps_failing_gives_up_after_30_s_and_a_forbidden_one_at_once(caplog):
    api, replay = _api(
        [tj("POST", "trainjob_created", 201), tj("GET", "trainjob_complete")]
        + [tj("DELETE", "server_error", 500)] * DELETE_TRIES
    )
    clock = Clock()
    # the stage's result is not lost
    Launcher(1.0, 3600, clock, clock.sleep).run([_trainjob_workload(api)])
    assert (
        len(replay.deletes()) == DELETE_TRIES
        and 20 <= sum(clock.sleeps) <= 40
        and not replay.script
    )
    assert f"could not delete TrainJob {NS}/{TJ}: HTTP 500" in caplog.text
    api, replay = _api(
        [
            pod("POST", "pod_created", 201),
            pod("GET", "pod_succeeded"),
            pod("DELETE", "forbidden_pod_create", 403),
        ]
    )
    clock = Clock()
    Launcher(1.0, 3600, clock, clock.sleep).run([_pod_workload(api)])
    # 403 will not pass by waiting
    assert len(replay.deletes()) == 1 and clock.sleeps == [] and not replay.script


def test_trainjob_whose_pods_cannot_start_fails_without_waiting_for_a_condition():
    api, replay = _api(
        [
            tj("POST", "trainjob_created", 201),
            tj("GET", "trainjob_created"),
            tj_pods(tj_pod("Pending", waiting=("ContainerCreating", ""))),
            tj("GET", "trainjob_created"),
            tj_pods(
                tj_pod(
                    "Pending",
                    waiting=("CreateContainerConfigError", 'secret "moerl-mlflow" not found'),
                )
            ),
            tj("DELETE", "deleted_trainjob"),
        ]
    )
    clock = Clock()
    with pytest.raises(
        WorkloadFailed,
        match=rf"TrainJob {NS}/{TJ} failed: pod {TJ}-node-0-0-x7k2p: container node "
        r'CreateContainerConfigError: secret "moerl-mlflow" not found',
    ):
        Launcher(5.0, 3600, clock, clock.sleep).run([_trainjob_workload(api)])
    assert clock.t == 5.0 and len(replay.deletes()) == 1 and not replay.script


def test_trainjob_image_pull_backoff_fails_after_the_backoff_time():
    polls = int(PULL_BACKOFF_S / 100) + 1
    backoff = tj_pod(
        "Pending", waiting=("ImagePullBackOff", 'Back-off pulling image "registry.example/moerl:1"')
    )
    api, replay = _api(
        [tj("POST", "trainjob_created", 201)]
        + [tj("GET", "trainjob_created"), tj_pods(backoff)] * polls
        + [tj("DELETE", "deleted_trainjob")]
    )
    clock = Clock()
    with pytest.raises(
        WorkloadFailed, match=r"ImagePullBackOff: Back-off pulling image .* for 600 s"
    ):
        Launcher(100.0, 36000, clock, clock.sleep).run([_trainjob_workload(api)])
    assert clock.t == PULL_BACKOFF_S and not replay.script


UNSCHEDULABLE = "0/4 nodes are available: 4 Insufficient vpc.amazonaws.com/efa."


@pytest.mark.parametrize(
    "pods", [[tj_pod("Pending", unschedulable=UNSCHEDULABLE)], []], ids=["unschedulable", "none"]
)
def test_trainjob_with_no_pod_running_fails_after_the_pending_timeout(pods):
    polls = 4  # at 0, 100, 200, 300 s: the 4th poll is past the pending timeout of 250 s
    api, replay = _api(
        [tj("POST", "trainjob_created", 201)]
        + [tj("GET", "trainjob_created"), tj_pods(*pods)] * polls
        + [tj("DELETE", "deleted_trainjob")]
    )
    clock = Clock()
    with pytest.raises(WorkloadPending) as err:
        Launcher(100.0, 36000, clock, clock.sleep, pending_timeout_s=250).run(
            [_trainjob_workload(api)]
        )
    msg = str(err.value)
    assert msg.startswith(f"TrainJob {NS}/{TJ} failed: pending for 300 s, no pod started running")
    assert (f"Pending: Unschedulable: {UNSCHEDULABLE}" if pods else "no pods yet") in msg
    assert (
        isinstance(err.value, WorkloadFailed) and len(replay.deletes()) == 1 and not replay.script
    )


def test_a_pending_pod_fails_after_the_pending_timeout_but_a_started_one_does_not():
    api, replay = _api(
        [pod("POST", "pod_created", 201)]
        + [pod("GET", "pod_unschedulable")] * 3
        + [pod("DELETE", "deleted_pod")]
    )
    clock = Clock()
    with pytest.raises(
        WorkloadPending, match=rf"Pod {NS}/{POD} failed: pending for 1800 s, .*Unschedulable: 0/4"
    ):
        # the default PENDING_TIMEOUT_S
        Launcher(900.0, 36000, clock, clock.sleep).run([_pod_workload(api)])
    assert clock.t == PENDING_TIMEOUT_S and not replay.script
    api, replay = _api(
        [
            pod("POST", "pod_created", 201),
            pod("GET", "pod_running"),
            pod("GET", "pod_running"),
            pod("GET", "pod_succeeded"),
            pod("DELETE", "deleted_pod"),
        ]
    )
    clock = Clock()
    # running for longer than that: fine
    Launcher(900.0, 36000, clock, clock.sleep).run([_pod_workload(api)])
    assert clock.t == 2 * 900.0 and not replay.script


def test_a_trainjob_that_started_is_not_failed_as_pending_when_its_pods_go_away():
    api, replay = _api(
        [
            tj("POST", "trainjob_created", 201),
            tj("GET", "trainjob_running"),
            tj_pods(tj_pod()),
            tj("GET", "trainjob_running"),
            tj_pods(),  # pods gone, condition not yet there
            tj("GET", "trainjob_complete"),
            tj("DELETE", "deleted_trainjob"),
        ]
    )
    clock = Clock()
    Launcher(100.0, 36000, clock, clock.sleep, pending_timeout_s=50).run([_trainjob_workload(api)])
    assert clock.t == 200.0 and not replay.script


JS_PATH = f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets"
DEP_PATH = f"/apis/apps/v1/namespaces/{NS}/deployments"
FLEET = "moerl-rollout-worker-fleet-0a1b2c3d-abcde"  # an elastic run's fleet (moerl.launch.fleet)


def _listed(kind: str, name: str, **meta) -> dict:
    return {"apiVersion": "v1", "kind": kind, "metadata": {"name": name, "namespace": NS, **meta}}


def test_sweep_deletes_what_the_launcher_left_of_a_run():
    own_pod = _listed(
        "Pod",
        POD,
        ownerReferences=[
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": "grpo-task",
                "uid": "u-1",
                "controller": False,
            }
        ],
    )
    tj_list = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJobList",
        "metadata": {},
        "items": [_listed("TrainJob", TJ)],
    }
    dep_list = {
        "apiVersion": "apps/v1",
        "kind": "DeploymentList",
        "metadata": {},
        "items": [_listed("Deployment", FLEET)],
    }
    # the JobSet API is not installed (404); the TrainJob's own pod goes with it, not by itself;
    # an elastic run's fleet Deployment goes (what it owns, and its pods, with it)
    api, replay = _api(
        [
            ("GET", TJ_PATH, 200, tj_list),
            tj("DELETE", "deleted_trainjob"),
            ("GET", JS_PATH, 404, "not_found_trainjob"),
            ("GET", DEP_PATH, 200, dep_list),
            ("DELETE", f"{DEP_PATH}/{FLEET}", 200, {"kind": "Status"}),
            ("GET", POD_PATH, 200, pod_list(tj_pod(), own_pod)),
            pod("DELETE", "deleted_pod"),
        ]
    )
    assert sweep(RUN, NS, api=api, sleep=lambda s: None) == [
        f"TrainJob {NS}/{TJ}",
        f"Deployment {NS}/{FLEET}",
        f"Pod {NS}/{POD}",
    ]
    selectors = {q["labelSelector"] for m, _, q, _ in replay.calls if m == "GET"}
    assert selectors == {f"moerl.ai/run-id={RUN},app.kubernetes.io/managed-by=moerl"}
    assert [q for _, q in replay.deletes()] == [
        {"propagationPolicy": "Background"}
    ] * 3 and not replay.script


def test_sweep_keeps_going_and_then_says_what_it_could_not_delete():
    tj_list = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJobList",
        "metadata": {},
        "items": [_listed("TrainJob", TJ)],
    }
    empty = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSetList",
        "metadata": {},
        "items": [],
    }
    api, replay = _api(
        [
            ("GET", TJ_PATH, 200, tj_list),
            tj("DELETE", "forbidden_pod_create", 403),
            ("GET", JS_PATH, 200, empty),
            ("GET", DEP_PATH, 200, {"kind": "DeploymentList", "metadata": {}, "items": []}),
            ("GET", POD_PATH, 200, pod_list(_listed("Pod", POD))),
            pod("DELETE", "not_found_pod", 404),
        ]
    )
    with pytest.raises(
        LaunchError, match=rf"sweeping run {RUN} in {NS}: deleting TrainJob {NS}/{TJ}: HTTP 403"
    ):
        sweep(RUN, NS, api=api, sleep=lambda s: None)
    # the pod was tried (already gone: fine)
    assert len(replay.deletes()) == 2 and not replay.script
    with pytest.raises(LaunchError, match="needs a run id"):
        sweep("", NS, api=api)


def test_launched_pods_never_get_the_tasks_own_service_account(caplog):
    """The task's account may create pods (its Role); a launched stage gets moerl-worker (S3 only,
    no API token) by default, and never falls back to the task's."""
    from moerl.config import LaunchConfig

    assert LaunchConfig().service_account == "moerl-worker"
    assert launch_service_account(_cfg(), NS) == "moerl-gpu"  # the config wins
    # read-mostly S3 role
    assert launch_service_account(_cfg(), NS, "rollout_worker") == "moerl-rollout"
    cfg = _cfg(service_account=None, rollout_service_account=None)
    assert launch_service_account(cfg, NS) is None  # not the task's own
    assert "unset; set it to one with S3 access (moerl-worker)" in caplog.text
    tj_body = build(
        cfg, "policy_update", RUN, TJ, ["true"], None, None, launch_service_account(cfg, NS)
    )
    (rjob,) = tj_body["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
        "replicatedJobs"
    ]
    assert "serviceAccountName" not in rjob["template"]["spec"]["template"]["spec"]
    assert (
        "serviceAccountName"
        not in build(cfg, "rollout_worker", RUN, POD, ["true"], "rollout-0", None)["spec"]
    )


@pytest.mark.parametrize(
    "uri, passed",
    [
        ("http://alice:s3cret@mlflow.mlflow:5000", "http://mlflow.mlflow:5000"),
        ("https://alice@mlflow.example/path", "https://mlflow.example/path"),
        # useless without its password: left out
        (
            "postgresql://alice:s3cret@db.mlflow:5432/mlflow",
            None,
        ),
        ("http://mlflow.mlflow:5000", "http://mlflow.mlflow:5000"),
    ],
)
def test_tracking_credentials_never_land_in_a_launched_object(uri, passed, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    for stage, worker in (("policy_update", None), ("rollout_worker", "rollout-0")):
        body = build(_cfg(), stage, RUN, TJ, ["true"], worker, None)
        text = json.dumps(body)
        assert "s3cret" not in text and "alice" not in text
        env = (
            body["spec"]["trainer"]["env"]
            if stage == "policy_update"
            else body["spec"]["containers"][0]["env"]
        )
        assert _env(env).get("MLFLOW_TRACKING_URI") == passed


# ---- the S3 exchange and the launched pod, for real ----------------------------------------


def test_node_parts_merge_and_refuse_what_would_be_lost():
    from moerl.launch.task import merge_outputs

    r0 = {
        "outputs": {
            "s": {"kind": "dir", "files": ["model.safetensors", "o/__0_0.distcp", "o/.metadata"]}
        },
        "nodes": 2,
    }
    r1 = {"outputs": {"s": {"kind": "dir", "files": ["o/__1_0.distcp"]}}}
    assert merge_outputs("s", [r0, r1], "TrainJob t")["files"] == sorted(
        [*r0["outputs"]["s"]["files"], "o/__1_0.distcp"]
    )
    with pytest.raises(LaunchError, match="nodes 0 and 1 both wrote o/.metadata"):
        merge_outputs(
            "s", [r0, {"outputs": {"s": {"kind": "dir", "files": ["o/.metadata"]}}}], "TrainJob t"
        )
    with pytest.raises(LaunchError, match="did not produce output 's'"):
        merge_outputs("s", [{"outputs": {}}, r1], "TrainJob t")


def test_node_group_from_trainers_variables():
    from moerl.launch.nodes import node_group

    assert node_group({}) is None and node_group({"PET_NNODES": "1"}) is None
    g = node_group(
        {
            "PET_NNODES": "2",
            "PET_NODE_RANK": "1",
            "PET_MASTER_ADDR": "moerl-x-node-0-0.moerl-x",
            "PET_MASTER_PORT": "29400",
        }
    )
    assert (g.rank, g.size, g.leader, g.loopback) == (1, 2, False, False)
    for env, needle in (
        (
            {
                "PET_NNODES": "2",
                "PET_NODE_RANK": "2",
                "PET_MASTER_ADDR": "a",
                "PET_MASTER_PORT": "1",
            },
            "PET_NODE_RANK=2 is outside 0..1",
        ),
        ({"PET_NNODES": "two"}, "PET_NNODES='two'"),
        (
            {"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_MASTER_PORT": "1"},
            "needs node 0's address",
        ),
    ):
        with pytest.raises(ConfigError, match=needle):
            node_group(env)


def test_trainjob_nodes_follow_the_mesh():
    """numNodes is the mesh's ranks at gpus_per_node per node (the seed's 16 x 8 H200 for a
    (16, 8) mesh); an explicit cluster.launch.trainer_nodes wins; a CPU trainer is one node."""

    def cfg(device, dp, ep, **launch):
        return parse_config(
            {
                "trainer": {
                    "parallelism": {
                        "device": device,
                        "data_parallel_shard": dp,
                        "expert_parallel_size": ep,
                    }
                },
                "cluster": {"launch": launch},
            }
        )

    assert objects.trainer_nodes(cfg("cuda", 16, 8)) == 16
    assert (
        objects.trainer_nodes(cfg("cuda", 1, 8)) == 1
        and objects.trainer_nodes(cfg("cuda", 1, 4)) == 1
    )
    assert objects.trainer_nodes(cfg("cuda", 4, 8, gpus_per_node=4)) == 8
    assert (
        objects.trainer_nodes(cfg("cpu", 2, 2)) == 1
        and objects.trainer_nodes(cfg("cpu", 2, 2, trainer_nodes=2)) == 2
    )
    tj = objects.trainjob(cfg("cuda", 16, 8), RUN, "moerl-policy-update-x", ["true"], [])
    assert tj["spec"]["trainer"]["numNodes"] == 16
