"""The engine's thread: a call in flight when the worker stops is waited for, so no torch call is cut off by the
interpreter's exit; a wedged one is left behind after a bounded wait."""

from __future__ import annotations

import threading
import time

from dora.rollout.offloop import EngineThread


async def test_close_waits_for_the_call_in_flight():
    engine = EngineThread()
    started = threading.Event()
    done = engine.call(lambda: (started.set(), time.sleep(0.3), 7)[2])
    assert started.wait(5)
    thread = engine.thread
    engine.close()
    assert thread is not None and not thread.is_alive(), "the call ran to its end before close returned"
    assert await done == 7


async def test_a_wedged_call_is_left_behind_after_the_wait():
    engine = EngineThread()
    gate = threading.Event()
    engine.call(gate.wait)
    thread = engine.thread
    started = time.monotonic()
    engine.close(wait_s=0.2)
    assert thread is not None and thread.is_alive() and time.monotonic() - started < 5
    gate.set()
    thread.join(5)
