"""`dora run`'s watch over its rollout workers: a worker that exits is reaped and reported, and a run that can no
longer go on is stopped instead of left waiting.

`dora run` starts the broker with ``core.min_workers = run.workers``: the first leases wait for the whole fleet.
So the run cannot go on when
- every worker has exited;
- a worker exited before the whole fleet had joined the broker (nobody starts it again);
- the fleet has not joined within ``run.worker_start_timeout_s`` (a worker hung while starting).
Once the fleet has joined, a worker that dies is reported (one line: its name, exit status and the last error
in its log) and the broker re-runs its groups on the others. Who joined and who was lost is read from the
broker's ``timeline.jsonl``; each worker's last error from its ``<name>.log`` in the run directory (structlog's
JSON lines, or the traceback Python printed on the way out).
"""

from __future__ import annotations

import json
import pathlib
import re
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dora.launch.local import LocalRun
from dora.ops.plot import TIMELINE

ENDING_GRACE_S = 10.0
"""Every worker gone and one of them exited 0 (let go by the broker, or asked to stop): this long for the broker
and learner to end the run themselves before it counts as stuck."""
TRACEBACK = "Traceback (most recent call last):"
QUALIFIED = re.compile(r"[A-Za-z_][\w.]*\.(\w+)")
ROUTINE = frozenset({"event", "level", "timestamp", "process", "host", "pid", "worker_id", "rank", "slurm_job_id",
                     "slurm_restart"})  # fmt: skip
"""Fields every log line carries: left out of the line that reports it."""


class RunStuck(RuntimeError):
    """The run cannot go on: `dora run` stops every process and exits 1."""


class WorkerWatch:
    """The rollout workers ``names`` of ``run``, checked on each pass of `dora run`'s progress loop."""

    def __init__(self, run: LocalRun, names: Sequence[str], *, start_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic, say: Callable[[str], None] | None = None
                 ) -> None:  # fmt: skip
        self.run = run
        self.names = list(names)
        self.start_timeout_s = start_timeout_s
        self.clock = clock
        self.say = say or (lambda line: print(f"dora run: {line}", file=sys.stderr))
        self.deadline = clock() + start_timeout_s
        self.offset = 0
        self.live: set[str] = set()
        """Worker ids joined and not lost, as the timeline says."""
        self.joined: set[str] = set()
        """Names of the workers that joined the broker at least once."""
        self.fleet_ready = False
        """The whole fleet was joined at once: the broker leases from then on, whoever is left."""
        self.lost: dict[str, int] = {}
        """Workers that exited non-zero, each reported once; their exit status."""
        self.gone: dict[str, int] = {}
        """Every worker that has exited (reaped), with its exit status."""
        self.all_gone_at: float | None = None

    def check(self) -> None:
        """Reap and report the workers that exited since the last check; RunStuck when the run cannot go on."""
        exited = []
        for name in self.names:
            code = self.run.procs[name].poll()  # reaps it: no zombie is left
            if code is not None and name not in self.gone:
                self.gone[name] = code
                exited.append(name)
        self.read_timeline()  # after the polls: every join before those exits is on it
        for name in exited:
            code = self.gone[name]
            if code != 0:
                self.lost[name] = code
                self.report(name, code)
        if len(self.gone) == len(self.names):
            now = self.clock()
            self.all_gone_at = now if self.all_gone_at is None else self.all_gone_at
            if len(self.lost) < len(self.gone) and now - self.all_gone_at < ENDING_GRACE_S:
                return  # one let go by the broker: the run may be ending
            raise RunStuck(f"every rollout worker has exited ({len(self.gone)} of {len(self.names)}): nothing is left "
                           f"to roll out")  # fmt: skip
        if self.fleet_ready:
            return
        if self.gone:
            raise RunStuck(f"the run cannot start: {', '.join(self.gone)} exited before all {len(self.names)} rollout "
                           f"workers had joined the broker (the first leases wait for the whole fleet: "
                           f"core.min_workers = run.workers)")  # fmt: skip
        if self.clock() > self.deadline:
            missing = [n for n in self.names if n not in self.joined]
            for name in missing:
                self.say(f"rollout worker {name} has not joined the broker after {self.start_timeout_s:g} s: "
                         f"{last_error(self.run.log(name))} (log: {self.run.dir / f'{name}.log'})")  # fmt: skip
            raise RunStuck(f"the run cannot start: {len(missing)} of {len(self.names)} rollout workers did not join "
                           f"the broker within run.worker_start_timeout_s = {self.start_timeout_s:g} s")  # fmt: skip

    def settle(self, codes: Mapping[str, int | None]) -> None:
        """After the stop: report the workers that failed on their own (exit status above 0) and were not reported
        yet, e.g. one that exited between the last check and the stop."""
        for name in self.names:
            code = codes.get(name)
            if code is not None and code > 0 and name not in self.lost:
                self.lost[name] = code
                self.report(name, code)

    def report(self, name: str, code: int) -> None:
        self.say(f"rollout worker {name} {status(code)}: {last_error(self.run.log(name))} "
                 f"(log: {self.run.dir / f'{name}.log'})")  # fmt: skip

    def read_timeline(self) -> None:
        """The workers joined and lost since the last read; the fleet is ready once all are joined at once."""
        rows, self.offset = new_lines(self.run.dir / TIMELINE, self.offset)
        for r in rows:
            worker = str(r.get("worker", ""))
            if r.get("event") == "joined":
                self.live.add(worker)
                self.joined.add(worker.split("/")[1] if worker.count("/") >= 2 else worker)
                self.fleet_ready |= len(self.live) >= len(self.names)
            elif r.get("event") == "lost":
                self.live.discard(worker)


