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
from moerl.store import open_store


def _cfg(tmp_path, iterations):
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({
        "task": {"prompts_per_iteration": 8},
        "rollout": {"samples_per_prompt": 4, "max_new_tokens": 6},
        "trainer": {"optimizer_steps_per_iteration": 2},
        "tracking": {"experiment": "resume"},
        "pipeline": {"iterations": iterations},
    }))


@pytest.mark.slow
def test_killed_run_resumes_from_last_complete_version(tmp_path):
    from mlflow.tracking import MlflowClient

    _cfg(tmp_path, iterations=3)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    proc = subprocess.Popen([sys.executable, "-m", "moerl.cli", "run", "run.yaml"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    # 1. kill the whole process tree (CLI + running task) once version 1 is published
    deadline = time.time() + 600
    store = None
    while time.time() < deadline:
        runs = tmp_path / "checkpoints" / "runs"
        if runs.is_dir() and any(runs.iterdir()):
            store = open_store(CheckpointConfig(uri=str(next(runs.iterdir()))))
            if (store.latest() or 0) >= 1:
                break
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = store.latest()
    assert killed_at in (1, 2) and store.versions() == list(range(killed_at + 1))
    run_id = store.uri.rstrip("/").rsplit("/", 1)[-1]

    # 2. resume: same MLflow run, continues from `latest`
    r = subprocess.run([sys.executable, "-m", "moerl.cli", "run", "run.yaml", "--resume", run_id], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"resuming MLflow run {run_id} from version {killed_at}" in r.stdout
    assert store.versions() == [0, 1, 2, 3] and store.latest() == 3  # each version once
    # 3. the trainer state continued: counters count every optimizer step of every iteration
    state = json.loads((store.fetch(3, tmp_path / "verify") / "trainer" / "state.json").read_text())
    assert state["version"] == 3 and state["step"] == 3 * 2
    # 4. one MLflow run, finished, with every iteration's metrics
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("resume").experiment_id])
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    assert {m.step for m in client.get_metric_history(run_id, "reward/mean")} >= {killed_at, 2}
    assert any(k.startswith("moerl.resumed_at.") for k in run.data.tags)
    # 5. resuming a finished run does nothing
    r = subprocess.run([sys.executable, "-m", "moerl.cli", "run", "run.yaml", "--resume", run_id], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "nothing to resume" in r.stdout


def test_resume_of_an_unknown_run_fails_clearly(tmp_path):
    _cfg(tmp_path, iterations=2)
    r = subprocess.run([sys.executable, "-m", "moerl.cli", "run", "run.yaml", "--resume", "nosuchrun"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    assert "--resume: no MLflow run 'nosuchrun'" in r.stderr and "Traceback" not in r.stderr
