"""`moerl bench state`'s arithmetic (the run itself is measured by hand: docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from benchmarks.state import _series, _slope, run_bench_state
from moerl.errors import ConfigError


def test_the_slope_is_the_least_squares_growth_per_version():
    assert _slope([(0, 1.0), (1, 3.0), (2, 5.0)]) == pytest.approx(2.0)
    assert _slope([(0, 4.0), (10, 4.0)]) == 0.0
    assert _slope([(3, 7.0)]) == 0.0


def test_series_split_by_kind_and_stage():
    rows = [
        {
            "version": v,
            "valkey_dataset_kb": 100.0 + v,
            "keys": 12,
            "op_keys": 40 * v,
            "published": 0,
            "dead": 0,
            "cache_lock_files": 2,
            "cache_copies": 2,
            "rss_mb": {"trainer": 700.0 + v, "gone": None},
        }
        for v in range(4)
    ]
    s = _series(rows)
    assert s["rss_mb/trainer"] == [(v, 700.0 + v) for v in range(4)] and "rss_mb/gone" not in s
    assert _slope(s["op_keys"]) == pytest.approx(40.0) and _slope(s["keys"]) == 0.0


def test_too_few_versions_are_refused_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match=r"--versions: 4; allowed: an integer >= 8"):
        run_bench_state(4, tmp_path / "r.json")
