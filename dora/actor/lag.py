"""Event-loop lag, shared by the broker, rollout and learner processes: a task sleeps ``PROBE_S`` and records how
much later than asked the loop woke it. A turn of the loop that holds it (handling messages, a decode step, a
weight load) shows as lag; so does a process the machine did not run.

A wake-up later than ``STALL_S`` is logged (``loop_stalled``) with where the time went:
- ``cpu_s``: the CPU the process used meanwhile (all its threads). About as much as the stall: it was busy in its
  own code.
- ``queued_s``: how long the loop's thread was ready to run and waited for a CPU (the kernel's run-queue time,
  ``/proc/thread-self/schedstat``; absent where the kernel does not keep it): the machine's load.
- the rest: the thread waited in a system call (a write held by the disk, a page fault served from it).

A peer is declared dead after ``heartbeat_interval_s × liveness`` of silence; a process's ``loop_stalled`` line just
before such a declaration says why it was silent.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import structlog

log = structlog.get_logger()

PROBE_S = 0.05
"""The probe sleeps this long, then records how much later than asked it woke."""
STALL_S = 0.5
"""A wake-up this late is logged as ``loop_stalled``."""
SCHEDSTAT = "/proc/thread-self/schedstat"


def queued_s() -> float | None:
    """Seconds this thread has waited, runnable, for a CPU since it started (None where the kernel does not say)."""
    try:
        with open(SCHEDSTAT, "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


async def probe_lag(observe: Callable[[float], None] | None = None) -> None:
    """Run until cancelled: measure the loop's lag every ``PROBE_S``, pass each to ``observe``, log the stalls."""
    while True:
        asked, cpu, queued = time.perf_counter(), time.process_time(), queued_s()
        await asyncio.sleep(PROBE_S)
        late = max(0.0, time.perf_counter() - asked - PROBE_S)
        if observe is not None:
            observe(late)
        if late > STALL_S:
            now_queued = queued_s()
            waited = {} if queued is None or now_queued is None else {"queued_s": round(now_queued - queued, 3)}
            log.warning("loop_stalled", late_s=round(late, 3), cpu_s=round(time.process_time() - cpu, 3), **waited)


@contextlib.asynccontextmanager
async def watching_lag(observe: Callable[[float], None] | None = None) -> AsyncIterator[None]:
    """The probe runs while the block does (an actor's whole life); a probe that failed raises at its end."""
    probe = asyncio.create_task(probe_lag(observe), name="loop-lag-probe")
    try:
        yield
    finally:
        probe.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await probe
