"""The shipped tool environments (`task.environment`, docs/tasks.md).

Design, details and limitations: docs/tasks.md#moerltaskstoolspy.
"""

from __future__ import annotations

import ast
import operator
import random
import re

from moerl.records import Prompt
from moerl.tasks.verifiers import positional

# ---------------------------------------------------------------------------- the calculator

_CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
MAX_EXPRESSION = 200  # characters
MAX_EXPONENT = 64


def evaluate(expression: str) -> float:
    """An arithmetic expression's value; ValueError for anything else."""
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"expression over {MAX_EXPRESSION} characters")
    tree = ast.parse(expression.replace("^", "**"), mode="eval")

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, (int, float))
            and not isinstance(node.value, bool)
        ):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent over {MAX_EXPONENT}")
            return _OPS[type(node.op)](left, right)
        raise ValueError(f"not arithmetic: {ast.dump(node)[:80]}")

    return ev(tree)


def _show(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def _as_number(text: str) -> float | None:
    try:
        if "/" in text:
            a, b = text.split("/")
            return float(a) / float(b)
        return float(text)
    except (ValueError, ZeroDivisionError):
        return None


class Calculator:
    """A calculator tool for arithmetic word problems (see the module docstring)."""

    def reset(self, row: dict) -> None:
        answer = _as_number(str(row.get("answer", "")).replace(",", "").strip())
        if answer is None:
            raise ValueError(
                f"row {row.get('id')!r}: the calculator task needs a numeric answer, got "
                f"{row.get('answer')!r}"
            )
        self.answer: float = answer
        return None

    def step(self, text: str) -> tuple[str | None, float | None, bool]:
        call = _CALL.search(text)
        if call is not None:
            try:
                return f"<result>{_show(evaluate(call.group(1)))}</result>", None, False
            except (ValueError, SyntaxError, ZeroDivisionError, OverflowError, TypeError) as err:
                return f"<result>error: {type(err).__name__}</result>", None, False
        numbers = _NUMBER.findall(text.replace(",", ""))
        got = _as_number(numbers[-1]) if numbers else None
        return (
            None,
            float(got is not None and abs(got - self.answer) <= 1e-6 * max(1.0, abs(self.answer))),
            True,
        )


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
