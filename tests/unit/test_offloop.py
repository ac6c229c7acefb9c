"""The engine's thread: a call in flight when the worker stops is waited for, so no torch call is cut off by the
interpreter's exit; a wedged one is left behind after a bounded wait."""

from __future__ import annotations

import subprocess
import sys
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


EXITING = """
import sys, threading, time
import torch
from dora.rollout.offloop import EngineThread

torch.set_num_threads(1)
a = torch.randn(400, 400)
engine, started = EngineThread(), threading.Event()

def decode(until_s):  # a run of torch calls, as a decode step is
    started.set()
    while time.monotonic() < until_s:
        torch.mm(a, a)

engine.call(decode, time.monotonic() + 1.0)
assert started.wait(30)
time.sleep(0.2)  # well inside the run of calls
if sys.argv[1] == "close":
    engine.close()
"""


def test_a_process_that_exits_with_its_engine_mid_call_exits_cleanly_once_closed():
    """The way a worker ends after a SIGTERM: the interpreter exits while the engine's thread is in a torch call.
    Left alone, that thread is cut off inside torch and the process aborts (exit 134 "terminate called without an
    active exception", which a Slurm job step reported); after ``close`` the process exits 0."""
    done = subprocess.run([sys.executable, "-c", EXITING, "close"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "terminate called" not in done.stderr
