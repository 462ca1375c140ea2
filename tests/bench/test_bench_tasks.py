"""`moerl bench tasks`: the call paths side by side, on real child processes and a
real Valkey; the rollout part runs in docs/benchmarks.md's command, not here (it needs an engine)."""

from benchmarks.tasks import bench_calls


def test_the_call_paths_are_measured_side_by_side():
    rep = bench_calls(30)
    rows = {r["path"]: r for r in rep["latency"]}
    assert set(rows) == {
        "verifier in-process",
        "env step in-process",
        "verifier pool",
        "env step pool",
        "verifier valkey",
    }
    # a process boundary costs more than a call; each row is measured, not assumed
    assert rows["verifier pool"]["p50_vs_in_process"] > 1 and rows["verifier valkey"]["p50_ms"] > 0
    assert all(r["p99_ms"] >= r["p50_ms"] > 0 and r["calls"] == 30 for r in rows.values())
    # each isolation's pool at 1 and 2 workers
    assert [(t["isolation"], t["workers"]) for t in rep["throughput"]] == [
        ("namespaces", 1),
        ("namespaces", 2),
        ("none", 1),
        ("none", 2),
    ] and all(t["calls_per_s"] > 0 for t in rep["throughput"])
