"""Samples from every worker's requests gathered into batches for one scorer, with the batch sizes counted.

Each HTTP request (one worker's micro-batch) queues its samples; one scoring thread takes up to ``batch_size`` of
them, waiting at most ``wait_s`` from the oldest one's arrival for more, and scores them in one call. So the
samples of several workers share a forward, and one worker's large request is split into batches of the size
the model is given. What the scorer raises is that batch's samples' error (answered to their callers), never the
end of the process.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

log = structlog.get_logger()

Score = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]
"""A batch of reward service requests -> one result each, in order, without its id: ``{"components": {...}}`` or
``{"error": "..."}``."""


@dataclass(slots=True)
class _Waiting:
    request: dict[str, Any]
    arrived_s: float
    future: concurrent.futures.Future[dict[str, Any]] = field(default_factory=concurrent.futures.Future)


class Batcher:
    """The queue of samples waiting to be scored and the thread that scores them (see the module docstring)."""

    def __init__(self, score: Score, *, batch_size: int, wait_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.score, self.batch_size, self.wait_s, self.clock = score, batch_size, wait_s, clock
        self._cond = threading.Condition()
        self._queue: collections.deque[_Waiting] = collections.deque()
        self._closed = False
        self._sizes = collections.Counter[int]()
        self._counts = {"requests": 0, "samples": 0, "batches": 0, "errors": 0, "score_s": 0.0}

    def submit(self, requests: list[dict[str, Any]]) -> list[concurrent.futures.Future[dict[str, Any]]]:
        """Queue one HTTP request's samples; each future holds that sample's result."""
        now = self.clock()
        waiting = [_Waiting(r, now) for r in requests]
        with self._cond:
            if self._closed:
                raise RuntimeError("the reward server is stopping")
            self._queue.extend(waiting)
            self._counts["requests"] += 1
            self._cond.notify()
        return [w.future for w in waiting]

    def run(self) -> None:
        """The scoring loop, on its own thread, until ``close`` (what is queued then is still scored)."""
        while (batch := self._next_batch()) is not None:
            start = self.clock()
            try:
                results = self.score([w.request for w in batch])
                if len(results) != len(batch):
                    raise RuntimeError(f"the scorer answered {len(results)} results for {len(batch)} samples")
            except Exception as e:  # one batch's failure (a text too long, out of memory) is its samples' error
                log.warning("reward_batch_failed", size=len(batch), error=f"{type(e).__name__}: {e}"[:300])
                results = [{"error": f"dora reward: {type(e).__name__}: {str(e)[:200]}"}] * len(batch)
            took_s = self.clock() - start
            with self._cond:
                self._sizes[len(batch)] += 1
                self._counts["batches"] += 1
                self._counts["samples"] += len(batch)
                self._counts["errors"] += sum("error" in r for r in results)
                self._counts["score_s"] += took_s
            log.debug("reward_batch", size=len(batch), took_ms=round(took_s * 1000, 1))
            for w, result in zip(batch, results, strict=True):
                w.future.set_result(result)

    def _next_batch(self) -> list[_Waiting] | None:
        """Up to ``batch_size`` samples, once the batch is full or its oldest has waited ``wait_s``; None when closed
        with nothing queued."""
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if not self._queue:
                return None
            while len(self._queue) < self.batch_size and not self._closed:
                left = self._queue[0].arrived_s + self.wait_s - self.clock()
                if left <= 0:
                    break
                self._cond.wait(left)
            return [self._queue.popleft() for _ in range(min(self.batch_size, len(self._queue)))]

    def close(self) -> None:
        """Score what is queued, then end ``run``."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def stats(self) -> dict[str, Any]:
        """HTTP requests and samples taken, batches scored and how many of each size, samples answered an error,
        and the seconds spent scoring."""
        with self._cond:
            out: dict[str, Any] = dict(self._counts)
            out["batch_sizes"] = {str(size): n for size, n in sorted(self._sizes.items())}
        out["batch_size_max"] = max(map(int, out["batch_sizes"]), default=0)
        out["batch_size_mean"] = out["samples"] / out["batches"] if out["batches"] else 0.0
        return out
