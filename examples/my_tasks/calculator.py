"""A tool environment as a user writes one: a calculator for arithmetic word problems.

    task.environment: my_tasks.calculator:Calculator

Each model message is a tool call, a `<calc>EXPRESSION</calc>` anywhere in it, evaluated by
walking its syntax tree (numbers, `+ - * /`, parentheses, `**` up to exponent 64; never `eval`)
and answered with `<result>VALUE</result>`; or, with no call, the final answer, scored 1 if its
last number equals the row's answer, which ends the episode. Use it on GSM8K-style rows:
`moerl tasks make reasoning-gym --names gsm_symbolic -o gsm.jsonl`.
"""

from __future__ import annotations

import ast
import operator
import re

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
