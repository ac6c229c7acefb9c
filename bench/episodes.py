"""Multi-turn episodes on one torch worker: episodes/s, and how much tool wall-time hides behind decoding.

    python bench/episodes.py [--latency-ms 1 10 100] [--groups 8] [--group-size 8] [--turns 4]

Each episode has ``--turns`` assistant turns of up to ``--turn-tokens`` tokens (a fixed random sixteenth of the
vocabulary ends a turn, so turn lengths vary as they do in real episodes); after each, the tool answers after
``latency`` (an async sleep). Two drivers of the same runner (``dora.rollout.episodes``) on the same
engine, side by side per latency:

- **overlapped** (dora's worker): a waiting episode leaves the decode batch and the engine keeps stepping the
  others while tools run;
- **blocking** (a worker that waits on its tool calls): whenever a tool call is out, nothing decodes until
  every outstanding call has answered.

Tool-wait overlap: the share of all tool-call wall-time during which the engine was running a decode step.
Printed per latency: episodes/s of both and their ratio, and both overlaps. The tiny model is built
offline into a temp folder; episodes end at their turn count.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dora.config.run import TaskSection  # noqa: E402
from dora.hf.tiny import build_model  # noqa: E402
from dora.rollout.engines.torch.engine import TorchEngine  # noqa: E402
from dora.rollout.episodes import Episodes  # noqa: E402
from dora.tasks.prompts import TaskRun  # noqa: E402
from dora.wire import messages as m  # noqa: E402

LATENCY_S = 0.0
CALLS: list[tuple[float, float]] = []
"""(start, end) of every tool call, on the perf_counter clock."""


class Tool:
    """Answers every turn after ``LATENCY_S``; done after ``TURNS`` turns."""

    turns = 4

    def __init__(self) -> None:
        self.n = 0

    def reset(self, item):
        return [{"role": "user", "content": item.prompt}]

    async def step(self, action):
        start = time.perf_counter()
        await asyncio.sleep(LATENCY_S)
        CALLS.append((start, time.perf_counter()))
        self.n += 1
        return [{"role": "tool", "content": f"result {self.n}"}], 1.0, self.n >= Tool.turns


def covered(calls: list[tuple[float, float]], steps: list[tuple[float, float]]) -> float:
    """The share of the calls' total duration that falls inside some step interval."""
    total = sum(b - a for a, b in calls)
    if not total:
        return 0.0
    inside = 0.0
    for a, b in calls:
        for s, e in steps:
            inside += max(0.0, min(b, e) - max(a, s))
    return inside / total


async def drive(episodes: Episodes, engine: TorchEngine, *, blocking: bool) -> list[tuple[float, float]]:
    steps: list[tuple[float, float]] = []
    original = engine.step

    def timed():
        start = time.perf_counter()
        out = original()
        steps.append((start, time.perf_counter()))
        return out

    while len(episodes):
        if blocking:
            calls = [ep.call for ep in episodes.open.values() if ep.call is not None and not ep.call.done()]
            if calls:
                await asyncio.wait(calls)
        episodes.advance(timed)
        episodes.take_finished()
        await asyncio.sleep(0 if len(engine) else 0.0005)
    return steps


def run(model: pathlib.Path, task: TaskRun, args: argparse.Namespace, *, blocking: bool) -> tuple[float, float]:
    CALLS.clear()
    engine = TorchEngine(model, max_slots=args.groups * args.group_size, version=0)
    episodes = Episodes(engine, task)
    vocab = engine.model.config.vocab_size  # a sixteenth of the vocabulary ends a turn: lengths vary, mean ~16
    episodes.stops = frozenset(np.random.default_rng(0).choice(vocab, vocab // 16, replace=False).tolist())

    async def main() -> list[tuple[float, float]]:
        for g in range(args.groups):
            episodes.submit(m.Generate(group_id=g, attempt=1, version=0, prompt_ids=task.prompt_ids(g),
                                       n_samples=args.group_size, max_tokens=args.turn_tokens, seed=g))  # fmt: skip
        return await drive(episodes, engine, blocking=blocking)

    start = time.perf_counter()
    steps = asyncio.run(main())
    seconds = time.perf_counter() - start
    return args.groups * args.group_size / seconds, covered(CALLS, steps)


def main() -> None:
    global LATENCY_S
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--latency-ms", type=float, nargs="+", default=[1, 10, 100])
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--turn-tokens", type=int, default=48)
    args = p.parse_args()
    Tool.turns = args.turns
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(pathlib.Path(tmp) / "model")
        section = TaskSection(name="arithmetic", tokenizer=str(model), chat_template=True, turn_end=(),
                              env="__main__:Tool", max_turns=args.turns, max_episode_tokens=4096)  # fmt: skip
        task = TaskRun(section, str(model))
        print(f"{args.groups} groups x {args.group_size} episodes, {args.turns} turns of <= {args.turn_tokens} tokens")
        print("| tool latency | episodes/s overlapped | episodes/s blocking | ratio | overlap | overlap blocking |")
        print("|---|---|---|---|---|---|")
        for ms in args.latency_ms:
            LATENCY_S = ms / 1000
            fast, hidden = run(model, task, args, blocking=False)
            slow, hidden_slow = run(model, task, args, blocking=True)
            print(f"| {ms:g} ms | {fast:.2f} | {slow:.2f} | {fast / slow:.2f}x | {hidden:.2f} | {hidden_slow:.2f} |")


if __name__ == "__main__":
    main()