def status(code: int) -> str:
    """How a process ended: ``exited with 1``, ``killed by SIGKILL``."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with {code}"


def last_error(log: str, limit: int = 300) -> str:
    """The last meaningful line of a process's log: the exception of its last traceback (with the indented
    lines of its message), its last JSON line of level error or critical, or a line of `dora`'s own ("dora
    rollout: ..."), whichever comes last; else its last line, said to be no error. Cut to ``limit`` characters."""
    lines = log.splitlines()
    found: str | None = None
    fallback = ""
    in_traceback = False
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                rec = None
            if isinstance(rec, dict):
                fallback = describe(rec)
                if rec.get("level") in ("error", "critical", "exception"):
                    found = fallback
                continue
        fallback = line.strip()
        if line.startswith(TRACEBACK):
            in_traceback = True
        elif in_traceback and not line[0].isspace():
            in_traceback = False
            rest = [x.strip() for x in _indented(lines[i + 1 :])]
            found = " ".join([short_name(line.strip()), *rest])
        elif not in_traceback and line.startswith("dora "):
            found = line.strip()
    text = found or (f"no error logged; last line: {fallback}" if fallback else "its log is empty")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe(rec: dict[str, Any]) -> str:
    """A structlog JSON line as one line: its event, its exception (the one raised last) or its own fields."""
    event = str(rec.get("event", ""))
    exc = rec.get("exception")
    if isinstance(exc, list) and exc and isinstance(exc[0], dict):
        return f"{event}: {short_name(str(exc[0].get('exc_type', '')))}: {exc[0].get('exc_value', '')}"
    if isinstance(exc, str) and exc.strip():  # format_exc_info's text
        return f"{event}: {short_name(exc.strip().splitlines()[-1])}"
    fields = " ".join(f"{k}={v}" for k, v in rec.items() if k not in ROUTINE)
    return f"{event} {fields}".strip()


def short_name(line: str) -> str:
    """``safetensors._rust.SafetensorError: msg`` as ``SafetensorError: msg``."""
    head, sep, rest = line.partition(":")
    m = QUALIFIED.fullmatch(head)
    return f"{m.group(1)}{sep}{rest}" if m else line


def _indented(lines: Sequence[str]) -> list[str]:
    out = []
    for line in lines:
        if not line.strip() or not line[0].isspace():
            break
        out.append(line)
    return out


def new_lines(path: pathlib.Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The whole JSON lines written to ``path`` past byte ``offset``, and the offset after them."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    whole = data[: data.rfind(b"\n") + 1]
    return [json.loads(x) for x in whole.splitlines() if x.strip()], offset + len(whole)
