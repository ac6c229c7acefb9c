"""Event-loop lag, shared by the broker, rollout and learner processes: a task sleeps ``PROBE_S`` and records how
much later than asked the loop woke it. A turn of the loop that holds it (handling messages, a decode step, a
weight load) shows as lag; so does a process the machine did not run.

A wake-up later than ``STALL_S`` is logged (``loop_stalled``) with the CPU the process used meanwhile. About as
much CPU as the stall: the process was busy in its own code. Far less: it was not run (the machine's load) or
waited in a system call (a write held by the disk). A peer is declared dead after ``heartbeat_interval_s ×
liveness`` of silence; a worker's ``loop_stalled`` line just before such a declaration says why it was silent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

log = structlog.get_logger()

PROBE_S = 0.05
"""The probe sleeps this long, then records how much later than asked it woke."""
STALL_S = 0.5
"""A wake-up this late is logged as ``loop_stalled``."""


async def probe_lag(observe: Callable[[float], None] | None = None) -> None:
    """Run until cancelled: measure the loop's lag every ``PROBE_S``, pass each to ``observe``, log the stalls."""
    while True:
        asked, cpu = time.perf_counter(), time.process_time()
        await asyncio.sleep(PROBE_S)
        late = max(0.0, time.perf_counter() - asked - PROBE_S)
        if observe is not None:
            observe(late)
        if late > STALL_S:
            log.warning("loop_stalled", late_s=round(late, 3), cpu_s=round(time.process_time() - cpu, 3))
