"""The core's invariants, recomputed from scratch after every event in strict mode: the ledger's and the scheduler's
(``Ledger.check``, ``scheduler_checks``), the feasibility of the deadlines, every group owed counted once (C2), the
filter's caps, no running group on a retired version, and the elastic hand-over's state. A broken one raises
``InvariantViolation``.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol

from dora.config import CoreConfig
from dora.core import deadline, scheduler_checks
from dora.core.events import DeliverBatch
from dora.core.ledger import InvariantViolation, Ledger
from dora.core.scheduler import GroupState, Scheduler
from dora.core.transfer import TransferQueue
from dora.ids import WorkerId


class CoreState(Protocol):
    """What the checks read of the core (``Core`` is one)."""

    cfg: CoreConfig
    ledger: Ledger
    scheduler: Scheduler
    transfer: TransferQueue
    start_cursor: int
    filtered_before: int
    yielding: set[WorkerId]
    held: DeliverBatch | None
    """The batch taken for training whose workers' yield is awaited, or None."""

    @property
    def step(self) -> int: ...


def check(core: CoreState) -> None:
    """Recompute every structural invariant; raise InvariantViolation on the first broken one."""
    core.ledger.check()
    scheduler_checks.check(core.scheduler, placement=not core.cfg.in_flight_swap)
    counts = core.ledger.deadline_counts()
    if not core.cfg.drops_stale and not deadline.feasible(counts, core.step, core.cfg.train_groups):
        raise InvariantViolation(f"feasibility broken at step {core.step}: {counts}")
    owed = Counter[int]()
    k = core.cfg.staleness
    for f in core.scheduler.flights.values():
        owed[f.deadline] += 1
        if not f.version <= f.deadline <= f.version + k:
            raise InvariantViolation(f"group {f.group_id} of version {f.version}: deadline {f.deadline}, K {k}")
    for d, groups in core.transfer.pending_by_deadline().items():
        owed[d] += groups
    expect = {d: n for d, n in owed.items() if n}
    if expect != counts:
        raise InvariantViolation(f"ledger counts {counts} != groups owed {expect}")
    created = core.scheduler.cursor - core.start_cursor + core.scheduler.reissued
    tq = core.transfer
    held = len(tq.consumed) + len(core.scheduler.flights) + len(tq) + len(tq.dropped) + len(tq.filtered)
    if created != held:
        raise InvariantViolation(f"C2: {created} groups created, {held} accounted for")
    filtered = core.scheduler.filtered
    if filtered != core.filtered_before + len(tq.filtered):
        raise InvariantViolation(f"{filtered} groups counted filtered, {len(tq.filtered)} filtered here")
    if core.cfg.prompt_budget is not None and created > core.cfg.prompt_budget + filtered:
        raise InvariantViolation(f"{created} groups created, budget is {core.cfg.prompt_budget} + {filtered}")
    window = len(tq.filtered_by_step.get(core.step, ()))
    if any(len(ids) > core.cfg.filter_cap for ids in tq.filtered_by_step.values()) or (
        tq.uniform_waiting and window < core.cfg.filter_cap
    ):
        raise InvariantViolation(f"step {core.step} filtered {window} groups, cap {core.cfg.filter_cap}, "
                                 f"with {tq.uniform_waiting} uniform groups waiting")  # fmt: skip
    running = [f for f in core.scheduler.flights.values() if f.state is not GroupState.QUEUED]
    if any(f.version not in core.ledger.alive() for f in running):
        raise InvariantViolation("a running group's version is retired")
    workers = core.scheduler.workers
    if any(w not in workers or not workers[w].yielded for w in core.yielding):
        raise InvariantViolation(f"yielding {sorted(core.yielding)} includes a worker not told to yield")
    if (core.held is None) != (not core.yielding):
        raise InvariantViolation("a batch is held with no yield awaited, or a yield is awaited for no batch")
    if core.held is not None and core.held is not core.transfer.training[-1]:
        raise InvariantViolation("the held batch is not the one taken for training")
    steps = [b.step for b in core.transfer.training]
    if steps and (len(steps) > 2 or steps != list(range(core.step - len(steps), core.step))
                  or steps[0] != core.ledger.newest):  # fmt: skip
        raise InvariantViolation(f"batches in training {steps} at step {core.step}, newest {core.ledger.newest}")
