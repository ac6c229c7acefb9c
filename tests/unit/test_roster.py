"""Roster: the serving worker with the most free slots per version, against a scan of every worker."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dora.core.roster import Roster
from dora.ids import WorkerId


def test_most_free_slots_first_then_join_order():
    r = Roster()
    r.offer(0, WorkerId("a"), 4, 1)
    r.offer(0, WorkerId("b"), 8, 2)
    r.offer(0, WorkerId("c"), 8, 3)
    state = {"a": (4, 1), "b": (8, 2), "c": (8, 3)}
    assert r.best(0, state.get) == "b"
    assert r.best(1, state.get) is None


def test_an_entry_that_no_longer_matches_is_dropped():
    r = Roster()
    r.offer(0, WorkerId("a"), 8, 1)
    r.offer(0, WorkerId("b"), 4, 2)
    state = {"a": (0, 1), "b": (4, 2)}  # a took a lease and was not offered again: its entry is stale
    assert r.best(0, state.get) == "b"
    assert r.listed(0) == {("b", 4, 2)}, "the stale entry came to the top and went"


def test_rebuild_keeps_exactly_the_serving_workers():
    r = Roster()
    for free in range(100):
        r.offer(0, WorkerId("a"), free, 1)
    assert r.crowded(0, workers=1)
    r.rebuild(0, [(WorkerId("a"), 3, 1)])
    assert r.listed(0) == {("a", 3, 1)} and not r.crowded(0, workers=1)
    r.rebuild(0, [])
    assert r.versions() == []


ops = st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(0, 2), st.integers(0, 8), st.booleans()), max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_best_is_what_a_scan_of_every_worker_finds(changes):
    """Offer every change (version, free slots, serving or not); the best of each version is the scan's."""
    r = Roster()
    order = {w: i for i, w in enumerate("abcdef")}
    state: dict[str, tuple[int, int, bool]] = {}
    for worker, version, free, serving in changes:
        state[worker] = (version, free, serving)
        if serving:
            r.offer(version, WorkerId(worker), free, order[worker])
        for v in range(3):
            on = [(f, -order[w], w) for w, (ver, f, s) in state.items() if s and ver == v]
            expect = max(on)[2] if on else None

            def current(name: WorkerId, v: int = v) -> tuple[int, int] | None:
                ver, f, s = state.get(name, (-1, 0, False))
                return (f, order[name]) if s and ver == v else None

            assert r.best(v, current) == expect
