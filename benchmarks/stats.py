"""Summary statistics for benchmark figures: mean, standard deviation, 95 % confidence
interval, percentiles. Pure Python; no scipy.

The confidence interval is Student's t interval of the mean, mean +- t(0.975, n-1) * s / sqrt(n),
with s the sample standard deviation (n - 1 in the denominator). It assumes the repeats are
independent and roughly normal; with 3 repeats it is wide, which is the honest answer. One
value has no spread: its std is 0 and its interval is the value itself, flagged `n` = 1.

Percentiles use the nearest-rank method on the sorted values (the p-th percentile is the
smallest value with at least p % of the values at or below it), so every percentile is one of
the measured values.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

# t(0.975, df) for df = 1..30; beyond 30 the normal 1.96 is within 2 %.
_T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)


def t975(df: int) -> float:
    """Student's t quantile at 0.975 for `df` degrees of freedom (>= 1)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.96


def summarize(values: Iterable[float]) -> dict[str, Any]:
    """{n, mean, std, ci95: [lo, hi], min, max} of `values` (finite numbers; at least one)."""
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("summarize needs at least one value")
    bad = [v for v in xs if not math.isfinite(v)]
    if bad:
        raise ValueError(f"summarize needs finite values, got {bad[:3]}")
    n = len(xs)
    mean = sum(xs) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    half = t975(n - 1) * std / math.sqrt(n) if n > 1 else 0.0
    return {
        "n": n,
        "mean": mean,
        "std": std,
        "ci95": [mean - half, mean + half],
        "min": min(xs),
        "max": max(xs),
    }


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank q-th percentile (0 < q <= 100) of `values` (at least one)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 < q <= 100:
        raise ValueError(f"percentile q must be in (0, 100], got {q}")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def distribution(values: Sequence[float]) -> dict[str, Any]:
    """{n, p50, p90, p99, mean, max} of `values`; {n: 0} when there are none."""
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "mean": sum(values) / len(values),
        "max": max(values),
    }


def noise_exceeded(a: dict[str, Any], b: dict[str, Any]) -> bool | None:
    """Whether two summaries' difference exceeds run-to-run noise: their 95 % intervals do not
    overlap. None when either has a single value (no noise estimate)."""
    if a["n"] < 2 or b["n"] < 2:
        return None
    return a["ci95"][1] < b["ci95"][0] or b["ci95"][1] < a["ci95"][0]
