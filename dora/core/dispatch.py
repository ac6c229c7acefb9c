"""Dispatch: which group is leased next, on which version, with which deadline, and to which worker.

Re-runs (groups whose lease was lost) go first, to the newest version; their deadline only moves later, so
they need no admission check. Then fresh groups: those a restarted broker owes, then the prompt cursor, within
the prompt budget. Each fresh group gets the earliest deadline admission allows (``pick_deadline``; the
arithmetic is ``deadline.admits``) and goes to the ready worker of its version with the most free slots.
Fresh groups fill the newest version up to the watermark, or come a whole wave at a time (``waves``), or, in
dora mode with legacy fill, go into an idle worker of a middle version. A group consumed as filtered (all rewards
equal, ``filter_uniform``) frees its room at once and moves the prompt budget one id on, so the streaming modes
lease another in its place as admission allows; the wave modes owe a refill, leased first, outside the waves.

These are functions of the ``Scheduler``'s state: they choose, then call ``Scheduler.lease``. The lease, its
attempt id and the slot bookkeeping belong to the scheduler. What happens to a result is ``intake``'s.
"""

from __future__ import annotations

from dora.core import deadline
from dora.core.events import Outbox
from dora.core.scheduler import Scheduler
from dora.ids import Mode


def dispatch(sched: Scheduler, step: int, out: Outbox) -> None:
    """Lease re-runs first, then fresh groups, as far as admission, capacity and the mode allow."""
    newest = sched.ledger.newest
    G = sched.cfg.group_size
    # Re-runs go to the newest version; their deadline only moves later, so no admission check is needed.
    while sched.queue:
        worker = sched.pick_worker(newest, G)
        if worker is None:
            break
        flight = sched.next_rerun()
        sched.move(flight, newest, max(flight.deadline, newest + sched.first_offset))
        sched.lease(flight, worker, newest, out)
    if sched.queue:
        return
    if sched.cfg.waves:
        while sched.refill > 0 and budget_left(sched) and _fresh(sched, newest, step, out, wave=False):
            sched.refilled()
        if sched.wave_left == 0 and not sched.wave and budget_left(sched):
            sched.start_wave()
        while sched.wave_left > 0 and budget_left(sched):
            if not _fresh(sched, newest, step, out):
                break
            sched.waved()
        return
    watermark = sched.cfg.watermark
    while len(sched.flights) < watermark and budget_left(sched):
        if _fresh(sched, newest, step, out):
            continue
        if not (sched.cfg.mode is Mode.DORA and sched.cfg.legacy_fill and _legacy_fill(sched, step, out)):
            break


def budget_left(sched: Scheduler) -> bool:
    """Whether a fresh group may still be dispatched: the next one's id (an owed one's, else the cursor) is below
    the prompt budget, plus one for every group filtered. (Without filtering every owed id is below it.)"""
    budget = sched.cfg.prompt_budget
    if budget is None:
        return True
    if not sched.cfg.filter_uniform:
        return bool(sched.owed) or sched.cursor < budget
    return (sched.owed[0] if sched.owed else sched.cursor) < budget + sched.filtered


def pick_deadline(sched: Scheduler, version: int, step: int) -> int | None:
    """The earliest deadline in [v + first offset, v + horizon] that admission allows; None if none does."""
    last = version + sched.horizon
    if sched.cfg.drops_stale:
        return last
    counts = sched.ledger.deadline_counts()
    for d in range(max(version + sched.first_offset, step), last + 1):
        if deadline.admits(counts, step, sched.cfg.train_groups, d):
            return d
    return None


def _fresh(sched: Scheduler, version: int, step: int, out: Outbox, *, wave: bool = True) -> bool:
    """Lease one new group on ``version`` if admission and capacity allow."""
    d = pick_deadline(sched, version, step)
    if d is None:
        return False
    worker = sched.pick_worker(version, sched.cfg.group_size)
    if worker is None:
        return False
    flight = sched.open_group(wave=wave)
    sched.admit(flight, version, d)
    sched.lease(flight, worker, version, out)
    return True


def _legacy_fill(sched: Scheduler, step: int, out: Outbox) -> bool:
    """dora: one new group into an idle slot of a middle version whose deadline is not the next step."""
    alive = sched.ledger.alive()
    for version in reversed(alive[1:-1]):  # never the oldest, never the newest (handled above)
        if version + sched.cfg.staleness > step and _fresh(sched, version, step, out):
            return True
    return False
