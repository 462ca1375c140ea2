"""An async run as a user starts it (`moerl run --mode async CONFIG`, in its own directory) and
the checks every such test makes of what it left in MLflow."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_async_cli(
    cwd: Path, config: str, experiment: str, versions: int, *sets: str, timeout: int = 1200
):
    """`moerl run --mode async configs/<config> --iterations <versions> [--set ...]` in `cwd`;
    returns (tracking uri, the one MLflow run of `experiment`). Fails with the output's tail."""
    from mlflow.tracking import MlflowClient

    args = [sys.executable, "-m", "moerl.cli", "run", "--mode", "async"]
    args += [str(ROOT / "configs" / config), "--iterations", str(versions)]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    uri = f"sqlite:///{cwd / 'mlflow.db'}"
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return uri, run


def assert_balanced(m: dict[str, float]) -> None:
    """The run's last `async/*` metrics: every generated sample trained or accounted for."""
    assert (
        m["async/trained"]
        + m["async/filtered"]
        + m["async/stale_dropped"]
        + m["async/failed"]
        + m["async/samples_dead"]
        == m["async/generated"] - m["async/duplicates"]
    ), m
