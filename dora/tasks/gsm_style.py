"""The example dataset: short arithmetic questions in GSM8K's layout, generated here, never downloaded.

Each row is ``{"question": "What is 47 + 38?", "answer": "47 + 38 = 85\\n#### 85"}``: the reasoning, then
``#### `` and the final number, as GSM8K writes it, so the same config, rewards and evaluation work on
GSM8K itself. Sums and differences of two numbers below 100. Train and test rows are disjoint (no
question of the test split is in the train split), so accuracy on the test split is held out.

``python -m dora.tasks.gsm_style DIR`` writes ``DIR/train.jsonl`` and ``DIR/test.jsonl``
(examples/data/arithmetic holds them, made by that command).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

TRAIN_ROWS = 2000
TEST_ROWS = 200


def question(a: int, op: str, b: int) -> dict[str, str]:
    value = a + b if op == "+" else a - b
    return {"question": f"What is {a} {op} {b}?", "answer": f"{a} {op} {b} = {value}\n#### {value}"}


def splits(seed: int = 0, train: int = TRAIN_ROWS, test: int = TEST_ROWS) -> dict[str, list[dict[str, str]]]:
    """Disjoint train and test rows, a pure function of the seed."""
    rng = np.random.default_rng(seed)
    pool = [(a, op, b) for a in range(100) for b in range(100) for op in "+-" if op == "+" or a >= b]
    if train + test > len(pool):
        raise ValueError(f"at most {len(pool)} distinct questions")
    order = rng.permutation(len(pool))
    chosen = [pool[i] for i in order[: train + test]]
    return {"train": [question(*q) for q in chosen[:train]], "test": [question(*q) for q in chosen[train:]]}


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
    p = argparse.ArgumentParser(prog="python -m dora.tasks.gsm_style", description=__doc__)
    p.add_argument("out", help="folder for train.jsonl and test.jsonl")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name, path in write(args.out, args.seed).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
