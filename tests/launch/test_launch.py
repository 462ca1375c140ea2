"""moerl.launch against real parts: the S3 exchange round trip with `python -m
moerl.launch.remote` running a real stage in a subprocess (the "pod"), a stage failure and a
termination log on the way back, and a trainer on two simulated nodes. No API server runs
here: a fake kubelet turns the launched objects into local processes. The schemas and the
watch logic on recorded API responses are in tests/unit/test_launch.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from moerl.config import parse_config
from moerl.launch.exchange import Exchange
from moerl.launch.task import run_remote
from moerl.launch.watch import WorkloadFailed
from tests.support.weights import read_weights
from tests.unit.test_launch import NS


class Kubelet:
    """A KubeApi double that runs what a created TrainJob or Pod asks for, as local processes:
    its command (the image's `python` is this interpreter) with its plain env values; its AWS
    credentials come from this process's standard chain, as IRSA gives them to a pod. A TrainJob
    of `numNodes` N runs N processes, as Trainer's torch plugin runs N pods: each gets
    PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR (here 127.0.0.1) and PET_MASTER_PORT, and a
    scratch folder of its own (a pod's emptyDir); the job completes when every node exits 0."""

    def __init__(self) -> None:
        self.core, self.custom, self.procs, self.bodies, self.deleted = self, self, {}, [], []

    def _start(self, body: dict) -> None:
        self.bodies.append(body)
        spec = body["spec"]
        c = spec["trainer"] if body["kind"] == "TrainJob" else spec["containers"][0]
        env = {
            k: v
            for k, v in os.environ.items()
            if k.startswith("AWS_") or k in ("PATH", "PYTHONPATH")
        }
        env |= {e["name"]: e["value"] for e in c["env"] if "value" in e}
        cmd = [
            sys.executable if c["command"][0] == "python" else c["command"][0],
            *c["command"][1:],
        ]
        nodes = c.get("numNodes", 1)
        if nodes == 1:
            self.procs[body["metadata"]["name"]] = [subprocess.Popen(cmd, env=env)]
            return
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        procs = []
        for k in range(nodes):
            scratch = f"{env['MOERL_SCRATCH']}/node-{k}"
            procs.append(
                subprocess.Popen(
                    cmd,
                    env={
                        **env,
                        "PET_NNODES": str(nodes),
                        "PET_NODE_RANK": str(k),
                        "PET_MASTER_ADDR": "127.0.0.1",
                        "PET_MASTER_PORT": str(port),
                        "MOERL_SCRATCH": scratch,
                        "HOME": f"{scratch}/home",
                        "TMPDIR": f"{scratch}/tmp",
                    },
                )
            )
        self.procs[body["metadata"]["name"]] = procs

    def _read(self, name: str, kind: str) -> object:
        codes = [p.poll() for p in self.procs[name]]
        code = next((c for c in codes if c not in (None, 0)), None if None in codes else 0)
        if kind == "Pod":
            phase = {None: "Running", 0: "Succeeded"}.get(code, "Failed")
            obj = {"metadata": {"name": name}, "status": {"phase": phase}}
        else:
            cond = (
                []
                if code is None
                else [
                    {
                        "type": "Complete" if code == 0 else "Failed",
                        "status": "True",
                        "reason": "x",
                        "message": f"exit {code}",
                    }
                ]
            )
            obj = {"metadata": {"name": name}, "status": {"conditions": cond}}
        return type("Resp", (), {"data": json.dumps(obj)})()

    def create_namespaced_custom_object(self, g, v, ns, plural, body, **kw):
        self._start(body)

    def create_namespaced_pod(self, ns, body, **kw):
        self._start(body)

    def get_namespaced_custom_object(self, g, v, ns, plural, name, **kw):
        return self._read(name, "TrainJob")

    def read_namespaced_pod(self, name, ns, **kw):
        return self._read(name, "Pod")

    def list_namespaced_pod(self, ns, **kw):
        return type("Resp", (), {"data": '{"items": []}'})()

    def delete_namespaced_custom_object(self, g, v, ns, plural, name, **kw):
        self.deleted.append(name)
        for p in self.procs[name]:
            p.kill()
            p.wait()

    def delete_namespaced_pod(self, name, ns, **kw):
        self.delete_namespaced_custom_object(None, None, ns, None, name)


def _batch(n: int = 8):
    from moerl.records import TrainSample

    return [
        TrainSample(
            prompt_token_ids=[21, 22, 23, 5 + i % 10],
            response_token_ids=[5 + i % 10, 6, 1],
            response_logprobs=[-3.0, -3.1, -2.9],
            advantage=1.0 if i % 2 else -1.0,
            policy_version=0,
        )
        for i in range(n)
    ]


def _tracked(cfg, tmp_path: Path):
    """cfg with a real MLflow store in tmp_path, and a run in it: the pod's stage records its
    runtime probe on that run at start (moerl/provenance.py stage_start)."""
    from moerl import tracking

    cfg = cfg.model_copy(
        update={
            "tracking": cfg.tracking.model_copy(
                update={"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}
            )
        }
    )
    return cfg, tracking.start_run(
        cfg, tracking.resolve_uri(cfg.tracking), {"moerl.mode": "launch-test"}
    )


def _tree(d: Path) -> dict[str, bytes]:
    return {
        p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()
    }


def _version0(cfg, run_id: str, tmp_path: Path):
    """The tiny model published as version 0 of `run_id` (what init_policy does)."""
    from moerl.components.publish_checkpoint.stage import prepare_initial, run_publish

    prepare_initial(cfg, tmp_path / f"v0-{run_id}")
    return run_publish(cfg, run_id, tmp_path / f"v0-{run_id}", 0)[0]


def _laid_out(cfg, run_id: str, version: int, dest: Path) -> dict[str, bytes]:
    """Published `version` of `run_id`, state included, fetched and verified into `dest`."""
    from moerl.components.publish_checkpoint.stage import prepare_resume

    prepare_resume(cfg, run_id, version, dest)
    return _tree(dest)


def _local(cfg, run_id: str):
    """`cfg` run on this machine (no launch), for the same update in-process."""
    return cfg.model_copy(
        update={
            "cluster": cfg.cluster.model_copy(
                update={
                    "launch": cfg.cluster.launch.model_copy(
                        update={"mode": "in_task", "trainer_nodes": 1}
                    )
                }
            )
        }
    )


def _remote_update(cfg, tmp_path: Path, monkeypatch, iteration: int, out: str):
    """Version 0 published, a batch as the task's artifact, and run_remote's policy update of
    them through the test kubelet: it publishes version 1, laid out into `tmp_path / out`.
    (cfg, run_id, kubelet, the task's value {policy_json, metrics})."""
    from moerl.records import write_records

    cfg, run_id = _tracked(cfg, tmp_path)
    policy0 = _version0(cfg, run_id, tmp_path)
    write_records(tmp_path / "batch.jsonl", _batch())
    monkeypatch.delenv("MOERL_SANDBOX_ROOT", raising=False)
    kubelet = Kubelet()
    value = run_remote(
        cfg,
        "policy_update",
        run_id,
        args={"iteration": iteration, "policy_json": policy0.model_dump_json()},
        inputs={"batch": tmp_path / "batch.jsonl"},
        api=kubelet,
    )
    _laid_out(cfg, run_id, 1, tmp_path / out)
    return cfg, run_id, kubelet, value


def _local_update(cfg, tmp_path: Path, iteration: int, out: str):
    """The same update in this process, under a run of its own: (metrics, its run id)."""
    from moerl import tracking
    from moerl.components.policy_update.update import run_sync_update

    local = _local(cfg, "")
    run_id = tracking.start_run(local, tracking.resolve_uri(local.tracking), {"moerl.mode": "t"})
    policy0 = _version0(local, run_id, tmp_path)
    done = run_sync_update(local, run_id, policy0, tmp_path / "batch.jsonl", iteration)
    assert done is not None and done[0].version == 1
    _laid_out(local, run_id, 1, tmp_path / out)
    return done[1], run_id


def _same_update(a: dict, b: dict) -> None:
    """Two updates' metrics agree on everything but time and the publication's own."""
    keep = ("train/", "moe/", "rollout_corr/")
    assert {k: v for k, v in a.items() if k.startswith(keep)} == {
        k: v for k, v in b.items() if k.startswith(keep)
    }


def test_remote_policy_update_round_trip_matches_the_in_process_stage(
    s3_server, tmp_path, monkeypatch
):
    """run_remote stages the batch (the only input: no trainer state passes through the task)
    to S3, the "pod" (`python -m moerl.launch.remote`, started from the TrainJob's own command
    and env) lays version 0 out from the store, trains and publishes version 1, and that
    version is byte-identical to the same update run in this process."""
    bucket = f"moerl-launch-{uuid.uuid4().hex[:10]}"
    s3_server.client().create_bucket(Bucket=bucket)
    cfg = parse_config(
        {
            "checkpoint": {
                "uri": f"s3://{bucket}/ckpt",
                "endpoint_url": s3_server.endpoint_url,
                "region": "us-east-1",
            },
            "trainer": {"optimizer": {"optimizer_steps_per_iteration": 2, "learning_rate": 0.01}},
            "cluster": {
                "scratch_dir": str(tmp_path / "scratch"),
                "launch": {"mode": "kubernetes", "namespace": NS, "poll_s": 0.2},
            },
        }
    )
    cfg, run_id, kubelet, value = _remote_update(cfg, tmp_path, monkeypatch, 3, "remote_out")
    metrics = value["metrics"]
    assert json.loads(value["policy_json"])["version"] == 1
    assert metrics["train/steps"] == 2 and metrics["weights/version"] == 1
    local, _ = _local_update(cfg, tmp_path, 3, "local_out")
    _same_update(metrics, local)
    remote_tree, local_tree = _tree(tmp_path / "remote_out"), _tree(tmp_path / "local_out")
    weights = [k for k in remote_tree if k.endswith(".safetensors") and "/" not in k]
    assert remote_tree.keys() == local_tree.keys() and weights  # the one rank's own file(s)
    assert all(remote_tree[k] == local_tree[k] for k in [*weights, "model.safetensors.index.json"])
    assert "trainer/optimizer/.metadata" in remote_tree  # the state, straight to the store
    # the TrainJob ran in the scratch dir it was given, was deleted, and the exchange is gone
    (body,) = kubelet.bodies
    assert body["kind"] == "TrainJob" and kubelet.deleted == [body["metadata"]["name"]]
    assert (tmp_path / "scratch" / "tmp").is_dir()
    ex = Exchange(cfg.checkpoint, f"s3://{bucket}/ckpt/runs/{run_id}/exchange")
    assert ex.keys() == []
    # the stage inside the "pod" recorded where it ran on the run
    from mlflow.tracking import MlflowClient

    tags = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(run_id).data.tags
    assert tags["runtime.policy_update.torch"] and "runtime.policy_update.cuda_available" in tags


@pytest.mark.nightly  # a resume across meshes on two nodes: second order
def test_a_trainer_on_two_nodes_equals_one_node_and_resumes_on_another_mesh(
    s3_server, tmp_path, monkeypatch
):
    """The mesh (2, 2) as a TrainJob of two nodes: each "pod" (its own scratch folder, sharing only
    the S3 server) lays version 0 out from the store, starts two ranks with torchrun, and the four
    meet in a static rendezvous at node 0 (Trainer's PET_* variables); node 0 publishes version 1
    with its ranks' weight files and state shards, node 1 puts its own. The published version
    equals the same mesh on one machine (weights byte for byte, metrics), and the next version
    trains from it at mesh (1, 4) on one node."""
    from moerl.components.policy_update.update import run_sync_update
    from moerl.records import PolicyVersion

    bucket = f"moerl-launch-{uuid.uuid4().hex[:10]}"
    s3_server.client().create_bucket(Bucket=bucket)
    cfg = parse_config(
        {
            "checkpoint": {
                "uri": f"s3://{bucket}/ckpt",
                "endpoint_url": s3_server.endpoint_url,
                "region": "us-east-1",
            },
            "trainer": {
                "optimizer": {"optimizer_steps_per_iteration": 2, "learning_rate": 0.01},
                "parallelism": {
                    "launcher": "torchrun",
                    "expert_parallel_size": 2,
                    "data_parallel_shard": 2,
                },
            },
            "cluster": {
                "scratch_dir": str(tmp_path / "scratch"),
                "launch": {
                    "mode": "kubernetes",
                    "namespace": NS,
                    "poll_s": 0.2,
                    "trainer_nodes": 2,
                },
            },
        }
    )
    cfg, run_id, kubelet, value = _remote_update(cfg, tmp_path, monkeypatch, 1, "two_nodes")
    (body,) = kubelet.bodies
    assert (
        body["spec"]["trainer"]["numNodes"] == 2
        and len(kubelet.procs[body["metadata"]["name"]]) == 2
    )
    # each node ran in its own scratch
    assert (tmp_path / "scratch" / "node-0").is_dir() and (tmp_path / "scratch" / "node-1").is_dir()
    two = _tree(tmp_path / "two_nodes")
    shards = sorted(k for k in two if k.endswith(".distcp"))
    # every rank's shard of the master weights and of Adam's state
    assert len(shards) == 8 and "trainer/optimizer/.metadata" in two and "trainer/state.json" in two
    assert "trainer/model/.metadata" in two
    local, _ = _local_update(cfg, tmp_path, 1, "one_node")
    one = _tree(tmp_path / "one_node")
    assert two.keys() == one.keys()
    weights = sorted(k for k in one if k.endswith(".safetensors"))
    assert len(weights) >= 2  # every rank that holds experts wrote its own file
    assert all(two[k] == one[k] for k in weights)
    _same_update(value["metrics"], local)
    assert Exchange(cfg.checkpoint, f"s3://{bucket}/ckpt/runs/{run_id}/exchange").keys() == []
    # the next version trains from what two nodes published, on another mesh, on one node
    other = _local(cfg, run_id)
    other = other.model_copy(
        update={
            "trainer": other.trainer.model_copy(
                update={
                    "parallelism": other.trainer.parallelism.model_copy(
                        update={"data_parallel_shard": 1, "expert_parallel_size": 4}
                    )
                }
            )
        }
    )
    done = run_sync_update(
        other,
        run_id,
        PolicyVersion.model_validate_json(value["policy_json"]),
        tmp_path / "batch.jsonl",
        2,
    )
    assert done is not None and done[0].version == 2 and done[1]["train/steps"] == 2
    _laid_out(other, run_id, 2, tmp_path / "resumed")
    w1, w2 = read_weights(tmp_path / "two_nodes"), read_weights(tmp_path / "resumed")
    assert any(not (w1[k] == w2[k]).all() for k in w1)


def test_remote_stage_failure_reaches_the_task_and_the_exchange_is_cleaned(
    s3_server, tmp_path, monkeypatch
):
    bucket = f"moerl-launch-{uuid.uuid4().hex[:10]}"
    s3_server.client().create_bucket(Bucket=bucket)
    cfg = parse_config(
        {
            "checkpoint": {
                "uri": f"s3://{bucket}/ckpt",
                "endpoint_url": s3_server.endpoint_url,
                "region": "us-east-1",
            },
            "cluster": {
                "scratch_dir": str(tmp_path / "scratch"),
                "launch": {"mode": "kubernetes", "namespace": NS, "poll_s": 0.2},
            },
        }
    )
    (tmp_path / "batch.jsonl").write_text("")
    # $MLFLOW_TRACKING_URI below only checks what reaches the pod
    cfg, run_id = _tracked(cfg, tmp_path)
    monkeypatch.delenv("MOERL_SANDBOX_ROOT", raising=False)
    for k, v in {
        "KFP_POD_NAME": "grpo-task-1",
        "KFP_POD_UID": "uid-task-1",
        "MOERL_POD_NAMESPACE": NS,
        "MOERL_SERVICE_ACCOUNT": "task-sa",
        "MLFLOW_TRACKING_URI": "http://bob:hunter2@mlflow:5000",
    }.items():
        monkeypatch.setenv(k, v)
    kubelet = Kubelet()
    with pytest.raises(WorkloadFailed, match="TrainJob .* failed: x: exit 1"):
        run_remote(
            cfg,
            "policy_update",
            run_id,
            # a version never published: the stage fails inside the "pod"
            args={
                "iteration": 0,
                "policy_json": '{"version": 0, "uri": "s3://x/v0", "manifest_sha256": "0"}',
            },
            inputs={"batch": tmp_path / "batch.jsonl"},
            api=kubelet,
        )
    assert Exchange(cfg.checkpoint, f"s3://{bucket}/ckpt/runs/{run_id}/exchange").keys() == []
    # what the task's environment put into the TrainJob: its pod as owner, its account, no credentials
    (body,) = kubelet.bodies
    assert (
        body["metadata"]["ownerReferences"][0] | {"name": "grpo-task-1", "uid": "uid-task-1"}
        == body["metadata"]["ownerReferences"][0]
    )
    patch = body["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
        "replicatedJobs"
    ][0]
    # never task-sa
    assert patch["template"]["spec"]["template"]["spec"]["serviceAccountName"] == "moerl-worker"
    assert "hunter2" not in json.dumps(body)


def test_a_failing_remote_run_says_why_in_the_termination_log(tmp_path, monkeypatch):
    from moerl.launch import remote

    log = tmp_path / "termination-log"
    monkeypatch.setattr(remote, "TERMINATION_LOG", str(log))
    monkeypatch.delenv("MOERL_SCRATCH", raising=False)
    monkeypatch.delenv("MOERL_SANDBOX_ROOT", raising=False)
    # nothing to write to: the kubelet makes the file
    assert remote.main(["gs://not-s3/spec.json"]) == 1
    assert not log.exists()
    log.write_text("")
    assert remote.main(["gs://not-s3/spec.json"]) == 1
    assert (
        log.read_text() == "RemoteError: expected s3://.../spec.json, got 'gs://not-s3/spec.json'"
    )
