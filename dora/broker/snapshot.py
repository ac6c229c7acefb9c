"""What a running broker is doing, read off the actor and its core: the `dora status` snapshot.

Read-only: nothing here changes the broker's state, so it may run between any two events (a status
request, a metrics scrape).
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from dora.config.run import RunConfig
from dora.core.core import Core


class Totals(Protocol):
    def totals(self) -> dict[str, float]: ...


class LatestMetrics(Protocol):
    """The numbers the broker was last told: the learner's latest step, the latest held-out round, and the
    rollout workers' own counters summed over the run."""

    learner: dict[str, float]
    held_out: dict[str, float]

    @property
    def workers(self) -> Totals: ...


class BrokerView(Protocol):
    """What the operators' views read off a running broker (``BrokerActor`` is one): its core and the counts
    the actor keeps beside it. Nothing here imports the actor, so the actor can import its views."""

    cfg: RunConfig
    core: Core
    clock: Callable[[], float]
    started: float
    epoch: int
    trained_tokens: int
    counters: Counter[str]
    malformed: Counter[str]
    lost: deque[dict[str, Any]]
    lag_s: deque[float]

    @property
    def decision_s(self) -> Mapping[str, float]:
        """Seconds spent in the core's decisions, by event kind."""

    @property
    def metrics(self) -> LatestMetrics: ...


def per_version(core: Core) -> dict[int, dict[str, Any]]:
    """Workers, running and queued groups and ledger state of every live version (and of retired versions
    that still own a queued re-run)."""
    return {v: dataclasses.asdict(row) for v, row in core.view.versions().items()}


def lag_ms(lags: deque[float]) -> dict[str, float]:
    """p50, p99 and max of the timer's lateness, in ms."""
    if not lags:
        return {}
    ordered = sorted(lags)

    def pick(q: float) -> float:
        return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)

    return {"p50": pick(0.5), "p99": pick(0.99), "max": pick(1.0)}


def snapshot(actor: BrokerView) -> dict[str, Any]:
    core, view = actor.core, actor.core.view
    totals = view.totals()
    elapsed = max(actor.clock() - actor.started, 1e-9)
    return {
        "mode": core.cfg.mode.value,
        "step": core.step,
        "newest_version": view.newest,
        "broker_epoch": actor.epoch,
        "versions": {str(v): row for v, row in per_version(core).items()},
        "workers": {
            s.worker_id: {
                "version": s.version,
                "ready": s.ready,
                "leaving": s.leaving,
                "used": s.used,
                "slots": s.slots,
                "groups": len(s.leases),
            }
            for s in view.workers()
        },
        "finished_waiting": totals.finished_waiting,
        "fleet_ready": core.fleet_ready,
        "staleness": {str(k): n for k, n in sorted(totals.staleness.items())},
        "trained_tokens": actor.trained_tokens,
        "tokens_per_s": actor.trained_tokens / elapsed,
        "migrated_groups": totals.migrated_groups,
        "requeued_groups": totals.requeued,
        "counters": dict(actor.counters),
        "decision_s": dict(actor.decision_s),
        "lost_peers": list(actor.lost),
        "malformed": dict(actor.malformed),
        "loop_lag_ms": lag_ms(actor.lag_s),
        "uptime_s": elapsed,
        "learner": dict(actor.metrics.learner),
        "held_out": dict(actor.metrics.held_out),
        "worker_counters": actor.metrics.workers.totals(),
    }
