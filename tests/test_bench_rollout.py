"""`moerl bench rollout`: the bare engine and the real rollout worker (units in flight) on the
same prompts, each in its own process; the report's counts are consistent with the workload.
Speed is read from the benchmark, never asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moerl.bench.rollout import parse_in_flight, run_bench_rollout
from moerl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_in_flight_arms_are_checked():
    assert parse_in_flight("1, 2,4") == (1, 2, 4)
    for bad in ("", "0", "1,1", "x", "65"):
        with pytest.raises(ConfigError, match="--in-flight must list distinct unit counts"):
            parse_in_flight(bad)


@pytest.mark.slow
def test_the_worker_and_the_bare_engine_generate_the_same_workload(tmp_path):
    out = tmp_path / "rollout.json"
    rep = run_bench_rollout(ROOT / "configs/tiny-moe-grpo.yaml",
                            ["units.max_prompts=4", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=8"],
                            units=3, in_flight="2", out=out, echo=lambda s: None)
    assert rep["ok"], rep["arms"]
    assert json.loads(out.read_text())["bench"] == "rollout"
    bare, worker = rep["arms"]["bare"], rep["arms"]["worker-2"]
    # every prompt of the 3 units, G samples each, in both arms (a group's tokens: 4 x at most 8)
    assert bare["groups"] == worker["groups"] == 12
    for arm in (bare, worker):
        assert 12 * 4 <= arm["tokens"] <= 12 * 4 * 8
        assert arm["tokens_per_s"] == pytest.approx(arm["tokens"] / arm["wall_s"])
    assert worker["ratio_to_bare"] == pytest.approx(worker["tokens_per_s"] / bare["tokens_per_s"])
    assert 0 < worker["busy_fraction"] <= 1.0 + 1e-6
    # 3 units issued at once, 2 allowed in flight: the second was leased while the first generated
    assert worker["units_overlapped"] >= 1 and worker["units_in_flight"] == 2
