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


def test_a_peer_that_missed_a_heartbeat_is_quiet_until_it_is_heard_or_dead():
    lv = Liveness(interval_s=0.5, liveness=20, stall_timeout_s=30)
    lv.joined("w", now=0.0)
    lv.joined("v", now=0.0)
    assert lv.quiet(0.9, after_s=1.0) == []
    lv.heard("v", now=0.9)
    assert lv.quiet(1.1, after_s=1.0) == ["w"]
    assert lv.quiet(2.0, after_s=1.0) == ["w", "v"]
    lv.heard("w", now=2.0)
    assert lv.quiet(2.5, after_s=1.0) == ["v"]
    assert lv.expired(10.95) == [("v", "silent")]
    assert lv.quiet(11.0, after_s=1.0) == ["w"], "v, declared dead, is no longer watched"


def test_heartbeats_without_progress_while_busy_is_a_stall():
    lv = Liveness(interval_s=0.5, liveness=4, stall_timeout_s=5)
    lv.joined("w", now=0.0)
    for t in range(1, 20):
        lv.progressed("w", now=t * 0.5, progress=100, busy=True)
        if t * 0.5 <= 5.5:
            assert lv.expired(t * 0.5) == [], t
    assert lv.expired(9.5) == [("w", "stalled")]


def test_time_the_judge_did_not_listen_counts_against_nobody():
    lv = Liveness(interval_s=0.5, liveness=4, stall_timeout_s=5)
    lv.joined("w", now=0.0)
    lv.progressed("w", now=1.0, progress=7, busy=True)
    lv.absent(3.0)  # the judge was held from 1.5 s to 4.5 s
    assert lv.expired(4.9) == []  # last heard at 1.0: 0.5 s of it while listening
    assert lv.expired(6.05) == [("w", "silent")]  # 2 s of silence while listening
    lv.joined("v", now=0.0)
    for t in (1.0, 2.0, 3.0):
        lv.progressed("v", now=t, progress=1, busy=True)
    lv.absent(2.5)
    for t in (6.0, 7.0, 8.0):  # heartbeats, no progress
        lv.progressed("v", now=t, progress=1, busy=True)
        assert lv.expired(t) == []  # progress last moved at 1.0: 5 s at 8.0, of which 2.5 s not watched
    assert lv.expired(8.6) == [("v", "stalled")]


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
