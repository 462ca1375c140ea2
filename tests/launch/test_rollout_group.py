"""A rollout engine over several nodes, launched as one JobSet per worker (docs/launch.md,
"Engines across nodes"): the JobSet and its NetworkPolicy against the published schemas
(JobSet v0.12.0's CRD, strict; Kubernetes 1.37, kubernetes-validate strict), the node ranks and
the leader's DNS name, the launch that creates the policy owned by the JobSet (API responses
replayed through the real kubernetes client), the pod's dispatch to leader or follower by rank,
the sync stage's refusal and the EKS compile.

No API server, no engine: the follower's stage code is the lead's
(components/rollout/follower.py); the dispatch test stands a fake in for it and for the leader's
worker function, which is all the dispatch calls.
"""

from __future__ import annotations

import os
import sys
import types

import jsonschema
import kubernetes_validate
import pytest
import yaml

from moerl.config import config_from_json, parse_config
from moerl.errors import ConfigError
from moerl.launch import objects, remote
from moerl.launch.task import build, check_launchable, is_group, workload_name_for
from moerl.launch.watch import Launcher, LaunchError, WorkloadFailed, workload
from moerl.orchestrate.compile import compile_pipeline
from tests.unit.test_launch import K8S_VERSION, NS, RFC1035, RUN, Clock, _api, _crd_schema, _env

JS_PATH = f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets"
NP_PATH = f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies"
POD_PATH = f"/api/v1/namespaces/{NS}/pods"
UID = "5a0c9f8e-1d2b-4c3a-9e8f-7a6b5c4d3e2f"
CMD = ["python", "-m", "moerl.launch.remote", "s3://b/runs/r/exchange/k/spec.json"]


def _cfg(nodes: int = 2, tp: int = 1, dp: int = 16, mode: str = "async", **launch) -> object:
    return parse_config(
        {
            "checkpoint": {"uri": "s3://moerl-ckpt/prod"},
            "pipeline": {"base_image": "registry.example/moerl:1", "mode": mode},
            "rollout": {
                "device": "cuda",
                "tensor_parallel_size": tp,
                "data_parallel_size": dp,
                "enable_expert_parallel": True,
                "grace_seconds": 90,
            },
            "cluster": {
                "launch": {
                    "mode": "kubernetes",
                    "service_account": "moerl-gpu",
                    "gpus_per_node": 8,
                    "efa_per_node": 16,
                    "rollout_nodes_per_worker": nodes,
                    **launch,
                }
            },
        }
    )


@pytest.fixture(scope="module")
def jobset_schema() -> dict:
    return _crd_schema("jobset.x-k8s.io_jobsets.v0.12.0.yaml.gz", "v1alpha2")


def _group(cfg, worker: str = "rollout-3") -> dict:
    name = workload_name_for(cfg, "rollout_worker", RUN, worker)
    return build(cfg, "rollout_worker", RUN, name, CMD, worker, owner=None, service_account=None)


def _pods(js: dict) -> dict[str, dict]:
    """replicated job name -> its pod template as a Pod."""
    return {
        rj["name"]: {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "p", **rj["template"]["spec"]["template"]["metadata"]},
            "spec": rj["template"]["spec"]["template"]["spec"],
        }
        for rj in js["spec"]["replicatedJobs"]
    }


# ---- the objects ------------------------------------------------------------------------------


