"""Multi-turn environments: the interface a user's environment implements, and the functions the
sandboxed pool runs for it.

An environment is a class (or any factory) named by import path, `package.module:Factory`, in
`task.environment` (every row) or `task.environments.<task>` (the rows of one task). One
instance per episode (one sample of a GRPO group), made with no arguments:

    reset(row: dict) -> str | None
        `row` is the dataset row (`id`, `task`, `prompt` or `messages`, `answer`, `meta`). The
        return value is a first observation appended after the prompt (None or "": nothing).
    step(text: str) -> (observation: str | None, reward: float | None, done: bool)
        `text` is the model's last message. Tool use is the main case: parse the message for a
        tool call, run it, return its result as the observation; the model then continues
        after it. `reward` adds to the episode's reward (None: nothing this step); `done`
        ends the episode. The episode also ends at `task.max_turns` model turns, or when the
        sample's token budget is spent.
    close() -> None (optional)

`reset` and `step` may be `async def`. Each call runs in the sandboxed pool (`sandbox.py`):
another process with no credentials, a time and a memory limit per call. The instance stays in
that child between calls (the pool routes an episode's calls to the child that holds it), so an
environment keeps its state in memory as it would in-process, but a call cut off by the time
limit loses the episode (it ends with an error and is counted, never scored 0).

The episode's reward: the sum of the rewards its steps returned; an episode whose steps returned
none is scored by the task's verifier on the model's last message, as a single-turn sample is.

The functions below run inside the sandboxed child; the episode loop that drives the engine
and these calls is `moerl/components/rollout/episodes.py`.
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
