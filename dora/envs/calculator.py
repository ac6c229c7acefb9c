"""A calculator tool for long arithmetic (``task.env = "dora.envs.calculator:Calculator"``).

Items are long sums and products (the built-in ``arithmetic`` task's: ``"48213+9071="``, answer ``"57284"``).
The model may write ``calc <expression>`` (digits, + - * and parentheses) and the tool answers ``= <value>``;
it ends the episode with ``answer <number>``, scored 1 when the number is the item's answer and 0 otherwise. A
turn with neither gets a reminder of the two forms. A blocking ``step`` (the worker runs it in a thread pool).
Its rows, with recorded episodes for a warm start: ``python -m dora.tasks.tool_rows FOLDER``.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

SYSTEM = "Use the calculator: write calc then an expression, and it answers. Finish with answer then the number."
CALL = re.compile(r"calc\s*([0-9+\-*() ]+)")
ANSWER = re.compile(r"answer\s*(-?\d+)")
MAX_DIGITS = 60
"""Values with more digits are refused (the tool's answer would be longer than any model turn)."""
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expression: str) -> int:
    """The value of an integer expression of + - * and parentheses; ValueError for anything else."""
    try:
        tree = ast.parse(expression.strip(), mode="eval").body
    except SyntaxError:
        raise ValueError(f"cannot read {expression.strip()!r}") from None

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            out = OPS[type(node.op)](value(node.left), value(node.right))
            if len(str(abs(out))) > MAX_DIGITS:
                raise ValueError("too large")
            return out
        raise ValueError(f"cannot compute {ast.unparse(node)!r}")

    return value(tree)


class Calculator:
    def __init__(self) -> None:
        self.answer = ""

    def reset(self, item: Any) -> list[dict[str, str]]:
        self.answer = str(item.answer).strip()
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": item.prompt}]

    def step(self, action: str) -> tuple[list[dict[str, str]], float | None, bool]:
        if found := ANSWER.search(action):
            return [], float(found.group(1) == self.answer), True
        if found := CALL.search(action):
            try:
                said = f"= {evaluate(found.group(1))}"
            except ValueError as e:
                said = f"error: {e}"
            return [{"role": "tool", "content": said}], None, False
        return [{"role": "user", "content": "Write calc <expression>, or answer <number>."}], None, False
