"""Rule verifiers: reward a response against the reference answer, in [0, 1].

- `positional`: partial credit. The fraction of the answer's characters the response gets
  right at the same position, divided by the longer of the two lengths, so a response that
  runs on past the answer loses credit. Exactly the answer scores 1.
- `exact`: 1 if the stripped response equals the answer, else 0.

`verifier_for(name, task)` resolves `auto` through each task's default; `verifier_target`
gives the import path the sandboxed pool (`moerl.tasks.sandbox`) calls: a shipped verifier's
name, or a user's own `package.module:function` (called as `fn(response, answer) -> float`).
"""

from __future__ import annotations

from typing import Callable

Verifier = Callable[[str, str], float]


def positional(response: str, answer: str) -> float:
    r = response.strip()
    if not answer:
        return 1.0 if not r else 0.0
    hits = sum(a == b for a, b in zip(r, answer))
    return hits / max(len(r), len(answer))


def exact(response: str, answer: str) -> float:
    return 1.0 if response.strip() == answer else 0.0


VERIFIERS: dict[str, Verifier] = {"positional": positional, "exact": exact}
TASK_DEFAULTS: dict[str, str] = {"copy": "positional", "reverse": "positional", "add": "positional"}


def is_import_path(name: str) -> bool:
    return ":" in name


def verifier_name(name: str, task: str) -> str:
    """`name` with `auto` resolved by the row's task (KeyError if the task has no default)."""
    if name == "auto":
        if task not in TASK_DEFAULTS:
            raise KeyError(f"task {task!r} has no default verifier; known tasks: {', '.join(TASK_DEFAULTS)}; "
                           "set reward.verifier explicitly")
        return TASK_DEFAULTS[task]
    return name


def verifier_target(name: str, task: str) -> str:
    """The import path of the verifier for a row: a shipped one's, or the user's own."""
    name = verifier_name(name, task)
    return name if is_import_path(name) else f"{__name__}:{name}"


def verifier_for(name: str, task: str) -> Verifier:
    """The shipped verifier for a row, in this process (preference-pair building, tests)."""
    return VERIFIERS[verifier_name(name, task)]