@pytest.mark.parametrize("nodes", [2, 4])
def test_a_group_worker_launches_as_a_valid_jobset_of_whole_nodes(jobset_schema, nodes):
    cfg = _cfg(nodes=nodes, dp=8 * nodes)
    assert is_group(cfg, "rollout_worker") and not is_group(cfg, "rollout")
    js = _group(cfg)
    assert js["kind"] == "JobSet"
    jsonschema.Draft7Validator(jobset_schema).validate(js)  # strict: a typo fails
    name = js["metadata"]["name"]
    # the longest pod name the Job controller derives is still a DNS label
    assert RFC1035.match(name) and len(f"{name}-worker-0-{nodes - 2}-abcde") <= 63
    leader, worker = js["spec"]["replicatedJobs"]
    assert (leader["name"], leader["replicas"], leader["template"]["spec"]["completions"]) == (
        "leader",
        1,
        1,
    )
    assert worker["template"]["spec"]["completions"] == nodes - 1
    assert worker["template"]["spec"]["completionMode"] == "Indexed"
    # the group's outcome is the leader's; any pod's failure fails it, and KFP retries it whole
    assert js["spec"]["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["leader"]}
    assert js["spec"]["failurePolicy"] == {"maxRestarts": 0}
    for rj in (leader, worker):
        assert rj["template"]["spec"]["backoffLimit"] == 0
    net = js["spec"]["network"]
    assert net["enableDNSHostnames"] and net["publishNotReadyAddresses"]
    for role, pod in _pods(js).items():
        assert kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
        spec = pod["spec"]
        (c,) = spec["containers"]
        # every pod: all GPUs and EFA devices of its node, requests = limits
        for k in ("requests", "limits"):
            assert c["resources"][k]["nvidia.com/gpu"] == "8", role
            assert c["resources"][k]["vpc.amazonaws.com/efa"] == "16", role
        # every pod may drain within the worker's grace and the margin
        assert spec["terminationGracePeriodSeconds"] == 90 + objects.GRACE_MARGIN_S
        assert spec["restartPolicy"] == "Never" and spec["automountServiceAccountToken"] is False
        labels = pod["metadata"]["labels"]
        assert labels[objects.LABEL_WORKLOAD] == name  # what the watch lists the pods by
        assert labels[objects.LABEL_GROUP] == "rollout"  # the fan-out's policy admits it
        e = _env(c)
        assert e["MOERL_GROUP_SIZE"] == str(nodes)
        # JobSet's hostname scheme: <jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<subdomain>
        assert e["MOERL_LEADER_ADDRESS"] == f"{name}-leader-0-0.{net['subdomain']}"
        assert e["MOERL_LEADER_ADDRESS"] == objects.leader_address(name)
    leader_env, worker_env = (_env(p["spec"]["containers"][0]) for p in _pods(js).values())
    assert leader_env["MOERL_NODE_RANK"] == "0" and "MOERL_WORKER_INDEX" not in leader_env
    # a worker's rank is its completion index + 1 (moerl.launch.remote adds the one)
    assert "MOERL_NODE_RANK" not in worker_env
    assert worker_env["MOERL_WORKER_INDEX"] == {
        "fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        }
    }


def test_the_groups_network_policy_admits_its_own_pods_on_every_tcp_port_and_no_one_else():
    js = _group(_cfg())
    name = js["metadata"]["name"]
    owner = objects.jobset_owner(name, UID)
    pol = objects.rollout_group_policy(js, owner)
    assert kubernetes_validate.validate(pol, K8S_VERSION, strict=True)
    members = {"matchLabels": {"jobset.sigs.k8s.io/jobset-name": name}}
    assert pol["metadata"]["name"] == name
    assert (
        pol["metadata"]["labels"][objects.LABEL_RUN] == js["metadata"]["labels"][objects.LABEL_RUN]
    )
    assert pol["metadata"]["ownerReferences"] == [owner]
    assert owner["kind"] == "JobSet" and owner["apiVersion"] == js["apiVersion"]
    assert owner["uid"] == UID
    assert pol["spec"]["podSelector"] == members
    assert pol["spec"]["policyTypes"] == ["Ingress"]  # egress stays as the namespace has it
    (rule,) = pol["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": members}]  # no namespaceSelector, no ipBlock
    assert rule["ports"] == [{"protocol": "TCP"}]  # no port: every one (DP RPC, NCCL, DeepEP)


# ---- the launch: the JobSet, then its policy owned by it -------------------------------------


def _created(js: dict) -> dict:
    return {**js, "metadata": {**js["metadata"], "uid": UID, "namespace": NS}}


def _status(js: dict, *conds: tuple[str, str, str]) -> dict:
    conditions = [{"type": t, "status": "True", "reason": r, "message": m} for t, r, m in conds]
    return {**_created(js), "status": {"conditions": conditions, "restarts": 0}}


def test_launch_creates_the_policy_owned_by_the_jobset_and_deletes_only_the_jobset():
    js = _group(_cfg())
    name = js["metadata"]["name"]
    api, replay = _api(
        [
            ("POST", JS_PATH, 201, _created(js)),
            ("POST", NP_PATH, 201, {"kind": "NetworkPolicy"}),
            ("GET", f"{JS_PATH}/{name}", 200, _status(js, ("Completed", "AllJobsCompleted", ""))),
            ("DELETE", f"{JS_PATH}/{name}", 200, {"kind": "Status"}),
        ]
    )
    clock = Clock()
    w = workload(api, NS, js, [objects.rollout_group_policy(js)])
    Launcher(5, 3600, clock=clock, sleep=clock.sleep).run([w])
    (_, _, _, sent) = replay.calls[1]
    assert sent["kind"] == "NetworkPolicy" and sent["metadata"]["name"] == name
    assert sent["metadata"]["ownerReferences"] == [objects.jobset_owner(name, UID)]
    # the policy goes with its JobSet (garbage collector): only the JobSet is deleted
    assert [p for p, _ in replay.deletes()] == [f"{JS_PATH}/{name}"]
    assert not replay.script


