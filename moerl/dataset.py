"""Verifiable synthetic tasks and dataset loading.

The shipped tasks are digit problems whose answers a rule can check with partial credit:

- `copy`:    "copy 48213=" -> "48213"
- `reverse`: "rev 48213="  -> "31284"
- `add`:     "add 12+345=" -> "357"

A dataset is a JSONL file of `Prompt` rows ({id, task, prompt, answer}). `builtin:<name>`
names a file shipped in `moerl/data/`; any other value is a path to a user's file in the
same schema. Malformed rows are skipped and counted; more than `max_bad_fraction` of them
fails the load with a `DataError`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from pydantic import ValidationError

from moerl.errors import DataError
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


@dataclass(frozen=True)
class Dataset:
    rows: list[Prompt]
    source: str
    bad_rows: int

    def batch(self, iteration: int, size: int, seed: int) -> list[Prompt]:
        """The prompts of `iteration`: a seeded permutation read with a cursor, so a run (and a
        resumed run) sees every prompt once per epoch in the same order."""
        order = list(range(len(self.rows)))
        random.Random(seed).shuffle(order)
        start = iteration * size
        return [self.rows[order[(start + j) % len(order)]] for j in range(size)]


def resolve_path(spec: str) -> Path:
    if spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        p = Path(str(resources.files("moerl.data").joinpath(f"{name}.jsonl")))
        if not p.is_file():
            known = sorted(x.name.removesuffix(".jsonl") for x in resources.files("moerl.data").iterdir()
                           if x.name.endswith(".jsonl"))
            raise DataError(f"task.dataset: no builtin dataset {name!r}; builtin: {', '.join(known)}")
        return p
    p = Path(spec).expanduser()
    if not p.is_file():
        raise DataError(f"task.dataset: file not found: {p}")
    return p


def load_dataset(spec: str, max_bad_fraction: float) -> Dataset:
    """Load a JSONL prompt dataset, skipping and counting malformed rows."""
    path = resolve_path(spec)
    rows: list[Prompt] = []
    bad = 0
    first_bad: str | None = None
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(Prompt.model_validate(json.loads(line)))
            except (json.JSONDecodeError, ValidationError) as err:
                bad += 1
                if first_bad is None:
                    first_bad = f"line {lineno}: {str(err).splitlines()[0]}"
    total = len(rows) + bad
    if total == 0:
        raise DataError(f"task.dataset: {path} has no rows")
    if bad / total > max_bad_fraction:
        raise DataError(
            f"task.dataset: {bad} of {total} rows in {path} are malformed "
            f"({bad / total:.1%} > task.max_bad_fraction {max_bad_fraction:.1%}); first: {first_bad}"
        )
    return Dataset(rows=rows, source=str(path), bad_rows=bad)
