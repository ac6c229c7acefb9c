"""Orchestrator: proportional allocation and same-version migration plans."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dora.core.orchestrator import WorkerView, all_placed, allocate, plan


@pytest.mark.parametrize(
    ("workers", "pending", "newest", "expect"),
    [
        (8, {}, 3, {3: 8}),
        (8, {2: 0, 3: 10}, 3, {3: 8}),
        (8, {2: 2, 3: 198}, 3, {2: 1, 3: 7}),  # the paper's case: residual requests keep one worker
        (16, {1: 8, 2: 8, 3: 16}, 3, {1: 4, 2: 4, 3: 8}),
        (3, {1: 1, 2: 1, 3: 100}, 3, {1: 1, 2: 1, 3: 1}),
        (2, {1: 5, 2: 5, 3: 5}, 3, {1: 1, 2: 1}),  # fewer workers than versions: oldest first
    ],
)
def test_allocate_examples(workers, pending, newest, expect):
    assert allocate(workers, pending, newest) == expect


@given(
    workers=st.integers(1, 64),
    pending=st.dictionaries(st.integers(0, 4), st.integers(0, 500), min_size=1, max_size=5),
)
def test_allocate_properties(workers, pending):
    newest = max(pending)
    target = allocate(workers, pending, newest)
    active = [v for v, r in pending.items() if r > 0]
    if not active:
        assert target == {newest: workers}
        return
    if workers < len(active):
        assert target == {v: 1 for v in sorted(active)[:workers]}
        return
    assert sum(target.values()) == workers
    assert set(target) == set(active) and all(n >= 1 for n in target.values())
    total = sum(pending[v] for v in active)
    for v in active:  # within one worker of the exact share, except where the floor of one lifts it
        quota = workers * pending[v] / total
        assert target[v] == 1 or abs(target[v] - quota) < 1 + len(active), (v, target, quota)
        assert target[v] <= max(1, math.ceil(quota)) + len(active)


def _w(name, version, free, groups=(), settled=True, order=0):
    return WorkerView(worker_id=name, version=version, free=free, groups=tuple(groups), settled=settled,
                      order=order)  # fmt: skip


def test_residual_requests_are_consolidated_on_one_worker_of_the_same_version():
    workers = [_w(f"old{i}", 1, free=15, groups=[(100 + i, 1)], order=i) for i in range(4)]
    workers += [_w(f"new{i}", 2, free=0, order=10 + i) for i in range(4)]
    p = plan(workers, pending={1: 4, 2: 400}, newest=2, full=True)
    assert len(p.moves) == 3, "seven of eight workers for 400 of 404 pending requests: three old ones leave"
    staying = {w.worker_id for w in workers if w.version == 1} - set(p.moves)
    assert len(staying) == 1
    assert sorted(g for g, _, _ in p.migrations) == sorted(100 + i for i in range(4) if f"old{i}" in p.moves)
    assert all(src in p.moves and dst in staying for _, src, dst in p.migrations)


def test_migration_targets_must_have_room():
    workers = [_w("a", 1, free=0, groups=[(1, 4)]), _w("b", 1, free=2, groups=[(2, 4)], order=1),
               _w("n", 2, free=8, order=2)]  # fmt: skip
    p = plan(workers, pending={1: 8, 2: 100}, newest=2, full=True)
    assert p.moves == [] and p.migrations == [], "neither old worker can absorb the other's 4 requests"


def test_without_migration_the_plans_leavers_keep_their_groups():
    workers = [_w("a", 1, free=0, groups=[(1, 4)]), _w("b", 1, free=2, groups=[(2, 4)], order=1),
               _w("n", 2, free=8, order=2)]  # fmt: skip
    host = _w("lora", 1, free=8, order=3)  # keeps version 1 beside a newer one: room for a's group
    for hosts in ({}, {1: [host]}):
        p = plan(workers, pending={1: 8, 2: 100}, newest=2, full=True, hosts=hosts, migrate=False)
        assert p.moves == ["a"] and p.migrations == [], "the surplus worker leaves with its group (it drains)"
    p = plan(workers, pending={1: 8, 2: 100}, newest=2, full=True, hosts={1: [host]})
    assert p.moves == ["a"] and p.migrations == [(1, "a", "lora")], "with migration its group goes to the host"


def test_between_triggers_only_idle_workers_of_finished_versions_move():
    workers = [_w("idle-done", 1, free=8), _w("idle-busy-version", 2, free=8), _w("busy", 2, free=4, groups=[(7, 4)]),
               _w("newest", 3, free=8), _w("loading-old", 2, free=8, settled=False)]  # fmt: skip
    p = plan(workers, pending={2: 4, 3: 50}, newest=3, full=False)
    assert sorted(p.moves) == ["idle-done", "loading-old"] and p.migrations == []


def test_workers_only_move_to_the_newest_version():
    workers = [_w("a", 1, free=8, groups=[(1, 1)]), _w("b", 2, free=8), _w("c", 3, free=8)]
    p = plan(workers, pending={1: 100, 2: 0, 3: 1}, newest=3, full=True)
    assert p.moves == ["b"], "version 1 wants more workers but never takes one from another version"


_views = st.lists(
    st.tuples(
        st.integers(1, 4),  # version
        st.integers(0, 16),  # free slots
        st.lists(st.integers(1, 8), max_size=3),  # unfinished samples of each group it holds
        st.booleans(),  # settled
    ),
    max_size=24,
)


@given(views=_views, pending=st.dictionaries(st.integers(1, 4), st.integers(0, 40), max_size=4), full=st.booleans())
def test_the_empty_workers_of_a_version_with_nothing_pending_move_and_leave_the_rest_of_the_plan_as_it_was(
    views, pending, full
):
    """What the core relies on to move most of an idle fleet without a plan (Core._orchestrate): every empty worker
    of a superseded version with nothing pending moves, and the plan for the others, counted in the same fleet, is
    the plan they get beside them. Between triggers, an empty worker still loading weights moves too."""
    newest = 4
    workers = [
        _w(f"w{i}", v, free, groups=[(100 * i + j, n) for j, n in enumerate(gs)], settled=settled, order=i)
        for i, (v, free, gs, settled) in enumerate(views)
    ]
    shortcut = [
        w for w in workers
        if w.version != newest and not w.groups and (not pending.get(w.version) or (not full and not w.settled))
    ]  # fmt: skip
    whole = plan(workers, pending, newest, full=full, fleet=len(workers))
    assert {w.worker_id for w in shortcut} <= set(whole.moves)
    if full:
        rest = [w for w in workers if w not in shortcut]
        part = plan(rest, pending, newest, full=True, fleet=len(workers))
        assert sorted(part.moves + [w.worker_id for w in shortcut]) == sorted(whole.moves)
        assert sorted(part.migrations) == sorted(whole.migrations)


def test_a_draining_versions_tail_is_packed_no_denser_than_drain_load():
    """Four workers of version 1 hold 30 unfinished samples each while version 2 has 4,000 to do. The paper's rule
    keeps one worker of version 1 and packs all 120 samples onto it; with drain_load = 66 two stay, 60 each."""
    workers = [_w(f"old{i}", 1, free=226, groups=[(100 + i, 30)], order=i) for i in range(4)]
    workers += [_w(f"new{i}", 2, free=0, order=10 + i) for i in range(4)]
    dense = plan(workers, pending={1: 120, 2: 4000}, newest=2, full=True)
    assert sorted(dense.moves) == ["old0", "old1", "old2"] and {dst for _, _, dst in dense.migrations} == {"old3"}
    bounded = plan(workers, pending={1: 120, 2: 4000}, newest=2, full=True, drain_load=66)
    assert sorted(bounded.moves) == ["old0", "old1"]
    assert sorted((g, dst) for g, _, dst in bounded.migrations) == [(100, "old2"), (101, "old3")]


_draining = st.lists(  # two older versions whose workers have room for each other's groups
    st.tuples(st.integers(2, 3), st.integers(0, 40), st.lists(st.integers(1, 6), max_size=3), st.just(True)),
    max_size=16,
)


@settings(max_examples=300)
@given(views=st.one_of(_views, _draining), newest_pending=st.integers(0, 400), drain=st.integers(1, 12))
def test_with_drain_load_no_worker_is_packed_past_it_and_an_older_version_keeps_enough_workers(
    views, newest_pending, drain
):
    newest = 4
    workers = [
        _w(f"w{i}", v, free, groups=[(100 * i + j, n) for j, n in enumerate(gs)], settled=settled, order=i)
        for i, (v, free, gs, settled) in enumerate(views)
    ]
    pending = Counter({newest: newest_pending})  # as the core counts it: an older version's unfinished samples
    for w in workers:
        pending[w.version] += sum(n for _, n in w.groups)
    p = plan(workers, pending, newest, full=True, fleet=len(workers), drain_load=drain)
    by_id = {w.worker_id: w for w in workers}
    sizes = {g: n for w in workers for g, n in w.groups}
    given_to = Counter()
    for g, src, dst in p.migrations:
        assert by_id[src].version == by_id[dst].version != newest and src in p.moves and dst not in p.moves
        given_to[dst] += sizes[g]
    for dst, n in given_to.items():
        w = by_id[dst]
        assert n <= w.free and sum(k for _, k in w.groups) + n <= drain, (dst, n, drain)
    for v in {w.version for w in workers} - {newest}:
        settled = [w for w in workers if w.version == v and w.settled]
        kept = [w for w in settled if w.worker_id not in p.moves]
        if pending.get(v):
            assert len(kept) >= min(len(settled), -(-pending[v] // drain)), (v, len(kept), pending[v], drain)


@pytest.mark.parametrize(
    ("holders", "room", "fits"),
    [
        ([], {}, True),  # no elastic worker holds a running group
        ([(0, ((1, 3),))], {0: {"s": 3}}, True),  # room on a peer of its version
        ([(0, ((1, 3),))], {0: {"s": 2}}, False),  # a group is never split
        ([(0, ((1, 3),))], {1: {"s": 8}}, False),  # room only on another version's peer (C1)
        ([(0, ((1, 3), (2, 2)))], {0: {"s": 3, "t": 2}}, True),  # largest first, each where it fits
        ([(0, ((1, 2),)), (0, ((2, 2),))], {0: {"s": 3}}, False),  # the first holder's group takes the room
        ([(0, ((1, 2),)), (1, ((2, 2),))], {0: {"s": 2}, 1: {"t": 2}}, True),
    ],
)
def test_all_placed_places_every_holders_groups_on_peers_of_its_version_with_room(holders, room, fits):
    assert all_placed(holders, room) is fits
