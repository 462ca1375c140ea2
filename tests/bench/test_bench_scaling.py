"""`moerl bench scaling` on a tiny workload: async runs (real vLLM workers, Valkey, MLflow) at
1 and 2 rollout workers; the report's schema, its plots, and figures that agree with the
counters. Speed is read, never asserted."""

from __future__ import annotations

import pytest

from tests.support.workloads import CONFIG, SMALL

pytestmark = pytest.mark.nightly  # a real benchmark run (docs/testing.md)


@pytest.fixture(scope="module")
def scaling(tmp_path_factory):
    from benchmarks.scaling import run_bench_scaling

    tmp = tmp_path_factory.mktemp("scaling")
    return run_bench_scaling(
        CONFIG,
        SMALL,
        workers=(1, 2),
        scorers=(1,),
        versions=2,
        out_dir=tmp / "out",
        work_dir=tmp / "work",
    ), tmp / "out"


def test_scaling_reports_throughput_and_efficiency_relative_to_the_smallest_size(scaling):
    rep, out = scaling
    assert rep["bench"] == "scaling" and rep["ok"], rep["points"]
    pts = {p["workers"]: p for p in rep["points"]}
    assert set(pts) == {1, 2}
    assert pts[1]["speedup"] == pytest.approx(1.0) and pts[1]["efficiency"] == pytest.approx(1.0)
    basis = pts[2]["speedup_basis"]
    assert basis in ("steady_samples_per_s", "samples_per_s")
    assert pts[2]["speedup"] == pytest.approx(pts[2][basis] / pts[1][basis])
    assert pts[2]["efficiency"] == pytest.approx(pts[2]["speedup"] / 2)
    for p in pts.values():
        c = p["counters"]
        assert p["samples_per_s"] == pytest.approx(c["generated"] / p["wall_s"])
        assert (
            c["trained"] + c["filtered"] + c["stale_dropped"] + c["failed"] + c["samples_dead"]
            == c["generated"] - c["duplicates"]
        )
    assert pts[2]["counters"]["engine_loads"] >= 2  # two workers, each its own engine
    for name in rep["plots"]:
        assert (out / name).stat().st_size > 1000
