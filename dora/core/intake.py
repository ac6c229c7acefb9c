"""Intake: finished samples taken into their groups, and what a bad sample costs its group.

A result first passes the lease fence (``Scheduler.check_result``: the current holder, the current attempt),
then the sample checks (``_sample_problem``): an index in [0, G) not taken yet, no generation error,
well-formed version segments, and every token of the lease's version (C1; under in-flight swap, none older
than it). A taken sample frees its slot (``Scheduler.took``). The sample that completes the group releases it
from the scheduler (``Scheduler.release``), and the caller hands it on to training (or, with ``filter_uniform``,
to filtering if its rewards, kept beside its samples, are all equal). A duplicate is refused
and otherwise ignored. Any other problem re-runs the group whole (C2), until the group has failed
``max_group_failures`` times (``GroupFailed``).

The fence and the slot bookkeeping belong to the ``scheduler``, and what is leased next to ``dispatch``. The
``Core`` hands a completed group to the transfer queue.
"""

from __future__ import annotations

from collections.abc import Iterator

from dora.config import CoreConfig
from dora.core.events import Outbox, ReadySample, Refused, Result, ResultsReported
from dora.core.scheduler import Flight, Scheduler
from dora.ids import Finish


class GroupFailed(RuntimeError):
    """A group errored max_group_failures times: it can be neither trained nor dropped."""


def accept(sched: Scheduler, report: ResultsReported, out: Outbox) -> Iterator[Flight]:
    """Record a worker's report of finished samples, in order, each exactly as if it came alone: the same refusals
    and the same state, the lease checked once per run of samples of one lease and slots, pending counts and the
    roster updated once per run. Yields each flight as the sample that completes its group is taken (the caller
    hands it on before the next sample is looked at)."""
    samples, i = report.samples, 0
    while i < len(samples):
        s = samples[i]
        found = sched.check_result(report.worker_id, s.group_id, s.attempt)
        if isinstance(found, str):
            out.emit(Refused(reason=found, worker_id=report.worker_id, group_id=s.group_id, attempt=s.attempt,
                             index=s.index))  # fmt: skip
            i += 1
            continue
        i, failed = _take_run(sched, found, report, i, out)
        if failed is not None:
            _failed(sched, found, failed, out)
        elif len(found.done) == sched.cfg.group_size:
            sched.release(found)
            yield found


def _take_run(sched: Scheduler, flight: Flight, report: ResultsReported, i: int, out: Outbox) -> tuple[int, str | None]:
    """Take the report's run of samples of the flight's lease from ``i`` on, until the group is complete, a sample
    fails it, or the run ends; free their slots once. Returns where the rest of the report starts, and the
    problem that failed the group (None if none did)."""
    cfg, worker, samples, payloads = sched.cfg, report.worker_id, report.samples, report.payloads
    G, swap = cfg.group_size, cfg.in_flight_swap
    group, attempt, done, version = samples[i].group_id, samples[i].attempt, flight.done, flight.version
    taken, failed = 0, None
    while i < len(samples) and (s := samples[i]).group_id == group and s.attempt == attempt:
        payload = payloads[i]
        i += 1
        index, segments = s.index, s.segments
        problem = None
        # the common case in one test: one run of tokens, all of the lease's version (else: the full check)
        if (
            swap
            or not 0 <= index < G
            or index in done
            or s.finish is Finish.ERROR
            or len(segments) != 1
            or segments[0][0] != version
            or segments[0][1] < 0
        ):
            problem = _sample_problem(cfg, flight, s)
        if problem is None:
            sched.take(flight, ReadySample(index=index, segments=segments, finish=s.finish, payload=payload), s.reward)
            taken += 1
            if len(done) == G:
                break
            continue
        out.emit(Refused(reason=problem, worker_id=worker, group_id=group, attempt=attempt, index=index))
        if problem != "duplicate_sample":
            failed = problem
            break
    sched.took(flight, taken)
    return i, failed


def _failed(sched: Scheduler, flight: Flight, problem: str, out: Outbox) -> None:
    """A sample of the flight failed: the group re-runs whole, unless it failed too often to be re-run."""
    if sched.fail(flight) >= sched.cfg.max_group_failures:
        raise GroupFailed(
            f"group {flight.group_id} failed {flight.failures} times (last: {problem}); "
            "it can be neither trained nor dropped"
        )
    sched.requeue(flight, out)


def _sample_problem(cfg: CoreConfig, flight: Flight, ev: Result) -> str | None:
    """Why a finished sample of the flight's current lease cannot be taken; None if it can."""
    if not 0 <= ev.index < cfg.group_size:
        return "bad_sample_index"
    if ev.index in flight.done:
        return "duplicate_sample"
    if ev.finish is Finish.ERROR:
        return "generation_error"
    if not ev.segments or any(n < 0 for _, n in ev.segments):
        return "bad_segments"
    if cfg.in_flight_swap:
        # partial resumes on newer weights by design: no token may predate the start version (C1 is counted).
        if any(v < flight.version for v, _ in ev.segments):
            return "wrong_version"
    elif any(v != flight.version for v, _ in ev.segments):
        return "c1_violation"
    return None
