"""`moerl compare RUN_ID...`: MLflow runs side by side, with the noise taken into account.

Design, details and limitations: docs/bench-reports/compare.md#how-it-works-benchmarkscomparepy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import format_table, write_report
from benchmarks.stats import noise_exceeded, summarize, t975
from moerl import tracking
from moerl.errors import ConfigError

# Training-run metrics compared (each over its history); timing/<stage>_s are added per run.
HEADLINE = (
    "reward/mean",
    "timing/iteration_s",
    "rollout/samples_per_s",
    "async/consumer_samples_per_s",
    "async/producer_samples_per_s",
    "train/loss",
    "buffer/staleness_mean",
)
LAST_N = {"reward/mean": 3}


def _runs(client, run_ids: Sequence[str]) -> list[Any]:
    from mlflow.exceptions import MlflowException

    runs = []
    for rid in run_ids:
        try:
            runs.append(client.get_run(rid))
        except MlflowException as e:
            raise ConfigError(
                f"compare: run {rid!r} not found at the tracking URI ({type(e).__name__})"
            ) from e
    return runs


def differing_params(runs: Sequence[Any]) -> dict[str, list[str | None]]:
    keys = sorted({k for r in runs for k in r.data.params})
    out = {}
    for k in keys:
        vals = [r.data.params.get(k) for r in runs]
        if len(set(vals)) > 1:
            out[k] = vals
    return out


def _history(client, run_id: str, key: str) -> list[float]:
    return [
        m.value
        for m in sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
        if math.isfinite(m.value)
    ]


def run_figures(client, run) -> dict[str, dict[str, Any]]:
    """Every headline figure of one run as a summary {n, mean, std, ci95, ...}."""
    rid, metrics, params = run.info.run_id, run.data.metrics, run.data.params
    figs: dict[str, dict[str, Any]] = {}
    if "bench.repeats" in params:  # a bench run: mean and std over its repeats
        n = int(params["bench.repeats"])
        for k, v in metrics.items():
            if k.startswith("bench/") and not k.endswith("_std") and f"{k}_std" in metrics:
                std = metrics[f"{k}_std"]
                half = t975(n - 1) * std / math.sqrt(n) if n > 1 else 0.0
                figs[k] = {
                    "n": n,
                    "mean": v,
                    "std": std,
                    "ci95": [v - half, v + half],
                    "source": "repeats",
                }
        return figs
    keys = [k for k in HEADLINE if k in metrics]
    keys += sorted(
        k
        for k in metrics
        if k.startswith("timing/")
        and k.endswith("_s")
        and k.count("/") == 1
        and k != "timing/iteration_s"
    )
    for k in keys:
        hist = _history(client, rid, k)[-LAST_N.get(k, 10**9) :]
        if hist:
            figs[k] = {**summarize(hist), "source": "iterations"}
    samples, it = (
        _history(client, rid, "rollout/samples"),
        _history(client, rid, "timing/iteration_s"),
    )
    if samples and len(samples) == len(it):  # sync: trajectories per second of each iteration
        figs["rollout/samples_per_s"] = {
            **summarize([s / t for s, t in zip(samples, it) if t > 0]),
            "source": "iterations",
        }
    return figs


def compare(client, run_ids: Sequence[str]) -> dict[str, Any]:
    if len(run_ids) < 2:
        raise ConfigError(f"compare: give at least two run ids, got {len(run_ids)}")
    if len(set(run_ids)) != len(run_ids):
        raise ConfigError("compare: a run id is given twice")
    runs = _runs(client, run_ids)
    figures = [run_figures(client, r) for r in runs]
    common = [k for k in figures[0] if all(k in f for f in figures[1:])]
    rows = []
    for k in common:
        base = figures[0][k]
        for i, f in enumerate(figures):
            s = f[k]
            delta = s["mean"] - base["mean"]
            rows.append(
                {
                    "metric": k,
                    "run": run_ids[i],
                    "n": s["n"],
                    "mean": s["mean"],
                    "std": s["std"],
                    "ci95": s["ci95"],
                    "source": s["source"],
                    "delta": delta if i else 0.0,
                    "delta_pct": 100 * delta / base["mean"] if i and base["mean"] else None,
                    "exceeds_noise": noise_exceeded(base, s) if i else None,
                }
            )
    curves = {rid: _history(client, rid, "reward/mean") for rid in run_ids}
    stage_means = [
        {
            k[len("timing/") : -2]: f[k]["mean"]
            for k in f
            if k.startswith("timing/") and k != "timing/iteration_s"
        }
        for f in figures
    ]
    return {
        "bench": "compare",
        "schema": 1,
        "runs": [
            {"run_id": r.info.run_id, "name": r.info.run_name, "status": r.info.status}
            for r in runs
        ],
        "differing_params": differing_params(runs),
        "metrics": rows,
        "only_in_some": sorted({k for f in figures for k in f} - set(common)),
        "reward_curves": curves,
        "stage_means": stage_means,
    }


def format_compare(rep: dict[str, Any]) -> str:
    ids = [r["run_id"][:8] for r in rep["runs"]]
    lines = ["params that differ:"]
    if rep["differing_params"]:
        lines.append(
            format_table(
                ["param", *ids],
                [
                    [k, *[v if v is not None else "-" for v in vals]]
                    for k, vals in rep["differing_params"].items()
                ],
            )
        )
    else:
        lines.append("  (none)")
    lines += ["", "metrics (delta against the first run; noise: do the 95 % intervals overlap?):"]
    table = []
    for m in rep["metrics"]:
        noise = {
            True: "EXCEEDS noise",
            False: "within noise",
            None: "-" if m["delta"] == 0 else "unknown (n=1)",
        }
        table.append(
            [
                m["metric"],
                m["run"][:8],
                m["n"],
                m["mean"],
                m["std"],
                f"{m['ci95'][0]:.3g}..{m['ci95'][1]:.3g}",
                m["delta"],
                None if m["delta_pct"] is None else f"{m['delta_pct']:+.1f}%",
                noise[m["exceeds_noise"]],
            ]
        )
    lines.append(
        format_table(
            ["metric", "run", "n", "mean", "std", "95% CI", "delta", "delta %", "noise"], table
        )
    )
    return "\n".join(lines)


def _plots(rep: dict[str, Any], out_dir: Path) -> list[str]:
    from benchmarks import plots

    ids = [r["run_id"][:8] for r in rep["runs"]]
    names = [
        plots.lines(
            {rid[:8]: list(enumerate(c, 1)) for rid, c in rep["reward_curves"].items()},
            out_dir,
            "reward_curves.png",
            "iteration / version",
            "reward/mean",
            "reward curves",
        )
    ]
    names.append(
        plots.stacked_stages(
            ids, rep["stage_means"], out_dir, "stages.png", "mean seconds per iteration, by stage"
        )
    )
    tp = [
        m
        for m in rep["metrics"]
        if m["metric"]
        in (
            "rollout/samples_per_s",
            "async/consumer_samples_per_s",
            "bench/trajectories_per_s_loop",
            "bench/output_tokens_per_s",
        )
    ]
    if tp:
        key = tp[0]["metric"]
        names.append(
            plots.error_bars(
                {m["run"][:8]: m for m in tp if m["metric"] == key},
                out_dir,
                "throughput.png",
                f"{key} (mean, 95 % CI)",
            )
        )
    return names


def run_compare(
    run_ids: Sequence[str],
    tracking_uri: str | None = None,
    out_dir: str | Path = "bench/compare",
    log_run: bool = True,
) -> dict[str, Any]:
    """The runs side by side: report.json, summary.md and plots in `out_dir`, the table printed.

    Args:
        run_ids: MLflow run ids
        tracking_uri: default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db
        out_dir: report.json, summary.md and plots
        log_run: log the comparison as an MLflow run (--no-mlflow: do not)
    """
    from mlflow.tracking import MlflowClient

    from moerl.config import TrackingConfig

    uri = tracking.resolve_uri(TrackingConfig(uri=tracking_uri))
    client = MlflowClient(uri)
    rep = compare(client, run_ids)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rep["plots"] = _plots(rep, out_dir)
    text = format_compare(rep)
    (out_dir / "summary.md").write_text(
        f"# moerl compare {' '.join(run_ids)}\n\n```\n{text}\n```\n"
    )
    write_report(out_dir / "report.json", rep)
    print(text)
    if log_run:
        run = client.create_run(
            tracking.experiment_id(client, "moerl-compare"),
            tags={"moerl.compare": ",".join(run_ids), "mlflow.runName": "compare"},
        )
        tracking.log_params(
            client, run.info.run_id, {f"run.{i}": rid for i, rid in enumerate(run_ids)}
        )
        for m in rep["metrics"]:
            if m["delta_pct"] is not None:
                client.log_metric(
                    run.info.run_id, f"delta_pct/{m['metric']}/{m['run'][:8]}", m["delta_pct"]
                )
        for f in sorted(out_dir.iterdir()):
            if f.suffix in (".json", ".md", ".png"):
                client.log_artifact(run.info.run_id, str(f), "compare")
        client.set_terminated(run.info.run_id, "FINISHED")
        rep["mlflow_run_id"] = run.info.run_id
        write_report(out_dir / "report.json", rep)
        print(f"logged the comparison as MLflow run {run.info.run_id} (experiment moerl-compare)")
    print(
        f"wrote {out_dir / 'report.json'}, {out_dir / 'summary.md'} and {len(rep['plots'])} plots"
    )
    return rep
