"""An async run as a user starts it (`moerl run --mode async CONFIG`, in its own directory) and
the checks every such test makes of what it left in MLflow."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class RunClock:
    """How long an async run may take, from what the run itself measures, so that a loaded
    machine does not fail a test and a hung run still does.

    The limit is `slack` x the run's projected length, never below `floor_s`: projected from
    its pace once a version is committed (the time to its latest committed version over the
    versions committed, times all the versions), and before that from its engines' measured
    start (`engine_load_s`, the step a loaded machine stretches most) times the versions. A
    run that stops committing keeps the limit its last commit set, and fails there, naming
    what it measured."""

    def __init__(self, versions: int, floor_s: float, slack: float = 2.0):
        self.versions, self.floor_s, self.slack = versions, floor_s, slack
        self.t0 = time.perf_counter()
        self.done, self.done_at, self.load_s = 0, self.t0, 0.0
        self._watched_at = 0.0

    def saw(self, version: int | None, load_s: float = 0.0) -> None:
        """The latest committed version now (None: none yet) and the longest engine start."""
        if version is not None and version > self.done:
            self.done, self.done_at = version, time.perf_counter()
        self.load_s = max(self.load_s, load_s)

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.t0

    def limit_s(self) -> float:
        pace = (self.done_at - self.t0) / self.done if self.done else self.load_s
        return max(self.floor_s, self.slack * pace * self.versions)

    def watch(self, run) -> None:
        """An `on_tick` of `LocalAsyncRun.supervise`: read the run's progress from its bus (at
        most once a second) and fail it once it is over its limit."""
        if time.perf_counter() - self._watched_at < 1.0:
            return
        self._watched_at = time.perf_counter()
        reg = run.bus.registry()
        loads = [
            s.get("engine_load_s", 0.0)
            for n, s in run.bus.stats().items()
            if n.startswith("rollout")
        ]
        self.saw(reg.version if reg is not None else None, max(loads, default=0.0))
        late = self.expired()
        assert late is None, late

    def expired(self) -> str | None:
        """Why the run is over its limit, or None."""
        elapsed, limit = self.elapsed_s(), self.limit_s()
        if elapsed <= limit:
            return None
        return (
            f"async run did not finish in {elapsed:.0f} s: its limit is {limit:.0f} s = max(floor "
            f"{self.floor_s:.0f} s, {self.slack:g} x {self.versions} versions x "
            + (
                f"{(self.done_at - self.t0) / self.done:.1f} s per version over the {self.done} "
                "committed)"
                if self.done
                else f"{self.load_s:.1f} s engine start; no version committed)"
            )
        )


_PROGRESS = re.compile(r"^\[moerl\]\s+\d+s version (\d+|-)/\d+")


def run_async_cli(
    cwd: Path, config: str, experiment: str, versions: int, *sets: str, timeout: int = 1200
):
    """`moerl run --mode async configs/<config> --iterations <versions> [--set ...]` in `cwd`;
    returns (tracking uri, the one MLflow run of `experiment`). Fails with the output's tail.
    `timeout`: the floor of the run's limit, which otherwise scales with the pace its progress
    lines report (`RunClock`)."""
    from mlflow.tracking import MlflowClient

    args = [sys.executable, "-m", "moerl.cli", "run", "--mode", "async"]
    args += [str(ROOT / "configs" / config), "--iterations", str(versions)]
    for s in sets:
        args += ["--set", s]
    clock = RunClock(versions, floor_s=timeout)
    out: list[str] = []
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(args, cwd=cwd, stdout=subprocess.PIPE, stderr=err, text=True)

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                out.append(line)
                if m := _PROGRESS.match(line):
                    clock.saw(None if m[1] == "-" else int(m[1]))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        late = None
        while proc.poll() is None and late is None:
            time.sleep(1.0)
            late = clock.expired()
        if late is not None:  # as a user's Ctrl-C: the run stops its stages, then it is killed
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(timeout=10)
        err.seek(0)
        tail = "".join(out)[-3000:] + err.read()[-3000:]
    assert late is None, f"{late}\n{tail}"
    assert proc.returncode == 0, tail
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


def history(uri: str, run_id: str, key: str) -> list[float]:
    """A run's values of metric `key`, by step."""
    from moerl import tracking

    return [v for _, v in tracking.metric_history(uri, run_id, key)]
