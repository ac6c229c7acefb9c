"""Liveness on a fake clock: silence, stalls, and what does not count as either."""

from __future__ import annotations

import pytest

from dora.actor.liveness import Liveness


def test_silent_peer_expires_after_interval_times_liveness():
    lv = Liveness(interval_s=0.5, liveness=4, stall_timeout_s=10)
    lv.joined("w", now=0.0)
    assert lv.expired(2.0) == []
    lv.heard("w", now=1.9)
    assert lv.expired(3.8) == []
    assert lv.expired(3.95) == [("w", "silent")]
    assert "w" not in lv and lv.expired(100) == [], "declared once"


def test_heartbeats_without_progress_while_busy_is_a_stall():
    lv = Liveness(interval_s=0.5, liveness=4, stall_timeout_s=5)
    lv.joined("w", now=0.0)
    for t in range(1, 20):
        lv.progressed("w", now=t * 0.5, progress=100, busy=True)
        if t * 0.5 <= 5.5:
            assert lv.expired(t * 0.5) == [], t
    assert lv.expired(9.5) == [("w", "stalled")]


@pytest.mark.parametrize("busy", [False, True])
def test_idle_or_progressing_peers_never_stall(busy):
    lv = Liveness(interval_s=0.5, liveness=4, stall_timeout_s=2)
    lv.joined("w", now=0.0)
    for t in range(1, 40):
        lv.progressed("w", now=t * 0.5, progress=t if busy else 0, busy=busy)
        assert lv.expired(t * 0.5) == []


def test_becoming_busy_restarts_the_stall_clock():
    lv = Liveness(interval_s=1, liveness=3, stall_timeout_s=5)
    lv.joined("w", now=0.0)
    lv.progressed("w", now=1, progress=7, busy=False)
    lv.progressed("w", now=8, progress=7, busy=True)  # idle for a long time, then given work
    assert lv.expired(9) == []
    lv.progressed("w", now=12, progress=7, busy=True)
    assert lv.expired(14) == [("w", "stalled")]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        Liveness(interval_s=1, liveness=1, stall_timeout_s=1)
