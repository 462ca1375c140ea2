"""The elastic fleet's rule (components/rollout/fleet.py): grow when the units waiting would
outlast an engine's load time, shrink when scored groups pile up beyond the high watermark,
never outside the bounds, scale-downs held; and its measurements on a real Valkey."""

from __future__ import annotations

import pytest

from moerl.components.rollout.fleet import (
    FleetView,
    Rates,
    Stabilizer,
    high_watermark,
    lag_count,
    load_time,
    measure,
    wish,
)
from moerl.config import parse_config
from moerl.errors import ConfigError
from tests.support.valkey_server import server, stage_bus  # noqa: F401 (server: a module fixture)


def view(workers=1, waiting=0, backlog=0, rate=1.0, load=4.0, busy=0) -> FleetView:
    return FleetView(workers, waiting, busy, backlog, rate, load)


def test_a_backlog_that_outlasts_an_engines_load_time_grows_the_fleet():
    # one worker drains 4 units in a load time: 10 waiting need ceil(10 / 4) = 3 workers
    w = wish(view(waiting=10), lo=1, hi=8, high_watermark=100)
    assert w.target == 3 and "10 units waiting" in w.reason and "drains 4" in w.reason


def test_a_backlog_shorter_than_a_load_time_adds_no_worker():
    # 4 units: the one worker clears them before a new engine would be ready
    assert wish(view(waiting=4), lo=1, hi=8, high_watermark=100).target == 1
    assert wish(view(waiting=5), lo=1, hi=8, high_watermark=100).target == 2


@pytest.mark.parametrize(
    ("v", "lo", "hi", "expect"),
    [
        (view(waiting=10_000), 1, 3, 3),  # never above max_workers
        (view(workers=3, waiting=0), 2, 5, 2),  # idle, nothing waiting: min_workers, not below
        (view(workers=3, waiting=0, busy=3), 1, 5, 3),  # all generating: keeping up, kept
        (view(workers=4, waiting=2, busy=2), 1, 5, 2),  # two idle: they go
        (view(workers=1, backlog=500), 1, 4, 1),  # shrinking stops at min_workers
        (view(workers=4, backlog=500, waiting=10_000), 1, 4, 3),  # the trainer is the bottleneck
    ],
)
def test_the_wish_never_leaves_the_bounds(v, lo, hi, expect):
    assert wish(v, lo, hi, high_watermark=100).target == expect


def test_scored_groups_past_the_high_watermark_shrink_one_at_a_time():
    w = wish(view(workers=5, backlog=101, waiting=50), lo=1, hi=8, high_watermark=100)
    assert w.target == 4 and "101 scored groups" in w.reason
    # at the watermark itself: the units decide
    assert wish(view(workers=5, backlog=100, waiting=50), 1, 8, 100).target == 8


def test_an_unmeasured_fleet_holds_its_size():
    w = wish(FleetView(2, 1000, 0, 0, None, None), lo=1, hi=8, high_watermark=100)
    assert w.target == 2 and "holding" in w.reason


def test_lag_count_is_units_per_load_time_and_at_least_one():
    assert lag_count(2.0, 3.0) == 6
    assert lag_count(0.01, 1.0) == 1
    assert lag_count(1.5, 3.0) == 5  # 4.5 rounds up: never a wish a shade too large


def test_scale_up_is_immediate_and_scale_down_waits_for_the_whole_hold():
    from moerl.components.rollout.fleet import Wish

    s = Stabilizer(hold_s=30.0, now=0.0)
    assert s(1.0, 1, Wish(3, "")) == 3  # up at once
    assert s(10.0, 3, Wish(1, "")) == 3  # down: held (the window saw 3 at t=1)
    assert s(25.0, 3, Wish(2, "")) == 3
    # t=40: the wish of 3 (t=1) left the window; the largest since is 2
    assert s(40.0, 3, Wish(1, "")) == 2
    assert s(56.0, 2, Wish(1, "")) == 1  # t=25's 2 left too
    # a fresh stabilizer never shrinks before it has watched one whole hold
    assert Stabilizer(hold_s=30.0, now=0.0)(5.0, 4, Wish(1, "")) == 4


def test_the_rate_counts_busy_seconds_only():
    r = Rates(samples_per_unit=256)
    assert r.update(generated=0, busy_s=0.0) is None
    assert r.update(generated=2560, busy_s=5.0) == pytest.approx(2.0)  # 10 units in 5 busy s
    # idle time passes (no busy seconds, nothing generated): the rate stays
    assert r.update(generated=2560, busy_s=5.0) == pytest.approx(2.0)
    # 5 units in 5 busy s: 1/s, smoothed with the last
    assert r.update(generated=3840, busy_s=10.0) == pytest.approx(1.5)


