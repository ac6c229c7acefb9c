"""Held-out evaluation: a model's answers to a dataset it never trains on, scored by the task's reward.

Each row is sampled ``samples`` times (``temperature`` 0: greedy, the one answer the model gives) by a
step engine (``TorchEngine`` or ``VllmEngine``: ``submit`` then ``step`` until every sequence is done), and
each completion is scored by the run's reward; a completion is correct when its reward is at least 1.

The metrics are ``dora.tasks.heldout``'s (accuracy, pass@k, mean reward and length).

Evaluation is never training traffic: it has its own rows, its own requests and its own metrics, and takes
no part in what the broker dispatches or trains.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from dora.ids import AttemptId, GroupId
from dora.rollout.engines.base import StepEngine
from dora.tasks.heldout import row_seed, summarize
from dora.tasks.prompts import TaskRun


def evaluate(engine: StepEngine[Any], task: TaskRun, *, samples: int = 1, temperature: float = 0.0,
             max_tokens: int = 32, limit: int | None = None, seed: int = 0,
             open_episodes: int = 64) -> dict[str, Any]:  # fmt: skip
    """Sample every row (the first ``limit``) with ``engine`` and score it; the metrics and the seconds taken.
    Episodes (an environment's or an agent's task) are open ``open_episodes`` at most (a row's samples at least), as
    a worker holds no more than its credit: hundreds of agents at once on one event loop wait past their timeout."""
    if samples < 1 or (temperature <= 0 and samples > 1):
        raise ValueError("eval: samples must be >= 1, and 1 with greedy decoding (temperature 0)")
    started = time.perf_counter()
    rows = task.rows[:limit] if limit else task.rows
    if task.env is not None or task.agent is not None:
        metrics = asyncio.run(_episodes(engine, task, rows, samples=samples, temperature=temperature,
                                        max_tokens=max_tokens, seed=seed, most=open_episodes))  # fmt: skip
        return {**metrics, "seconds": round(time.perf_counter() - started, 3)}
    for r in rows:
        prompt = task.encode(task.texts[r.index])
        engine.submit(group_id=r.index, attempt=0, prompt=prompt, n=samples, max_tokens=max_tokens,
                      temperature=temperature, seed=row_seed(seed, r.index))  # fmt: skip
    done: dict[int, list[Any]] = {r.index: [] for r in rows}
    left = len(rows) * samples
    while left:
        for seq in engine.step():
            done[seq.group_id].append(seq)
            left -= 1
    per_row, lengths, failed = [], [], 0
    for r in rows:
        scores = []
        for seq in sorted(done[r.index], key=lambda s: s.index):
            scored = task.score_row(r.index, seq.tokens)
            failed += bool(scored.reason)
            scores.append(scored.reward)
        per_row.append(scores)
        lengths.append([len(s.tokens) for s in done[r.index]])
    out: dict[str, Any] = summarize(per_row, lengths)
    out.update(reward_failures=float(failed), seconds=round(time.perf_counter() - started, 3))
    return out


async def _episodes(engine: StepEngine[Any], task: TaskRun, rows: list[Any], *, samples: int, temperature: float,
                    max_tokens: int, seed: int, most: int) -> dict[str, Any]:  # fmt: skip
    """An environment's or an agent's task: each row's ``samples`` episodes, scored by the environment or returned
    by the agent (a success is a reward of at least 1), as a worker's evaluation round runs them. Runs on its own
    event loop, from a process's main thread (dora run, dora eval)."""
    from dora.rollout.agents.episodes import AgentEpisodes
    from dora.rollout.episodes import Episodes, score
    from dora.wire import messages as m

    episodes = AgentEpisodes(engine, task) if task.agent is not None else Episodes(engine, task)
    done: dict[int, list[Any]] = {r.index: [] for r in rows}
    waiting = list(rows)
    try:
        while waiting or len(episodes):  # the engine steps on a thread, as a worker's does: agents go on meanwhile
            while waiting and (not len(episodes) or len(episodes) + samples <= most):
                r = waiting.pop(0)
                prompt = np.array(task.encode(task.texts[r.index]), np.int32)
                episodes.submit(m.Generate(group_id=GroupId(r.index), attempt=AttemptId(0),
                                           version=engine.version or 0, prompt_ids=prompt, n_samples=samples,
                                           max_tokens=max_tokens, temperature=temperature,
                                           seed=row_seed(seed, r.index)), task.row_item(r.index))  # fmt: skip
            episodes.take_answers()
            episodes.turns_ended(await asyncio.to_thread(engine.step) if len(engine) else [])
            for ep in episodes.take_finished():
                done[ep.key[0]].append(ep)
            await asyncio.sleep(0 if len(engine) else 0.002)
        for ep in episodes.take_finished():
            done[ep.key[0]].append(ep)
    finally:
        if isinstance(episodes, AgentEpisodes):
            await episodes.close()
    per_row, lengths, failed = [], [], 0
    for r in rows:
        eps = sorted(done[r.index], key=lambda e: e.key[2])
        scored = [score(ep) for ep in eps]
        failed += sum(bool(reason) for _, reason in scored)
        per_row.append([reward for reward, _ in scored])
        lengths.append([ep.length for ep in eps])
    out: dict[str, Any] = summarize(per_row, lengths)
    out.update(reward_failures=float(failed), turns=float(np.mean([len(e.turns) for v in done.values() for e in v])))
    return out
