"""Version ledger: which policy versions exist, who serves them, and when their weights may go.

Lifecycle of a version ``v``::

    PUBLISHED --first worker pinned--> LIVE --a newer version goes live--> DRAINING --> RETIRED
        \\________________ superseded before any worker loaded it ________________/

- PUBLISHED: the learner wrote the weights; no rollout worker serves them yet.
- LIVE: the newest version that workers serve; new groups go here.
- DRAINING: superseded; its workers finish (or hand over) its groups and take no new main-stream work.
- RETIRED: not the newest, no worker pinned, and every group dispatched on it consumed by the learner.
  The ``Retire`` action lets the weight store delete the files. A retired version never comes back.

Failure semantics (the core's part of them; the actor handles sockets):
1. A result for an unknown worker, an unknown group or a stale attempt is refused and counted; the
   core's state does not change.
2. A lost worker's groups return to the queue whole, with a fresh attempt id at their next lease; the
   partial output is discarded, so the prompt is re-run, never dropped (C2).
3. A group re-run after a failure goes to the newest version that can take it and never to an older
   version than it had, so its deadline only moves later and the feasibility invariant is kept.
4. A broken invariant inside the core raises ``InvariantViolation``: that is a bug in this process,
   and the process must stop rather than train on bad data.

Multi-version workers (LoRA: a version is an adapter, and one engine holds several): besides the version it is
pinned to, a worker may keep older versions it was pinned to while groups of them still run on it (``keep``). A
kept version is as alive as a pinned one: it is not retired while any worker keeps it. A full-weight worker keeps
none.

Invariant kept here: at most K + 1 versions are not retired at any time (checked by ``check``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from enum import StrEnum

from dora.ids import WorkerId


class InvariantViolation(AssertionError):
    """The core's own state broke C1, C2, C3 or a structural invariant: a bug, never a user error."""


class VersionState(StrEnum):
    PUBLISHED = "published"
    LIVE = "live"
    DRAINING = "draining"
    RETIRED = "retired"


