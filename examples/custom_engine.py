"""A rollout worker around your own inference code: implement the engine calls, hand it to RolloutActor.

    python examples/custom_engine.py --broker broker.json --config run.toml --name my-worker

``MyEngine`` wraps a stand-in for an embedding stack's generate function (here: a fixed random
policy over a small vocabulary, with its log-probs). The contract is in
``dora.rollout.engines.base``. The worker gets its pinned version from ``loaded``, leases from
``submit``, and is polled with ``advance``. It reports each finished sample through ``result``, with
its token ids, behaviour log-probs and ``(version, tokens)`` segments. Migration hands over the token
prefix. This engine re-generates the rest from the prefix, as any engine without KV transfer would.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

import numpy as np
import uvloop
import zmq.asyncio

from dora.config import ConfigError, load
from dora.discovery import resolve_endpoint
from dora.ids import Finish
from dora.logging import configure_logging
from dora.rollout.actor import RolloutActor
from dora.runconfig import RunConfig
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


class MyEngine:
    name = "custom"

    def __init__(self) -> None:
        self.version: int | None = None
        self.tokens_generated = 0
        self.pending: list[tuple[int, int, int, list[int], int, int, list[int], list[float]]] = []
        self.finished: list[tuple[int, int, int, list[int], list[float], int]] = []

    def busy(self) -> bool:
        return bool(self.pending)

    def load_seconds(self) -> float:
        return 0.0

    def loaded(self, version: int, uri: str = "", sha256: str = "") -> None:
        self.version = version  # a real stack would load the weights at `uri` and check `sha256`

    def submit(self, gen: m.Generate, now: float) -> None:
        for i in range(gen.n_samples):
            self.pending.append((gen.group_id, gen.attempt, i, gen.prompt_ids.tolist(), gen.max_tokens,
                                 gen.seed + i, [], []))  # fmt: skip

    def export(self, group: int, attempt: int, now: float) -> list[m.RequestState]:
        mine = [p for p in self.pending if p[:2] == (group, attempt)]
        self.pending = [p for p in self.pending if p[:2] != (group, attempt)]
        return [m.RequestState(index=p[2], token_ids=np.array(p[6], np.int32), logprobs=np.array(p[7], np.float32))
                for p in mine]  # fmt: skip

    def import_(self, mig: m.MigrateIn, now: float) -> None:
        for r in mig.requests:
            self.pending.append((mig.group_id, mig.attempt, r.index, mig.prompt_ids.tolist(), mig.max_tokens,
                                 mig.seed + r.index, r.token_ids.tolist(), r.logprobs.tolist()))  # fmt: skip

    def cancel(self, group: int, attempt: int, now: float) -> None:
        self.pending = [p for p in self.pending if p[:2] != (group, attempt)]

    def advance(self, now: float) -> None:  # one request per call: the worker's loop stays responsive
        if self.pending and self.version is not None:
            group, attempt, index, prompt, max_tokens, seed, done, lps = self.pending.pop(0)
            more, more_lps = my_generate(prompt + done, max_tokens - len(done), seed)
            self.tokens_generated += len(more)
            self.finished.append((group, attempt, index, done + more, lps + more_lps, self.version))

    def take_finished(self) -> list:
        out, self.finished = self.finished, []
        return out

    def next_event_s(self) -> float | None:
        return 0.0 if self.pending else None

    def result(self, sample: tuple, broker_epoch: int) -> m.SampleFinished:
        group, attempt, index, tokens, lps, version = sample
        return m.SampleFinished(group_id=group, attempt=attempt, index=index,
                                segments=np.array([[version, len(tokens)]], np.int32),
                                token_ids=np.array(tokens, np.int32), logprobs=np.array(lps, np.float32),
                                reward=float(len(tokens) % 2), finish=Finish.STOP,
                                broker_epoch=broker_epoch)  # fmt: skip

    def load(self) -> tuple[int, float]:
        return len(self.pending), min(1.0, len(self.pending) / 64)

    def clear(self) -> None:
        self.pending.clear()
        self.finished.clear()


async def serve(cfg: RunConfig, broker: str, name: str) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ctx = zmq.asyncio.Context()
    try:
        actor = RolloutActor(cfg, ctx, lambda: resolve_endpoint(broker), name, MyEngine(), clock=loop.time)
        return await actor.run(stop)
    finally:
        ctx.destroy(linger=0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--broker", required=True)
    p.add_argument("--config")
    p.add_argument("--name", default=f"custom-{os.getpid()}")
    args = p.parse_args()
    try:
        cfg = load(RunConfig, path=args.config, env=os.environ)
    except ConfigError as e:
        print(f"custom_engine: {e}", file=sys.stderr)
        return 2
    configure_logging(cfg.log, process="rollout", worker_id=args.name)
    return uvloop.run(serve(cfg, args.broker, args.name))


if __name__ == "__main__":
    raise SystemExit(main())
