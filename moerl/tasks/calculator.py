"""The shipped multi-turn task: sums the policy cannot do in its head, with a calculator tool.

    prompt  "do 23+4="     the task, as text (row meta: {"a": 23, "b": 4})
    turn 1  "23+4"         the model calls the calculator with an expression
    observation " 27="     the environment runs the call and replies with its result
    turn 2  "27"           the model answers; the episode ends

`Calculator` is the environment (`task.environment: moerl.tasks.calculator:Calculator`). Its
reply depends on the model's call, so the right final answer depends on what the environment
replied: a wrong call gets the sum of the wrong numbers (or " err=" for a call that does not
parse). The reward is shaped in two halves, each with positional partial credit (as the digit
verifiers give): half for the call against the row's expression, half for the final answer
against the true sum. So an untrained policy scores near 0.1, and one that calls the tool
right and copies its reply scores 1.

`generate` draws rows deterministically; `moerl/tasks/data/digits-calc.jsonl` is its output
(`builtin:digits-calc`, `configs/tiny-moe-calc.yaml`).
"""

from __future__ import annotations

import random
import re

from moerl.records import Prompt
from moerl.tasks.verifiers import positional

_CALL = re.compile(r"^\s*(\d{1,9})\s*\+\s*(\d{1,9})\s*$")
TASK = "calc"


class Calculator:
    """A calculator tool behind a two-turn episode (see the module docstring)."""

    def reset(self, row: dict) -> None:
        meta = row.get("meta") or {}
        a, b = meta.get("a"), meta.get("b")
        if not isinstance(a, int) or not isinstance(b, int):
            raise ValueError(f"row {row.get('id')!r}: a calc row's meta holds the integers a and b, got {meta!r}")
        self.expression, self.answer = f"{a}+{b}", str(a + b)
        self.turn = 0
        return None  # the prompt says it all

    def step(self, text: str) -> tuple[str | None, float | None, bool]:
        self.turn += 1
        if self.turn == 1:  # the tool call
            m = _CALL.match(text)
            result = str(int(m.group(1)) + int(m.group(2))) if m else "err"
            return f" {result}=", 0.5 * positional(text, self.expression), False
        return None, 0.5 * positional(text, self.answer), True  # the answer


def generate(n: int, seed: int, digits: tuple[int, int] = (1, 1)) -> list[Prompt]:
    """`n` calc rows, operands of `digits` (min, max) digits, deterministic in `seed`."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = (_operand(rng, digits) for _ in range(2))
        rows.append(Prompt(id=f"{TASK}-{seed}-{i:06d}", task=TASK, prompt=f"do {a}+{b}=", answer=str(a + b),
                           meta={"a": a, "b": b}))
    return rows


def _operand(rng: random.Random, digits: tuple[int, int]) -> int:
    k = rng.randint(*digits)
    return rng.randrange(10 ** (k - 1), 10**k)
