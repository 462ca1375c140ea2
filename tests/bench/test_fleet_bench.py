"""`moerl bench fleet`'s report math, on recorded inputs (benchmarks/fleet.py).

What is checked: the arms' configs (bounds refused when they cannot scale, the default change of
generation cost, the fixed and elastic fleets, the interleaving); the resize lines as events and
the fleet's size over time; worker-seconds and idle worker-seconds from the workers' final
stats; scale-up latency of the added workers only; starvation per step before and after the
change; the change's time and the first scale-up after it; response lengths; the ratios and
medians over rounds, and the printed table.
"""

import json
from pathlib import Path

import pytest

from benchmarks import fleet
from moerl.config import load_config, parse_config
from moerl.errors import ConfigError

LINES = [
    (3.0, "[moerl]   3s version 1/6 reward/mean=0.1"),
    (12.5, "[moerl] fleet: 1 -> 2 rollout workers: 9 units waiting; one worker drains 4 ..."),
    (40.0, "[moerl] fleet: 2 -> 1 rollout workers: 300 scored groups wait for the trainer"),
    (41.0, "some other line: fleet: 5 -> 6 rollout"),
]
STATS = {
    "rollout-0": {"wall_s": 60.0, "busy_s": 45.0, "first_sample_s": 9.0},
    "rollout-1": {"wall_s": 30.0, "busy_s": 32.0, "first_sample_s": 7.0},  # busy > wall: idle 0
    "rollout-2": {"wall_s": 10.0, "busy_s": 4.0, "first_sample_s": 5.0},
    "scorer-0": {"wall_s": 60.0, "busy_s": 1.0},
    "trainer": {"wall_s": 60.0},
}
ROOT = Path(__file__).resolve().parents[2]
WAITS = [(0, 5.0), (1, 1.0), (2, 0.5), (3, 4.0), (4, 2.0), (5, 0.25)]


def cfg(**rollout):
    return parse_config({"pipeline": {"mode": "async"}, "rollout": rollout})


def test_the_arms_configs():
    with pytest.raises(ConfigError, match="min_workers .1. must be below rollout.max_workers .1."):
        fleet.bounds(cfg())
    assert fleet.bounds(cfg(min_workers=1, max_workers=3)) == (1, 3)
    assert fleet.arm_sets("fixed", 1, 3) == [
        "rollout.workers=1",
        "rollout.min_workers=1",
        "rollout.max_workers=1",
    ]
    assert fleet.arm_sets("elastic", 1, 3)[-1] == "rollout.max_workers=3"
    assert [fleet.round_order(i) for i in range(3)] == [
        ("fixed", "elastic"),
        ("elastic", "fixed"),
        ("fixed", "elastic"),
    ]


def test_the_change_of_generation_cost(tmp_path):
    sets, at = fleet.change_overrides(cfg(max_new_tokens=12), 7)
    assert at == 3
    # the override the bench adds is one `--set` accepts
    conf = tmp_path / "c.yaml"
    conf.write_text("pipeline: {mode: async}\nrollout: {max_new_tokens: 12}\n")
    steps = load_config(conf, sets, mode="async").rollout.max_new_tokens_schedule
    assert [(s.from_version, s.max_new_tokens) for s in steps] == [(3, 24)]
    # the config's own schedule is kept as it is
    own = cfg(max_new_tokens_schedule=[{"from_version": 5, "max_new_tokens": 40}])
    assert fleet.change_overrides(own, 7) == ([], 5)
    with pytest.raises(ConfigError, match="at least 2"):
        fleet.change_overrides(cfg(), 1)
    # a schedule with no before and after in this run, or no change at all, is refused
    for bad in (
        [{"from_version": 0, "max_new_tokens": 40}],  # from the start: no before
        [{"from_version": 7, "max_new_tokens": 40}],  # at --versions: no after
        [{"from_version": 3, "max_new_tokens": 12}],  # the same length
    ):
        with pytest.raises(ConfigError, match="must change the length"):
            fleet.change_overrides(cfg(max_new_tokens=12, max_new_tokens_schedule=bad), 7)


def test_resize_lines_and_the_fleet_size_over_time():
    events = fleet.fleet_events(LINES)
    assert [(e["t_s"], e["from"], e["to"]) for e in events] == [(12.5, 1, 2), (40.0, 2, 1)]
    assert events[0]["why"].startswith("9 units waiting")
    size = fleet.size_over_time(1, events, 50.0)
    assert size["steps"] == [(0.0, 1), (12.5, 2), (40.0, 1)]
    assert size["max"] == 2
    assert size["mean"] == pytest.approx((12.5 * 1 + 27.5 * 2 + 10.0 * 1) / 50.0)
    assert fleet.size_over_time(2, [], 10.0) == {"steps": [(0.0, 2)], "mean": 2.0, "max": 2}


