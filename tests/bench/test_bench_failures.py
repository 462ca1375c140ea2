"""`moerl bench failures` on a tiny workload: a fault-free and a faulted async run (real vLLM
workers, Valkey, MLflow; a SIGTERM drain and a SIGKILL injected); no finished sample lost,
the iteration-time ratio and the recovery times reported, plots written."""

from __future__ import annotations

import pytest

from tests.support.workloads import CONFIG, SMALL

pytestmark = pytest.mark.nightly  # a real benchmark run (docs/testing.md)


@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    from benchmarks.failures import run_bench_failures

    tmp = tmp_path_factory.mktemp("failures")
    # a small buffer (4 scored groups, half a version) keeps the workers from generating every
    # version's groups before the faults: the trainer needs the faulted workers' replacements
    return run_bench_failures(
        CONFIG,
        [
            *SMALL,
            "rollout.workers=2",
            "units.max_prompts=2",
            "units.visibility_timeout_s=4",
            "rollout.grace_seconds=10",
            "buffer.high_watermark=4",
            "buffer.low_watermark=2",
        ],
        # the two faults 0.5 s apart: at this workload's pace (a version in
        # well under a second once the engines are up) a wider gap let the
        # second worker finish every version alone before its fault came
        versions=8,
        kinds=("sigterm", "sigkill"),
        faults_per_minute=120,
        max_faults=2,
        out_dir=tmp / "out",
        work_dir=tmp / "work",
    ), tmp / "out"


def test_failures_lose_no_finished_sample_and_report_the_iteration_time(failures):
    rep, out = failures
    assert rep["ok"], rep["summary"] or rep["runs"]
    assert [f["kind"] for f in rep["faults"]] == ["sigterm", "sigkill"]
    assert {f["worker"] for f in rep["faults"]} == {"rollout-0", "rollout-1"}
    s = rep["summary"]
    assert s["finished_samples_lost"] == 0 and s["finished_samples_lost_fault_free"] == 0
    c_ff = rep["runs"]["fault_free"]["counters"]  # every unit executed exactly once without faults
    assert c_ff["duplicates"] == 0 and c_ff["units_reclaimed"] == 0 and c_ff["leases_lost"] == 0, (
        c_ff
    )
    assert s["samples_duplicated_fault_free"] == 0 and s["units_reclaimed_fault_free"] == 0
    assert s["iteration_time_ratio"] == pytest.approx(
        rep["runs"]["faulted"]["wall_s"] / rep["runs"]["fault_free"]["wall_s"]
    )
    assert s["iteration_s_faulted"] == pytest.approx(rep["runs"]["faulted"]["wall_s"] / 8)
    assert s["restarts"] >= 1  # the killed worker came back, as KFP's retry would bring it
    exits = rep["runs"]["faulted"]["exits"]
    assert 75 in exits[rep["faults"][0]["worker"]]  # the SIGTERM'd worker drained and exited 75
    assert -9 in exits[rep["faults"][1]["worker"]]
    assert len(s["recovery_s"]) == 2 and all(r is None or r > 0 for r in s["recovery_s"])
    # a replacement generated the versions after the faults
    assert any(r is not None for r in s["recovery_s"])
    for name in rep["plots"]:
        assert (out / name).stat().st_size > 1000
