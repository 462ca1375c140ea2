"""`moerl bench fleet`: an elastic rollout fleet against a fixed one, side by side, on a workload
whose generation cost changes mid-run (`rollout.max_new_tokens_schedule`; without one in the
config, the bench doubles max_new_tokens at half the versions).

Each arm is the user's `moerl run CONFIG --mode async` in a fresh child process, the same seed:
fixed (rollout.workers = min_workers, no scaling) and elastic (min_workers..max_workers, starting
at min); repeats interleave them, the first arm alternating. Each arm's run gets a Valkey of the
bench's own (started and stopped here), so the workers' final stats outlive the run: the fixed
arm's worker-seconds and idle worker-seconds are then measured as the elastic arm's fleet/* are
(components/rollout/fleet.py). Reported per arm: time to finish, worker-seconds paid, idle
worker-seconds, buffer starvation (timing/buffer_wait_s, per trainer step and after the change),
scale-up latency, the fleet's size over time (the run's "fleet: A -> B" lines, timed here), the
response length per step (the change held), and elastic/fixed ratios of the per-arm medians over repeats.

Design, details and limitations: docs/bench-reports/fleet.md.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import envelope, format_table, log_tail, only_run, write_report
from benchmarks.machine import machine_line
from benchmarks.modes import ArmFailed, arm_paths
from benchmarks.peer import BUSY_CORES, CpuUsage, clear_own_dirs
from moerl import tracking
from moerl.config import RunConfig, load_config
from moerl.errors import ConfigError, MoerlError

ARMS = ("fixed", "elastic")
# `LocalAsyncRun.resize`'s line: "[moerl] fleet: 1 -> 2 rollout workers: <why>"
FLEET_LINE = re.compile(r"\[moerl\] fleet: (\d+) -> (\d+) rollout workers: (.*)")
# `moerl run --mode async`'s status line: "[moerl]   198s version 8/24 reward/mean=0.256 ..."
VERSION_LINE = re.compile(r"\[moerl\]\s+\S+ version (\d+)/(\d+) ")
# what each arm's row reports, and which of them the ratios compare (elastic / fixed)
RATIO_KEYS = (
    "wall_s",
    "worker_s",
    "idle_worker_s",
    "starvation_s",
    "starvation_after_change_s",
)


# -- configs -----------------------------------------------------------------------------------
def bounds(cfg: RunConfig) -> tuple[int, int]:
    """(min_workers, max_workers) of the config; the bench compares a fleet that can scale."""
    lo, hi = cfg.rollout.fleet_bounds
    if lo >= hi:
        raise ConfigError(
            f"bench fleet: rollout.min_workers ({lo}) must be below rollout.max_workers ({hi}): the "
            "elastic arm scales between them and the fixed arm runs min_workers; set both"
        )
    return lo, hi


def change_overrides(cfg: RunConfig, versions: int) -> tuple[list[str], int]:
    """The generation cost's change: the config's own `rollout.max_new_tokens_schedule`, or, when
    it has none, max_new_tokens doubled from version versions // 2. Returns the overrides that
    add it (none for the config's own) and the first version of the change."""
    steps = cfg.rollout.max_new_tokens_schedule
    if steps:
        at = steps[0].from_version
        if not 0 < at < versions or steps[0].max_new_tokens == cfg.rollout.max_new_tokens:
            raise ConfigError(
                f"bench fleet: rollout.max_new_tokens_schedule's first step (from_version {at}, "
                f"max_new_tokens {steps[0].max_new_tokens}) must change the length "
                f"(max_new_tokens {cfg.rollout.max_new_tokens}) at a version within 1..{versions - 1} "
                "(--versions), so that the run has a before and an after"
            )
        return [], at
    if versions < 2:
        raise ConfigError(
            f"bench fleet: --versions {versions}: the generation cost changes at half the versions, "
            "so at least 2 are needed (or give rollout.max_new_tokens_schedule)"
        )
    at, doubled = versions // 2, 2 * cfg.rollout.max_new_tokens
    return [
        f"rollout.max_new_tokens_schedule=[{{from_version: {at}, max_new_tokens: {doubled}}}]"
    ], at


def arm_sets(arm: str, lo: int, hi: int) -> list[str]:
    """The fleet of `arm`: both start at min_workers; only the elastic one may grow."""
    top = hi if arm == "elastic" else lo
    return [f"rollout.workers={lo}", f"rollout.min_workers={lo}", f"rollout.max_workers={top}"]


def round_order(i: int) -> tuple[str, ...]:
    """Round i's arms: fixed first in even rounds, elastic first in odd ones."""
    return ARMS if i % 2 == 0 else ARMS[::-1]


# -- the report's math, on what the arms recorded ------------------------------------------------
def fleet_events(lines: Sequence[tuple[float, str]]) -> list[dict[str, Any]]:
    """The run's resize lines, (seconds from the arm's start, text), as events."""
    out = []
    for t, line in lines:
        m = FLEET_LINE.search(line)
        if m:
            out.append({"t_s": t, "from": int(m[1]), "to": int(m[2]), "why": m[3].strip()})
    return out


def size_over_time(start: int, events: Sequence[dict[str, Any]], end_s: float) -> dict[str, Any]:
    """The fleet's size as steps [(t_s, size)], its time-weighted mean over [0, end_s], largest."""
    steps = [(0.0, start), *((e["t_s"], e["to"]) for e in events)]
    spans = zip(steps, [*steps[1:], (end_s, steps[-1][1])])
    mean = sum(n * max(0.0, t2 - t1) for (t1, n), (t2, _) in spans) / max(end_s, 1e-9)
    return {"steps": steps, "mean": mean, "max": max(n for _, n in steps)}


def worker_seconds(stats: dict[str, dict[str, float]]) -> dict[str, float]:
    """Worker-seconds paid (each rollout worker's wall_s, its process's life) and idle (alive with
    nothing to generate: wall_s - busy_s), from the workers' final stats on the bus: what
    fleet/worker_s and fleet/idle_worker_s measure (LocalFleet.metrics)."""
    rollout = {n: s for n, s in stats.items() if n.startswith("rollout")}
    return {
        "worker_s": sum(s.get("wall_s", 0.0) for s in rollout.values()),
        "idle_worker_s": sum(
            max(0.0, s.get("wall_s", 0.0) - s.get("busy_s", 0.0)) for s in rollout.values()
        ),
        "workers_seen": float(len(rollout)),
    }


def scale_up_latency(stats: dict[str, dict[str, float]], start: int) -> float | None:
    """Mean time from an added worker's start to its first group (`first_sample_s`): the
    workers past the first `start` ones (rollout-<start> and later) are the added ones."""
    lat = [
        s["first_sample_s"]
        for n, s in stats.items()
        if n.startswith("rollout-")
        and n.rsplit("-", 1)[1].isdigit()
        and int(n.rsplit("-", 1)[1]) >= start
        and "first_sample_s" in s
    ]
    return sum(lat) / len(lat) if lat else None


def starvation(waits: Sequence[tuple[int, float]], change_at: int) -> dict[str, Any]:
    """The buffer's starvation: the trainer's wait for scored groups (timing/buffer_wait_s) per
    step, summed, before and from the change (the step that trains on the first version of the
    change, `change_at`, on)."""
    before = [v for s, v in waits if s < change_at]
    after = [v for s, v in waits if s >= change_at]
    return {
        "starvation_s": sum(v for _, v in waits),
        "starvation_before_change_s": sum(before),
        "starvation_after_change_s": sum(after),
        "per_step_after_change_s": [round(v, 3) for v in after],
    }


def change_time(reward_s: Sequence[float], change_at: int) -> float:
    """Seconds from the arm's start to when the change's first version was published: the
    reward of step change_at - 1 is logged when that version is trained (0 for version 0)."""
    if change_at <= 0 or not reward_s:
        return 0.0
    return reward_s[min(change_at, len(reward_s)) - 1]


def reaction(events: Sequence[dict[str, Any]], changed_s: float) -> float | None:
    """Seconds from the change to the first scale-up after it (None: none)."""
    ups = [e["t_s"] for e in events if e["to"] > e["from"] and e["t_s"] >= changed_s]
    return ups[0] - changed_s if ups else None


def lengths(history: Sequence[tuple[int, float]], change_at: int) -> dict[str, float | None]:
    """Mean response length before and from the change (response/length_mean per step)."""
    before = [v for s, v in history if s < change_at]
    after = [v for s, v in history if s >= change_at]
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return {"length_before": mean(before), "length_after": mean(after)}


def arm_row(
    wall_s: float,
    stats: dict[str, dict[str, float]],
    lines: Sequence[tuple[float, str]],
    waits: Sequence[tuple[int, float]],
    length_history: Sequence[tuple[int, float]],
    reward_s: Sequence[float],
    start: int,
    change_at: int,
    logged: dict[str, float] | None = None,
) -> dict[str, Any]:
    """One arm's row from what it recorded: its wall time, the workers' final stats on the bus,
    its timed output lines, the trainer's buffer waits, response lengths and reward times per
    step; `logged`: the fleet/* metrics the run logged itself (the elastic arm), kept beside."""
    events = fleet_events(lines)
    changed = change_time(reward_s, change_at)
    return {
        "ok": True,
        "wall_s": wall_s,
        **worker_seconds(stats),
        **starvation(waits, change_at),
        "scale_up_latency_s": scale_up_latency(stats, start),
        "change_s": changed,
        "first_scale_up_after_change_s": reaction(events, changed),
        "fleet_events": events,
        "fleet_size": size_over_time(start, events, wall_s),
        **lengths(length_history, change_at),
        "logged_fleet": dict(logged or {}),
    }


def ratios(fixed: dict[str, Any] | None, elastic: dict[str, Any] | None) -> dict[str, float | None]:
    """elastic / fixed for each of RATIO_KEYS (None where an arm failed or the fixed is 0)."""
    out: dict[str, float | None] = {}
    for k in RATIO_KEYS:
        a = (elastic or {}).get(k) if (elastic or {}).get("ok") else None
        b = (fixed or {}).get(k) if (fixed or {}).get("ok") else None
        out[k] = a / b if a is not None and b else None
    return out


def summarize(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per arm, the median over the rounds it finished of each ratio key and the scale-up
    latency; the elastic/fixed ratios of those medians."""

    def med(arm: str, key: str) -> float | None:
        xs = [
            r["arms"][arm][key]
            for r in rounds
            if r["arms"].get(arm, {}).get("ok") and r["arms"][arm].get(key) is not None
        ]
        return statistics.median(xs) if xs else None

    keys = (*RATIO_KEYS, "scale_up_latency_s", "first_scale_up_after_change_s")
    arms = {a: {k: med(a, k) for k in keys} for a in ARMS}
    for a in ARMS:
        arms[a]["ok"] = any(r["arms"].get(a, {}).get("ok") for r in rounds)
    return {"arms": arms, "ratios": ratios(arms["fixed"], arms["elastic"])}


def format_summary(report: dict[str, Any]) -> str:
    s = report["summary"]
    headers = ["arm", "finish s", "worker s", "idle worker s", "starved s", "starved after s",
               "scale-up s", "up after change s"]  # fmt: skip
    rows = [
        [
            a,
            *(
                s["arms"][a].get(k)
                for k in (*RATIO_KEYS, "scale_up_latency_s", "first_scale_up_after_change_s")
            ),
        ]  # fmt: skip
        for a in ARMS
    ]
    r = s["ratios"]
    rows.append(["elastic/fixed", *(r.get(k) for k in RATIO_KEYS), None, None])
    lines = [
        f"medians over {len(report['rounds'])} round(s); the cost changes at version "
        f"{report['change_at']} ({report['schedule']})",
        format_table(headers, rows),
        "",
    ]
    for i, rd in enumerate(report["rounds"], 1):
        for a in rd["order"]:
            x = rd["arms"][a]
            if not x.get("ok"):
                last = (x.get("error") or "").strip().splitlines()[-1:]
                lines.append(f"round {i} {a} FAILED: {last[0] if last else 'unknown'}")
                continue
            sizes = " ".join(f"{t:.0f}s:{n}" for t, n in x["fleet_size"]["steps"])
            f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
            busy = x.get("others_cores")
            lines.append(
                f"round {i} {a}: fleet {sizes} (mean {x['fleet_size']['mean']:.2f}); response "
                f"length {f(x['length_before'])} -> {f(x['length_after'])}; starved per step "
                f"after the change {x['per_step_after_change_s']}; other processes' load "
                f"{f(busy)} cores"
            )
    return "\n".join(lines)


def format_markdown(report: dict[str, Any]) -> str:
    return "\n".join(
        [
            "# moerl bench fleet",
            "",
            f"`{report['command']}`",
            "",
            "```",
            format_summary(report),
            "```",
            "",
            machine_line(report["machine"]),
            "",
        ]  # fmt: skip
    )


# -- running an arm ----------------------------------------------------------------------------
def arm_argv(config: str | Path, sets: Sequence[str]) -> list[str]:
    return ["run", str(config), "--mode", "async", *(x for s in sets for x in ("--set", s))]


def _run_arm(
    config: str | Path,
    sets: list[str],
    arm_dir: Path,
    start: int,
    change_at: int,
    timeout_s: float = 1800.0,
) -> dict[str, Any]:
    """`moerl run` with `sets` in `arm_dir`, against a Valkey of the bench's own, killed after
    `timeout_s`; its row."""

    from moerl.bus.client import EmbeddedValkey, connect
    from moerl.bus.run import RunBus
    from moerl.launch import procs

    cfg = load_config(config, sets, mode="async")
    uri = tracking.resolve_uri(cfg.tracking)
    server = EmbeddedValkey(arm_dir / "valkey", appendonly=cfg.valkey.appendonly).start()
    argv = arm_argv(config, [*sets, f"valkey.url={server.url}"])
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    log_path = arm_dir / "moerl.log"
    lines: list[tuple[float, str]] = []
    try:
        t0, t0_unix = time.perf_counter(), time.time()
        seen = ""
        with log_path.open("w") as log_file:
            proc = procs.spawn(
                "moerl.cli", argv, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            assert proc.stdout is not None  # stdout=PIPE
            # bounded: a run that hangs is killed (its stdout then ends) and the arm fails
            import threading

            timer = threading.Timer(timeout_s, procs.kill_groups, args=([proc],))
            timer.start()
            try:
                for line in proc.stdout:
                    t = time.perf_counter() - t0
                    log_file.write(f"{t:9.2f} {line}")
                    if line.startswith("[moerl]"):
                        lines.append((t, line.rstrip("\n")))
                    m = VERSION_LINE.match(line)
                    if (m and m[1] != seen) or FLEET_LINE.search(line):
                        seen = m[1] if m else seen
                        print(f"[moerl] bench fleet: {t:6.1f}s {line.strip()[8:]}", flush=True)
                code = proc.wait()
            finally:
                timer.cancel()
                procs.kill_groups([proc])
        wall = time.perf_counter() - t0
        if code != 0:
            why = (
                f"killed after {timeout_s:g} s (--timeout-s)"
                if wall >= timeout_s
                else f"exited {code}"
            )
            raise ArmFailed(f"run {why}; last lines of its output:\n{log_tail(log_path)}")
        run_id = only_run(uri, cfg.tracking.experiment, "bench fleet")
        stats = RunBus(connect(server.url, 10.0), run_id).stats()
    finally:
        server.stop()
    from mlflow.tracking import MlflowClient

    last = MlflowClient(uri).get_run(run_id).data.metrics
    row = arm_row(
        wall,
        stats,
        lines,
        tracking.metric_history(uri, run_id, "timing/buffer_wait_s"),
        tracking.metric_history(uri, run_id, "response/length_mean"),
        [t - t0_unix for t in tracking.metric_times(uri, run_id, "reward/mean")],
        start,
        change_at,
        logged={k: v for k, v in last.items() if k.startswith("fleet/") and k != "fleet/workers"},
    )
    return {**row, "run_id": run_id, "command": "moerl " + " ".join(arm_argv(config, sets))}


def run_bench_fleet(
    config: str | Path,
    overrides: Sequence[str] = (),
    versions: int | None = None,
    repeats: int = 1,
    out_dir: str | Path = "bench/fleet",
    timeout_s: float = 1800.0,
) -> dict[str, Any]:
    """Run the fixed and the elastic arm `repeats` times, interleaved; write report.json and
    summary.md to `out_dir` (each arm's directory under it) and print the table.

    Args:
        config: the workload's run config (YAML)
        overrides: config overrides KEY=VALUE (repeatable)
        versions: versions per arm (default: the config's async pipeline.versions)
        repeats: rounds of both arms, interleaved (the first arm alternates); the table shows
            medians
        out_dir: report.json, summary.md and round<i>/<arm>/ (replaced by each run)
        timeout_s: each arm's run is killed after this long, and the bench fails (default 1800)
    """
    if repeats < 1:
        raise ConfigError(f"bench fleet: --repeats must be >= 1, got {repeats}")
    if versions is not None and versions < 1:
        raise ConfigError(f"bench fleet: --versions must be >= 1, got {versions}")
    base = load_config(config, list(overrides), mode="async")
    versions = versions or base.pipeline.versions
    lo, hi = bounds(base)
    if base.reward.kind != "rules":
        raise ConfigError(
            "bench fleet: reward.kind must be rules (each arm runs in a fresh store, where no "
            "reward model is registered)"
        )
    change, change_at = change_overrides(base, versions)
    out = Path(out_dir)
    clear_own_dirs(out)  # a run before: its round<i>/ (each arm's MLflow database must be new)
    rounds: list[dict[str, Any]] = []
    for i in range(repeats):
        arms: dict[str, dict[str, Any]] = {}
        for arm in round_order(i):
            arm_dir = out / f"round{i + 1}" / arm
            arm_dir.mkdir(parents=True, exist_ok=True)
            sets = [*overrides, *change, *arm_sets(arm, lo, hi), *arm_paths(arm_dir),
                    f"pipeline.versions={versions}"]  # fmt: skip
            print(
                f"[moerl] bench fleet: round {i + 1}/{repeats} arm {arm} "
                f"({lo}..{hi if arm == 'elastic' else lo} workers), {versions} versions",
                flush=True,
            )
            usage = CpuUsage()
            try:
                arms[arm] = _run_arm(config, sets, arm_dir, lo, change_at, timeout_s)
            except Exception as err:  # noqa: BLE001 - recorded; the other arm still runs
                if not isinstance(err, MoerlError):
                    traceback.print_exc()
                arms[arm] = {"ok": False, "error": tracking.redact(f"{type(err).__name__}: {err}")}
            # the machine's other load: two arms under different load compare badly
            arms[arm]["others_cores"] = others = usage.others_cores()
            if others is not None and others > BUSY_CORES:
                print(
                    f"[moerl] bench fleet: WARNING: other processes kept {others:.2f} cores busy "
                    "during this arm; its times are skewed (run the bench on an idle machine)",
                    flush=True,
                )
        rounds.append(
            {
                "order": list(round_order(i)),
                "arms": arms,
                "ratios": ratios(arms.get("fixed"), arms.get("elastic")),
            }
        )
    cfg = load_config(config, [*overrides, *change], mode="async")
    cmd = ["moerl", "bench", "fleet", str(config), "--versions", str(versions), "--repeats",
           str(repeats), "--out-dir", str(out), *(x for s in overrides for x in ("--set", s))]  # fmt: skip
    report = envelope(
        "fleet",
        all(a.get("ok") for r in rounds for a in r["arms"].values()),
        command=" ".join(cmd),
        config=str(config),
        overrides=list(overrides),
        versions_per_arm=versions,
        bounds=[lo, hi],
        change_at=change_at,
        schedule=json.dumps(
            [s.model_dump() for s in cfg.rollout.max_new_tokens_schedule], separators=(",", ":")
        ),
        max_new_tokens=cfg.rollout.max_new_tokens,
        summary=summarize(rounds),
        rounds=rounds,
    )
    write_report(out / "report.json", report)
    (out / "summary.md").write_text(format_markdown(report))
    print(format_summary(report))
    print(f"wrote {out / 'report.json'} and {out / 'summary.md'}")
    return report