def test_worker_seconds_and_scale_up_latency_from_the_workers_stats():
    w = fleet.worker_seconds(STATS)
    assert w == {"worker_s": 100.0, "idle_worker_s": 15.0 + 0.0 + 6.0, "workers_seen": 3.0}
    # the added workers are rollout-1 and later when the fleet started at 1
    assert fleet.scale_up_latency(STATS, 1) == pytest.approx(6.0)
    assert fleet.scale_up_latency(STATS, 3) is None


def test_starvation_before_and_after_the_change():
    s = fleet.starvation(WAITS, 3)
    assert s["starvation_s"] == pytest.approx(12.75)
    assert s["starvation_before_change_s"] == pytest.approx(6.5)
    assert s["starvation_after_change_s"] == pytest.approx(6.25)
    assert s["per_step_after_change_s"] == [4.0, 2.0, 0.25]


def test_the_change_s_time_and_the_first_scale_up_after_it():
    reward_s = [10.0, 20.0, 30.0, 45.0]
    assert fleet.change_time(reward_s, 3) == 30.0  # version 3 published with step 2's reward
    assert fleet.change_time(reward_s, 0) == 0.0
    assert fleet.change_time(reward_s, 9) == 45.0  # fewer versions logged than the change
    events = fleet.fleet_events(LINES)
    assert fleet.reaction(events, 10.0) == pytest.approx(2.5)
    assert fleet.reaction(events, 13.0) is None  # only a scale-down after it


def test_an_arm_s_row_ratios_and_the_summary_over_rounds():
    row = fleet.arm_row(
        50.0,
        STATS,
        LINES,
        WAITS,
        [(0, 12.0), (1, 11.0), (2, 12.0), (3, 24.0), (4, 23.0)],
        [5.0, 10.0, 20.0, 30.0, 40.0, 50.0],
        start=1,
        change_at=3,
        logged={"fleet/idle_worker_s": 21.0},
    )
    assert row["ok"] and row["wall_s"] == 50.0 and row["idle_worker_s"] == 21.0
    assert row["change_s"] == 20.0 and row["first_scale_up_after_change_s"] is None
    assert row["length_before"] == pytest.approx(35 / 3) and row["length_after"] == 23.5
    assert row["logged_fleet"] == {"fleet/idle_worker_s": 21.0}
    fixed = {**row, "wall_s": 100.0, "idle_worker_s": 7.0, "worker_s": 50.0, "others_cores": 0.5}
    r = fleet.ratios(fixed, row)
    assert r["wall_s"] == 0.5 and r["idle_worker_s"] == 3.0 and r["worker_s"] == 2.0
    assert r["starvation_s"] == 1.0
    assert fleet.ratios(fixed, {"ok": False, "error": "x"})["wall_s"] is None
    assert fleet.ratios({**fixed, "idle_worker_s": 0.0}, row)["idle_worker_s"] is None
    rounds = [
        {"order": ["fixed", "elastic"], "arms": {"fixed": fixed, "elastic": row}},
        {
            "order": ["elastic", "fixed"],
            "arms": {"fixed": {**fixed, "wall_s": 80.0}, "elastic": {**row, "wall_s": 60.0}},
        },
        {"order": ["fixed", "elastic"], "arms": {"fixed": fixed, "elastic": {"ok": False}}},
    ]
    s = fleet.summarize(rounds)
    assert s["arms"]["fixed"]["wall_s"] == 100.0  # median of 100, 80, 100
    assert s["arms"]["elastic"]["wall_s"] == 55.0  # the failed round left out
    assert s["ratios"]["wall_s"] == pytest.approx(0.55)
    text = fleet.format_summary(
        {"summary": s, "rounds": rounds, "change_at": 3, "schedule": "[...]"}
    )
    assert "elastic/fixed" in text and "round 3 elastic FAILED" in text
    assert "fleet 0s:1 12s:2 40s:1" in text
    assert "other processes' load 0.5 cores" in text and "other processes' load - cores" in text


