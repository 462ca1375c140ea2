"""A local async run's start, stage by stage, read from the stages' logs
(moerl/orchestrate/async_run.py `startup_times`)."""

from __future__ import annotations

import datetime

import pytest

from moerl.orchestrate.async_run import startup_line, startup_times


def _stamp(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]


def test_events_are_read_relative_to_the_runs_start():
    t0 = 1_800_000_000.0
    log = "\n".join(
        [
            "Writing model shards: 100%",  # unstamped lines are skipped
            f"{_stamp(t0 + 2.5)} rollout-0 INFO moerl.launch.podenv: rollout_worker: entered 0.75 s after its process began",
            f"{_stamp(t0 + 3.0)} rollout-0 INFO rollout-0: engine started on dummy weights in 0.5 s",
            f"{_stamp(t0 + 4.25)} rollout-0 INFO rollout-0: first group generated 1.8 s after start",
            f"{_stamp(t0 + 9.0)} rollout-0 INFO rollout-0: first group generated 6.0 s after start",
        ]
    )
    got = startup_times(log, t0)
    assert got["entered"] == pytest.approx(2.5, abs=1e-3)
    assert got["imports"] == pytest.approx(0.75)
    assert got["began"] == pytest.approx(1.75, abs=1e-3)
    assert got["engine_ready"] == pytest.approx(3.0, abs=1e-3)
    assert got["first_group"] == pytest.approx(4.25, abs=1e-3)  # the first one only
    assert "first_version" not in got


def test_the_line_names_what_is_missing():
    line = startup_line(
        {"startup/rollout-0/entered_s": 2.0, "startup/trainer/first_version_s": 21.5}
    )
    assert "rollout-0 entered 2.0 s" in line and "version 1 21.5 s" in line
    assert "engine ready -" in line
