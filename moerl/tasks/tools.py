"""The shipped tool environments (`task.environment`, docs/tasks.md).

Design, details and limitations: docs/tasks.md#6-the-shipped-tool-environments.
"""

from __future__ import annotations

import random

from moerl.records import Prompt
from moerl.tasks.verifiers import positional

# ---------------------------------------------------------------------------- the lookup task

TASK = "lookup"


class Lookup:
    """A key-value store the model queries, then answers from (see the module docstring)."""

    def reset(self, row: dict) -> None:
        meta = row.get("meta") or {}
        key, value = meta.get("key"), meta.get("value")
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(
                f"row {row.get('id')!r}: a lookup row's meta holds the strings key and value, got {meta!r}"
            )
        self.key, self.value = key, value
        self.turn = 0
        return None  # the prompt says it all

    def step(self, text: str) -> tuple[str | None, float | None, bool]:
        self.turn += 1
        if self.turn == 1:  # the query
            reply = self.value if text.strip() == self.key else "err"
            return f" {reply}=", 0.5 * positional(text, self.key), False
        return None, 0.5 * positional(text, self.value), True  # the answer


def generate(n: int, seed: int, key_digits: int = 3, value_digits: int = 3) -> list[Prompt]:
    """`n` lookup rows with random keys and values, deterministic in `seed`."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        key = "".join(rng.choice("0123456789") for _ in range(key_digits))
        value = "".join(rng.choice("0123456789") for _ in range(value_digits))
        rows.append(
            Prompt(
                id=f"{TASK}-{seed}-{i:06d}",
                task=TASK,
                prompt=f"do {key}=",
                answer=value,
                meta={"key": key, "value": value},
            )
        )
    return rows
