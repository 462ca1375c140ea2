"""`moerl bench failures CONFIG`: policy-iteration time under Spot-style interruptions.

Design, details and limitations: docs/bench-reports/failures.md#how-it-works-benchmarksfailurespy.
"""

from __future__ import annotations

import signal
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import format_table, write_report
from benchmarks.machine import machine_record
from benchmarks.modes import arm_config, check_same_workload, workload
from benchmarks.scaling import async_point
from moerl import provenance, tracking
from moerl.errors import ConfigError, MoerlError

KINDS = {"sigterm": signal.SIGTERM, "sigkill": signal.SIGKILL}


def parse_kinds(text: str | Sequence[str]) -> list[str]:
    """'sigterm,sigkill' (or a sequence) as the fault kinds; a ConfigError otherwise."""
    kinds = [k.strip() for k in (text.split(",") if isinstance(text, str) else text) if k.strip()]
    if not kinds or any(k not in KINDS for k in kinds):
        raise ConfigError(
            f"bench failures: --kinds must name {' and/or '.join(KINDS)}, comma-separated; got {text!r}"
        )
    return kinds


class FaultInjector:
    """The `on_tick` hook of the faulted run: injects the faults on schedule and times each
    worker's recovery from its heartbeats."""

    def __init__(
        self, kinds: Sequence[str], faults_per_minute: float, max_faults: int, clock=time.time
    ):
        self.kinds, self.every_s, self.max = list(kinds), 60.0 / faults_per_minute, max_faults
        self.clock = clock
        self.faults: list[dict[str, Any]] = []
        self.next_at: float | None = None

    def __call__(self, run) -> None:
        now = self.clock()
        reg = run.bus.registry()
        if self.next_at is None:
            if reg is None or reg.version < 1:
                return  # the first fault comes after version 1 is out: every engine has loaded
            self.next_at = now
        self._watch_recovery(run, now)
        if len(self.faults) >= self.max or now < self.next_at:
            return
        workers = sorted(n for n in run.children if n.startswith("rollout-"))
        name = workers[len(self.faults) % len(workers)]
        kind = self.kinds[len(self.faults) % len(self.kinds)]
        if run.children[name].proc.poll() is not None:
            return  # between a worker's exit and its restart: try again next tick
        run.signal(name, KINDS[kind])
        self.faults.append(
            {
                "worker": name,
                "kind": kind,
                "at_s": now,
                "version_at_fault": reg.version if reg else None,
                "recovered_after_s": None,
            }
        )
        print(
            f"[moerl] bench failures: {kind} -> {name} (fault {len(self.faults)}/{self.max})",
            flush=True,
        )
        self.next_at = now + self.every_s

    def _watch_recovery(self, run, now: float) -> None:
        pending = [f for f in self.faults if f["recovered_after_s"] is None]
        if not pending:
            return
        stats = run.bus.stats()
        for f in pending:
            # a dead process's last stats stay until its replacement beats
            st = stats.get(f["worker"], {})
            if st.get("started_unix", 0.0) > f["at_s"] and st.get("busy_s", 0.0) > 0:
                f["recovered_after_s"] = now - f["at_s"]


def lost_samples(c: dict[str, int]) -> int:
    """Finished samples that were never accounted for (must be 0); dead-lettered ones are
    accounted for (`samples_dead`, each with its reason in the dead-letter stream)."""
    used = (
        c.get("trained", 0)
        + c.get("filtered", 0)
        + c.get("stale_dropped", 0)
        + c.get("failed", 0)
        + c.get("samples_dead", 0)
    )
    return c.get("generated", 0) - c.get("duplicates", 0) - used