class Ledger:
    """Versions, worker pins and per-version unconsumed group counts. Pure: no I/O, no clock."""

    def __init__(self, max_staleness: int, initial_version: int = 0, *, bounded: bool = True) -> None:
        self.max_staleness = max_staleness
        self.bounded = bounded
        """Enforce the K + 1 live-version bound (off only for the drop_stale baseline, which has no admission bound)."""
        self.newest = initial_version
        self._state: dict[int, VersionState] = {initial_version: VersionState.PUBLISHED}
        self._pins: dict[WorkerId, int] = {}
        self._pinned: dict[int, dict[WorkerId, None]] = {}
        """version -> the workers pinned to it (in pin order), for versions with any: ``_pins`` inverted, so that
        nothing per event has to look at every worker."""
        self._kept: dict[WorkerId, set[int]] = {}
        """worker -> the older versions it still holds besides its pin (multi-version workers only)."""
        self._keepers: dict[int, dict[WorkerId, None]] = {}
        """version -> the workers keeping it (``_kept`` inverted)."""
        self._unconsumed: Counter[int] = Counter()
        """Unconsumed groups per dispatch version (a version with any is not retired)."""
        self._by_deadline: Counter[int] = Counter()
        """Unconsumed groups per deadline (the feasibility invariant's counts)."""

    # ------------------------------------------------------------------ queries

    def state(self, version: int) -> VersionState:
        return self._state.get(version, VersionState.RETIRED)

    def alive(self) -> list[int]:
        """Versions not retired, oldest first."""
        return sorted(self._state)

    def version_of(self, worker: WorkerId) -> int | None:
        return self._pins.get(worker)

    def workers_of(self, version: int) -> list[WorkerId]:
        return list(self._pinned.get(version, ()))

    def pinned_to(self, version: int) -> Collection[WorkerId]:
        """The workers pinned to ``version``: a live view, not to be kept across a pin or unpin."""
        return self._pinned.get(version, {}).keys()

    def kept_by(self, worker: WorkerId) -> frozenset[int]:
        """The versions ``worker`` keeps besides its pin."""
        return frozenset(self._kept.get(worker, ()))

    def holds(self, worker: WorkerId, version: int) -> bool:
        """Whether ``worker`` serves ``version``: pinned to it, or keeping it."""
        return self._pins.get(worker) == version or version in self._kept.get(worker, ())

    def keepers(self, version: int) -> Collection[WorkerId]:
        """The workers keeping ``version`` besides their pin: a live view."""
        return self._keepers.get(version, {}).keys()

    def pinned_versions(self) -> list[int]:
        """Versions at least one worker is pinned to, oldest first."""
        return sorted(self._pinned)

    def deadline_counts(self) -> dict[int, int]:
        """{deadline: unconsumed groups}."""
        return {d: n for d, n in self._by_deadline.items() if n}

    # ------------------------------------------------------------------ transitions

    def publish(self, version: int) -> None:
        if version != self.newest + 1:
            raise ValueError(f"version {version} published out of order; newest is {self.newest}")
        self._state[version] = VersionState.PUBLISHED
        self.newest = version

    def pin(self, worker: WorkerId, version: int) -> None:
        """``worker`` serves ``version`` from now on (loading counts: the pin moves when Pin is sent)."""
        if self.state(version) is VersionState.RETIRED:
            raise InvariantViolation(f"pinning {worker} to retired version {version}")
        self._unpin(worker)
        self._pins[worker] = version
        self._pinned.setdefault(version, {})[worker] = None

    def mark_loaded(self, version: int) -> None:
        """A worker finished loading ``version``: it goes LIVE and older LIVE versions start draining."""
        if self._state.get(version) is VersionState.PUBLISHED:
            self._state[version] = VersionState.LIVE
        if self._state.get(version) is VersionState.LIVE:
            for v, st in self._state.items():
                if v < version and st is VersionState.LIVE:
                    self._state[v] = VersionState.DRAINING

    def keep(self, worker: WorkerId, version: int) -> None:
        """``worker`` goes on serving ``version`` (groups of it run there) besides the version it is pinned to."""
        if self.state(version) is VersionState.RETIRED or self._pins.get(worker) in (None, version):
            raise InvariantViolation(f"{worker} cannot keep version {version} (pinned to {self._pins.get(worker)})")
        self._kept.setdefault(worker, set()).add(version)
        self._keepers.setdefault(version, {})[worker] = None

    def drop(self, worker: WorkerId, version: int) -> None:
        """Nothing of ``version`` runs on ``worker`` any more: it no longer keeps it."""
        kept = self._kept.get(worker)
        if kept is None or version not in kept:
            return
        kept.discard(version)
        if not kept:
            del self._kept[worker]
        del self._keepers[version][worker]
        if not self._keepers[version]:
            del self._keepers[version]

    def unpin(self, worker: WorkerId) -> None:
        """The worker is gone: it serves nothing, pinned or kept."""
        for version in sorted(self._kept.get(worker, ())):
            self.drop(worker, version)
        self._unpin(worker)

    def _unpin(self, worker: WorkerId) -> None:
        version = self._pins.pop(worker, None)
        if version is not None:
            workers = self._pinned[version]
            del workers[worker]
            if not workers:
                del self._pinned[version]

    def add_group(self, version: int, deadline: int) -> None:
        if self.state(version) is VersionState.RETIRED:
            raise InvariantViolation(f"group dispatched on retired version {version}")
        if not version <= deadline <= version + self.max_staleness:
            raise InvariantViolation(f"deadline {deadline} of a version-{version} group is outside [v, v + K]")
        self._unconsumed[version] += 1
        self._by_deadline[deadline] += 1

    def move_group(self, old: tuple[int, int], new: tuple[int, int]) -> None:
        """A group's (version, deadline) changes: a re-run on a newer version, or a deadline extended.
        Both only ever move later, which never breaks the feasibility invariant."""
        if new[0] < old[0] or new[1] < old[1]:
            raise InvariantViolation(f"group moved earlier ({old} -> {new})")
        self.remove_group(*old)
        self.add_group(*new)

    def remove_group(self, version: int, deadline: int) -> None:
        if self._unconsumed[version] <= 0 or self._by_deadline[deadline] <= 0:
            raise InvariantViolation(f"consuming a group of version {version}, deadline {deadline}, that has none")
        for counts, key in ((self._unconsumed, version), (self._by_deadline, deadline)):
            counts[key] -= 1
            if not counts[key]:
                del counts[key]

    def collect_retired(self) -> list[int]:
        """Retire every version that is superseded, unserved and fully consumed; return them, oldest first."""
        pinned, kept = self._pinned.keys(), self._keepers.keys()
        gone = [v for v in sorted(self._state)
                if v < self.newest and v not in pinned and v not in kept and not self._unconsumed[v]]  # fmt: skip
        for v in gone:
            del self._state[v]  # state() reports RETIRED for any version no longer held
        return gone

    def check(self) -> None:
        alive = self.alive()
        if self.bounded and len(alive) > self.max_staleness + 1:
            raise InvariantViolation(f"{len(alive)} versions alive {alive}, bound is K + 1 = {self.max_staleness + 1}")
        inverted: dict[int, set[WorkerId]] = {}
        for w, v in self._pins.items():
            inverted.setdefault(v, set()).add(w)
        if inverted != {v: set(ws) for v, ws in self._pinned.items()}:
            raise InvariantViolation("the workers pinned per version are out of date")
        for w, v in self._pins.items():
            if self.state(v) is VersionState.RETIRED:
                raise InvariantViolation(f"worker {w} pinned to retired version {v}")
        keepers: dict[int, set[WorkerId]] = {}
        for w, kept in self._kept.items():
            if not kept or w not in self._pins or self._pins[w] in kept:
                raise InvariantViolation(f"worker {w} keeps {sorted(kept)} pinned to {self._pins.get(w)}")
            for v in kept:
                keepers.setdefault(v, set()).add(w)
                if self.state(v) is VersionState.RETIRED:
                    raise InvariantViolation(f"worker {w} keeps retired version {v}")
        if keepers != {v: set(ws) for v, ws in self._keepers.items()}:
            raise InvariantViolation("the workers keeping each version are out of date")
        for v, n in self._unconsumed.items():
            if n and self.state(v) is VersionState.RETIRED:
                raise InvariantViolation(f"retired version {v} still has {n} unconsumed groups")
