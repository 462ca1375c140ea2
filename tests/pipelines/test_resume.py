"""Resume: a run killed mid-pipeline continues from its last complete version, in the same
MLflow run, with the trainer state (optimizer, counters) it had, and no duplicate versions."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from moerl.config import CheckpointConfig
from moerl.store.runs import open_store


def _cfg(tmp_path, iterations):
    (tmp_path / "run.yaml").write_text(
        yaml.safe_dump(
            {
                "task": {"prompts_per_iteration": 8},
                "rollout": {"samples_per_prompt": 4, "max_new_tokens": 6},
                "trainer": {"optimizer": {"optimizer_steps_per_iteration": 2}},
                "tracking": {"experiment": "resume"},
                "pipeline": {"iterations": iterations},
            }
        )
    )


def _run_and_kill_once_published(tmp_path, env, version, *args):
    """Start `moerl run run.yaml [args]`; SIGKILL its whole process tree (CLI + running task) as
    soon as `latest` reaches `version`; return the run's store and what the CLI printed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "moerl.cli", "run", "run.yaml", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.time() + 600
    store = None
    while time.time() < deadline:
        runs = tmp_path / "checkpoints" / "runs"
        if runs.is_dir() and any(runs.iterdir()):
            store = open_store(CheckpointConfig(uri=str(next(runs.iterdir()))))
            latest = store.latest()
            if latest is not None and latest >= version:
                break
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    out = proc.communicate()[0]
    assert store is not None, "the run published nothing before the deadline"
    return store, out


@pytest.mark.nightly
def test_a_run_killed_twice_resumes_each_time_from_its_last_complete_version(tmp_path):
    """Killed once version 0 is published (during iteration 0), resumed through `resume_policy`
    (it used to republish version 0 and fail "already exists"); that resume killed once version 1
    is published, resumed again from version 1 with the trainer state (optimizer, counters) it
    had; then done, and a resume of the finished run does nothing."""
    from mlflow.tracking import MlflowClient

    _cfg(tmp_path, iterations=2)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    # 1. kill the whole process tree (CLI + running task) once version 0 is published
    store, _ = _run_and_kill_once_published(tmp_path, env, 0)
    assert store.latest() == 0 and store.versions() == [0]
    run_id = store.uri.rstrip("/").rsplit("/", 1)[-1]
    # 2. resume from version 0, killed again once version 1 is published (polled every 0.2 s,
    # against tens of seconds per iteration)
    store, out = _run_and_kill_once_published(tmp_path, env, 1, "--resume", run_id)
    assert f"resuming MLflow run {run_id} from version 0" in out
    assert store.latest() == 1 and store.versions() == [0, 1]
    # 3. resume from version 1 to the end: same MLflow run, each version once
    r = subprocess.run(
        [sys.executable, "-m", "moerl.cli", "run", "run.yaml", "--resume", run_id],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"resuming MLflow run {run_id} from version 1" in r.stdout
    assert store.versions() == [0, 1, 2] and store.latest() == 2
    # 4. the trainer state continued across the second kill: every optimizer step counted
    state = json.loads((store.fetch(2, tmp_path / "verify") / "trainer" / "state.json").read_text())
    assert state["version"] == 2 and state["step"] == 2 * 2
    # 5. one MLflow run, finished, with the iterations' metrics
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("resume").experiment_id])
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    assert {1} <= {m.step for m in client.get_metric_history(run_id, "reward/mean")} <= {0, 1}
    # one per resume that ran
    assert len([k for k in run.data.tags if k.startswith("moerl.resumed_at.")]) == 2
    # 6. resuming a finished run does nothing
    r = subprocess.run(
        [sys.executable, "-m", "moerl.cli", "run", "run.yaml", "--resume", run_id],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and "nothing to resume" in r.stdout


def test_resume_from_version_0_starts_with_resume_policy(tmp_path):
    """A resume from version 0 must not run init_policy (it would publish version 0 again)."""
    from kfp import compiler

    from moerl.config import parse_config
    from moerl.pipelines.grpo import build_pipeline

    cfg = parse_config({"pipeline": {"iterations": 2}})
    names = {}
    for resume in (False, True):
        out = tmp_path / f"p{resume}.yaml"
        compiler.Compiler().compile(build_pipeline(cfg, start_iteration=0, resume=resume), str(out))
        spec = yaml.safe_load(out.read_text())  # the run's tasks sit in the exit handler's sub-DAG
        dags = [spec["root"]] + [c for c in spec["components"].values() if "dag" in c]
        names[resume] = {t["taskInfo"]["name"] for d in dags for t in d["dag"]["tasks"].values()}
    assert "init-policy-v0" in names[False] and "resume-policy-v0" not in names[False]
    assert "resume-policy-v0" in names[True] and "init-policy-v0" not in names[True]
    assert {"rollout-0", "policy-update-v1", "policy-update-v2"} <= names[True]


@pytest.mark.slow  # `moerl run` as a process (refused before any work)
def test_resume_of_an_unknown_run_fails_clearly(tmp_path):
    _cfg(tmp_path, iterations=2)
    r = subprocess.run(
        [sys.executable, "-m", "moerl.cli", "run", "run.yaml", "--resume", "nosuchrun"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1
    assert "--resume: no MLflow run 'nosuchrun'" in r.stderr and "Traceback" not in r.stderr
