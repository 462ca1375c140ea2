"""`moerl bench rollout`: the bare engine and the real rollout worker (units in flight) on the
same prompts, each in its own process; the report's counts are consistent with the workload.
Speed is read from the benchmark, never asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.rollout import (
    _combine,
    parse_in_flight,
    parse_seqs,
    parse_updates,
    run_bench_rollout,
)
from moerl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_in_flight_arms_are_checked():
    assert parse_in_flight("1, 2,4") == (1, 2, 4)
    for bad in ("", "0", "1,1", "x", "65"):
        with pytest.raises(ConfigError, match="--in-flight must list distinct unit counts"):
            parse_in_flight(bad)


def test_a_max_num_seqs_sweep_is_checked():
    assert parse_seqs("64, 256") == (64, 256)
    for bad in ("", "0", "64,64", "x"):
        with pytest.raises(ConfigError, match="--max-num-seqs must list distinct sequence counts"):
            parse_seqs(bad)


def test_workload_and_update_arms_are_checked(tmp_path):
    assert parse_updates("between_units, in_flight") == ("between_units", "in_flight")
    for bad in ("", "inflight", "in_flight,in_flight"):
        with pytest.raises(
            ConfigError, match="--updates must list distinct rollout.weight_update values"
        ):
            parse_updates(bad)
    with pytest.raises(ConfigError, match="--workload must be one of digits, long-tail"):
        run_bench_rollout(
            ROOT / "configs/tiny-moe-grpo.yaml", [], workload="long", out=tmp_path / "r.json"
        )
    with pytest.raises(ConfigError, match="--swap-every"):
        run_bench_rollout(
            ROOT / "configs/tiny-moe-grpo.yaml", [], swap_every=-1, out=tmp_path / "r.json"
        )
    with pytest.raises(ConfigError, match="--warmup-units must be in 0..64"):
        run_bench_rollout(
            ROOT / "configs/tiny-moe-grpo.yaml", [], warmup_units=-1, out=tmp_path / "r.json"
        )
    with pytest.raises(ConfigError, match="--repeats must be in 1..20"):
        run_bench_rollout(
            ROOT / "configs/tiny-moe-grpo.yaml", [], repeats=0, out=tmp_path / "r.json"
        )


def test_rounds_combine_into_the_median_round_and_the_median_of_the_rounds_ratios():
    """`--repeats`: an arm reports its round of median tokens/s; a worker's ratio is the median
    of each round's ratio to that round's bare engine, not a ratio of medians."""
    rounds = [
        {"ok": True, "tokens_per_s": t, "wall_s": w}
        for t, w in ((90.0, 1.0), (70.0, 2.0), (80.0, 3.0))
    ]
    worker = _combine(rounds, [100.0, 100.0, 80.0])
    assert (worker["tokens_per_s"], worker["wall_s"], worker["rounds"]) == (80.0, 3.0, 3)
    assert worker["tokens_per_s_rounds"] == [90.0, 70.0, 80.0]
    assert worker["ratio_rounds"] == pytest.approx([0.9, 0.7, 1.0]) and worker[
        "ratio_to_bare"
    ] == pytest.approx(0.9)
    assert "ratio_to_bare" not in _combine(rounds, None)  # a bare arm
    # even: the lower middle round
    assert _combine(rounds[:2], [100.0, 100.0])["tokens_per_s"] == 70.0
    failed = _combine(rounds[:1] + [{"ok": False, "error": "engine died"}], [100.0, None])
    assert failed["ok"] is False and failed["error"] == "engine died" and failed["rounds"] == 2


@pytest.mark.nightly  # a real benchmark run (docs/testing.md)
def test_the_worker_and_the_bare_engine_generate_the_same_workload_across_swaps(tmp_path):
    """The long-tail workload with a version every 0.2 s: the between-units worker drains for
    each version it takes, the in-flight one never does and its responses cross versions."""
    out = tmp_path / "rollout.json"
    rep = run_bench_rollout(
        ROOT / "configs/tiny-moe-grpo.yaml",
        ["units.max_prompts=4", "rollout.samples_per_prompt=4"],
        units=12,
        in_flight="2",
        out=out,
        echo=lambda s: None,
        workload="long-tail",
        updates="between_units,in_flight",
        swap_every=0.2,
    )
    assert rep["ok"], rep["arms"]
    assert json.loads(out.read_text())["bench"] == "rollout"
    w = rep["workload"]
    assert w["workload"] == "long-tail" and w["max_new_tokens"] == 384
    # every arm generated 2 other units first, untimed (a fresh engine's first batches are slow)
    assert w["warmup_units"] == 2 and all(a["warmup_units"] == 2 for a in rep["arms"].values())
    assert 1 <= w["length_p50"] <= w["length_p90"] <= w["length_max"] <= 384
    bare, between, inflight = (rep["arms"][k] for k in ("bare", "worker-2", "worker-2-inflight"))
    # every prompt of the 12 timed units, G samples each, in every arm, the warm-up's not counted
    # (a group's tokens: 4 x at most 384)
    assert bare["groups"] == between["groups"] == inflight["groups"] == 48
    for arm in (bare, between, inflight):
        assert 48 * 4 <= arm["tokens"] <= 48 * 4 * 384
        assert arm["tokens_per_s"] == pytest.approx(arm["tokens"] / arm["wall_s"])
    for arm in (between, inflight):
        assert arm["ratio_to_bare"] == pytest.approx(arm["tokens_per_s"] / bare["tokens_per_s"])
        # the window's 48 groups and those of its 12 acknowledgements that went on the outbox (a unit
        # that ends at a swap is acknowledged on the loop), none of the warm-up's (counted first)
        assert (
            48 <= arm["bus_writes"] <= 48 + 12 and 1 <= arm["bus_round_trips"] <= arm["bus_writes"]
        )
        assert 0 < arm["busy_fraction"] <= 1.0 + 1e-6
        assert arm["units_in_flight"] == 2 and arm["swaps"] >= 1
    assert between["weight_update"] == "between_units" and inflight["weight_update"] == "in_flight"
    # between units: every swap waited for the units' tails, and no response crossed versions
    assert between["swaps_in_flight"] == 0 and between["samples_mixed_version"] == 0
    assert between["drain_steps"] >= 1 and between["drain_s"] > 0
    assert 0 < between["drain_mean_batch"] <= 2 * 256
    # in flight: swapped with sequences running, never drained, and some responses hold two versions;
    # it kept leasing meanwhile (12 units issued, 2 in flight: one leased beside another). The
    # between-units worker stops leasing whenever a newer version waits, so with a version every
    # 0.2 s it may never overlap two units
    assert inflight["swaps_in_flight"] >= 1 and inflight["samples_mixed_version"] >= 1
    assert inflight["units_overlapped"] >= 1
    assert inflight["drain_steps"] == 0 and inflight["drain_s"] == 0


@pytest.mark.nightly  # a real benchmark run (docs/testing.md)
def test_interleaved_rounds_and_the_breakdown_report_what_they_measured(tmp_path):
    """`--repeats 2 --breakdown` on a small digits workload: every arm ran twice, each worker's
    ratio is the median of its rounds' ratios to the same round's bare engine, and the breakdown
    drove one engine every way, each window the same number of groups, its bus way through the
    worker's real outbox to a real Valkey."""
    rep = run_bench_rollout(
        ROOT / "configs/tiny-moe-grpo.yaml",
        ["units.max_prompts=4", "rollout.samples_per_prompt=4"],
        units=2,
        in_flight="1",
        out=tmp_path / "r.json",
        echo=lambda s: None,
        repeats=2,
        breakdown=True,
    )
    assert rep["ok"], (rep["arms"], rep.get("breakdown"))
    bare, worker = rep["arms"]["bare"], rep["arms"]["worker-1"]
    assert rep["workload"]["repeats"] == 2 and bare["rounds"] == worker["rounds"] == 2
    assert len(bare["tokens_per_s_rounds"]) == len(worker["ratio_rounds"]) == 2
    assert worker["ratio_rounds"] == pytest.approx(
        [w / b for w, b in zip(worker["tokens_per_s_rounds"], bare["tokens_per_s_rounds"])]
    )
    assert min(worker["ratio_rounds"]) <= worker["ratio_to_bare"] <= max(worker["ratio_rounds"])
    # 2 units x 4 prompts, and their acknowledgements
    assert worker["groups"] == 8 and 8 <= worker["bus_writes"] <= 8 + 2
    split = rep["breakdown"]
    assert split["ok"] and split["rounds"] == 3 and split["units_per_window"] == 2
    assert list(split["ways"]) == [
        "generate",
        "loop",
        "loop+seeds",
        "loop+samples",
        "loop+samples+bus",
    ]
    assert split["ways"]["generate"]["ratio_to_generate"] == 1.0
    for way in split["ways"].values():
        assert way["tokens_per_s"] > 0 and len(way["ratio_rounds"]) == 3
    assert split["bus_writes"] == 3 * 8  # the bus way's groups, every round, all written
    assert 1 <= split["bus_round_trips"] <= split["bus_writes"]
