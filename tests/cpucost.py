"""What each test costs: ``pytest -p tests.cpucost`` appends, per test, its wall time and the CPU time of the test
process and of every process it started and reaped (``getrusage``, so the figure holds whatever else runs beside
it, other xdist workers included), with the xdist worker that ran it and when it started, to ``$DORA_CPUCOST``
(default ``cpucost.jsonl``). Processes started by Slurm's daemons are not the test's children and do not count."""

from __future__ import annotations

import json
import os
import resource
import time

import pytest


def cpu_s() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    start, wall, cpu = time.time(), time.monotonic(), cpu_s()
    yield
    row = {
        "test": item.nodeid,
        "wall_s": round(time.monotonic() - wall, 2),
        "cpu_s": round(cpu_s() - cpu, 2),
        "worker": os.environ.get("PYTEST_XDIST_WORKER"),
        "start": round(start, 2),
    }
    with open(os.environ.get("DORA_CPUCOST", "cpucost.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
