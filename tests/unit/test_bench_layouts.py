"""`moerl bench rollout --all2all / --tensor-parallel / --data-parallel`: the variants (the
product of the axes, validated by the config before any work), their interleaved order, and the
ratios to the baseline (medians of the rounds' ratios). The engines: tests/bench/test_bench_layouts.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.layouts import combine, interleaved, layout_variants, variant_settings
from benchmarks.rollout import run_bench_rollout
from moerl.errors import ConfigError

CONFIG = Path(__file__).resolve().parents[2] / "configs/tiny-moe-grpo.yaml"


def test_variants_are_the_product_of_the_axes_in_order():
    got = variant_settings("none,deepep_v2", "1,2", None)
    assert [n for n, _ in got] == ["tp1/no-ep", "tp1/deepep_v2", "tp2/no-ep", "tp2/deepep_v2"]
    assert got[3][1] == [
        "rollout.tensor_parallel_size=2",
        "rollout.enable_expert_parallel=true",
        "rollout.all2all_backend=deepep_v2",
    ]
    assert got[0][1] == ["rollout.tensor_parallel_size=1", "rollout.enable_expert_parallel=false"]
    assert [n for n, _ in variant_settings(None, None, "2,4")] == ["dp2", "dp4"]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("pplx,deepep_v2", None, None), "--all2all must list distinct values of none, allgather"),
        (("deepep_v2,deepep_v2", None, None), "--all2all must list distinct"),
        ((None, "1,x", None), "--tensor-parallel must list distinct integers in 1..64"),
        ((None, None, "0"), "--data-parallel must list distinct integers in 1..1024"),
        ((None, None, None), "needs --all2all, --tensor-parallel or --data-parallel"),
        ((None, "2", None), "two variants or more; got only tp2"),
    ],
)
def test_bad_variant_lists_are_refused_naming_the_flag(args, match):
    with pytest.raises(ConfigError, match=match):
        variant_settings(*args)


def test_an_all2all_backend_on_cpu_is_refused_before_any_work(tmp_path):
    out = tmp_path / "r.json"
    with pytest.raises(
        ConfigError,
        match=r"variant allgather_reducescatter .*rollout.all2all_backend need device cuda",
    ):
        run_bench_rollout(CONFIG, [], all2all="allgather_reducescatter,deepep_v2", out=out)
    assert not out.exists()
    with pytest.raises(ConfigError, match=r"variant dp2 .*rollout.data_parallel_size 2 on cpu"):
        layout_variants(CONFIG, [], data_parallel="1,2")


def test_on_cuda_every_variant_validates_with_its_layout():
    base = ["rollout.device=cuda", "rollout.tensor_parallel_size=2"]
    got = dict(layout_variants(CONFIG, base, all2all="allgather_reducescatter,deepep_v2"))
    assert list(got) == ["allgather_reducescatter", "deepep_v2"]
    for name, cfg in got.items():
        r = cfg.rollout
        assert r.enable_expert_parallel and r.all2all_backend == name
        assert r.devices_per_engine == 2 and r.resolved.dtype == "bfloat16"
    # expert parallelism over one device is refused, naming the keys
    with pytest.raises(ConfigError, match="variant deepep_v2 .*rollout.tensor_parallel_size x"):
        layout_variants(CONFIG, ["rollout.device=cuda"], all2all="none,deepep_v2")


def test_worker_arm_flags_are_refused_in_a_layout_comparison(tmp_path):
    with pytest.raises(ConfigError, match="--swap-every, --breakdown belong to the worker arms"):
        run_bench_rollout(
            CONFIG, [], tensor_parallel="1,2", swap_every=1.0, breakdown=True, out=tmp_path / "r"
        )
    with pytest.raises(ConfigError, match="--timeout bounds a layout comparison"):
        run_bench_rollout(CONFIG, [], timeout_s=5.0, out=tmp_path / "r")


def test_rounds_are_interleaved_and_ratios_are_medians_of_the_rounds_ratios():
    assert interleaved(["a", "b"], 2) == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]
    base = [
        {"ok": True, "tokens_per_s": t, "tpot_ms_p50": m} for t, m in ((100, 10), (80, 12), (90, 9))
    ]
    other = [
        {"ok": True, "tokens_per_s": t, "tpot_ms_p50": m} for t, m in ((150, 5), (80, 6), (99, 9))
    ]
    got = combine(other, base)
    assert got["tokens_per_s"] == 99 and got["rounds"] == 3  # its median round
    assert got["throughput_ratio_rounds"] == pytest.approx([1.5, 1.0, 1.1])
    assert got["throughput_ratio"] == pytest.approx(1.1)
    assert got["tpot_ratio_rounds"] == pytest.approx([0.5, 0.5, 1.0])
    assert got["tpot_ratio"] == pytest.approx(0.5)
    assert "throughput_ratio" not in combine(base, None)  # the baseline
    failed = combine(other[:1] + [{"ok": False, "error": "engine died"}], base[:2])
    assert failed["ok"] is False and failed["error"] == "engine died"
