"""Timing model of one inference-engine replica (one rollout worker, i.e. one DP group).

Continuous batching in lockstep: every *running* request gains one token per decode step, and one
step takes ``tpot_scale * (tpot_base_s + tpot_per_seq_s * running)`` seconds (``decode_step_s``; ``[engine]``,
``dora.config.sim.EngineSection``, holds the numbers).
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

Agentic episodes (``Request.ends``): a request that ends a turn leaves the batch and is *parked* while
its tool call runs (the caller owns that clock and calls ``resume``): it holds no decode slot, so the
other sequences decode on, but it stays in the engine (its lease holds). With ``keep_kv`` its KV cache
stays cached (prefix caching): it takes no room from running sequences, which evict parked caches,
oldest first, when running + cached KV would exceed the budget. On resume the tool's observation
tokens are prefilled, and the whole context too if its cache is gone (``keep_kv = False``, evicted, a
weight swap in ``partial``). A resumed turn queues behind the waiting requests, as a new request would.

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

from dora.config.sim import EngineSection
from dora.ids import WorkerId

EPS = 1e-6


def decode_step_s(engine: EngineSection, running: int) -> float:
    """Seconds of one decode step of a replica running ``running`` sequences."""
    return engine.tpot_scale * (engine.tpot_base_s + engine.tpot_per_seq_s * running)


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
    """Heap entry of its current run (changes every time it is admitted or parked)."""
    ends: tuple[int, ...] = ()
    """Agentic episode: tokens generated at the end of each turn (the last is ``length``); () = one turn."""
    observations: tuple[int, ...] = ()
    """Tokens each tool result appends to the context, one per turn but the last."""
    tools_s: tuple[float, ...] = ()
    """Seconds of each tool call, one per turn but the last (the caller's clock)."""
    turn: int = 0
    """The turn being generated; while waiting on a tool, the next one."""
    waiting_tool: bool = False
    """Between two turns: its tool call runs; it holds its lease but no decode slot."""
    tool_back: bool = False
    """Its tool result came while no engine held it (a migration in transit): the next engine resumes it."""
    fresh: int = 0
    """Context tokens added since its KV was built (tool results): prefilled on admission even with KV."""
    holder: WorkerId | None = None
    """The worker holding it (set by the simulator's world, which routes tool results there)."""
    version: int | None = None
    """The version it runs under on a multi-version engine (its adapter); None: the engine's loaded version."""

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

    @property
    def turn_end(self) -> int:
        """Tokens it will have generated when its current turn ends."""
        return self.ends[self.turn] if self.ends else self.length

    def segments(self) -> tuple[tuple[int, int], ...]:
        return tuple((v, n) for v, n in self.closed)

    @property
    def context(self) -> float:
        """KV tokens the request holds (exact, so admission and preemption agree with the KV account)."""
        return self.prompt_len + self.generated


class Engine:
    """Running and waiting requests of one replica. Pure bookkeeping: the caller owns time."""

    def __init__(
        self, max_slots: int, kv_budget_tokens: int, kv_watermark: float = 0.01, *, keep_kv: bool = True
    ) -> None:
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
        self.keep_kv = keep_kv
        """A parked episode keeps its KV cache (until running sequences need the room)."""
        self.parked: dict[int, Request] = {}
        """Episodes waiting on a tool call, by id."""
        self.parked_kv = 0.0
        """KV tokens cached for parked episodes."""
        self._cached: deque[tuple[int, Request]] = deque()
        """(seq, request) of parked episodes with a cache, oldest first (stale entries are skipped)."""
        self.turn_ends: list[Request] = []
        """Episodes parked since the caller last took them (``take_turn_ends``): their tool calls start now."""
        self.evictions = 0
        self.resume_prefill = 0
        """Context tokens re-prefilled because an episode resumed without its KV cache."""

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.parked)

    def requests(self) -> list[Request]:
        return [*self.running.values(), *self.waiting, *self.parked.values()]

    def is_parked(self, r: Request) -> bool:
        return self.parked.get(id(r)) is r

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
        if self.parked_kv:  # running sequences reach the parked caches: the next one is evicted then
            finish = min(finish, (self._room() - self.parked_kv) / n)
        return max(finish, 0.0)

    # ------------------------------------------------------------------ changes

    def submit(self, reqs: list[Request], *, front: bool = False) -> int:
        """Queue requests; returns prompt/prefix tokens to prefill for those admitted now. Episodes waiting
        on a tool (migrated between turns) are parked, or resumed if their result already came."""
        if any(r.waiting_tool for r in reqs):
            between = [r for r in reqs if r.waiting_tool]
            reqs = [r for r in reqs if not r.waiting_tool]
            for r in between:
                if r.tool_back:
                    self._resume(r)
                else:
                    self._park(r)
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
            if r.turn < len(r.ends) - 1:  # a turn ended: the episode waits on its tool call
                r.generated = float(r.turn_end)
                r.close_segment(r.generated)
                r.turn += 1
                r.waiting_tool = True
                self._park(r)
                self.turn_ends.append(r)
                continue
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

    def resume(self, r: Request) -> int:
        """A parked episode's tool result is in: it queues for its next turn. Returns prefill tokens."""
        self._unpark(r)
        self._resume(r)
        return self._admit()

    def admit(self) -> int:
        """Admit waiting requests that now fit (after ``remove`` freed room); returns prefill tokens."""
        return self._admit()

    def take_turn_ends(self) -> list[Request]:
        out, self.turn_ends = self.turn_ends, []
        return out

    def remove(self, group_id: int, attempt: int) -> list[Request]:
        """Take a group's requests out (cancel or export); their version history is closed."""
        out = [r for r in self.parked.values() if (r.group_id, r.attempt) == (group_id, attempt)]
        for r in out:
            self._unpark(r)
        for r in [r for r in self.running.values() if (r.group_id, r.attempt) == (group_id, attempt)]:
            self._stop(r)
            out.append(r)
        keep: deque[Request] = deque()
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
        self.parked.clear()
        self._cached.clear()
        self.parked_kv = 0.0
        self.turn_ends.clear()

    def drop_kv(self) -> int:
        """Every cache is dropped (the accelerator's memory goes to another use); returns the tokens the
        running requests must re-prefill. Waiting and parked requests re-prefill when admitted."""
        tokens = sum(round(r.prompt_len + self.counter - r.offset) for r in self.running.values())
        for r in self.waiting:
            r.has_kv = False
        for r in self.parked.values():
            r.has_kv = False
        self.parked_kv = 0.0
        self._cached.clear()
        return tokens

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
        for r in self.parked.values():  # its next turn runs on the new weights, after a full re-prefill
            r.has_kv = False
        self.parked_kv = 0.0
        self._cached.clear()
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
            elif r.fresh:
                prefill += r.fresh
            r.fresh = 0
            r.seq = next(self._seq)
            r.offset = self.counter - r.generated
            if r.open_version is None:
                r.open_version = self.version if r.version is None else r.version
                r.open_at = r.generated
            self.running[id(r)] = r
            self._kv_const += r.prompt_len - r.offset
            heapq.heappush(self._heap, (r.offset + r.turn_end, r.seq, r))
            heapq.heappush(self._latest, (-r.arrival, r.seq, r))
        if self.parked_kv:
            self._evict()
        return prefill

    def _park(self, r: Request) -> None:
        r.seq = next(self._seq)
        self.parked[id(r)] = r
        if not self.keep_kv:
            r.has_kv = False
        if r.has_kv:
            self.parked_kv += r.context
            self._cached.append((r.seq, r))
            if len(self._cached) > 2 * len(self.parked) + 64:
                self._cached = deque(e for e in self._cached if self._caches(*e))

    def _unpark(self, r: Request) -> None:
        del self.parked[id(r)]
        if r.has_kv:
            self.parked_kv -= r.context
        if not self.parked:
            self.parked_kv = 0.0

    def _resume(self, r: Request) -> None:
        """Append its tool result and queue its next turn behind the waiting requests."""
        if not r.has_kv:
            self.resume_prefill += round(r.context)
        obs = r.observations[r.turn - 1] if r.observations else 0
        r.prompt_len += obs
        r.fresh += obs
        r.waiting_tool = r.tool_back = False
        r.arrival = next(self._arrivals)
        self.waiting.append(r)

    def _caches(self, seq: int, r: Request) -> bool:
        return self.is_parked(r) and r.seq == seq and r.has_kv

    def _evict(self) -> None:
        """Drop parked caches, oldest first, while the next decode step would not fit beside them."""
        while self._cached and self._room() - self.parked_kv <= EPS:
            seq, r = self._cached.popleft()
            if self._caches(seq, r):
                r.has_kv = False
                self.parked_kv -= r.context
                self.evictions += 1
        if not self._cached:
            self.parked_kv = 0.0

    def _stop(self, r: Request) -> None:
        """Take a running request out of the batch, keeping its progress."""
        del self.running[id(r)]
        self._kv_const -= r.prompt_len - r.offset
        r.generated = min(float(r.turn_end), self.counter - r.offset)

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