def test_the_command_hands_its_options_to_the_bench(monkeypatch):
    import argparse
    import inspect

    from benchmarks.cli import add_bench_parsers

    real = inspect.signature(fleet.run_bench_fleet)
    calls = []

    def runner(*args, **kwargs):  # the runner's own signature, without running the arms
        calls.append(real.bind(*args, **kwargs).arguments)
        return {"ok": False}

    parser = argparse.ArgumentParser(prog="moerl")  # the flags: the real runner's signature
    add_bench_parsers(parser.add_subparsers(dest="command", required=True))
    a = parser.parse_args(
        ["bench", "fleet", "c.yaml", "--versions", "6", "--repeats", "2", "--set", "a.b=1"]
    )
    monkeypatch.setattr(fleet, "run_bench_fleet", runner)
    assert a.func(a) == 1  # a failed arm: a non-zero exit
    assert calls == [
        {
            "config": "c.yaml",
            "overrides": ["a.b=1"],
            "versions": 6,
            "repeats": 2,
            "out_dir": "bench/fleet",
            "timeout_s": 1800.0,
        }
    ]


def test_the_bench_refuses_what_it_cannot_compare_before_running(tmp_path):
    conf = tmp_path / "c.yaml"
    conf.write_text("rollout: {min_workers: 1, max_workers: 2}\n")
    with pytest.raises(ConfigError, match="--repeats must be >= 1"):
        fleet.run_bench_fleet(conf, repeats=0, out_dir=tmp_path / "out")
    with pytest.raises(ConfigError, match="must be below rollout.max_workers"):
        fleet.run_bench_fleet(conf, ["rollout.max_workers=1"], out_dir=tmp_path / "out")
    with pytest.raises(ConfigError, match="reward.kind must be rules"):
        fleet.run_bench_fleet(
            conf, ["reward.kind=model", "reward.model.registered=rm/1"], out_dir=tmp_path / "out"
        )
    assert not (tmp_path / "out").exists()


@pytest.mark.nightly  # a real benchmark run (docs/testing.md)
def test_a_short_real_run_of_both_arms(tmp_path):
    """Both arms as real `moerl run --mode async` children (about 1.5 min here): the report's
    numbers come from what the runs recorded, and the elastic arm's worker-seconds read from
    the bench's Valkey are the ones the run logged itself as fleet/*."""
    sets = [
        "task.prompts_per_iteration=8",
        "rollout.samples_per_prompt=4",
        "units.max_prompts=2",
        "trainer.optimizer.optimizer_steps_per_iteration=2",
        "trainer.optimizer.learning_rate=1e-6",
        "rollout.max_new_tokens=8",
        "rollout.min_workers=1",
        "rollout.max_workers=2",
        "rollout.fleet_interval_s=1",
        "reward.scorers=1",
    ]
    out = tmp_path / "out"
    report = fleet.run_bench_fleet(
        ROOT / "configs/tiny-moe-grpo.yaml", sets, versions=4, out_dir=out
    )
    assert report["ok"] and report["change_at"] == 2
    assert json.loads((out / "report.json").read_text())["summary"] == report["summary"]
    assert "elastic/fixed" in (out / "summary.md").read_text()
    arms = report["rounds"][0]["arms"]
    for arm in ("fixed", "elastic"):
        a = arms[arm]
        assert a["ok"] and a["wall_s"] > 0 and 0 <= a["idle_worker_s"] < a["worker_s"]
        assert len(a["per_step_after_change_s"]) == 2  # steps 2 and 3 of 4
        assert a["starvation_s"] >= a["starvation_after_change_s"] > 0
        assert a["length_after"] > a["length_before"]  # 8 tokens, then 16
    assert arms["fixed"]["fleet_events"] == [] and arms["fixed"]["logged_fleet"] == {}
    logged = arms["elastic"]["logged_fleet"]
    assert logged["fleet/worker_s"] == pytest.approx(arms["elastic"]["worker_s"], rel=1e-6)
    assert logged["fleet/idle_worker_s"] == pytest.approx(
        arms["elastic"]["idle_worker_s"], rel=1e-6
    )
    sizes = [n for _, n in arms["elastic"]["fleet_size"]["steps"]]
    assert sizes[0] == 1 and all(1 <= n <= 2 for n in sizes)


def test_an_arm_that_outlives_its_timeout_is_killed_and_fails(tmp_path):
    """The arm's run is a real `moerl run` child, killed at --timeout-s: the bench fails naming
    the timeout instead of waiting on it for good, and leaves no process behind."""
    from benchmarks.modes import ArmFailed

    arm = tmp_path / "arm"
    arm.mkdir()
    sets = [f"pipeline.work_dir={arm / 'work'}", f"tracking.uri=sqlite:///{arm / 'mlflow.db'}"]
    with pytest.raises(ArmFailed, match=r"killed after 3 s \(--timeout-s\)"):
        fleet._run_arm(ROOT / "configs/tiny-moe-grpo.yaml", sets, arm, 1, 2, timeout_s=3.0)
