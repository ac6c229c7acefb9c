"""Built-in verifiable tasks with locally generated, deterministic datasets.

A task maps an item index to an ``Item`` (prompt text, reference answer) by a pure function of
(seed, index): every process (broker, rollout workers, learner) regenerates the same item from the
group id, so no dataset file has to be shipped or kept in sync. Sizes are drawn from long-tailed
distributions, so reference answers (and the answers a trained model writes) have long-tailed lengths.

- ``arithmetic``: ``a+b`` or ``a*b`` with operand digit counts from a geometric law (1 to 20 digits).
  The answer is the exact integer.
- ``countdown``: reach a target with some of the given numbers and + - * / (each number at most
  once). The count of numbers is long-tailed (2 to 7). Every item is solvable: the target comes from
  a random expression over the numbers, which is the reference answer.

Completions are scored by reward functions (``dora.tasks.rewards``); an answer is the text after the
last ``=`` of the completion, or the whole completion.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True, kw_only=True)
class Item:
    task: str
    index: int
    prompt: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)


def _rng(seed: int, task: str, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, sum(task.encode()), index])


def _digits(rng: np.random.Generator, mean: float, cap: int) -> int:
    return int(min(cap, rng.geometric(1.0 / mean)))


def _number(rng: np.random.Generator, digits: int) -> int:
    if digits == 1:
        return int(rng.integers(0, 10))
    first = int(rng.integers(1, 10))
    rest = rng.integers(0, 10, size=digits - 1)
    return int(str(first) + "".join(map(str, rest)))


@dataclass(frozen=True, slots=True)
class Arithmetic:
    seed: int = 0
    name: str = "arithmetic"

    def item(self, index: int) -> Item:
        rng = _rng(self.seed, self.name, index)
        op = "+" if rng.random() < 0.6 else "*"
        a = _number(rng, _digits(rng, 3.0, 20))
        b = _number(rng, _digits(rng, 2.0 if op == "*" else 3.0, 20))
        value = a + b if op == "+" else a * b
        return Item(task=self.name, index=index, prompt=f"{a}{op}{b}=", answer=str(value), meta={"op": op})


@dataclass(frozen=True, slots=True)
class Countdown:
    seed: int = 0
    name: str = "countdown"

    def item(self, index: int) -> Item:
        rng = _rng(self.seed, self.name, index)
        k = int(min(7, 1 + rng.geometric(0.45)))
        numbers = [int(x) for x in rng.integers(1, 26, size=k)]
        order = [int(i) for i in rng.permutation(k)]
        expr, value = str(numbers[order[0]]), numbers[order[0]]
        for i in order[1:]:
            n = numbers[i]
            ops = ["+", "*"] + (["-"] if value - n > 0 else []) + (["/"] if n > 1 and value % n == 0 else [])
            op = ops[int(rng.integers(0, len(ops)))]
            value = {"+": value + n, "-": value - n, "*": value * n, "/": value // n}[op]
            expr = f"({expr}){op}{n}" if op in "*/" and any(c in expr for c in "+-") else f"{expr}{op}{n}"
        shown = " ".join(map(str, sorted(numbers)))
        return Item(task=self.name, index=index, prompt=f"{shown} -> {value}:", answer=expr,
                    meta={"numbers": sorted(numbers), "target": value})  # fmt: skip


TASKS: dict[str, type[Arithmetic | Countdown]] = {"arithmetic": Arithmetic, "countdown": Countdown}


def get(name: str, seed: int = 0) -> Arithmetic | Countdown:
    try:
        return TASKS[name](seed=seed)
    except KeyError:
        raise ValueError(f"unknown task {name!r}; built in: {', '.join(sorted(TASKS))}") from None
