"""Rows for the calculator environment (``dora.envs.calculator``): long sums and products of the built-in
``arithmetic`` task, each with a recorded right episode for a warm start (``sft.trace_field = "trace"``).

``python -m dora.tasks.tool_rows FOLDER`` writes ``FOLDER/train.jsonl`` and ``FOLDER/test.jsonl``
(``question``, ``answer``, ``trace``), the layout ``task.dataset`` reads (examples/data/calculator).
"""

from __future__ import annotations

import json
import pathlib
import sys
from collections.abc import Callable
from typing import Any

from dora.tasks.tasks import Arithmetic, Item


def trace(item: Item, tool: bool) -> list[dict[str, str]]:
    """A right episode for ``item`` after its opening: with the calculator, or the answer alone."""
    a = {"role": "assistant", "content": f"answer {item.answer}"}
    if not tool:
        return [a]
    return [{"role": "assistant", "content": f"calc {item.prompt.rstrip('=')}"},
            {"role": "tool", "content": f"= {item.answer}"}, a]  # fmt: skip


def write_rows(folder: str | pathlib.Path, *, train: int = 2000, test: int = 300,
               traced: Callable[[Item, bool], Any] = trace) -> None:  # fmt: skip
    """``train.jsonl`` and ``test.jsonl`` (``question``, ``answer``, ``trace``: a recorded right episode, with
    the calculator in every other row and the answer alone in the rest) from two seeds of the arithmetic
    task; a test question also in train is left out. ``traced(item, tool)`` records a row's episode (an agent's
    conversation: examples/agents/rows.py)."""
    out = pathlib.Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    for name, n, seed in (("train", train, 0), ("test", test, 1)):
        task, i = Arithmetic(seed=seed), 0
        rows: list[dict[str, object]] = []
        while len(rows) < n:
            item, i = task.item(i), i + 1
            if item.prompt in seen:
                continue
            seen.add(item.prompt)
            rows.append({"question": item.prompt, "answer": item.answer, "trace": traced(item, len(rows) % 2 == 0)})
        with open(out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    write_rows(sys.argv[1] if len(sys.argv) > 1 else "examples/data/calculator")
