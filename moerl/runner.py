"""Run or compile the sync pipeline.

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
from moerl.dataset import load_dataset
from moerl.errors import CheckpointError, ConfigError, MoerlError
from moerl.policy import check_checkpoint

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
    out, err = _ConsoleFilter(log_file, sys.stdout, verbose), _ConsoleFilter(log_file, sys.stderr, verbose)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield
    finally:
        out.drain()
        err.drain()


def _report(uri: str, shown: str, run_id: str, ok: bool, t0: float) -> float | None:
    """Print how the run went and where to look at it; returns the mean of the last 3 rewards."""
    hist = tracking.metric_history(uri, run_id, "reward/mean")
    final = sum(v for _, v in hist[-3:]) / len(hist[-3:]) if hist else None
    print(f"[moerl] {'finished' if ok else 'FAILED'} in {time.perf_counter() - t0:.0f} s; "
          f"reward/mean {hist[0][1]:.3f} -> {final:.3f} (mean of last 3)" if hist else "[moerl] no iterations logged",
          flush=True)
    view = f"open {shown} (the MLflow server)" if shown.startswith(("http://", "https://")) \
        else f"mlflow ui --backend-store-uri {shown}"
    print(f"[moerl] MLflow run: {run_id}\n[moerl] view it:    {view}", flush=True)
    return final


def _report_reward_model(uri: str, shown: str, run_id: str, ok: bool, t0: float) -> "RunSummary":
    """How a reward-model run went: held-out accuracy and the registered version."""
    from mlflow.tracking import MlflowClient

    run = MlflowClient(uri).get_run(run_id)
    acc = run.data.metrics.get("rm/eval_accuracy")
    registered = run.data.tags.get("reward_model.registered", "nothing registered")
    print(f"[moerl] {'finished' if ok else 'FAILED'} in {time.perf_counter() - t0:.0f} s; held-out pairwise accuracy "
          f"{'-' if acc is None else f'{acc:.3f}'}; {registered}", flush=True)
    view = f"open {shown} (the MLflow server)" if shown.startswith(("http://", "https://")) \
        else f"mlflow ui --backend-store-uri {shown}"
    print(f"[moerl] MLflow run: {run_id}\n[moerl] view it:    {view}", flush=True)
    return RunSummary(ok=ok, run_id=run_id, tracking_uri=shown, final_reward=acc)


def preflight(cfg: RunConfig) -> None:
    """Everything that can be checked before work starts; raises a MoerlError naming the field."""
    if cfg.require.gpu or cfg.require.deepep or cfg.require.efa:  # the stages run on this machine
        from moerl.errors import RequirementError

        missing = provenance.missing_requirements(cfg.require, provenance.runtime_probe())
        if missing:
            raise RequirementError("; ".join(missing))
    if cfg.pipeline.kind == "reward_model":
        from moerl.preferences import load_preferences

        load_preferences(cfg.reward_model.data, cfg.task.max_bad_fraction)
    else:
        load_dataset(cfg.task.dataset, cfg.task.max_bad_fraction)
    if cfg.pipeline.kind == "grpo" and cfg.reward.kind != "rules":  # the reward model must exist and verify
        from moerl.components.reward_model import registry

        rm = registry.resolve(tracking.resolve_uri(cfg.tracking), cfg.reward.model)
        registry.fetch(cfg.checkpoint, rm)
    if cfg.model.path:
        check_checkpoint(cfg.model.path)
    from moerl.checkpoints import open_store

    open_store(cfg.checkpoint).check_access()


def absolutize(cfg: RunConfig) -> RunConfig:
    """Make every local path absolute, so tasks in other processes and cwds agree."""
    def ab(p: str) -> str:
        return str(Path(p).expanduser().resolve())

    ck = cfg.checkpoint
    updates = {
        "checkpoint": ck.model_copy(update={
            "uri": ck.uri if ck.uri.startswith("s3://") else ab(ck.uri), "cache_dir": ab(ck.cache_dir)}),
        "pipeline": cfg.pipeline.model_copy(update={
            "pipeline_root": ab(cfg.pipeline.pipeline_root), "work_dir": ab(cfg.pipeline.work_dir)}),
        "tracking": cfg.tracking.model_copy(update={"uri": tracking.resolve_uri(cfg.tracking)}),
    }
    if cfg.model.path:
        updates["model"] = cfg.model.model_copy(update={"path": ab(cfg.model.path)})
    if not cfg.task.dataset.startswith("builtin:"):
        updates["task"] = cfg.task.model_copy(update={"dataset": ab(cfg.task.dataset)})
    if not cfg.reward_model.data.startswith("builtin:"):
        updates["reward_model"] = cfg.reward_model.model_copy(update={"data": ab(cfg.reward_model.data)})
    return cfg.model_copy(update=updates)


def compile_pipeline(cfg: RunConfig, out: Path, target: str = "local", resume: str | None = None,
                     start_iteration: int = 0) -> Path:
    """Write the pipeline of `pipeline.mode` (sync: `pipelines/grpo.py`; async:
    `pipelines/grpo_async.py`) as KFP IR YAML.

    `target` `eks` first refuses a config that is not cluster-safe (`pipelines/eks.py`:
    local checkpoint, cache, model, dataset or tracking paths; async without `valkey.url`) and
    adds every task's pod settings. A sync pipeline is capped at
    `pipelines.grpo.MAX_COMPILED_ITERATIONS` iterations (its size grows with each); `resume`
    and `start_iteration` compile the continuation of run `resume` from its published version
    `start_iteration`, to chain runs past the cap.

    Credentials in `tracking.uri` are never written: they are stripped, and stderr says which
    variables the cluster must provide instead. The async pipeline needs `valkey.url`: its
    tasks run on separate pods, and the embedded Valkey that `moerl run --mode async` starts
    exists only on the machine that runs it."""
    from kfp import compiler

    from moerl.pipelines.grpo import TARGETS, check_compiled_size

    if target not in TARGETS:
        raise ConfigError(f"--target: must be one of {', '.join(TARGETS)}, got {target!r}")
    if cfg.pipeline.kind == "reward_model":
        return _compile_reward_model(cfg, out, target, resume, start_iteration)
    if cfg.pipeline.mode == "async" and not cfg.valkey.url:
        raise ConfigError("valkey.url: the async pipeline needs a Valkey its pods can reach; set it to "
                          "redis://, rediss://, valkey:// or valkeys://host:port/db of a Valkey Service (password from "
                          "$VALKEY_PASSWORD). Unset is allowed only for `moerl run --mode async`, which starts "
                          "an embedded server on this machine")
    if cfg.pipeline.mode == "async" and (resume or start_iteration):
        raise ConfigError("--resume/--start-iteration: the async pipeline resumes by itself (a restarted trainer "
                          "continues from the last published version); they apply to the sync pipeline only")
    if cfg.pipeline.mode == "sync":
        if start_iteration and not resume:
            raise ConfigError("--start-iteration: needs --resume RUN_ID (the run whose published version it continues)")
        if not 0 <= start_iteration < cfg.pipeline.iterations:
            raise ConfigError(f"--start-iteration: must be in [0, pipeline.iterations = {cfg.pipeline.iterations}), "
                              f"got {start_iteration}")
        check_compiled_size(cfg, start_iteration)
    cfg = _for_target(cfg, target)
    if cfg.pipeline.mode == "async":
        from moerl.pipelines.grpo_async import build_async_pipeline

        pipeline = build_async_pipeline(cfg, git_sha=provenance.git_sha(), target=target)
    else:
        from moerl.pipelines.grpo import build_pipeline

        pipeline = build_pipeline(cfg, git_sha=provenance.git_sha(), start_iteration=start_iteration,
                                  resume=bool(resume), target=target, run_id=resume or "")
    out.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(pipeline, str(out))
    return out


def _for_target(cfg: RunConfig, target: str) -> RunConfig:
    """What every compiled pipeline goes through: credentials out of tracking.uri (stderr says
    which variables the cluster must provide), and on `eks` the cluster-safety checks."""
    cfg, secret_env = tracking.split_credentials(cfg)
    if target == "eks":
        from moerl.pipelines.eks import check_cluster_safe

        check_cluster_safe(cfg)
    if secret_env:
        print(f"moerl: compile: removed the credentials in tracking.uri from the pipeline; give its tasks "
              f"{' and '.join(sorted(secret_env))} from a Kubernetes Secret", file=sys.stderr)
    return cfg


def _compile_reward_model(cfg: RunConfig, out: Path, target: str, resume: str | None, start_iteration: int) -> Path:
    """`pipeline.kind: reward_model`: pipelines/reward_model.py, with the GRPO pipelines'
    credential stripping and cluster-safety checks."""
    from kfp import compiler

    from moerl.pipelines.grpo import TARGETS
    from moerl.pipelines.reward_model import build_reward_model_pipeline

    if target not in TARGETS:
        raise ConfigError(f"--target: must be one of {', '.join(TARGETS)}, got {target!r}")
    if resume or start_iteration:
        raise ConfigError("--resume/--start-iteration: a reward-model run has no iterations to continue; run it again")
    cfg = _for_target(cfg, target)
    out.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(build_reward_model_pipeline(cfg, git_sha=provenance.git_sha(), target=target), str(out))
    return out


def _resume_point(cfg: RunConfig, uri: str, run_id: str) -> int:
    """The version run `run_id` continues from: its store's `latest`, which only ever points
    at a complete, verified version, after `recover` repaired what a publish killed before
    moving `latest` left above it (adopting a verified version, deleting an incomplete one)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from moerl.checkpoints import run_store

    try:
        MlflowClient(uri).get_run(run_id)
    except MlflowException:
        raise MoerlError(f"--resume: no MLflow run {run_id!r} at {uri}; pass the run id `moerl run` printed") from None
    store = run_store(cfg.checkpoint, run_id)
    before = store.latest()
    latest = store.recover()  # nothing publishes now: the run is dead or this is its only writer
    if latest != before:
        print(f"[moerl] --resume: version {latest} was published but `latest` still said "
              f"{'nothing' if before is None else before}; adopted it", flush=True)
    if latest is None:
        raise CheckpointError(f"--resume: run {run_id} has no published version under {cfg.checkpoint.uri}/runs/{run_id}; "
                              "check checkpoint.uri")
    return latest


