"""PNG plots for benchmark reports and run comparisons (matplotlib, headless Agg backend).

Every function writes its PNG files into `out_dir` and returns their names; the reports list
them, and `make test` checks they exist.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out_dir: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out_dir / name, dpi=100)
    _plt().close(fig)
    return name


def latency_cdf(
    requests: Sequence[dict[str, Any]], out_dir: Path, name: str = "latency.png"
) -> str:
    """Empirical CDFs of time to first token, time per output token and end-to-end latency."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, key in zip(axes, ("ttft_s", "tpot_s", "e2e_s")):
        xs = sorted(q[key] for q in requests if q.get(key) is not None)
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))])
        ax.set_xlabel(f"{key} (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(key.replace("_s", ""))
        ax.grid(alpha=0.3)
    return _save(fig, out_dir, name)


def stacked_stages(
    labels: Sequence[str],
    stage_s: Sequence[dict[str, float]],
    out_dir: Path,
    name: str = "stages.png",
    title: str = "mean seconds per policy version, by stage",
) -> str:
    """One stacked bar per label (a repeat, a run): each stage's seconds per version."""
    plt = _plt()
    stages = sorted({s for d in stage_s for s in d})
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(labels) + 3), 4))
    bottom = [0.0] * len(labels)
    for s in stages:
        vals = [d.get(s, 0.0) for d in stage_s]
        ax.bar(labels, vals, bottom=bottom, label=s)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("seconds")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, out_dir, name)


def error_bars(
    figures: dict[str, dict[str, Any]],
    out_dir: Path,
    name: str = "throughput.png",
    title: str = "throughput (mean, 95 % CI)",
) -> str:
    """One bar per figure (a summary with mean and ci95), with its confidence interval."""
    plt = _plt()
    keys = list(figures)
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3.6), squeeze=False)
    for ax, k in zip(axes[0], keys):
        s = figures[k]
        ax.bar(
            [0],
            [s["mean"]],
            yerr=[[s["mean"] - s["ci95"][0]], [s["ci95"][1] - s["mean"]]],
            capsize=6,
        )
        ax.set_xticks([])
        ax.set_title(k, fontsize=8)
    fig.suptitle(title)
    return _save(fig, out_dir, name)


def lines(
    series: dict[str, Sequence[tuple[float, float]]],
    out_dir: Path,
    name: str,
    xlabel: str,
    ylabel: str,
    title: str,
) -> str:
    """One line per series of (x, y) points."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for label, pts in series.items():
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=8)
    return _save(fig, out_dir, name)


def suite_plots(
    report: dict[str, Any], out_dir: Path, requests: Sequence[dict[str, Any]]
) -> list[str]:
    r = report["results"]
    raw = report["raw"]["repeats"]
    names = [latency_cdf(requests, out_dir)]
    per_repeat = [
        {
            s: sum(v["stage_s"][s] for v in rep["versions"]) / len(rep["versions"])
            for s in rep["versions"][0]["stage_s"]
        }
        for rep in raw
    ]
    names.append(stacked_stages([f"repeat {i}" for i in range(len(raw))], per_repeat, out_dir))
    h = r["headline"]
    names.append(
        error_bars(
            {
                k: h[k]
                for k in (
                    "output_tokens_per_s",
                    "trajectories_per_s_generation",
                    "trajectories_per_s_loop",
                    "versions_per_hour",
                )
                if k in h
            },
            out_dir,
        )
    )
    series: dict[str, Sequence[tuple[float, float]]] = {}
    for side in ("rollout", "train"):
        for i, run in enumerate(r["imbalance"][side]["over_time"]):
            series[f"{side} r{i}"] = [(p["version"], p["max_over_mean_max_layer"]) for p in run]
    names.append(
        lines(
            series,
            out_dir,
            "imbalance.png",
            "policy version",
            "max / mean tokens per expert",
            "expert load imbalance (worst layer)",
        )
    )
    return names
