"""Rule verifiers: reward a response against the reference answer, in [0, 1].

- `positional`: partial credit. The fraction of the answer's characters the response gets
  right at the same position, divided by the longer of the two lengths, so a response that
  runs on past the answer loses credit. Exactly the answer scores 1.
- `exact`: 1 if the stripped response equals the answer, else 0.

`verifier_for(name, task)` resolves `auto` through each task's default.
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


def verifier_for(name: str, task: str) -> Verifier:
    if name == "auto":
        if task not in TASK_DEFAULTS:
            raise KeyError(f"task {task!r} has no default verifier; known tasks: {', '.join(TASK_DEFAULTS)}; "
                           "set reward.verifier explicitly")
        name = TASK_DEFAULTS[task]
    return VERIFIERS[name]
