"""Deadline arithmetic, and the counter-example a plain capacity bound gets wrong
(docs/how-it-works.md#deadlines-admission-and-consumption)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dora.config import CoreConfig
from dora.core import deadline
from dora.core.core import Core
from dora.core.events import (
    BatchRequested,
    DeliverBatch,
    Lease,
    VersionLoaded,
    VersionPublished,
    WorkerJoined,
)
from dora.ids import Mode
from tests.unit.machine import finished


@pytest.mark.parametrize(
    ("counts", "step", "batch", "ok"),
    [
        ({}, 0, 2, True),
        ({0: 2}, 0, 2, True),
        ({0: 3}, 0, 2, False),  # three groups due at step 0, one batch of two
        ({1: 4}, 0, 2, True),  # due by step 1: two batches
        ({0: 1, 1: 4}, 0, 2, False),  # five due by step 1
        ({2: 6}, 0, 2, True),
        ({2: 4}, 2, 2, False),  # the counter-example's step 2: four owed, one batch left
        ({1: 1}, 2, 2, False),  # overdue
        ({3: 2, 5: 2}, 3, 1, False),
        ({3: 1, 5: 2}, 3, 1, True),
    ],
)
def test_feasible(counts, step, batch, ok):
    assert deadline.feasible(counts, step, batch) is ok


@given(
    counts=st.dictionaries(st.integers(0, 6), st.integers(1, 6), max_size=4),
    step=st.integers(0, 6),
    batch=st.integers(1, 4),
    due=st.integers(0, 9),
)
def test_a_group_is_admitted_exactly_when_the_invariant_holds_with_it(counts, step, batch, due):
    grown = {**counts, due: counts.get(due, 0) + 1}
    assert deadline.admits(counts, step, batch, due) is (due >= step and deadline.feasible(grown, step, batch))


@given(
    counts=st.dictionaries(st.integers(0, 6), st.integers(1, 6), max_size=4),
    step=st.integers(0, 6),
    batch=st.integers(1, 4),
    due=st.integers(0, 9),
)
def test_admissible_is_the_number_of_single_admissions(counts, step, batch, due):
    """admissible(d) == how many times admits(d) holds when groups are added one at a time."""
    if not deadline.feasible(counts, step, batch):
        return
    grown, n = dict(counts), 0
    while deadline.admits(grown, step, batch, due):
        grown[due] = grown.get(due, 0) + 1
        n += 1
        assert n < 100
    assert deadline.admissible(counts, step, batch, due) == n
    assert deadline.feasible(grown, step, batch)


@given(
    counts=st.dictionaries(st.integers(0, 5), st.integers(1, 5), min_size=1, max_size=4),
    batch=st.integers(1, 4),
)
def test_earliest_deadline_first_keeps_the_invariant_once_all_have_finished(counts, batch):
    """The liveness argument: with every owed group finished, EDF always leaves a feasible rest."""
    step = 0
    if not deadline.feasible(counts, step, batch) or sum(counts.values()) < batch:
        return
    edf = sorted(d for d, n in counts.items() for _ in range(n))[:batch]
    assert deadline.keeps_invariant_after(counts, step, batch, edf)


def _finish(core: Core, lease: Lease) -> list:
    out = []
    for i in range(lease.n_samples):
        out += core.handle(
            0.0,
            finished(
                worker_id=lease.worker_id, group_id=lease.group_id, attempt=lease.attempt, index=i,
                segments=((lease.version, 3),),
            ),
        )  # fmt: skip
    return out


def _batches(actions) -> list[DeliverBatch]:
    return [a for a in actions if isinstance(a, DeliverBatch)]


def test_design_counter_example_k2_b2():
    """K=2, B=2. Six groups dispatched on v0; step 0 eats the two fast ones; two fast v1 groups finish.

    A capacity bound would let step 1 eat the two v1 groups and leave four v0 groups owed at step 2,
    where only two fit: drop one (C2) or overrun K (C3). The deadline rule makes step 1 wait for v0.
    """
    core = Core(CoreConfig(mode=Mode.DORA, max_staleness=2, train_groups=2, group_size=1, rollout_groups=8))
    core.handle(0, WorkerJoined(worker_id="a", slots=8))
    acts = core.handle(0, VersionLoaded(worker_id="a", version=0))
    v0 = [a for a in acts if isinstance(a, Lease)]
    assert len(v0) == 6 and {a.version for a in v0} == {0}, "admission allows exactly (K+1)*B groups on v0"

    assert not _batches(core.handle(0, BatchRequested(step=0)))
    _finish(core, v0[0])
    (b0,) = _batches(_finish(core, v0[1]))
    assert {g.group_id for g in b0.groups} == {v0[0].group_id, v0[1].group_id}

    acts = core.handle(0, VersionPublished(version=1))
    acts += core.handle(0, WorkerJoined(worker_id="b", slots=8))
    acts += core.handle(0, VersionLoaded(worker_id="b", version=1))
    v1 = [a for a in acts if isinstance(a, Lease) and a.version == 1]
    assert len(v1) == 2, "deadline 3 has room for exactly two v1 groups next to four owed v0 groups"
    _finish(core, v1[0])
    _finish(core, v1[1])

    # The two v1 groups are finished, but taking them would leave 4 groups due at step 2 > B.
    assert not deadline.keeps_invariant_after(core.ledger.deadline_counts(), 1, 2, [3, 3])
    assert not _batches(core.handle(0, BatchRequested(step=1)))
    assert core.transfer.waiting_on(core.ledger.deadline_counts()) == 0 and len(core.transfer) == 2

    _finish(core, v0[2])
    (b1,) = _batches(_finish(core, v0[3]))
    assert {g.version for g in b1.groups} == {0}, "step 1 takes the oldest groups"

    core.handle(0, VersionPublished(version=2))
    assert not _batches(core.handle(0, BatchRequested(step=2))), "groups with deadline 2 must come first"
    _finish(core, v0[4])
    (b2,) = _batches(_finish(core, v0[5]))
    assert {g.group_id for g in b2.groups} == {v0[4].group_id, v0[5].group_id}
    assert max(b2.step - g.version for g in b2.groups) == 2  # exactly K, never more

    core.handle(0, VersionPublished(version=3))
    (b3,) = _batches(core.handle(0, BatchRequested(step=3)))
    assert {g.group_id for g in b3.groups} == {v1[0].group_id, v1[1].group_id}
    trained = [g.group_id for b in (b0, b1, b2, b3) for g in b.groups]
    assert sorted(trained) == sorted(a.group_id for a in v0 + v1), "nothing dropped, nothing twice"
