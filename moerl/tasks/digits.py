"""The shipped tasks: digit problems whose answers a rule can check with partial credit.

- `copy`:    "copy 48213=" -> "48213"
- `reverse`: "rev 48213="  -> "31284"
- `add`:     "add 12+345=" -> "357"

`generate` draws them deterministically from a seed; the files in `moerl/tasks/data/` are its
output, and `moerl.tasks.verifiers` scores the responses.
"""

from __future__ import annotations

import random

from moerl.records import Prompt

TASKS = ("copy", "reverse", "add")


def make_prompt(task: str, rng: random.Random, digits: tuple[int, int]) -> tuple[str, str]:
    """One (prompt, answer) pair of `task` with operands of `digits` (min, max) digits."""
    n = rng.randint(*digits)
    if task == "copy":
        s = "".join(rng.choice("0123456789") for _ in range(n))
        return f"copy {s}=", s
    if task == "reverse":
        s = "".join(rng.choice("0123456789") for _ in range(n))
        return f"rev {s}=", s[::-1]
    if task == "add":
        a, b = rng.randrange(10 ** (n - 1), 10**n), rng.randrange(10 ** (n - 1), 10**n)
        return f"add {a}+{b}=", str(a + b)
    raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")


def generate(tasks: list[str], n: int, seed: int, digits: tuple[int, int] = (4, 6)) -> list[Prompt]:
    """`n` prompts drawn round-robin from `tasks`, deterministic in `seed`."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        task = tasks[i % len(tasks)]
        prompt, answer = make_prompt(task, rng, digits)
        rows.append(Prompt(id=f"{task}-{seed}-{i:06d}", task=task, prompt=prompt, answer=answer))
    return rows