def test_the_load_time_is_the_newest_workers():
    stats = {
        "rollout-0": {"started_unix": 100.0, "first_sample_s": 20.0},  # the run's first start
        "rollout-3": {"started_unix": 400.0, "first_sample_s": 6.0},  # joined mid-run
        "rollout-4": {"started_unix": 500.0},  # still loading
        "scorer-0": {"started_unix": 900.0, "first_sample_s": 1.0},
    }
    assert load_time(stats) == 6.0
    assert load_time({"rollout-0": {"busy_s": 1.0}}) is None


def test_the_config_bounds_and_their_refusals():
    cfg = parse_config({"pipeline": {"mode": "async"}, "rollout": {"workers": 2, "max_workers": 4}})
    assert cfg.rollout.fleet_bounds == (2, 4) and cfg.rollout.elastic
    assert high_watermark(cfg) == cfg.buffer.high_watermark
    fixed = parse_config({"pipeline": {"mode": "async"}, "rollout": {"workers": 2}})
    assert fixed.rollout.fleet_bounds == (2, 2) and not fixed.rollout.elastic
    with pytest.raises(ConfigError, match="rollout.workers 5 must lie within"):
        parse_config({"pipeline": {"mode": "async"}, "rollout": {"workers": 5, "max_workers": 4}})
    with pytest.raises(ConfigError, match="elastic fleet needs pipeline.mode async"):
        parse_config(
            {
                "pipeline": {"mode": "sync"},
                "rollout": {"min_workers": 1, "max_workers": 2, "workers": 1},
            }
        )


def test_measure_reads_the_queues_and_keeps_its_numbers_on_the_bus(server, request, monkeypatch):
    bus = stage_bus(server, request, monkeypatch, visibility_timeout_s=30)
    cfg = parse_config(
        {
            "pipeline": {"mode": "async"},
            "rollout": {"workers": 1, "max_workers": 3},
            "units": {"max_prompts": 2},
        }
    )
    for i in range(5):
        bus.issue_unit([{"id": f"p{i}", "task": "t", "prompt": "x", "answer": "y"}] * 2)
    assert bus.lease_unit("rollout-0", block_ms=50) is not None  # leased: no longer waiting
    rates = Rates(samples_per_unit=cfg.units.max_prompts * cfg.rollout.samples_per_prompt)
    bus.heartbeat("rollout-0", busy_s=0.0, started_unix=1.0, first_sample_s=3.0)
    v = measure(bus, cfg, workers=1, rates=rates)
    assert (v.units_waiting, v.busy, v.load_s, v.units_per_busy_s) == (4, 1, 3.0, None)
    per_unit = cfg.units.max_prompts * cfg.rollout.samples_per_prompt
    bus.incr(generated=4 * per_unit)
    bus.heartbeat("rollout-0", busy_s=2.0, started_unix=1.0, first_sample_s=3.0)
    v = measure(bus, cfg, workers=1, rates=rates)
    assert v.units_per_busy_s == pytest.approx(2.0)
    kept = bus.fleet()
    assert kept["lag_count"] == 6.0 and kept["load_s"] == 3.0 and kept["units_waiting"] == 4.0


class _Fleet:
    """A stand-in for the fleet's Deployment and ScaledObject (the controller's loop is pure
    logic; the objects and their patches are validated in tests/launch/test_fleet.py)."""

    def __init__(self, replicas: int, fail: bool = False):
        self.n, self.fail, self.lag_counts = replicas, fail, []

    def replicas(self) -> int:
        if self.fail:
            raise RuntimeError("the API is unreachable")
        return self.n

    def scale(self, replicas: int) -> None:
        self.n = replicas

    def set_lag_count(self, lag_count: int) -> None:
        self.lag_counts.append(lag_count)


def _measured(bus, cfg, waiting: int) -> None:
    for i in range(waiting):
        bus.issue_unit([{"id": f"p{i}", "task": "t", "prompt": "x", "answer": "y"}])
    bus.heartbeat("rollout-0", busy_s=0.0, started_unix=1.0, first_sample_s=2.0)


