"""Timing model of one inference-engine replica (one rollout worker, i.e. one DP group).

Continuous batching in lockstep: every *running* request gains one token per decode step, and one
step takes ``tpot_base_s + tpot_per_seq_s * running`` seconds (see ``dora.config.sim.EngineTiming``).
Memory-bound decode is nearly flat in batch size, which is what makes a lone straggler expensive.

- At most ``max_slots`` requests run at once, and their KV cache (prompt + generated tokens of every
  running request) must fit in ``kv_budget_tokens``. Requests beyond that wait, in arrival order;
  one is admitted only if 1% of the cache stays free after it (vLLM's admission watermark).
- KV grows by one token per running request per step. When the next step would not fit, the latest
  arrival is preempted (its KV dropped, as vLLM's recompute preemption does) and goes back to the
  front of the queue; it must re-prefill prompt + generated tokens when it runs again.
- Admitting a request costs a prefill of its prompt (plus its generated prefix when its KV was lost:
  preemption, a weight swap in ``partial`` mode, a migration without KV transfer). Prefill is
  returned as *tokens*; the simulator turns them into time during which this engine does not decode.

Progress is kept as one float counter of decode steps: a running request that started at counter
``c0`` with ``g0`` tokens already generated has ``g0 + (counter - c0)`` tokens, so advancing the engine
is O(1) and finishing a request O(log n) (a heap keyed by the counter at which it completes).
Each request also records which weights generated which of its tokens, so C1 can be checked later.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

EPS = 1e-6


@dataclass(slots=True, eq=False)
class Request:
    group_id: int
    attempt: int
    index: int
    length: int
    """Output tokens this sample will have when it finishes."""
    prompt_len: int
    generated: float = 0.0
    """Tokens generated so far; authoritative while the request is not running."""
    offset: float = 0.0
    """While running: generated = engine.counter - offset."""
    closed: list[list[int]] = field(default_factory=list)
    """Finished runs of the version history: [[version, tokens], ...]."""
    open_version: int | None = None
    open_at: float = 0.0
    has_kv: bool = False
    """The engine holding it has its KV cache (no prefill needed to resume)."""
    arrival: int = -1
    """Priority on its engine, fixed when it first arrives there: preemption takes the latest arrival,
    so a resumed request keeps its place (as vLLM does) instead of being preempted again and again."""
    seq: int = 0
    """Heap entry of its current run (changes every time it is admitted)."""

    def close_segment(self, generated: float) -> None:
        if self.open_version is not None:
            n = round(generated - self.open_at)
            if n > 0:
                if self.closed and self.closed[-1][0] == self.open_version:
                    self.closed[-1][1] += n
                else:
                    self.closed.append([self.open_version, n])
        self.open_version = None
        self.open_at = generated

    def segments(self) -> tuple[tuple[int, int], ...]:
        return tuple((v, n) for v, n in self.closed)

    @property
    def context(self) -> float:
        """KV tokens the request holds (exact, so admission and preemption agree with the KV account)."""
        return self.prompt_len + self.generated


class Engine:
    """Running and waiting requests of one replica. Pure bookkeeping: the caller owns time."""

    def __init__(self, max_slots: int, kv_budget_tokens: int, kv_watermark: float = 0.01) -> None:
        self.max_slots = max_slots
        self.kv_budget = kv_budget_tokens
        self.watermark = kv_watermark * kv_budget_tokens
        """KV kept free when admitting (vLLM's block-manager watermark, 1%): without it a full cache
        admits a request only to preempt it one step later."""
        self.counter = 0.0
        self.version: int | None = None
        self.running: dict[int, Request] = {}
        self._heap: list[tuple[float, int, Request]] = []
        self._latest: list[tuple[int, int, Request]] = []
        """Max-heap (negated arrival) of running requests: the preemption victim in O(log n)."""
        self.waiting: deque[Request] = deque()
        self._kv_const = 0.0
        """sum(prompt_len - offset) over running requests: kv_used = _kv_const + n * counter."""
        self._seq = itertools.count()
        self._arrivals = itertools.count()
        self.preemptions = 0

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        return len(self.running) + len(self.waiting)

    def requests(self) -> list[Request]:
        return [*self.running.values(), *self.waiting]

    def kv_used(self) -> float:
        return self._kv_const + len(self.running) * self.counter

    def _room(self) -> float:
        """KV tokens left after the next decode step (each running sequence adds one)."""
        return self.kv_budget - self.kv_used() - len(self.running)

    def steps_to_next(self) -> float | None:
        """Decode steps until the next request finishes or the KV cache overflows; None if idle."""
        self._clean_heap()
        if not self._heap:
            return None
        finish = self._heap[0][0] - self.counter
        n = len(self.running)
        if n > 1:  # settle() leaves room > EPS, so this is a strictly positive time
            finish = min(finish, self._room() / n)
        return max(finish, 0.0)

    # ------------------------------------------------------------------ changes

    def submit(self, reqs: list[Request], *, front: bool = False) -> int:
        """Queue requests; returns prompt/prefix tokens to prefill for those admitted now."""
        for r in reqs:
            r.arrival = next(self._arrivals)
        if front:
            self.waiting.extendleft(reversed(reqs))
        else:
            self.waiting.extend(reqs)
        return self._admit()

    def advance(self, steps: float) -> None:
        self.counter += steps

    def settle(self) -> tuple[list[Request], int]:
        """Finish what is done, preempt on KV overflow, admit what fits. Returns (finished, prefill tokens)."""
        done: list[Request] = []
        while True:
            self._clean_heap()
            if not self._heap or self._heap[0][0] > self.counter + EPS:
                break
            _, _, r = heapq.heappop(self._heap)
            self._stop(r)
            r.generated = float(r.length)
            r.close_segment(r.generated)
            done.append(r)
        while len(self.running) > 1 and self._room() <= EPS:
            victim = self._pop_latest()
            self._stop(victim)
            victim.has_kv = False
            self.waiting.appendleft(victim)
            self.preemptions += 1
        return done, self._admit()

    def run_for(self, steps: float) -> tuple[list[Request], int]:
        """Decode ``steps`` steps, stopping at every finish and KV boundary on the way (so each stretch
        runs at a constant batch size). Returns (finished requests, prefill tokens incurred)."""
        done: list[Request] = []
        prefill = 0
        left = steps
        while self.running and left > 0:
            nxt = self.steps_to_next()
            step = left if nxt is None else min(left, nxt)
            self.advance(step)
            left -= step
            finished, tokens = self.settle()
            done += finished
            prefill += tokens
            if step <= 0 and not finished:
                break
        return done, prefill

    def remove(self, group_id: int, attempt: int) -> list[Request]:
        """Take a group's requests out (cancel or export); their version history is closed."""
        out = []
        for r in [r for r in self.running.values() if (r.group_id, r.attempt) == (group_id, attempt)]:
            self._stop(r)
            out.append(r)
        keep = deque()
        for r in self.waiting:
            (out if (r.group_id, r.attempt) == (group_id, attempt) else keep).append(r)
        self.waiting = keep
        for r in out:
            r.close_segment(r.generated)
        return out

    def clear(self) -> None:
        self.running.clear()
        self._heap.clear()
        self._latest.clear()
        self.waiting.clear()
        self._kv_const = 0.0

    def swap_weights(self, version: int) -> int:
        """Load ``version`` under the current requests (partial mode); returns tokens to re-prefill."""
        self.version = version
        tokens = 0
        for r in self.running.values():
            r.generated = self.counter - r.offset
            r.close_segment(r.generated)
            r.open_version = version
            tokens += round(r.context)  # the KV cache of the old weights is useless under the new ones
        for r in self.waiting:
            r.close_segment(r.generated)  # resumes under the new version when admitted again
            r.has_kv = False
        return tokens

    # ------------------------------------------------------------------ internals

    def _admit(self) -> int:
        prefill = 0
        while self.waiting and len(self.running) < self.max_slots:
            r = self.waiting[0]
            if self.running and self._room() - r.context - 1 <= self.watermark + EPS:
                break
            self.waiting.popleft()
            if not r.has_kv:
                prefill += round(r.context)
                r.has_kv = True
            r.seq = next(self._seq)
            r.offset = self.counter - r.generated
            if r.open_version is None:
                r.open_version = self.version
                r.open_at = r.generated
            self.running[id(r)] = r
            self._kv_const += r.prompt_len - r.offset
            heapq.heappush(self._heap, (r.offset + r.length, r.seq, r))
            heapq.heappush(self._latest, (-r.arrival, r.seq, r))
        return prefill

    def _stop(self, r: Request) -> None:
        """Take a running request out of the batch, keeping its progress."""
        del self.running[id(r)]
        self._kv_const -= r.prompt_len - r.offset
        r.generated = min(float(r.length), self.counter - r.offset)

    def _pop_latest(self) -> Request:
        while True:
            _, seq, r = heapq.heappop(self._latest)
            if self.running.get(id(r)) is r and r.seq == seq:
                return r

    def _clean_heap(self) -> None:
        """Drop heap entries of requests that stopped running (or were re-admitted under a newer entry)."""
        heap = self._heap
        while heap:
            _, seq, r = heap[0]
            if self.running.get(id(r)) is r and r.seq == seq:
                return
            heapq.heappop(heap)