def test_a_failed_follower_fails_the_group_and_the_group_is_deleted():
    js = _group(_cfg())
    name = js["metadata"]["name"]
    follower = {
        "metadata": {
            "name": f"{name}-worker-0-0-x7k2p",
            "namespace": NS,
            "labels": {objects.LABEL_WORKLOAD: name},
        },
        "spec": {"containers": [{"name": "rollout", "image": "x"}]},
        "status": {
            "phase": "Failed",
            "containerStatuses": [
                {
                    "name": "rollout",
                    "ready": False,
                    "restartCount": 0,
                    "image": "x",
                    "imageID": "",
                    "state": {
                        "terminated": {
                            "exitCode": 75,
                            "reason": "Error",
                            "message": "FollowerFailed: follower node 1 of rollout group rollout-3 exited 75",
                        }
                    },
                }
            ],
        },
    }
    failed = _status(js, ("Failed", "FailedJobs", "jobset failed due to one or more job failures"))
    api, replay = _api(
        [
            ("POST", JS_PATH, 201, _created(js)),
            ("POST", NP_PATH, 201, {"kind": "NetworkPolicy"}),
            ("GET", f"{JS_PATH}/{name}", 200, failed),
            ("GET", POD_PATH, 200, {"kind": "PodList", "items": [follower]}),
            ("DELETE", f"{JS_PATH}/{name}", 200, {"kind": "Status"}),
        ]
    )
    clock = Clock()
    w = workload(api, NS, js, [objects.rollout_group_policy(js)])
    with pytest.raises(WorkloadFailed, match=r"FailedJobs.*follower node 1 .* exited 75"):
        Launcher(5, 3600, clock=clock, sleep=clock.sleep).run([w])
    assert [p for p, _ in replay.deletes()] == [f"{JS_PATH}/{name}"]


def test_a_policy_the_task_may_not_create_fails_the_launch_and_deletes_the_jobset():
    js = _group(_cfg())
    name = js["metadata"]["name"]
    api, replay = _api(
        [
            ("POST", JS_PATH, 201, _created(js)),
            ("POST", NP_PATH, 403, {"kind": "Status", "message": "forbidden"}),
            ("DELETE", f"{JS_PATH}/{name}", 200, {"kind": "Status"}),
        ]
    )
    clock = Clock()
    w = workload(api, NS, js, [objects.rollout_group_policy(js)])
    with pytest.raises(LaunchError, match="needs create on networkpolicies.networking.k8s.io"):
        Launcher(5, 3600, clock=clock, sleep=clock.sleep).run([w])
    assert [p for p, _ in replay.deletes()] == [f"{JS_PATH}/{name}"]


def test_only_a_jobset_owns_objects():
    cfg = _cfg(nodes=1, dp=8)
    pod = objects.rollout_pod(cfg, RUN, "rollout-0", ["true"], [])
    with pytest.raises(ValueError, match="only a JobSet"):
        workload(None, NS, pod, [{"kind": "NetworkPolicy"}])  # type: ignore[arg-type]


# ---- in the pod: leader or follower by rank --------------------------------------------------


@pytest.fixture
def stand_ins(monkeypatch):
    """The leader's worker function and the follower's, recording what the dispatch passed and
    the node rank the environment held when they were called."""
    calls: list[tuple[str, str, str | None]] = []
    follower_code = {"code": 0}

    def leader(cfg, run_id, worker):
        calls.append(("leader", worker, os.environ.get("MOERL_NODE_RANK")))
        return 0

    def follower(cfg, run_id, worker):
        calls.append(("follower", worker, os.environ.get("MOERL_NODE_RANK")))
        return follower_code["code"]

    def pod(cfg, run_id, index):
        calls.append(("pod", str(index), None))
        return 0

    import moerl.components.rollout.pod as pod_module
    import moerl.components.rollout.worker as worker_module

    monkeypatch.setattr(worker_module, "run_rollout_worker", leader)
    monkeypatch.setattr(pod_module, "run_rollout_pod", pod)
    fake = types.ModuleType("moerl.components.rollout.follower")
    fake.run_follower = follower  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "moerl.components.rollout.follower", fake)
    for var in ("MOERL_NODE_RANK", "MOERL_WORKER_INDEX", "MOERL_GROUP_SIZE"):
        monkeypatch.delenv(var, raising=False)
    return calls, follower_code


def _dispatch(cfg) -> object:
    return remote.STAGES["rollout_worker"].fn(cfg, RUN, {"worker": "rollout-3", "pod": 3}, {}, {})


def test_rank_0_runs_the_leader_and_worker_pods_the_follower_at_index_plus_one(
    stand_ins, monkeypatch
):
    calls, _ = stand_ins
    cfg = _cfg(nodes=3, dp=24)
    monkeypatch.setenv("MOERL_GROUP_SIZE", "3")
    monkeypatch.setenv("MOERL_NODE_RANK", "0")
    assert _dispatch(cfg) == 0
    monkeypatch.delenv("MOERL_NODE_RANK")
    monkeypatch.setenv("MOERL_WORKER_INDEX", "1")  # the second worker pod: node rank 2
    assert _dispatch(cfg) == 0
    assert calls == [("leader", "rollout-3", "0"), ("follower", "rollout-3", "2")]


