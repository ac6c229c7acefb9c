"""Version ledger: lifecycle, retire conditions, the K + 1 bound."""

from __future__ import annotations

import pytest

from dora.core.ledger import InvariantViolation, Ledger, VersionState


def test_lifecycle_published_live_draining_retired():
    led = Ledger(max_staleness=1)
    assert led.state(0) is VersionState.PUBLISHED
    led.pin("a", 0)
    led.mark_loaded(0)
    assert led.state(0) is VersionState.LIVE
    led.add_group(0, 1)
    led.publish(1)
    assert led.state(1) is VersionState.PUBLISHED and led.newest == 1
    led.pin("b", 1)
    led.mark_loaded(1)
    assert led.state(0) is VersionState.DRAINING and led.state(1) is VersionState.LIVE
    assert led.collect_retired() == []  # v0 still has a worker and an unconsumed group
    led.pin("a", 1)
    assert led.collect_retired() == []  # ... and still an unconsumed group
    led.remove_group(0, 1)
    assert led.collect_retired() == [0]
    assert led.state(0) is VersionState.RETIRED and led.alive() == [1]
    assert led.collect_retired() == [], "a version is retired once"


@pytest.mark.parametrize(
    ("pinned", "groups", "newest_too", "retired"),
    [
        (False, False, False, True),
        (True, False, False, False),  # a worker still serves it
        (False, True, False, False),  # a group dispatched on it is not consumed yet
        (False, False, True, False),  # it is the newest version
    ],
)
def test_retire_condition(pinned, groups, newest_too, retired):
    led = Ledger(max_staleness=3)
    if not newest_too:
        led.publish(1)
    if pinned:
        led.pin("w", 0)
    if groups:
        led.add_group(0, 3)
    assert (led.collect_retired() == [0]) is retired


def test_superseded_before_anyone_loaded_it_is_retired():
    led = Ledger(max_staleness=2)
    led.pin("w", 0)
    led.publish(1)
    led.publish(2)
    assert led.collect_retired() == [1]
    assert led.alive() == [0, 2]


def test_out_of_order_publish_is_refused():
    led = Ledger(max_staleness=1)
    with pytest.raises(ValueError, match="out of order"):
        led.publish(2)


def test_structural_violations_raise():
    led = Ledger(max_staleness=0)
    led.pin("w", 0)
    led.publish(1)
    with pytest.raises(InvariantViolation, match="versions alive"):
        led.check()  # K + 1 = 1, but v0 (pinned) and v1 are alive
    led.pin("w", 1)
    assert led.collect_retired() == [0]
    led.check()
    with pytest.raises(InvariantViolation, match="retired"):
        led.pin("w", 0)
    with pytest.raises(InvariantViolation, match="retired"):
        led.add_group(0, 0)
    with pytest.raises(InvariantViolation, match="has none"):
        led.remove_group(1, 1)
    led.add_group(1, 1)
    with pytest.raises(InvariantViolation, match="earlier"):
        led.move_group((1, 1), (0, 0))


def test_deadline_counts_are_per_deadline_within_v_to_v_plus_k():
    led = Ledger(max_staleness=2)
    led.add_group(0, 2)
    led.add_group(0, 1)
    led.publish(1)
    led.add_group(1, 3)
    led.add_group(1, 2)
    assert led.deadline_counts() == {1: 1, 2: 2, 3: 1}
    led.move_group((0, 1), (0, 2))  # a deadline extended
    assert led.deadline_counts() == {2: 3, 3: 1}
    with pytest.raises(InvariantViolation, match="outside"):
        led.add_group(1, 4)
    with pytest.raises(InvariantViolation, match="earlier"):
        led.move_group((1, 3), (1, 2))


def test_the_workers_of_each_version_follow_pins_and_unpins():
    led = Ledger(max_staleness=2)
    led.pin("a", 0)
    led.pin("b", 0)
    led.publish(1)
    led.pin("a", 1)
    assert led.workers_of(0) == ["b"] and list(led.pinned_to(1)) == ["a"] and led.pinned_versions() == [0, 1]
    led.unpin("b")
    assert led.workers_of(0) == [] and led.pinned_versions() == [1]
    led.check()
