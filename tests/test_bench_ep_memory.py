"""`moerl bench ep-memory`: real spawned ranks on a small expert-heavy model; each rank's
expert bytes and memory growth fall with the EP size."""

import json

import pytest


@pytest.mark.slow
def test_bench_ep_memory_experts_shard_and_rss_falls(tmp_path, capsys):
    from moerl.bench.ep_memory import run_bench_ep_memory

    out = tmp_path / "bench" / "ep_memory.json"
    run_bench_ep_memory((1, 2), out, num_layers=2, num_experts=16, hidden_size=256, moe_intermediate_size=256)
    data = json.loads(out.read_text())
    rows = {(r["world"], r["rank"]): r for r in data["results"]}
    assert sorted(rows) == [(1, 0), (2, 0), (2, 1)]
    assert data["expert_mb_total"] == pytest.approx(2 * 16 * 3 * 256 * 256 * 4 / 2**20)
    for (world, _), r in rows.items():
        assert r["experts_held"] == 16 // world
        assert r["expert_mb_held"] == pytest.approx(r["expert_mb_expected"])
        assert r["rss_base_mb"] < r["rss_load_mb"] <= r["rss_step_mb"] <= r["rss_save_mb"]
    # 24 MiB of experts become ~100 MiB with grads and Adam moments at EP = 1; half of it at EP = 2
    # (replicated weights, ~1 MiB here, and activations do not shard)
    for rank in (0, 1):
        assert rows[(2, rank)]["step_growth_x_ep1"] < 0.8
    assert "1/EP" in capsys.readouterr().out


@pytest.mark.parametrize("sizes", ["", "0,2", "two"])
def test_bad_world_sizes_fail_before_any_rank_starts(sizes, tmp_path, capsys):
    from moerl.cli import main

    assert main(["bench", "ep-memory", "--world-sizes", sizes, "--out", str(tmp_path / "x.json")]) == 2
    assert "--world-sizes" in capsys.readouterr().err and not (tmp_path / "x.json").exists()


def test_world_size_that_does_not_divide_the_experts_is_refused(tmp_path, capsys):
    from moerl.cli import main

    assert main(["bench", "ep-memory", "--world-sizes", "1,3", "--out", str(tmp_path / "x.json")]) == 2
    assert "expert_parallel_size (3)" in capsys.readouterr().err
