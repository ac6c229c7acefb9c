"""A rollout worker around your own inference code: implement the engine calls, hand it to RolloutActor.

    python examples/custom_engine.py --broker broker.json --config run.toml --name my-worker

``MyEngine`` (a ``WorkerEngine``) wraps a stand-in for an embedding stack's generate function (here: a fixed random
policy over a small vocabulary, with its log-probs). The contract is in
``dora.rollout.engines.base``. The worker gets its pinned version from ``loaded``, leases from
``submit``, and is polled with ``advance``. It reports each finished sample through ``result``, with
its token ids, behaviour log-probs and ``(version, tokens)`` segments. Migration hands over the token
prefix. This engine re-generates the rest from the prefix, as any engine without KV transfer would.

Three methods are the stack's own: ``generate`` (inference), ``reward`` (scoring) and ``loaded`` (taking a
version's weights). ``examples/embed/worker.py`` overrides them with a real model, the run's task and its
reward, and starts the same worker through ``main``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import uvloop
import zmq.asyncio

from dora.actor.discovery import resolve_endpoint, run_finished
from dora.config import ConfigError, load
from dora.config.run import RunConfig
from dora.ids import Finish
from dora.logging import configure_logging
from dora.rollout.actor import RolloutActor
from dora.rollout.engines.base import WorkerEngine
from dora.samples import FinishedSample
from dora.wire import messages as m

VOCAB = 64


def my_generate(prefix: list[int], max_tokens: int, seed: int) -> tuple[list[int], list[float]]:
    """Your inference: continue ``prefix`` by up to ``max_tokens`` tokens; their log-probs."""
    rng = np.random.default_rng([seed, len(prefix)])
    logits = rng.normal(size=VOCAB)
    logp = logits - np.log(np.exp(logits).sum())
    n = int(rng.integers(1, max_tokens + 1))
    tokens = rng.choice(VOCAB, size=n, p=np.exp(logp)).tolist()
    return tokens, [float(logp[t]) for t in tokens]


@dataclass(slots=True)
class Request:
    """One sample of a leased group; ``tokens`` holds a prefix made elsewhere when it migrated in."""

    group: int
    attempt: int
    index: int
    prompt: list[int]
    max_tokens: int
    seed: int
    temperature: float
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class MyEngine(WorkerEngine):
    name = "custom"

    def __init__(self) -> None:
        self.version: int | None = None
        self.generated = 0
        self.pending: list[Request] = []
        self.finished: list[tuple[int, int, int, list[int], list[float], int]] = []

    # ---------------------------------------------------------------- the stack's own

    def generate(self, batch: list[Request]) -> list[tuple[list[int], list[float]]]:
        """Continue each request (its prompt, then any tokens it brought when it migrated in), with its seed and
        temperature: per request, the new token ids and their behaviour log-probs. A batch is one group's
        samples that share their prefix."""
        return [my_generate(r.prompt + r.tokens, r.max_tokens - len(r.tokens), r.seed) for r in batch]

    def reward(self, group: int, tokens: list[int]) -> float:
        """Score a finished sample of ``group``."""
        return float(len(tokens) % 2)

    def loaded(self, version: int, uri: str = "", sha256: str = "", keep: frozenset[int] = frozenset(),
               inline: Mapping[str, bytes] = {}) -> None:  # fmt: skip
        self.version = version  # a real stack would load the weights at `uri` and check `sha256`

    # ---------------------------------------------------------------- the worker's calls

    @property
    def tokens_generated(self) -> int:
        return self.generated

    def held_versions(self) -> set[int]:
        return set() if self.version is None else {self.version}

    def busy(self) -> bool:
        return bool(self.pending)

    def load_seconds(self) -> float:
        return 0.0

    def submit(self, gen: m.Generate, now: float) -> None:
        for i in range(gen.n_samples):
            self.pending.append(Request(gen.group_id, gen.attempt, i, gen.prompt_ids.tolist(), gen.max_tokens,
                                        gen.seed + i, gen.temperature))  # fmt: skip

    def export(self, group: int, attempt: int, now: float) -> list[m.RequestState]:
        mine = [p for p in self.pending if (p.group, p.attempt) == (group, attempt)]
        self.cancel(group, attempt, now)
        return [m.RequestState(index=p.index, token_ids=np.array(p.tokens, np.int32),
                               logprobs=np.array(p.logprobs, np.float32)) for p in mine]  # fmt: skip

    def import_(self, mig: m.MigrateIn, now: float) -> None:
        for r in mig.requests:
            self.pending.append(Request(mig.group_id, mig.attempt, r.index, mig.prompt_ids.tolist(), mig.max_tokens,
                                        mig.seed + r.index, mig.temperature, r.token_ids.tolist(),
                                        r.logprobs.tolist()))  # fmt: skip

    def cancel(self, group: int, attempt: int, now: float) -> None:
        self.pending = [p for p in self.pending if (p.group, p.attempt) != (group, attempt)]

    def advance(self, now: float) -> None:  # one group's samples per call: the worker's loop stays responsive
        if self.pending and self.version is not None:
            head = self.pending[0]
            same = (head.group, head.attempt, head.tokens)
            batch = [r for r in self.pending if (r.group, r.attempt, r.tokens) == same]
            self.pending = [r for r in self.pending if (r.group, r.attempt, r.tokens) != same]
            for r, (more, more_lps) in zip(batch, self.generate(batch), strict=True):
                self.generated += len(more)
                self.finished.append((r.group, r.attempt, r.index, r.tokens + more, r.logprobs + more_lps,
                                      self.version))  # fmt: skip

    def take_finished(self) -> list:
        out, self.finished = self.finished, []
        return out

    def next_event_s(self) -> float | None:
        return 0.0 if self.pending else None

    def result(self, sample: tuple, broker_epoch: int) -> FinishedSample:
        group, attempt, index, tokens, lps, version = sample
        return FinishedSample(group_id=group, attempt=attempt, index=index,
                                segments=np.array([[version, len(tokens)]], np.int32),
                                token_ids=np.array(tokens, np.int32), logprobs=np.array(lps, np.float32),
                                reward=self.reward(group, tokens), finish=Finish.STOP,
                                broker_epoch=broker_epoch)  # fmt: skip

    def load(self) -> tuple[int, float]:
        return len(self.pending), min(1.0, len(self.pending) / 64)

    def clear(self) -> None:
        self.pending.clear()
        self.finished.clear()


async def serve(cfg: RunConfig, broker: str, name: str, engine: MyEngine) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ctx = zmq.asyncio.Context()
    try:
        # run_finished: a worker that lost its session (busy when the broker said goodbye) reads in the discovery
        # file whether the run is over, and leaves instead of reconnecting to a broker that has gone
        actor = RolloutActor(cfg, ctx, lambda: resolve_endpoint(broker), name, engine, clock=loop.time,
                             run_finished=lambda epoch: run_finished(broker, epoch))  # fmt: skip
        return await actor.run(stop)
    finally:
        ctx.destroy(linger=0)


def main(make_engine: Callable[[RunConfig], MyEngine] = lambda cfg: MyEngine(), doc: str | None = __doc__) -> int:
    """A rollout worker process: ``--broker``, ``--config`` and ``--name``, then ``make_engine(cfg)`` serves."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--broker", required=True)
    p.add_argument("--config")
    p.add_argument("--name", default=f"custom-{os.getpid()}")
    args = p.parse_args()
    try:
        cfg = load(RunConfig, path=args.config, env=os.environ)
        engine = make_engine(cfg)
    except ConfigError as e:
        print(f"{p.prog}: {e}", file=sys.stderr)
        return 2
    configure_logging(cfg.log, process="rollout", worker_id=args.name)
    return uvloop.run(serve(cfg, args.broker, args.name, engine))


if __name__ == "__main__":
    raise SystemExit(main())
