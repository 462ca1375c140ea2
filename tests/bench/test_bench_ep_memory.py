"""`moerl bench ep-memory`: real spawned ranks on a small expert-heavy model; each rank's
expert bytes and memory growth fall with the EP size."""

import json

import pytest


@pytest.mark.nightly  # a real benchmark run (docs/testing.md)
def test_bench_ep_memory_experts_shard_and_rss_falls(tmp_path, capsys):
    from benchmarks.ep_memory import run_bench_ep_memory

    out = tmp_path / "bench" / "ep_memory.json"
    run_bench_ep_memory(
        (1, 2), out, num_layers=2, num_experts=16, hidden_size=256, moe_intermediate_size=256
    )
    data = json.loads(out.read_text())
    rows = {(r["world"], r["rank"]): r for r in data["results"]}
    assert sorted(rows) == [(1, 0), (2, 0), (2, 1)]
    # weights, grads and Adam moments: 1/world of 4x the model each, nothing replicated
    for r in rows.values():
        assert 0.99 <= r["state_ratio"] <= 1.1, r
    assert data["expert_mb_total"] == pytest.approx(2 * 16 * 3 * 256 * 256 * 4 / 2**20)
    for (world, _), r in rows.items():
        assert r["experts_held"] == 16 // world
        assert r["expert_mb_held"] == pytest.approx(r["expert_mb_expected"])
        assert r["rss_base_mb"] < r["rss_load_mb"] <= r["rss_step_mb"] <= r["rss_save_mb"]
    # 24 MiB of experts become ~100 MiB with grads and Adam moments at EP = 1; half of it at EP = 2
    # (replicated weights, ~1 MiB here, and activations do not shard)
    for rank in (0, 1):
        assert rows[(2, rank)]["step_growth_x_ep1"] < 0.8
    assert "1/world" in capsys.readouterr().out


@pytest.mark.nightly  # a real benchmark run (docs/testing.md)
def test_bench_ep_memory_at_a_2x2_mesh_holds_a_quarter_per_rank(tmp_path):
    from benchmarks.ep_memory import run_bench_ep_memory

    out = tmp_path / "mesh.json"
    run_bench_ep_memory(
        out=out,
        meshes=((2, 2),),
        num_layers=1,
        num_experts=8,
        hidden_size=128,
        moe_intermediate_size=64,
    )
    rows = json.loads(out.read_text())["results"]
    assert sorted((r["dp"], r["ep"], r["rank"]) for r in rows) == [(2, 2, r) for r in range(4)]
    for r in rows:
        assert r["experts_held"] == 2  # 8 experts / ep 2 = 4 per EP rank, FSDP-sharded over dp 2
        assert 0.99 <= r["state_ratio"] <= 1.1, r


@pytest.mark.parametrize("meshes", ["2", "0x2", "axb"])
def test_bad_meshes_fail_before_any_rank_starts(meshes, tmp_path, capsys):
    from moerl.cli import main

    assert main(["bench", "ep-memory", "--meshes", meshes, "--out", str(tmp_path / "x.json")]) == 2
    assert "--meshes" in capsys.readouterr().err and not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("sizes", ["", "0,2", "two"])
def test_bad_world_sizes_fail_before_any_rank_starts(sizes, tmp_path, capsys):
    from moerl.cli import main

    assert (
        main(["bench", "ep-memory", "--world-sizes", sizes, "--out", str(tmp_path / "x.json")]) == 2
    )
    assert "--world-sizes" in capsys.readouterr().err and not (tmp_path / "x.json").exists()


def test_world_size_that_does_not_divide_the_experts_is_refused(tmp_path, capsys):
    from moerl.cli import main

    assert (
        main(["bench", "ep-memory", "--world-sizes", "1,3", "--out", str(tmp_path / "x.json")]) == 2
    )
    assert "expert_parallel_size (3)" in capsys.readouterr().err
