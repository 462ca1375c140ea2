"""Multi-turn environments: the interface a user's environment implements, and the functions the
sandboxed pool runs for it.

Design, details and limitations: docs/tasks.md#3-an-environment-multi-turn-tools.
"""

from __future__ import annotations

import math
from typing import Any

from moerl.userfiles import short_repr

RESET = f"{__name__}:env_reset"
STEP = f"{__name__}:env_step"
CLOSE = f"{__name__}:env_close"

_LIVE: dict[str, Any] = {}  # episode key -> environment instance (in the sandboxed child)
# What a step says when its episode's state is gone (its child was replaced): the driver
# rebuilds the episode on another child by replaying it (components/rollout/episodes.py).
LOST = "has no environment in this sandbox process"


def _run(value: Any) -> Any:
    import asyncio
    import inspect

    if inspect.isawaitable(value):

        async def wait():
            return await value

        return asyncio.run(wait())
    return value


def _observation(obs: Any, what: str) -> str | None:
    if obs is None or isinstance(obs, str):
        return obs or None
    raise TypeError(f"{what} returned the observation {short_repr(obs)}; allowed: a str or None")


def env_reset(factory: str, key: str, row: dict) -> str | None:
    """Make the episode `key`'s environment with `factory` and reset it on `row`."""
    from moerl.tasks.sandbox import resolve

    env = resolve(factory)()
    for name in ("reset", "step"):
        if not callable(getattr(env, name, None)):
            raise TypeError(
                f"{factory}() made a {type(env).__name__} without a {name}() method; an environment has "
                "reset(row) and step(text)"
            )
    obs = _observation(_run(env.reset(row)), f"{factory}.reset")
    _LIVE[key] = env
    return obs


def env_step(key: str, text: str) -> list:
    """One step of episode `key`: `[observation | None, reward | None, done]`."""
    env = _LIVE.get(key)
    if env is None:
        raise KeyError(
            f"episode {key!r} {LOST} (the process that held it was replaced after a timeout or a crash)"
        )
    got = _run(env.step(text))
    name = f"{type(env).__name__}.step"
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        raise TypeError(
            f"{name} returned {short_repr(got)}; allowed: (observation: str | None, reward: float | None, "
            "done: bool)"
        )
    obs, reward, done = got
    if reward is not None and (
        isinstance(reward, bool)
        or not isinstance(reward, (int, float))
        or not math.isfinite(reward)
    ):
        raise TypeError(
            f"{name} returned the reward {short_repr(reward)}; allowed: a finite number or None"
        )
    if not isinstance(done, bool):
        raise TypeError(f"{name} returned done={short_repr(done)}; allowed: True or False")
    return [_observation(obs, name), None if reward is None else float(reward), done]


def env_close(keys: list[str]) -> int:
    """Close and forget the episodes `keys` (those this child holds); how many it closed."""
    n = 0
    for key in keys:
        env = _LIVE.pop(key, None)
        if env is None:
            continue
        n += 1
        close = getattr(env, "close", None)
        if callable(close):
            try:
                _run(close())
            except Exception:  # noqa: BLE001 - the episode is over; a close that fails loses nothing
                pass
    return n


def environment_for(task: str, default: str | None, per_task: dict[str, str]) -> str | None:
    """The environment factory of rows of `task`: `task.environments[task]`, else
    `task.environment`, else None (single-turn)."""
    return per_task.get(task, default)


def environment_key(task: str, per_task: dict[str, str]) -> str:
    """The config key that chose the environment of `task` (for error messages)."""
    return f"task.environments.{task}" if task in per_task else "task.environment"