def test_outside_a_group_the_pod_runs_its_engines_as_before(stand_ins):
    calls, _ = stand_ins
    assert _dispatch(_cfg(nodes=1, dp=8)) == 0
    assert calls == [("pod", "3", None)]


def test_a_follower_that_does_not_finish_fails_its_pod_with_its_code(stand_ins, monkeypatch):
    calls, follower_code = stand_ins
    follower_code["code"] = 75  # drained (EXIT_DRAINED): the group must fail and be retried
    monkeypatch.setenv("MOERL_GROUP_SIZE", "2")
    monkeypatch.setenv("MOERL_WORKER_INDEX", "0")
    with pytest.raises(remote.FollowerFailed, match="follower node 1 .* exited 75") as e:
        _dispatch(_cfg())
    assert e.value.exit_code == 75
    assert calls == [("follower", "rollout-3", "1")]


def test_group_rank_reads_and_checks_the_environment():
    env = {"MOERL_WORKER_INDEX": "2", "MOERL_GROUP_SIZE": "4"}
    assert remote.group_rank(env) == 3 and env["MOERL_NODE_RANK"] == "3"
    assert remote.group_rank({"MOERL_NODE_RANK": "0", "MOERL_GROUP_SIZE": "2"}) == 0
    assert remote.group_rank({}) is None
    with pytest.raises(remote.RemoteError, match="outside the group"):
        remote.group_rank({"MOERL_WORKER_INDEX": "1", "MOERL_GROUP_SIZE": "2"})
    with pytest.raises(remote.RemoteError, match="completion index"):
        remote.group_rank({"MOERL_WORKER_INDEX": "x"})


# ---- what is refused, and the compile ---------------------------------------------------------


def test_the_sync_rollout_stage_refuses_nodes_and_names_the_async_pipeline():
    cfg = _cfg(mode="sync")
    with pytest.raises(
        ConfigError,
        match=r"cluster.launch.rollout_nodes_per_worker 2: the sync .*pipeline.mode async",
    ):
        check_launchable(cfg, "rollout")
    check_launchable(_cfg(), "rollout_worker")  # accepted: TP x DP = 16 = 8 GPUs x 2 nodes


def test_an_engine_that_is_not_its_nodes_gpus_is_refused():
    with pytest.raises(ConfigError, match="rollout_nodes_per_worker = 2 nodes of 8 GPUs"):
        check_launchable(_cfg(dp=8), "rollout_worker")


def _eks(mode: str, nodes: int) -> dict:
    data = {
        "checkpoint": {"uri": "s3://moerl-runs/team"},
        "tracking": {"uri": "https://mlflow.moerl.svc:5000"},
        "pipeline": {"mode": mode, "iterations": 2},
        "rollout": {
            "device": "cuda",
            "data_parallel_size": 8 * nodes,
            "enable_expert_parallel": True,
            "workers": 2,
        },
        "cluster": {
            "groups": {
                g: {"image": f"ecr.example/moerl-{g}:1"}
                for g in ("trainer", "rollout", "cpu", "buffer", "reward")
            },
            "launch": {"mode": "kubernetes", "rollout_nodes_per_worker": nodes},
        },
    }
    if mode == "async":
        data["valkey"] = {"url": "redis://valkey.moerl.svc:6379/0", "username": "moerl"}
    return data


def test_compile_for_eks_accepts_an_async_group_and_refuses_a_sync_one(tmp_path):
    path = compile_pipeline(parse_config(_eks("async", 2)), tmp_path / "a.yaml", target="eks")
    # the run's config, as the pipeline passes it to the rollout_worker launcher task, builds
    # a JobSet of two whole nodes there
    pipeline_doc = next(yaml.safe_load_all(path.read_text()))
    params = pipeline_doc["root"]["inputDefinitions"]["parameters"]
    cfg = config_from_json(params["config_json"]["defaultValue"])
    js = _group(cfg, "rollout-1")
    pods = _pods(js)
    assert js["kind"] == "JobSet" and sorted(pods) == ["leader", "worker"]
    for pod in pods.values():
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        assert (limits["nvidia.com/gpu"], limits["vpc.amazonaws.com/efa"]) == ("8", "16")
    with pytest.raises(ConfigError, match="pipeline.mode async"):
        compile_pipeline(parse_config(_eks("sync", 2)), tmp_path / "s.yaml", target="eks")
    assert not (tmp_path / "s.yaml").exists()
