"""A guessing game with higher/lower feedback (``task.env = "dora.envs.guess:Guess"``).

Each item's answer is the secret, an integer in [1, 100]. Every assistant turn is a guess (the first
integer in it); the game answers ``higher`` or ``lower`` until the guess is right, which ends the episode
with reward 1. A bisecting player needs at most 7 turns and a careless one many more, so episode lengths
are long-tailed by nature; ``task.max_turns`` cuts the tail (reward 0). An async ``step``: it runs on the
worker's event loop.

``python -m dora.envs.guess FOLDER`` writes the game's rows as ``train.jsonl`` and ``test.jsonl``
(``question``, ``answer``), the layout ``task.dataset`` reads.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys
from typing import Any

import numpy as np

LOW, HIGH = 1, 100
SYSTEM = f"Guess my number between {LOW} and {HIGH}. Reply with one number; I answer higher or lower."
NUMBER = re.compile(r"-?\d+")


class Guess:
    def __init__(self) -> None:
        self.secret = 0

    def reset(self, item: Any) -> list[dict[str, str]]:
        self.secret = int(item.answer)
        if not LOW <= self.secret <= HIGH:
            raise ValueError(f"the secret {self.secret} is outside [{LOW}, {HIGH}]")
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": item.prompt}]

    async def step(self, action: str) -> tuple[list[dict[str, str]], float | None, bool]:
        found = NUMBER.search(action)
        if found is None:
            return [{"role": "user", "content": "A number, please."}], None, False
        guess = int(found.group())
        if guess == self.secret:
            return [], 1.0, True
        return [{"role": "user", "content": "higher" if guess < self.secret else "lower"}], None, False


def player(secret: int, rng: np.random.Generator) -> list[dict[str, str]]:
    """The episode of a player who guesses uniformly at random among the numbers the feedback still allows: never
    wrong about the feedback, rarely quick (right within 7 turns about half the time; bisecting always is)."""
    low, high, turns = LOW, HIGH, []
    while True:
        guess = int(rng.integers(low, high + 1))
        turns.append({"role": "assistant", "content": str(guess)})
        if guess == secret:
            return turns
        turns.append({"role": "user", "content": "higher" if guess < secret else "lower"})
        low, high = (guess + 1, high) if guess < secret else (low, guess - 1)


def write_rows(folder: str | pathlib.Path, *, train: int = 2000, test: int = 200, seed: int = 0) -> None:
    """``train.jsonl`` and ``test.jsonl``: ``question``, ``answer`` (the secret) and ``trace`` (a random but
    consistent player's episode, for a warm start that RL can improve on)."""
    out = pathlib.Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name, n in (("train", train), ("test", test)):
        with open(out / f"{name}.jsonl", "w") as f:
            for secret in rng.integers(LOW, HIGH + 1, size=n):
                row = {"question": "Your guess?", "answer": str(int(secret)), "trace": player(int(secret), rng)}
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    write_rows(sys.argv[1] if len(sys.argv) > 1 else "examples/data/guess")
