"""`moerl bench scaling CONFIG`: the same workload at several sizes, async mode.

Design, details and limitations: docs/bench-reports/scaling.md#how-it-works-benchmarksscalingpy.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import format_table, log_tail, write_report
from benchmarks.machine import machine_record
from benchmarks.modes import ArmFailed, _own_experiment, arm_config, check_same_workload, workload
from moerl import provenance, tracking
from moerl.config import RunConfig
from moerl.errors import ConfigError, MoerlError


def parse_sizes(text: str | Sequence[int], what: str) -> list[int]:
    """'1,2,4' (or a sequence) as distinct counts >= 1; a ConfigError otherwise."""
    try:
        parts = text.split(",") if isinstance(text, str) else [str(x) for x in text]
        sizes = [int(x) for x in parts if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(n < 1 for n in sizes) or len(set(sizes)) != len(sizes):
        raise ConfigError(
            f"bench scaling: --{what} must be distinct integers >= 1, comma-separated; got {text!r}"
        )
    return sizes


def async_point(cfg: RunConfig, point_dir: Path, on_tick=None) -> dict[str, Any]:
    """One async run of `cfg`: wall time, the bus counters, and the MLflow figures."""
    from mlflow.tracking import MlflowClient

    from moerl.orchestrate.async_run import run_async

    uri = _own_experiment(cfg, point_dir)
    stats: dict[str, Any] = {}
    t0 = time.perf_counter()
    summary = run_async(cfg, on_tick=on_tick, stats=stats)
    wall = time.perf_counter() - t0
    if not summary.ok:
        raise ArmFailed(
            "the async run failed; last lines of the trainer's log:\n"
            + log_tail(Path(cfg.pipeline.work_dir) / summary.run_id / "logs" / "trainer.log")
        )
    last = MlflowClient(uri).get_run(summary.run_id).data.metrics
    c = stats.get("counters") or {}
    hist = [v for _, v in tracking.metric_history(uri, summary.run_id, "buffer/staleness_mean")]
    rewards = [v for _, v in tracking.metric_history(uri, summary.run_id, "reward/mean")]
    rates = [
        v for _, v in tracking.metric_history(uri, summary.run_id, "async/producer_samples_per_s")
    ]
    steady = rates[1:] or rates  # the first version's window includes the engines' start
    return {
        "ok": True,
        "run_id": summary.run_id,
        "wall_s": wall,
        "counters": c,
        "restarts": stats.get("restarts"),
        "exits": stats.get("exits"),
        "samples_per_s": c.get("generated", 0) / wall,
        "steady_samples_per_s": sum(steady) / len(steady) if steady else None,
        "tokens_per_s": c.get("tokens_generated", 0) / wall,
        "versions_per_hour": 3600 * cfg.pipeline.versions / wall,
        "staleness_mean": sum(hist) / len(hist) if hist else None,
        "reward_last3": sum(rewards[-3:]) / len(rewards[-3:]) if rewards else None,
        "trainer_busy_fraction": last.get("async/trainer_busy_fraction"),
    }


def run_bench_scaling(
    config: str | Path,
    overrides: Sequence[str] = (),
    workers: str | Sequence[int] = (1, 2, 4),
    scorers: str | Sequence[int] = (1,),
    versions: int = 4,
    out_dir: str | Path = "bench/scaling",
    work_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Each (workers, scorers) point, one async run each; report.json, summary.md and plots in
    `out_dir`.

    Args:
        config: the workload's run config (YAML)
        overrides: config overrides KEY=VALUE (repeatable)
        workers: rollout-worker counts, comma-separated
        scorers: scorer counts, comma-separated
        versions: policy versions per run
        out_dir: report.json, summary.md and plots
        work_dir: keep every run's files here (default: a temp dir, deleted)
    """
    from benchmarks import plots
    from benchmarks.progress import progress

    workers, scorers = parse_sizes(workers, "workers"), parse_sizes(scorers, "scorers")
    if versions < 1:
        raise ConfigError(f"bench scaling: --versions must be >= 1, got {versions}")
    points = [(w, s) for s in scorers for w in workers]
    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory(prefix="moerl-bench-scaling-") as tmp:
        root = Path(work_dir) if work_dir is not None else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        dirs = {p: Path(tempfile.mkdtemp(prefix=f"w{p[0]}-s{p[1]}-", dir=root)) for p in points}
        cfgs = {
            p: arm_config(
                config,
                [*overrides, f"rollout.workers={p[0]}", f"reward.scorers={p[1]}"],
                "async",
                versions,
                dirs[p],
            )
            for p in points
        }
        check_same_workload({f"workers={w},scorers={s}": c for (w, s), c in cfgs.items()})
        results: dict[tuple[int, int], dict[str, Any]] = {}
        with progress(len(points), "bench scaling", unit="run") as bar:
            for p in points:
                try:
                    results[p] = async_point(cfgs[p], dirs[p])
                except Exception as err:  # noqa: BLE001 - a failed point is reported; the others still run
                    if not isinstance(err, MoerlError):
                        traceback.print_exc()
                    results[p] = {
                        "ok": False,
                        "error": tracking.redact(f"{type(err).__name__}: {err}"),
                    }
                bar.advance(1, f"workers={p[0]} scorers={p[1]}")
    rows = []
    for s in scorers:
        base = results[(workers[0], s)]
        for w in workers:
            r = results[(w, s)]
            ok = r["ok"] and base["ok"]
            key = (
                "steady_samples_per_s"
                if ok and r["steady_samples_per_s"] and base["steady_samples_per_s"]
                else "samples_per_s"
            )
            speedup = r[key] / base[key] if ok and base[key] else None
            rows.append(
                {
                    "workers": w,
                    "scorers": s,
                    **r,
                    "speedup": speedup,
                    "speedup_basis": key if ok else None,
                    "efficiency": speedup / (w / workers[0]) if speedup is not None else None,
                }
            )
    first = next(iter(cfgs.values()))
    report: dict[str, Any] = {
        "bench": "scaling",
        "schema": 1,
        "config": str(config),
        "overrides": list(overrides),
        "workload": workload(first, versions),
        "workers": list(workers),
        "scorers": list(scorers),
        "points": rows,
        "ok": all(r["ok"] for r in rows),
        "cores": len(os.sched_getaffinity(0)),
        "versions": provenance.collect(),
        "machine": machine_record(),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    report["plots"] = [
        plots.lines(
            {
                f"scorers={s}": [
                    (r["workers"], r["steady_samples_per_s"] or r["samples_per_s"])
                    for r in rows
                    if r["scorers"] == s and r["ok"]
                ]
                for s in scorers
            },
            out_dir,
            "scaling.png",
            "rollout workers",
            "samples generated / s",
            "aggregate throughput",
        ),
        plots.lines(
            {
                f"scorers={s}": [
                    (r["workers"], r["efficiency"])
                    for r in rows
                    if r["scorers"] == s and r["efficiency"] is not None
                ]
                for s in scorers
            },
            out_dir,
            "efficiency.png",
            "rollout workers",
            "per-worker efficiency",
            "efficiency relative to the smallest size",
        ),
    ]
    write_report(out_dir / "report.json", report)
    print(
        format_table(
            [
                "workers",
                "scorers",
                "ok",
                "wall s",
                "samples/s (wall)",
                "samples/s (steady)",
                "tokens/s",
                "speedup",
                "efficiency",
                "staleness",
            ],
            [
                [
                    r["workers"],
                    r["scorers"],
                    r["ok"],
                    r.get("wall_s"),
                    r.get("samples_per_s"),
                    r.get("steady_samples_per_s"),
                    r.get("tokens_per_s"),
                    r["speedup"],
                    r["efficiency"],
                    r.get("staleness_mean"),
                ]
                for r in rows
            ],
        )
    )
    print(f"wrote {out_dir / 'report.json'} and {len(report['plots'])} plots")
    return report
