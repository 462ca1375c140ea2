"""`moerl bench weight-sync` on the tiny model: both paths deliver every version (the bench
refuses digests that differ between them), the report carries every row and the ratios."""

import json

import pytest


@pytest.mark.nightly  # a real benchmark run: two engines and a 2-rank trainer mesh
def test_bench_weight_sync_tiny_delivers_both_ways(tmp_path):
    from benchmarks.weight_sync import run_bench

    out = tmp_path / "s.json"
    rows = run_bench("tiny", versions=2, engines=2, out=out)
    data = json.loads(out.read_text())
    assert data["bench"] == "weight_sync" and data["ok"]
    assert [(r["version"], r["path"]) for r in data["rows"]] == [
        (1, "files"),
        (1, "collective"),
        (2, "files"),
        (2, "collective"),
    ]
    for r in rows:
        assert r.to_serving_s > 0 and r.engine_pause_s > 0 and r.trainer_stall_s > 0
    files = [r for r in rows if r.path == "files"]
    wire = [r for r in rows if r.path == "collective"]
    # the same version, the same bytes: each trainer rank sends its share, never the whole model
    assert [r.bytes_per_engine for r in files] == [r.bytes_per_engine for r in wire]
    assert all(r.trainer_rank_bytes < r.bytes_per_engine for r in wire)
    assert set(data["files_vs_collective"]) == {"trainer_stall_s", "engine_pause_s", "to_serving_s"}


def test_bench_weight_sync_refuses_bad_input_before_any_work(tmp_path):
    from benchmarks.weight_sync import run_bench
    from moerl.errors import ConfigError

    with pytest.raises(ConfigError, match="--size 'huge'; allowed: tiny, 0.5b"):
        run_bench("huge", out=tmp_path / "x.json")
    with pytest.raises(ConfigError, match="--engines"):
        run_bench("tiny", engines=0, out=tmp_path / "x.json")
    assert not (tmp_path / "x.json").exists()
