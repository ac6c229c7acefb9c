"""Lease reconciliation: what a worker says it holds against what the core thinks it holds.

Links lose messages (a broker restart, a reconnect, a chaos proxy). Each rollout heartbeat carries the
highest command number the worker saw, the (group, attempt) leases it holds and the version it serves
or is loading. From that, one function mends each kind of loss:
- a lease whose command the worker saw go by but does not hold was lost: the core re-queues the group
  whole (``LeaseLost``; C2 holds because the group is re-run, never dropped);
- a void lease the worker still works on gets its ``Cancel`` again;
- a lost ``MigrateOut``, ``Assign``, ``Yield`` or ``Resume`` is sent again;
- a lost ``WeightsLoaded`` or ``Yielded`` is taken from the heartbeat.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from dora.broker.links import Peer
from dora.core import events as ev
from dora.core.core import Core
from dora.core.view import WorkerState
from dora.ids import AttemptId, GroupId, WorkerId
from dora.wire import messages as m

log = structlog.get_logger()


def reconcile(
    core: Core,
    peer: Peer,
    hb: m.Heartbeat,
    *,
    command: Callable[[WorkerId, Any], None],
    feed: Callable[[ev.Event], Any],
    counters: Counter[str],
) -> None:
    """Compare what a worker (``peer``) says it holds with the core's view, and
    mend what a lost message broke: core events go to ``feed``, commands sent again to ``command``."""
    w = WorkerId(peer.identity.decode())
    if core.view.worker(w) is None:
        return
    mend = Mend(peer, hb, command, feed, counters)
    worker = mend.leases(core, w)
    if worker.lending:
        mend.lending(w)
    elif not worker.yielded:
        mend.load(worker)


@dataclass(slots=True)
class Mend:
    """One heartbeat's mending: what the worker said (``hb``), what was sent to it (``peer``), and where events and
    commands go."""

    peer: Peer
    hb: m.Heartbeat
    command: Callable[[WorkerId, Any], None]
    feed: Callable[[ev.Event], Any]
    counters: Counter[str]

    def leases(self, core: Core, w: WorkerId) -> WorkerState:
        """Leases lost on the way, void leases still worked on, and migrations whose command was lost; returns the
        worker as the core sees it after."""
        peer, hb = self.peer, self.hb
        worker = core.view.worker(w)
        assert worker is not None
        held = hb.held()
        current: set[tuple[int, int]] = {(int(g), int(a)) for g, a in worker.leases}
        for key in sorted(current - held):  # it saw the command go by, and holds nothing of it
            if peer.lease_seq.get(key, hb.seen + 1) <= hb.seen:
                self.counters["lease lost on the way"] += 1
                log.warning("lease_lost", group_id=key[0], attempt=key[1], seen=hb.seen)
                self.feed(ev.LeaseLost(worker_id=w, group_id=GroupId(key[0]), attempt=AttemptId(key[1])))
        worker = core.view.worker(w)
        assert worker is not None  # a lost lease re-queues its group; the worker stays
        current = {(int(g), int(a)) for g, a in worker.leases}
        peer.lease_seq = {k: v for k, v in peer.lease_seq.items() if k in current}
        for group, attempt in sorted(held - current):  # void leases it still works on: its Cancel was lost
            self.counters["cancel sent again"] += 1
            self.command(w, m.Cancel(group_id=GroupId(group), attempt=AttemptId(attempt)))
        for key, out in list(peer.migrate_out.items()):
            if not core.view.exporting(w, GroupId(key[0]), AttemptId(key[1])):
                del peer.migrate_out[key]  # answered (or the group moved on) in some other way
            elif key in held and out.seq <= hb.seen:
                self.counters["migrate_out sent again"] += 1
                self.command(w, out)
        return worker

    def lending(self, w: WorkerId) -> None:
        """A worker the core is lending to the trainer: its lost Yielded is taken, or its lost Yield sent again."""
        if self.hb.yielded:  # it yielded, and the Yielded was lost
            self.counters["yielded taken from a heartbeat"] += 1
            self.feed(ev.Lent(worker_id=w))
        elif self.peer.yield_cmd is not None and self.peer.yield_cmd.seq <= self.hb.seen:
            self.counters["yield sent again"] += 1
            self.command(w, self.peer.yield_cmd)

    def load(self, worker: WorkerState) -> None:
        """A worker pinned to a version it has not loaded (as the core sees it): the load it reports is taken, or
        the Assign or Resume it lost is sent again."""
        hb, peer = self.hb, self.peer
        w, pinned, assign, resume = worker.worker_id, worker.version, peer.assign, peer.resume
        resumed = resume is not None and resume.version == pinned and (assign is None or resume.seq > assign.seq)
        if pinned is None or worker.ready or (not resumed and (assign is None or assign.version != pinned)):
            return
        if hb.version == pinned and hb.loading < 0 and not hb.yielded:  # it loaded them; the WeightsLoaded was lost
            self.counters["weights_loaded taken from a heartbeat"] += 1
            self.feed(ev.VersionLoaded(worker_id=w, version=pinned))
        elif resumed and resume is not None and hb.yielded and resume.seq <= hb.seen:
            self.counters["resume sent again"] += 1
            self.command(w, resume)
        elif not resumed and assign is not None and pinned not in (hb.version, hb.loading) and assign.seq <= hb.seen:
            self.counters["assign sent again"] += 1
            self.command(w, assign)