def run_bench_failures(
    config: str | Path,
    overrides: Sequence[str] = (),
    versions: int = 6,
    kinds: str | Sequence[str] = ("sigterm", "sigkill"),
    faults_per_minute: float = 2.0,
    max_faults: int = 2,
    out_dir: str | Path = "bench/failures",
    work_dir: str | Path | None = None,
) -> dict[str, Any]:
    """A fault-free and a faulted async run of the same workload; report.json, summary.md and
    plots in `out_dir`.

    Args:
        config: the workload's run config (YAML)
        overrides: config overrides KEY=VALUE (repeatable)
        versions: policy versions per run (faults start after version 1)
        kinds: fault kinds, comma-separated: sigterm, sigkill
        faults_per_minute: the faulted run's fault rate
        max_faults: faults injected at most
        out_dir: report.json, summary.md and plots
        work_dir: keep every run's files here (default: a temp dir, deleted)
    """
    from benchmarks import plots
    from benchmarks.progress import progress

    kinds = parse_kinds(kinds)
    if versions < 2:
        raise ConfigError(
            f"bench failures: --versions must be >= 2 (faults start after version 1), got {versions}"
        )
    if faults_per_minute <= 0 or max_faults < 1:
        raise ConfigError("bench failures: --faults-per-minute must be > 0 and --max-faults >= 1")
    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory(prefix="moerl-bench-failures-") as tmp:
        root = Path(work_dir) if work_dir is not None else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        dirs = {
            a: Path(tempfile.mkdtemp(prefix=f"{a}-", dir=root)) for a in ("fault_free", "faulted")
        }
        cfgs = {a: arm_config(config, overrides, "async", versions, d) for a, d in dirs.items()}
        check_same_workload(cfgs)
        injector = FaultInjector(kinds, faults_per_minute, max_faults)
        results: dict[str, dict[str, Any]] = {}
        with progress(2, "bench failures", unit="run") as bar:
            for arm in ("fault_free", "faulted"):
                try:
                    results[arm] = async_point(
                        cfgs[arm], dirs[arm], on_tick=injector if arm == "faulted" else None
                    )
                except Exception as err:  # noqa: BLE001 - reported; the other arm still runs
                    if not isinstance(err, MoerlError):
                        traceback.print_exc()
                    results[arm] = {
                        "ok": False,
                        "error": tracking.redact(f"{type(err).__name__}: {err}"),
                    }
                bar.advance(1, arm)
    ff, fa = results["fault_free"], results["faulted"]
    faults = injector.faults
    t0 = faults[0]["at_s"] if faults else 0.0
    for f in faults:
        f["at_s"] = f["at_s"] - t0  # seconds after the first fault
    summary: dict[str, Any] = {}
    if ff["ok"] and fa["ok"]:
        c_ff, c_fa = ff["counters"], fa["counters"]
        summary = {
            "iteration_s_fault_free": ff["wall_s"] / versions,
            "iteration_s_faulted": fa["wall_s"] / versions,
            "iteration_time_ratio": fa["wall_s"] / ff["wall_s"],
            "finished_samples_lost": lost_samples(c_fa),
            "finished_samples_lost_fault_free": lost_samples(c_ff),
            "samples_duplicated": c_fa.get("duplicates", 0),
            # a fault-free run executes every unit once: nothing reclaimed, nothing finished twice
            "samples_duplicated_fault_free": c_ff.get("duplicates", 0),
            "units_reclaimed_fault_free": c_ff.get("units_reclaimed", 0),
            "samples_generated_extra": c_fa.get("generated", 0) - c_ff.get("generated", 0),
            "units_requeued": c_fa.get("units_requeued", 0),
            "units_reclaimed": c_fa.get("units_reclaimed", 0),
            "samples_regenerated_at_most": (
                c_fa.get("units_requeued", 0) + c_fa.get("units_reclaimed", 0)
            )
            * cfgs["faulted"].units.max_prompts
            * cfgs["faulted"].rollout.samples_per_prompt,
            "drains": c_fa.get("drains", 0),
            "restarts": fa.get("restarts"),
            "recovery_s": [f["recovered_after_s"] for f in faults],
        }
    report = {
        "bench": "failures",
        "schema": 1,
        "config": str(config),
        "overrides": list(overrides),
        "workload": workload(cfgs["faulted"], versions),
        "injection": {
            "kinds": list(kinds),
            "faults_per_minute": faults_per_minute,
            "max_faults": max_faults,
            "visibility_timeout_s": cfgs["faulted"].units.visibility_timeout_s,
            "grace_seconds": cfgs["faulted"].rollout.grace_seconds,
        },
        "faults": faults,
        "runs": results,
        "summary": summary,
        "ok": bool(summary)
        and summary["finished_samples_lost"] == 0
        and len(faults) > 0
        and summary["samples_duplicated_fault_free"] == 0
        and summary["units_reclaimed_fault_free"] == 0,
        "versions": provenance.collect(),
        "machine": machine_record(),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    plots_ = []
    if summary:
        plots_.append(
            plots.stacked_stages(
                ["fault-free", "faulted"],
                [
                    {"iteration": summary["iteration_s_fault_free"]},
                    {"iteration": summary["iteration_s_faulted"]},
                ],
                out_dir,
                "iteration_time.png",
                "policy-iteration time (s per version)",
            )
        )
        rec = [
            (i + 1, f["recovered_after_s"])
            for i, f in enumerate(faults)
            if f["recovered_after_s"] is not None
        ]
        plots_.append(
            plots.lines(
                {"recovery": rec},
                out_dir,
                "recovery.png",
                "fault",
                "seconds to recover",
                "recovery time per fault",
            )
        )
    report["plots"] = plots_
    write_report(out_dir / "report.json", report)
    print(
        format_table(
            ["fault", "worker", "kind", "at s", "recovered after s"],
            [
                [i + 1, f["worker"], f["kind"], f["at_s"], f["recovered_after_s"]]
                for i, f in enumerate(faults)
            ],
        )
    )
    if summary:
        print(
            format_table(
                ["figure", "value"],
                [[k, v if not isinstance(v, list) else str(v)] for k, v in summary.items()],
            )
        )
    print(
        f"wrote {out_dir / 'report.json'}"
        + ("" if report["ok"] else "  (NOT ok: see summary/runs)")
    )
    return report
