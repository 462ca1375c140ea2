"""`moerl bench state`: does the run's state stay bounded over a long async run?

Design, details and limitations: docs/bench-reports/state.md#how-it-works-benchmarksstatepy.
"""

from __future__ import annotations

import re
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import envelope, format_table, write_report

ROOT = Path(__file__).resolve().parents[2]
_NUM = re.compile(r":?\d+")


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _sample(run, admin, cache: Path) -> dict[str, Any]:  # noqa: ANN001 - a LocalAsyncRun, a valkey client
    prefix = f"moerl:{run.run_id}:"
    kinds = Counter(
        _NUM.sub("", k[len(prefix) :].split(":")[0])
        for k in admin.scan_iter(match=f"{prefix}*", count=1000)
    )
    mem = admin.info("memory")
    files = list(cache.rglob("*")) if cache.is_dir() else []
    return {
        "valkey_dataset_kb": int(mem["used_memory_dataset"]) / 1024,
        "valkey_used_mb": int(mem["used_memory"]) / 2**20,
        # op keys (a hand-off's once-only guard) expire OP_TTL_S after their write: bounded by
        # rate x TTL, so counted apart from the keys that would have to stay flat
        "op_keys": kinds.get("op", 0),
        "keys": sum(n for k, n in kinds.items() if k != "op"),
        "keys_by_kind": dict(sorted(kinds.items())),
        "published": int(admin.scard(f"{prefix}published")),
        "dead": int(admin.xlen(f"{prefix}dead")),
        "cache_lock_files": sum(p.name.endswith(".lock") for p in files),
        "cache_copies": sum(
            p.is_dir() and re.fullmatch(r"v\d{6,}", p.name) is not None for p in files
        ),
        "rss_mb": {
            c.name: _rss_mb(c.proc.pid) for c in run.children.values() if c.proc.poll() is None
        },
    }


def _slope(points: list[tuple[int, float]]) -> float:
    """Least-squares growth per version."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else 0.0


def _series(rows: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        for k in (
            "valkey_dataset_kb",
            "keys",
            "op_keys",
            "published",
            "dead",
            "cache_lock_files",
            "cache_copies",
        ):
            out.setdefault(k, []).append((r["version"], float(r[k])))
        for name, mb in r["rss_mb"].items():
            if mb is not None:
                out.setdefault(f"rss_mb/{name}", []).append((r["version"], mb))
    return out


def run_bench_state(
    versions: int = 200,
    out: Path = Path("bench/state.json"),
    overrides: Sequence[str] = (),
    echo=print,
) -> dict[str, Any]:
    """One async run of `versions` versions, sampled at every version; the report (also `out`).

    Args:
        versions: versions of the tiny model to run
        out: the report (JSON)
        overrides: a config override KEY=VALUE (repeatable)
    """
    import valkey

    from moerl.config import load_config
    from moerl.errors import ConfigError
    from moerl.orchestrate.async_run import run_async

    if versions < 8:
        raise ConfigError(
            f"--versions: {versions}; allowed: an integer >= 8 (the slopes need points in both halves)"
        )
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="moerl-bench-state-") as tmp:
        t = Path(tmp)
        cfg = load_config(
            ROOT / "configs/tiny-moe-grpo.yaml",
            [
                f"checkpoint.uri={t / 'ckpt'}",
                f"checkpoint.cache_dir={t / 'cache'}",
                f"pipeline.work_dir={t / 'work'}",
                f"pipeline.pipeline_root={t / 'root'}",
                f"tracking.uri=sqlite:///{t / 'mlflow.db'}",
                f"pipeline.versions={versions}",
                "task.prompts_per_iteration=8",
                "rollout.samples_per_prompt=4",
                "trainer.optimizer.optimizer_steps_per_iteration=1",
                "units.max_prompts=2",
                "rollout.workers=1",
                "reward.scorers=1",
                "rollout.max_new_tokens=6",
                *overrides,
            ],
            mode="async",
        )
        state: dict[str, Any] = {"seen": -1, "admin": None}

        def tick(run) -> None:  # noqa: ANN001 - a LocalAsyncRun
            reg = run.bus.registry()
            v = reg.version if reg is not None else 0
            if v == state["seen"] or run.valkey is None:
                return
            state["seen"] = v
            if state["admin"] is None:  # the embedded server's default user: the loopback admin
                state["admin"] = valkey.Valkey.from_url(run.valkey.url, decode_responses=True)
            row = {
                "version": v,
                "t_s": time.perf_counter() - state.setdefault("t0", time.perf_counter()),
                **_sample(run, state["admin"], Path(cfg.checkpoint.cache_dir)),
            }
            rows.append(row)

        stats: dict[str, Any] = {}
        summary = run_async(cfg, on_tick=tick, stats=stats)
    if not summary.ok or not rows:
        raise RuntimeError(f"bench state: the run failed ({summary.run_id}); see its log above")
    half = versions // 2
    series = _series(rows)
    table = []
    for name, pts in sorted(series.items()):
        at = {
            p: next((y for x, y in pts if x >= p), pts[-1][1])
            for p in (versions // 4, half, versions)
        }
        first = _slope([(x, y) for x, y in pts if x <= half])
        second = _slope([(x, y) for x, y in pts if x >= half])
        table.append(
            {
                "series": name,
                "at_quarter": at[versions // 4],
                "at_half": at[half],
                "at_end": pts[-1][1],
                "slope_first_half": first,
                "slope_second_half": second,
            }
        )
    report = envelope(
        "state",
        True,
        versions=versions,
        overrides=list(overrides),
        counters=stats.get("counters", {}),
        series=table,
        samples=rows,
    )
    write_report(out, report)
    echo(
        format_table(
            [
                "series",
                f"v{versions // 4}",
                f"v{half}",
                "end",
                "per version (1st half)",
                "per version (2nd half)",
            ],
            [
                [
                    r["series"],
                    r["at_quarter"],
                    r["at_half"],
                    r["at_end"],
                    r["slope_first_half"],
                    r["slope_second_half"],
                ]
                for r in table
            ],
        )
    )
    echo(f"keys by kind at the end: {rows[-1]['keys_by_kind']}")
    echo(f"report: {out}")
    return report
