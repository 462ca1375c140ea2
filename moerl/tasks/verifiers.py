"""Rule verifiers: reward a response against the reference answer, in [0, 1].

Design, details and limitations: docs/tasks.md#moerltasksverifierspy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from moerl.userfiles import short_repr

Verifier = Callable[..., float]


def positional(response: str, answer: str) -> float:
    r = response.strip()
    if not answer:
        return 1.0 if not r else 0.0
    hits = sum(a == b for a, b in zip(r, answer))
    return hits / max(len(r), len(answer))


def exact(response: str, answer: str) -> float:
    return 1.0 if response.strip() == answer else 0.0


VERIFIERS: dict[str, Verifier] = {"positional": positional, "exact": exact}
TASK_DEFAULTS: dict[str, str] = {
    "copy": "positional",
    "reverse": "positional",
    "add": "positional",
    # the `moerl[tasks]` extra's (moerl/tasks/offline.py), by import path
    "reasoning_gym": "moerl.tasks.offline:score_reasoning_gym",
    "math": "moerl.tasks.offline:score_math",
}


def is_import_path(name: str) -> bool:
    return ":" in name


def verifier_name(name: str, task: str, per_task: Mapping[str, str] | None = None) -> str:
    """The verifier for a row of `task`: `per_task[task]`, else `name` unless `auto`, else the
    task's default (KeyError naming the keys to set if there is none)."""
    if per_task and task in per_task:
        return per_task[task]
    if name == "auto":
        if task not in TASK_DEFAULTS:
            raise KeyError(
                f"task {task!r} has no verifier: set reward.verifiers.{task} (or reward.verifier) to "
                f"package.module:function; tasks with a shipped one: {', '.join(TASK_DEFAULTS)}"
            )
        return TASK_DEFAULTS[task]
    return name


def verifier_target(name: str, task: str, per_task: Mapping[str, str] | None = None) -> str:
    """The import path of the verifier for a row: a shipped one's, or the user's own."""
    name = verifier_name(name, task, per_task)
    return name if is_import_path(name) else f"{__name__}:{name}"


def verifier_key(name: str, task: str, per_task: Mapping[str, str] | None = None) -> str:
    """The config key that chose the verifier for `task` (for error messages)."""
    if per_task and task in per_task:
        return f"reward.verifiers.{task}"
    return "reward.verifier"


def verifier_for(name: str, task: str) -> Verifier:
    """The shipped verifier for a row, in this process (preference-pair building, tests)."""
    return VERIFIERS[verifier_name(name, task)]


# What the pool runs for every verifier call (the verifier's own path is its first argument).
CALL_VERIFIER = f"{__name__}:call_verifier"


def as_score(ok: bool, value: Any, error: str) -> float | str:
    """A sandboxed call's outcome as a score, or the error text that fails its sample: the
    call's own error, or a value that is not a finite number."""
    import math

    if not ok:
        return error
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return f"ValueError: verifier returned {short_repr(value)}, not a finite number"
    return float(value)


@functools.lru_cache(maxsize=256)
def _resolved(target: str) -> tuple[Callable[..., Any], bool]:
    """The verifier `target` names and whether it takes `meta` (a third positional argument)."""
    import inspect

    from moerl.tasks.sandbox import resolve

    fn = resolve(target)
    try:
        sig = inspect.signature(fn)
    except ValueError:  # no signature to read (a builtin): called with (response, answer)
        return fn, False
    try:
        sig.bind("", "", None)
        return fn, True
    except TypeError:
        pass
    try:
        sig.bind("", "")
    except TypeError as err:
        raise TypeError(
            f"{target} takes neither (response, answer, meta) nor (response, answer): {err}"
        ) from None
    return fn, False


def call_verifier(target: str, response: str, answer: str, meta: dict | None = None) -> Any:
    """Run inside the sandbox: the verifier `target` on one sample; an `async def` verifier is
    run to completion in a fresh event loop."""
    import asyncio
    import inspect

    fn, takes_meta = _resolved(target)
    value = fn(response, answer, meta) if takes_meta else fn(response, answer)
    if inspect.isawaitable(value):
        value = asyncio.run(_awaited(value))
    return value


async def _awaited(value):
    return await value