def test_the_trainers_controller_scales_the_deployment_or_keeps_kedas_lag_count(
    server, request, monkeypatch
):
    from moerl.components.rollout.fleet import FleetController

    bus = stage_bus(server, request, monkeypatch, visibility_timeout_s=30)
    cfg = parse_config(
        {
            "pipeline": {"mode": "async"},
            "rollout": {"workers": 1, "max_workers": 3, "samples_per_prompt": 2},
            "units": {"max_prompts": 1},
        }
    )
    _measured(bus, cfg, waiting=10)
    fleet = _Fleet(1)
    c = FleetController(cfg, bus, fleet, keda=False)
    c.tick(0.0)  # the rate is not measured yet: holds
    assert fleet.n == 1 and not c.changes
    bus.incr(generated=4)  # 2 units in 2 busy seconds: 1 unit/s x 2 s load = lagCount 2
    bus.heartbeat("rollout-0", busy_s=2.0, started_unix=1.0, first_sample_s=2.0)
    c.tick(1.0)
    assert fleet.n == 3 and "10 units waiting" in c.changes[-1][2]  # ceil(10 / 2) = 5 > max 3
    assert bus.fleet()["target"] == 3.0
    # with KEDA: the lagCount only, set once per change; the replicas are KEDA's
    keda = _Fleet(1)
    k = FleetController(cfg, bus, keda, keda=True)
    k.rates = c.rates  # the same measurements
    k.tick(2.0)
    k.tick(3.0)
    assert keda.lag_counts == [2] and keda.n == 1


def test_a_failing_api_never_stops_the_controller_and_is_counted(server, request, monkeypatch):
    import time

    from moerl.components.rollout.fleet import FleetController

    bus = stage_bus(server, request, monkeypatch, visibility_timeout_s=30)
    cfg = parse_config(
        {
            "pipeline": {"mode": "async"},
            "rollout": {"workers": 1, "max_workers": 2, "fleet_interval_s": 0.05},
        }
    )
    c = FleetController(cfg, bus, _Fleet(1, fail=True), keda=False)
    c.start()
    time.sleep(0.5)
    assert c.is_alive() and c.failures >= 3
    c.stop()
    assert not c.is_alive()


def test_the_local_controller_shrinks_on_a_scored_pile_and_grows_on_waiting_units(
    server, request, monkeypatch
):
    """`LocalFleet.decide` (the local launcher's controller) on a real Valkey: scored groups
    past the high watermark take one worker away once the hold has passed; units that outlast
    a load time add workers up to max_workers; never below min_workers."""
    from moerl.bus import SCORED
    from moerl.orchestrate.async_run import LocalFleet

    bus = stage_bus(server, request, monkeypatch, visibility_timeout_s=30)
    cfg = parse_config(
        {
            "pipeline": {"mode": "async"},
            "rollout": {
                "workers": 2,
                "min_workers": 1,
                "max_workers": 4,
                "fleet_high_watermark_groups": 3,
                "fleet_scale_down_after_s": 0,
                "samples_per_prompt": 2,
            },
            "units": {"max_prompts": 1},
        }
    )
    f = LocalFleet(cfg)
    for i in range(5):  # five scored groups wait, the trainer takes none
        bus.r.xadd(bus.key(SCORED), {"group_id": f"g{i}"})
    assert bus.backlog() == 5
    target, why = f.decide(bus, 3, now=f.stabilizer.since + 1)
    assert target == 2 and "5 scored groups" in why
    target, _ = f.decide(bus, 1, now=f.stabilizer.since + 2)
    assert target == 1  # min_workers
    bus.r.delete(bus.key(SCORED))  # the trainer took them
    bus.ensure_groups()
    _measured(bus, cfg, waiting=12)
    f.decide(bus, 1, now=f.stabilizer.since + 3)  # the first reading of the rate
    bus.incr(generated=4)
    bus.heartbeat("rollout-0", busy_s=2.0, started_unix=1.0, first_sample_s=2.0)
    target, why = f.decide(bus, 1, now=f.stabilizer.since + 4)
    assert target == 4 and "12 units waiting" in why  # ceil(12 / 2) = 6, max_workers 4


def test_a_pipeline_refuses_an_elastic_fleet_it_could_not_scale():
    """In a compiled pipeline the fleet is a Deployment the trainer's launcher creates: without
    cluster.launch.mode kubernetes the fixed worker tasks would run and nothing would scale."""
    from moerl.preflight import preflight

    cfg = parse_config({"pipeline": {"mode": "async"}, "rollout": {"workers": 1, "max_workers": 2}})
    with pytest.raises(ConfigError, match="needs cluster.launch.mode kubernetes"):
        preflight(cfg, here=False)
