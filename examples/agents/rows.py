"""Rows for the calculator agent (examples/agents/calculator.py): long sums and products of the built-in
``arithmetic`` task, each with a recorded right conversation for a warm start (``sft.trace_field = "trace"``).

``python -m examples.agents.rows FOLDER`` writes ``FOLDER/train.jsonl`` and ``FOLDER/test.jsonl`` (``question``,
``answer``, ``trace``), the layout ``task.dataset`` reads (examples/data/agent-calculator). A trace is the
conversation as the agent holds it, ``{"tools": TOOLS, "messages": [...]}``: its first request's messages (the
agent's system prompt, the question), then, in every other row, a ``calc`` call and its result, and the answer.
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

from dora.envs.calculator import evaluate
from dora.tasks import tool_rows
from dora.tasks.tasks import Item
from examples.agents.calculator import SYSTEM, TOOLS


def trace(item: Item, tool: bool) -> dict[str, Any]:
    """A right conversation for ``item``: with the calculator, or the answer alone."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": item.prompt}]
    if tool:
        expression = item.prompt.rstrip("=")
        call = {"id": "call_0", "type": "function",
                "function": {"name": "calc", "arguments": json.dumps({"expression": expression})}}  # fmt: skip
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_0", "content": str(evaluate(expression))}]  # fmt: skip
    messages.append({"role": "assistant", "content": item.answer})
    return {"tools": TOOLS, "messages": messages}


def write_rows(folder: str | pathlib.Path, *, train: int = 2000, test: int = 300) -> None:
    """``train.jsonl`` and ``test.jsonl`` from two seeds of the arithmetic task (the calculator environment's
    questions: ``dora.tasks.tool_rows``), the calculator in every other row; a test question also in train is left
    out."""
    tool_rows.write_rows(folder, train=train, test=test, traced=trace)


if __name__ == "__main__":
    write_rows(sys.argv[1] if len(sys.argv) > 1 else "examples/data/agent-calculator")
