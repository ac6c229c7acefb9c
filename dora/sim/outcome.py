"""What one simulated run measures: each train step, the fleet's time integrals, the counts the driver keeps,
each worker's timeline, and the ``Outcome`` that gathers them for ``dora.sim.metrics``."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from dora.ids import Mode, WorkerId


@dataclass(slots=True)
class StepRecord:
    step: int
    delivered_s: float
    published_s: float = 0.0
    tokens: int = 0
    """Prompt + response tokens trained (plus tool observations, for agentic episodes)."""
    response_tokens: int = 0
    episodes: int = 0
    turns: int = 0
    """Assistant turns of the batch's episodes (multi-turn workloads; 0 otherwise)."""
    bubble: float = 0.0
    """(max - mean) / max of the batch's response lengths."""
    train_s: float = 0.0
    """Seconds the trainer computed on the batch (the role switch and the publish not counted)."""
    kv_token_steps: float = 0.0
    """The least KV its samples held over their decode steps (``dora.sim.bounds.kv_token_steps``; an episode as
    one sample of all its turns, its tool results left out)."""


@dataclass(slots=True)
class Totals:
    """Time integrals, sampled at every step boundary so a steady-state window can be cut out."""

    t: float = 0.0
    rollout_active_s: float = 0.0
    rollout_only_s: float = 0.0
    trainer_busy_s: float = 0.0
    slot_s: float = 0.0
    """Integral of running sequences over time (all workers)."""
    capacity_s: float = 0.0
    """Integral of (workers x max_slots) over the time rollout could run."""
    tool_wait_s: float = 0.0
    """Integral of episodes waiting on a tool call over time (all workers)."""
    busy_worker_s: float = 0.0
    """Integral of workers decoding over time."""

    def minus(self, other: Totals) -> Totals:
        return Totals(*(getattr(self, f) - getattr(other, f) for f in Totals.__slots__))


@dataclass(slots=True)
class Counts:
    """What the driver counts as the run goes, beside the core's own totals; an ``Outcome`` carries them."""

    yields: int = 0
    """Times an elastic worker yielded its accelerators to the trainer."""
    loads: int = 0
    """Versions loaded by workers (``Pin``s; resumes after a yield not counted)."""
    load_s: float = 0.0
    """Seconds of those loads, summed over workers."""
    load_bytes: float = 0.0
    """Bytes workers received for them (adapters with LoRA, full weights otherwise)."""
    keeping_assigns: int = 0
    """Loads of a multi-version worker that kept older versions beside the new one (groups of them ran there)."""
    max_versions_held: int = 1
    """Most versions one worker held at once."""
    tokens_decoded_while_loading: float = 0.0
    """Tokens workers decoded while they loaded a version (only multi-version workers can)."""
    max_live_versions: int = 1
    """Most versions alive at once."""
    decision_s: float = 0.0
    """Wall-clock seconds the core took deciding, over the whole run (what orchestration costs at this fleet
    size, measured on the production core)."""


@dataclass(slots=True, kw_only=True)
class Outcome(Counts):
    """Everything one simulated run measured; ``dora.sim.metrics`` turns it into the reported numbers."""

    mode: Mode
    staleness_bound: int
    placement: str
    rollout_workers: int
    trainer_gpus: int
    elastic_workers: int
    wall_s: float
    steps: list[StepRecord]
    totals_at_step: list[Totals]
    """Totals at the end of every step (index i = after step i)."""
    staleness: Counter[int]
    c1_violations: int
    mixed_version_trajectories: int
    trained: list[int]
    dropped_lengths: list[int]
    trained_lengths: list[int]
    groups_dispatched: int
    groups_in_flight: int
    migrated_groups: int
    migrated_requests: int
    reprefill_tokens: int
    requeued: int
    rebalances: int
    worker_moves: int
    preemptions: int
    groups_filtered: int = 0
    """Groups consumed as filtered (every reward equal, ``core.filter_uniform``): generated, never trained."""
    filtered_tokens: int = 0
    """Response tokens of those groups: decoded for nothing (what refilling costs)."""
    resume_prefill_tokens: int = 0
    """Context re-prefilled because an episode resumed after a tool call without its KV cache."""
    kv_evictions: int = 0
    """Parked episodes' KV caches evicted for running sequences."""
    timeline: dict[str, list[tuple[float, float, int, str]]] = field(default_factory=dict)


@dataclass(slots=True)
class Occupancy:
    """What the fleet holds now, per worker and summed over workers: what ``Totals`` integrate over time."""

    running: dict[WorkerId, int] = field(default_factory=dict)
    """Sequences each worker decodes (0 while it does not decode)."""
    parked: dict[WorkerId, int] = field(default_factory=dict)
    """Episodes waiting on a tool call on each worker."""
    serving: dict[WorkerId, bool] = field(default_factory=dict)
    """Whether each worker is alive and holds its accelerators (not yielded to the trainer)."""
    n_running: int = 0
    n_busy: int = 0
    """Workers decoding."""
    n_parked: int = 0
    n_serving: int = 0

    def update(self, worker: WorkerId, running: int, parked: int, serving: bool) -> None:
        old = self.running.get(worker, 0)
        self.n_running += running - old
        self.n_busy += (running > 0) - (old > 0)
        self.running[worker] = running
        self.n_parked += parked - self.parked.get(worker, 0)
        self.parked[worker] = parked
        self.n_serving += serving - self.serving.get(worker, False)
        self.serving[worker] = serving


@dataclass(slots=True)
class Timeline:
    """Each worker's states over time, for the plots: spans of (start_s, end_s, version, state)."""

    spans: dict[str, list[tuple[float, float, int, str]]] = field(default_factory=dict)
    _open: dict[WorkerId, tuple[float, int, str]] = field(default_factory=dict)
    """Each worker's current state, since when."""

    def note(self, worker: WorkerId, now: float, version: int, state: str) -> None:
        """The worker is in ``state`` under ``version`` at ``now``; a change closes the span before it."""
        current = self._open.get(worker)
        if current is None or current[1:] != (version, state):
            self.close(worker, now)
            self._open[worker] = (now, version, state)

    def close(self, worker: WorkerId, now: float) -> None:
        """The worker's current span ends at ``now`` (an empty one is left out)."""
        current = self._open.get(worker)
        if current is not None and now > current[0]:
            self.spans.setdefault(worker, []).append((current[0], now, current[1], current[2]))
