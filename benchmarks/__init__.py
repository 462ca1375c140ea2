"""Every benchmark, in one home: `moerl bench ...` (benchmarks/cli.py lists them) and
`moerl compare`, with one report format.

Every report is a JSON object with the same envelope (`envelope`):
    bench     which benchmark ("suite", "scaling", "failures", "modes", "project", "weights",
              "dispatch", "ep-memory", "compare")
    schema    the report format's version (1)
    ok        whether every check the benchmark makes held (the command exits non-zero if not)
    versions  what it ran on: moerl version and git sha, torch, vLLM, NCCL, DeepEP, libfabric
    machine   the machine: CPU model, cores, SMT siblings, memory, load (benchmarks/machine.py)
and the benchmark's own fields. Each command also prints a plain-text table; the workload
benchmarks add PNG plots and a Markdown summary. docs/benchmarks.md describes each one and
holds reports measured here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

SCHEMA = 1


def envelope(bench: str, ok: bool, **fields: Any) -> dict[str, Any]:
    """A report: the common envelope (bench, schema, ok, versions, machine) around `fields`
    (a `machine` field of the benchmark's own is kept: it extends `machine_record`)."""
    from benchmarks.machine import machine_record
    from moerl import provenance

    report = {"bench": bench, "schema": SCHEMA, "ok": ok, **fields}
    report["versions"] = provenance.collect()
    report.setdefault("machine", machine_record())
    return report


def write_report(out: Path, report: dict[str, Any]) -> Path:
    """Write `report` as indented JSON to `out` (parents created); returns `out`."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
    return out


def cell(value: Any, digits: int = 2) -> str:
    """A table cell: floats rounded to `digits`, None as '-', anything else as str."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "ok" if value else "FAIL"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns right-aligned to their widest cell, a rule under the header."""
    text = [[str(h) for h in headers]] + [[cell(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in text) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in text]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def child_main(
    argv: list[str] | None,
    module: str,
    command: str,
    what: str,
    fn: Callable[[Any, int, Path], dict[str, Any]],
) -> int:
    """The entry point of a benchmark's child process (`python -m <module> <command> --config
    C --iterations N --work W --out O`; vLLM wants a `__main__` module of its own): run
    `fn(config, iterations, work)` and write its result as JSON to O. A MoerlError prints one
    line and sets the exit code."""
    import argparse
    import logging

    from moerl.config import config_from_json
    from moerl.errors import MoerlError

    ap = argparse.ArgumentParser(
        prog=f"python -m {module}", description=f"{what} (started by the benchmark)"
    )
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser(command)
    p.add_argument("--config", required=True, help="the resolved run config, as JSON")
    p.add_argument("--iterations", type=int, required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s {command} %(levelname)s %(message)s"
    )
    try:
        res = fn(config_from_json(Path(a.config).read_text()), a.iterations, Path(a.work))
    except MoerlError as err:
        print(f"moerl: error: {what}: {err}", flush=True)
        return err.exit_code
    Path(a.out).write_text(json.dumps(res))
    return 0


def run_child(
    module: str,
    command: str,
    cfg: Any,
    iterations: int,
    work: Path,
    name: str,
    env_extra: dict[str, str] | None = None,
    on_line: Callable[[str], None] | None = None,
    timeout_s: float | None = None,
) -> tuple[int, Path, Path]:
    """Start `python -m <module> <command>` (see `child_main`) on `cfg` in `work` and wait for
    it; it dies with this process. Everything it prints goes to `<work>/<name>.log`, each line
    also to `on_line`. `timeout_s`: kill it (its process group) after that long, exit code 124.
    Returns (exit code, the result JSON's path, the log's path)."""
    import os
    import subprocess
    import threading

    from moerl.config import config_to_json
    from moerl.launch import procs

    cfg_path, result, log_path = (
        work / f"{name}.config.json",
        work / f"{name}.json",
        work / f"{name}.log",
    )
    cfg_path.write_text(config_to_json(cfg))
    env = {
        **os.environ,
        **(env_extra or {}),
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    args = [
        command,
        "--config",
        str(cfg_path),
        "--iterations",
        str(iterations),
        "--work",
        str(work / "work"),
        "--out",
        str(result),
    ]
    with log_path.open("w") as log_file:
        proc = procs.spawn(
            module, args, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert proc.stdout is not None  # stdout=PIPE
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            procs.kill_groups([proc])  # its pipe closes: the loop below ends

        timer = threading.Timer(timeout_s, expire) if timeout_s else None
        if timer is not None:
            timer.daemon = True
            timer.start()
        try:
            for line in proc.stdout:
                log_file.write(line)
                if on_line is not None:
                    on_line(line)
            code = proc.wait()
        finally:
            if timer is not None:
                timer.cancel()
            procs.kill_groups([proc])
        if expired.is_set():
            log_file.write(
                f"moerl: bench child {name} killed after {timeout_s:g} s (its timeout)\n"
            )
            code = 124
    return code, result, log_path


def log_tail(path: Path, lines: int = 25) -> str:
    """The last `lines` lines of a log file ('' when it does not exist)."""
    return (
        "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""
    )


def only_run(uri: str, experiment: str, what: str) -> str:
    """The id of the one MLflow run a bench arm's `moerl run` child made in its own tracking
    store `uri`; ArmFailed naming `what` when there is not exactly one."""
    from mlflow.tracking import MlflowClient

    from benchmarks.modes import ArmFailed

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id]) if exp is not None else []
    if len(runs) != 1:
        raise ArmFailed(f"{what}: expected one MLflow run in {uri}, found {len(runs)}")
    return runs[0].info.run_id


def unit_prompts(cfg, n_units: int) -> list[list]:
    """The first `n_units` work units' prompts (units.max_prompts each) in the run's seeded order:
    what the rollout benches feed every arm, so they compare on the same prompts."""
    from moerl.tasks.dataset import load_dataset

    ds = load_dataset(cfg.task.dataset, cfg.task.max_bad_fraction, cfg.checkpoint)
    size = cfg.units.max_prompts
    return [ds.window(u * size, size, cfg.task.shuffle_seed) for u in range(n_units)]
