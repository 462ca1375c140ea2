"""Run the sync pipeline on this machine (kfp.local).

`run_local` is what `moerl run` does, in numbered steps: (1) preflight checks, so a bad
dataset, model path or store fails before any work; (2) make local paths absolute, since
pipeline tasks run as separate processes, and move the credentials of `tracking.uri` out of the
config into the environment the tasks inherit (`tracking.split_credentials`: nothing printed,
logged, stored in MLflow or compiled carries them); (3) create the MLflow run with provenance;
(4) execute the pipeline with kfp.local's SubprocessRunner; (5) print where the run is.

Limitations: kfp.local runs tasks one after another on this machine; it refuses container
components, which is why every stage is a lightweight component.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from moerl import provenance, tracking
from moerl.config import RunConfig, config_to_json
from moerl.errors import ConfigError, MoerlError
from moerl.orchestrate.prepare import absolutize, begin_run, resume_point
from moerl.preflight import preflight
from moerl.store.s3server import embedded_cache_tier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSummary:
    ok: bool
    run_id: str
    tracking_uri: str
    final_reward: float | None


_KEEP = re.compile(r"\[moerl\]|finished with status|Traceback|Error|error:")


class _ConsoleFilter(io.TextIOBase):
    """kfp.local echoes every task's full executor input and vLLM's start-up chatter. Send all
    of it to a log file, and only progress lines, task status and errors to the terminal.
    Every line passes `tracking.redact` first: no `user:password@` of any URI reaches either
    (the config carries none by then; this catches whatever a library prints)."""

    def __init__(self, log_file, console, verbose: bool):
        self.log_file, self.console, self.verbose, self._buf = log_file, console, verbose, ""

    def write(self, text: str) -> int:
        self._buf += text
        *lines, self._buf = self._buf.split("\n")
        for line in map(tracking.redact, lines):
            self.log_file.write(line + "\n")
            if self.verbose or _KEEP.search(line):
                self.console.write(line.strip() + "\n" if not self.verbose else line + "\n")
        self.console.flush()
        return len(text)

    def drain(self) -> None:
        """Write out a last line that had no newline."""
        if self._buf:
            self.write("\n")

    def flush(self) -> None:
        self.log_file.flush()
        self.console.flush()


@contextlib.contextmanager
def _filtered_output(log_file, verbose: bool):
    """stdout and stderr through `_ConsoleFilter` into `log_file` and the terminal."""
    out, err = (
        _ConsoleFilter(log_file, sys.stdout, verbose),
        _ConsoleFilter(log_file, sys.stderr, verbose),
    )
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield
    finally:
        out.drain()
        err.drain()


def report(uri: str, shown: str, run_id: str, ok: bool, t0: float) -> float | None:
    """Print how the run went and where to look at it; returns the mean of the last 3 rewards."""
    hist = tracking.metric_history(uri, run_id, "reward/mean")
    final = sum(v for _, v in hist[-3:]) / len(hist[-3:]) if hist else None
    print(
        f"[moerl] {'finished' if ok else 'FAILED'} in {time.perf_counter() - t0:.0f} s; "
        f"reward/mean {hist[0][1]:.3f} -> {final:.3f} (mean of last 3)"
        if hist
        else "[moerl] no iterations logged",
        flush=True,
    )
    view = (
        f"open {shown} (the MLflow server)"
        if shown.startswith(("http://", "https://"))
        else f"mlflow ui --backend-store-uri {shown}"
    )
    print(f"[moerl] MLflow run: {run_id}\n[moerl] view it:    {view}", flush=True)
    return final


def _report_reward_model(uri: str, shown: str, run_id: str, ok: bool, t0: float) -> RunSummary:
    """How a reward-model run went: held-out accuracy and the registered version."""
    from mlflow.tracking import MlflowClient

    run = MlflowClient(uri).get_run(run_id)
    acc = run.data.metrics.get("rm/eval_accuracy")
    registered = run.data.tags.get("reward_model.registered", "nothing registered")
    print(
        f"[moerl] {'finished' if ok else 'FAILED'} in {time.perf_counter() - t0:.0f} s; held-out pairwise accuracy "
        f"{'-' if acc is None else f'{acc:.3f}'}; {registered}",
        flush=True,
    )
    view = (
        f"open {shown} (the MLflow server)"
        if shown.startswith(("http://", "https://"))
        else f"mlflow ui --backend-store-uri {shown}"
    )
    print(f"[moerl] MLflow run: {run_id}\n[moerl] view it:    {view}", flush=True)
    return RunSummary(ok=ok, run_id=run_id, tracking_uri=shown, final_reward=acc)


def run_local(
    cfg: RunConfig, iterations: int | None = None, verbose: bool = False, resume: str | None = None
) -> RunSummary:
    from kfp import local

    if cfg.pipeline.kind == "reward_model" and resume:
        raise ConfigError(
            "--resume: a reward-model run has no iterations to continue; run it again"
        )
    if iterations is not None:
        cfg = cfg.model_copy(
            update={"pipeline": cfg.pipeline.model_copy(update={"iterations": iterations})}
        )
    # 1. preflight
    preflight(cfg)
    # 2. absolute paths; credentials leave the config for the environment the tasks inherit
    cfg, secret_env = tracking.split_credentials(absolutize(cfg))
    os.environ.update(secret_env)
    uri = tracking.resolve_uri(cfg.tracking)
    shown = tracking.redact(uri)
    # 3. the MLflow run: a new one, or the resumed one continued
    sha = provenance.git_sha()
    start = 0
    if resume:
        run_id, start = resume, resume_point(cfg, uri, resume)
        if start >= cfg.pipeline.iterations:
            print(
                f"[moerl] run {run_id} already published version {start}: nothing to resume",
                flush=True,
            )
            return RunSummary(ok=True, run_id=run_id, tracking_uri=shown, final_reward=None)
        begin_run(cfg, uri, "sync-kfp-local", resume=run_id, resumed_from=str(start))
    else:
        run_id = begin_run(
            cfg,
            uri,
            "reward-model-kfp-local" if cfg.pipeline.kind == "reward_model" else "sync-kfp-local",
        )
    # 4. the pipeline, on kfp.local
    Path(cfg.pipeline.pipeline_root).mkdir(parents=True, exist_ok=True)
    local.init(
        runner=local.SubprocessRunner(use_venv=False),
        pipeline_root=cfg.pipeline.pipeline_root,
        raise_on_error=True,
    )
    log_path = Path(cfg.pipeline.work_dir) / f"{run_id}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"[moerl] pipeline log (every task's full output): {log_path}", flush=True)
    t0 = time.perf_counter()
    ok = _run_pipeline(cfg, uri, run_id, sha, start, bool(resume), verbose, log_path)
    # 5. where the run is
    if cfg.pipeline.kind == "reward_model":
        return _report_reward_model(uri, shown, run_id, ok, t0)
    final = report(uri, shown, run_id, ok, t0)
    return RunSummary(ok=ok, run_id=run_id, tracking_uri=shown, final_reward=final)


def _run_pipeline(
    cfg: RunConfig,
    uri: str,
    run_id: str,
    sha: str,
    start: int,
    resume: bool,
    verbose: bool,
    log_path: Path,
) -> bool:
    """Compile and run the run's pipeline on kfp.local (initialized by the caller), every
    task's output into `log_path`; whether it succeeded. A failure is tagged on the MLflow run,
    which is terminated FAILED, and said in one line."""
    from moerl.pipelines.grpo import build_pipeline

    try:
        with (
            log_path.open("w") as lf,
            _filtered_output(lf, verbose),
            embedded_cache_tier(cfg, Path(cfg.pipeline.work_dir) / run_id / "ckpt-cache") as cfg,
        ):
            if cfg.pipeline.kind == "reward_model":
                from moerl.pipelines.reward_model import build_reward_model_pipeline

                pipeline = build_reward_model_pipeline(cfg, git_sha=sha)
            else:
                pipeline = build_pipeline(cfg, git_sha=sha, start_iteration=start, resume=resume)
            pipeline(config_json=config_to_json(cfg), run_id=run_id)
    except (RuntimeError, MoerlError) as err:
        tracking.set_tags(uri, run_id, {"moerl.status": "failed", "moerl.error": str(err)[:4000]})
        from mlflow.tracking import MlflowClient

        MlflowClient(uri).set_terminated(run_id, status="FAILED")
        print(
            f"moerl: error: pipeline failed: {tracking.redact(str(err))} (full output: {log_path})",
            flush=True,
        )
        return False
    return True
