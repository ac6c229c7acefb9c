"""Transfer queue: finished groups wait here until a train batch takes them.

A batch for step ``s`` is exactly ``train_groups`` whole groups. It takes every group whose deadline
is ``s`` (waiting for them if they still run), then fills up earliest deadline (oldest version)
first, then in completion order, and only with a choice that keeps the feasibility invariant for
``s + 1`` (see ``deadline``). Staleness ``s - v`` is asserted per trajectory when the batch is
taken and recorded in a histogram; so is C1 (in ``partial`` mode, violations are counted instead,
since that baseline resumes requests on newer weights by design).

A delivered batch stays here until the learner publishes version ``s + 1``: if the learner is lost
before that, the same batch is delivered again, so a crash never drops or reshuffles a batch.

Filtering (``filter_uniform``): a finished group whose rewards are all equal waits here marked uniform, and
``filter`` consumes it as filtered, earliest deadline first, while step ``s`` has filtered fewer than its cap:
it leaves the unconsumed groups without a batch (it is never trained) and is recorded once, with the step
whose window it was filtered in (between taking batch ``s - 1`` and batch ``s``; the broker journals them
with batch ``s``). Past the cap a uniform group is an ordinary finished group: trained, never lost.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from dora.core import deadline
from dora.core.events import DeliverBatch, ReadyGroup
from dora.core.ledger import InvariantViolation
from dora.ids import GroupId


@dataclass(slots=True, frozen=True)
class Finished:
    group: ReadyGroup
    seq: int
    """Completion order."""
    uniform: bool = False
    """Its rewards are all equal (only looked for with ``filter_uniform``)."""


class TransferQueue:
    """Finished groups by deadline, batch assembly and the consumption-side invariant checks."""

    def __init__(
        self, train_groups: int, max_staleness: int, *, count_c1: bool, drop_stale: bool = False, start_step: int = 0
    ) -> None:
        self.train_groups = train_groups
        self.max_staleness = max_staleness
        self.count_c1 = count_c1
        """True in partial mode: mixed-version trajectories are counted, not refused."""
        self.step = start_step
        """s: the next step whose batch will be taken (= batches taken so far)."""
        self._by_deadline: dict[int, list[Finished]] = {}
        self._seq = 0
        self.training: list[DeliverBatch] = []
        """Batches taken and not yet completed by their publish, oldest first: one, or two while the learner trains
        batch ``s + 1`` as version ``s + 1`` is written (``Core._requested``)."""
        self.staleness = Counter[int]()
        """Trajectories consumed, by staleness u - v."""
        self.c1_violations = 0
        """Trajectories consumed whose tokens came from more than one version (partial mode)."""
        self.consumed: list[GroupId] = []
        self.drop_stale = drop_stale
        """drop_stale baseline: batches fill in completion order and over-stale groups are discarded."""
        self.dropped: list[ReadyGroup] = []
        self.filtered: list[GroupId] = []
        """Groups consumed as filtered (all rewards equal), never trained."""
        self.filtered_by_step: dict[int, list[GroupId]] = {}
        """step -> the groups filtered while it was the next step, until its batch is trained."""
        self._uniform = 0
        """Finished groups here marked uniform."""

    def __len__(self) -> int:
        return sum(len(q) for q in self._by_deadline.values())

    def add(self, group: ReadyGroup, *, uniform: bool = False) -> None:
        self._seq += 1
        d = group.deadline
        if d < self.step and not self.drop_stale:
            raise InvariantViolation(f"group {group.group_id} finished after its deadline {d} (step {self.step})")
        self._by_deadline.setdefault(d, []).append(Finished(group=group, seq=self._seq, uniform=uniform))
        self._uniform += uniform

    def filter(self, cap: int) -> list[ReadyGroup]:
        """Consume finished uniform groups as filtered, earliest deadline (then completion) first, while step ``s``
        has filtered fewer than ``cap``; return them (the caller takes them out of the unconsumed counts)."""
        gone: list[ReadyGroup] = []
        if not self._uniform or len(self.filtered_by_step.get(self.step, ())) >= cap:
            return gone  # (past the cap, on every event until the batch is taken: nothing to look at)
        window = self.filtered_by_step.setdefault(self.step, [])
        for d in sorted(self._by_deadline):
            if len(window) >= cap or not self._uniform:
                break
            queue = self._by_deadline[d]
            keep = []
            for f in queue:
                if f.uniform and len(window) < cap:
                    gone.append(f.group)
                    window.append(f.group.group_id)
                    self.filtered.append(f.group.group_id)
                    self._uniform -= 1
                else:
                    keep.append(f)
            self._by_deadline[d] = keep
        self._by_deadline = {d: q for d, q in self._by_deadline.items() if q}
        if not window:
            del self.filtered_by_step[self.step]
        return gone

    @property
    def uniform_waiting(self) -> int:
        """Finished groups here whose rewards are all equal (left past their step's cap)."""
        return self._uniform

    def pending_by_deadline(self) -> dict[int, int]:
        return {d: len(q) for d, q in self._by_deadline.items() if q}

    def waiting_on(self, counts: dict[int, int]) -> int:
        """Groups with deadline ``s`` that are still running (the batch must wait for them)."""
        return counts.get(self.step, 0) - len(self._by_deadline.get(self.step, ()))

    def expire(self) -> list[ReadyGroup]:
        """drop_stale only: discard finished groups that would exceed K at step ``s`` (they are lost)."""
        stale = [f for d, q in self._by_deadline.items() if d < self.step for f in q]
        gone = [f.group for f in stale]
        self._uniform -= sum(f.uniform for f in stale)
        self._by_deadline = {d: q for d, q in self._by_deadline.items() if d >= self.step}
        self.dropped.extend(gone)
        return gone

    def take(self, counts: dict[int, int]) -> DeliverBatch | None:
        """Assemble batch ``s`` if the rule allows; ``counts`` are all unconsumed groups by deadline."""
        B = self.train_groups
        if len(self) < B:
            return None
        picked: list[Finished] = []
        if self.drop_stale:  # the peer rule: first finished, first trained
            picked = sorted((f for q in self._by_deadline.values() for f in q), key=lambda f: f.seq)[:B]
        else:
            # Oldest first: earliest deadline, then completion order. Check the counts before building the batch.
            take = self._oldest_first()
            if not deadline.keeps_invariant_after(counts, self.step, B, take):
                return None
            for d, n in take.items():
                picked.extend(self._by_deadline[d][:n])
                self._by_deadline[d] = self._by_deadline[d][n:]
        if self.drop_stale:
            gone = {id(f) for f in picked}
            self._by_deadline = {d: [f for f in q if id(f) not in gone] for d, q in self._by_deadline.items()}
        self._by_deadline = {d: q for d, q in self._by_deadline.items() if q}
        self._uniform -= sum(f.uniform for f in picked)
        batch = DeliverBatch(step=self.step, groups=tuple(f.group for f in picked))
        self._consume(batch)
        self.training.append(batch)
        self.step += 1
        return batch

    def would_take(self, counts: dict[int, int]) -> bool:
        """Would ``take(counts)`` assemble a batch now? (It changes nothing.)"""
        if len(self) < self.train_groups:
            return False
        return self.drop_stale or deadline.keeps_invariant_after(counts, self.step, self.train_groups,
                                                                  self._oldest_first())  # fmt: skip

    def _oldest_first(self) -> dict[int, int]:
        """{deadline: groups} of the batch taken oldest first: the earliest deadlines' finished groups."""
        take: dict[int, int] = {}
        for d in sorted(self._by_deadline):
            take[d] = min(len(self._by_deadline[d]), self.train_groups - sum(take.values()))
        return take

    def _consume(self, batch: DeliverBatch) -> None:
        """Per-batch and per-trajectory assertions (exact size, whole groups, C1, C3), then the histogram."""
        if len(batch.groups) != self.train_groups:
            raise InvariantViolation(f"batch {batch.step} has {len(batch.groups)} groups, not {self.train_groups}")
        if len({g.group_id for g in batch.groups}) != len(batch.groups):
            raise InvariantViolation(f"batch {batch.step} holds a group twice")
        sizes = {len(g.samples) for g in batch.groups}
        if len(sizes) != 1:
            raise InvariantViolation(f"batch {batch.step} mixes group sizes {sorted(sizes)}")
        for g in batch.groups:
            lag = batch.step - g.version
            if not 0 <= lag <= self.max_staleness or (batch.step > g.deadline and not self.drop_stale):
                raise InvariantViolation(
                    f"C3: group {g.group_id} of version {g.version} (deadline {g.deadline}) consumed at step "
                    f"{batch.step} (staleness {lag}, K = {self.max_staleness})"
                )
            for s in g.samples:
                if len(s.segments) == 1 and s.segments[0][0] == g.version:
                    continue  # one run of the group's version (or of no tokens): C1 holds
                versions = {v for v, n in s.segments if n > 0} or {g.version}
                if versions != {g.version}:
                    if not self.count_c1:
                        raise InvariantViolation(
                            f"C1: group {g.group_id} sample {s.index} has tokens of versions {sorted(versions)}"
                        )
                    self.c1_violations += 1
            self.staleness[lag] += len(g.samples)
            self.consumed.append(g.group_id)

    @property
    def in_training(self) -> DeliverBatch | None:
        """The oldest batch taken whose publish has not come: the one the next publish completes."""
        return self.training[0] if self.training else None

    def trained(self, version: int) -> bool:
        """The learner published ``version``: the oldest batch in training is done. False if it is not that one's."""
        batch = self.in_training
        if batch is None or batch.step + 1 != version:
            return False
        self.filtered_by_step.pop(batch.step, None)
        self.training.pop(0)
        return True