def begin_run(cfg: RunConfig, uri: str, mode: str, resume: str | None = None, resumed_from: str = "") -> str:
    """A new MLflow run with the provenance tags and `moerl.mode`, or run `resume` marked running
    again (tagged with when, from where, and this checkout's git sha). Returns the run id."""
    shown = tracking.redact(uri)
    if resume:
        from mlflow.tracking import MlflowClient

        MlflowClient(uri).update_run(resume, status="RUNNING")
        tracking.set_tags(uri, resume, {"moerl.status": "running",
                                        f"moerl.resumed_at.{int(time.time())}": resumed_from or mode,
                                        "moerl.resume_git_sha": provenance.git_sha()})
        print(f"[moerl] resuming MLflow run {resume}{f' from version {resumed_from}' if resumed_from else ''} "
              f"({mode}) at {shown}", flush=True)
        return resume
    tags = provenance.collect()
    tags["moerl.mode"] = mode
    run_id = tracking.start_run(cfg, uri, tags)
    print(f"[moerl] MLflow run {run_id} (experiment {cfg.tracking.experiment!r}) at {shown}", flush=True)
    return run_id


def run_local(cfg: RunConfig, iterations: int | None = None, verbose: bool = False,
              resume: str | None = None) -> RunSummary:
    from kfp import local

    from moerl.pipelines.grpo import build_pipeline

    if cfg.pipeline.kind == "reward_model" and resume:
        raise ConfigError("--resume: a reward-model run has no iterations to continue; run it again")
    if iterations is not None:
        cfg = cfg.model_copy(update={"pipeline": cfg.pipeline.model_copy(update={"iterations": iterations})})
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
        run_id, start = resume, _resume_point(cfg, uri, resume)
        if start >= cfg.pipeline.iterations:
            print(f"[moerl] run {run_id} already published version {start}: nothing to resume", flush=True)
            return RunSummary(ok=True, run_id=run_id, tracking_uri=shown, final_reward=None)
        begin_run(cfg, uri, "sync-kfp-local", resume=run_id, resumed_from=str(start))
    else:
        run_id = begin_run(cfg, uri, "reward-model-kfp-local" if cfg.pipeline.kind == "reward_model" else "sync-kfp-local")
    # 4. the pipeline, on kfp.local
    Path(cfg.pipeline.pipeline_root).mkdir(parents=True, exist_ok=True)
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=cfg.pipeline.pipeline_root,
               raise_on_error=True)
    log_path = Path(cfg.pipeline.work_dir) / f"{run_id}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"[moerl] pipeline log (every task's full output): {log_path}", flush=True)
    t0 = time.perf_counter()
    ok = True
    try:
        with log_path.open("w") as lf, _filtered_output(lf, verbose):
            if cfg.pipeline.kind == "reward_model":
                from moerl.pipelines.reward_model import build_reward_model_pipeline

                pipeline = build_reward_model_pipeline(cfg, git_sha=sha)
            else:
                pipeline = build_pipeline(cfg, git_sha=sha, start_iteration=start, resume=bool(resume))
            pipeline(config_json=config_to_json(cfg), run_id=run_id)
    except (RuntimeError, MoerlError) as err:
        ok = False
        tracking.set_tags(uri, run_id, {"moerl.status": "failed", "moerl.error": str(err)[:4000]})
        from mlflow.tracking import MlflowClient

        MlflowClient(uri).set_terminated(run_id, status="FAILED")
        print(f"moerl: error: pipeline failed: {tracking.redact(str(err))} (full output: {log_path})", flush=True)
    # 5. where the run is
    if cfg.pipeline.kind == "reward_model":
        return _report_reward_model(uri, shown, run_id, ok, t0)
    final = _report(uri, shown, run_id, ok, t0)
    return RunSummary(ok=ok, run_id=run_id, tracking_uri=shown, final_reward=final)
