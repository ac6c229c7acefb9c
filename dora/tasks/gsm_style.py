"""The example dataset: short multi-step arithmetic in GSM8K's layout, generated here, never downloaded.

A question chains four one-digit numbers, ``{"question": "What is 8 + 6 + 5 - 2?", ...}``; the running
total never goes below zero. Answers come in the two styles found in real SFT mixtures, drawn half and
half (seeded) for the train rows:

- worked: one line per step, then ``#### `` and the result, as GSM8K writes it:
  ``"8 + 6 = 14\\n14 + 5 = 19\\n19 - 2 = 17\\n#### 17"``;
- terse: the result alone, ``"#### 17"``.

Test rows carry the worked answer; scoring reads only the number after ``####``, so the style a model
answers in does not matter to the metric, only whether the number is right. A tiny model fine-tuned on
this mixture imitates both styles, and it is right far more often when it writes the steps out (it
cannot add four numbers in one token). That is the gap reinforcement learning is for: GRPO rewards the
correct answers, which are mostly worked ones, so the policy moves to showing its steps and held-out
exact match rises (docs/data.md).

Train and test questions are disjoint, so accuracy on the test split is held out.
``python -m dora.tasks.gsm_style DIR`` writes ``DIR/train.jsonl`` and ``DIR/test.jsonl``
(examples/data/arithmetic holds them, made by that command).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

TRAIN_ROWS = 2000
TEST_ROWS = 500
NUMBERS = 4
WORKED_SHARE = 0.5
"""Share of the train rows whose answer shows its steps (the rest give the result alone)."""


def chain(numbers: list[int], ops: list[str]) -> list[tuple[int, str, int, int]]:
    """The steps of ``numbers[0] ops[0] numbers[1] ...`` from left to right: (total, op, number, new total)."""
    steps, total = [], numbers[0]
    for op, n in zip(ops, numbers[1:], strict=True):
        new = total + n if op == "+" else total - n
        steps.append((total, op, n, new))
        total = new
    return steps


def row(numbers: list[int], ops: list[str], *, worked: bool) -> dict[str, str]:
    steps = chain(numbers, ops)
    question = f"What is {numbers[0]}" + "".join(f" {op} {n}" for op, n in zip(ops, numbers[1:], strict=True)) + "?"
    result = f"#### {steps[-1][3]}"
    lines = [f"{a} {op} {b} = {c}" for a, op, b, c in steps] if worked else []
    return {"question": question, "answer": "\n".join([*lines, result])}


def splits(seed: int = 0, train: int = TRAIN_ROWS, test: int = TEST_ROWS) -> dict[str, list[dict[str, str]]]:
    """Disjoint train and test rows, a pure function of the seed."""
    rng = np.random.default_rng(seed)
    seen: set[tuple[tuple[int, ...], tuple[str, ...]]] = set()
    questions: list[tuple[list[int], list[str]]] = []
    while len(questions) < train + test:
        numbers = [int(x) for x in rng.integers(0, 10, NUMBERS)]
        ops, total = [], numbers[0]
        for n in numbers[1:]:
            op = "-" if total >= n and rng.random() < 0.5 else "+"
            total = total + n if op == "+" else total - n
            ops.append(op)
        key = (tuple(numbers), tuple(ops))
        if key not in seen:
            seen.add(key)
            questions.append((numbers, ops))
    worked = rng.random(train) < WORKED_SHARE
    return {
        "train": [row(*q, worked=bool(w)) for q, w in zip(questions[:train], worked, strict=True)],
        "test": [row(*q, worked=True) for q in questions[train:]],
    }


def write(out: str | pathlib.Path, seed: int = 0) -> dict[str, pathlib.Path]:
    """Write ``train.jsonl`` and ``test.jsonl`` into ``out``; returns their paths."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, rows in splits(seed).items():
        paths[name] = out / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dora.tasks.gsm_style", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("out", help="folder for train.jsonl and test.jsonl")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name, path in write(args.out, args.seed).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
