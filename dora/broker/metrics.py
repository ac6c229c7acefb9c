"""The broker's numbers for operators: Prometheus metrics, and the run's record files.

Prometheus: one ``CollectorRegistry`` per broker. Most numbers already live in the actor and its core
(workers per version, queues, the staleness histogram, migrations, malformed frames); the collector
reads them when scraped instead of keeping a second copy. What leaves no trace in that state is
counted as it happens: leases, lease latency, train steps, lost peers, event-loop lag. The endpoint
(`serve_http`) is an asyncio server in the broker's own event loop, so a scrape runs between two
events and sees one consistent state.

Record files (JSON lines, appended to, one ``write`` per line): ``broker.metrics_file`` gets one line
per train step, ``broker.timeline_file`` one per worker event (joined, assigned, ready, lost) and per
published version, each with the wall-clock time ``t``. `dora plot` draws a run from them.

Sinks (``[metrics]``, dora.broker.sinks): each train step's line also goes to TensorBoard and Weights & Biases
when configured, as named scalars; other streams (a held-out evaluation) log through ``scalars``.

What the rollout workers count themselves (reward service calls, agent episodes that failed: their heartbeats'
``counters``) is summed over the run's worker processes by ``WorkerCounters``: Prometheus
``dora_worker_counters_total{name=...}``, and ``worker_counters`` in each train step's line.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import IO, Any, cast

import structlog
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from dora.broker.sinks import flatten, open_sinks, step_scalars
from dora.broker.snapshot import BrokerView, per_version
from dora.config.run import split_host_port
from dora.core import events as ev
from dora.core.core import Core
from dora.ids import GroupId, WorkerId
from dora.wire import messages as m

log = structlog.get_logger()

LEASE_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
STEP_BUCKETS_S = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
REQUEST_TIMEOUT_S = 5.0
"""A scrape must send its request within this long."""
REWARD_FAILED = "reward failed ("
"""The actor's counters of samples whose reward failed are ``reward failed (<reason>)``."""


class JsonLines:
    """An append-only JSON-lines file; each line is written whole and flushed."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: IO[str] = open(path, "a", buffering=1)  # noqa: SIM115 (closed by close())

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self._file.close()


class WorkerCounters:
    """The rollout workers' cumulative counters (``Heartbeat.counters``), summed over every worker process the run
    has had; no sum ever goes down.

    A worker process reports its counts since it started. They are kept per process, ``(name, host, pid)`` of its
    Hello: a worker that reconnects (a new session of the same process) goes on counting from where it was, a worker
    restarted is a new process starting from 0, and a process gone stays in the sums with the last counts it sent
    (what it counted after its last heartbeat is lost). A count a process reports lower than before (its pid reused
    by a restart) is taken as a new start: the earlier count is kept aside in the sum."""

    def __init__(self) -> None:
        self._latest: dict[tuple[str, str, int], dict[str, float]] = {}
        self._before: collections.defaultdict[str, float] = collections.defaultdict(float)
        """Counts of processes that started again under the same key, up to their restart."""

    def update(self, process: tuple[str, str, int], counters: Mapping[str, float]) -> None:
        """A heartbeat's counters from the worker process ``process``: ``(name, host, pid)``."""
        latest = self._latest.setdefault(process, {})
        for name, value in counters.items():
            before = latest.get(name, 0.0)
            if value < before:
                self._before[name] += before
            latest[name] = value

    def totals(self) -> dict[str, float]:
        """Each counter summed over the processes, by name (sorted)."""
        out = collections.defaultdict(float, self._before)
        for counters in self._latest.values():
            for name, value in counters.items():
                out[name] += value
        return {name: round(out[name], 6) for name in sorted(out)}


class BrokerMetrics:
    """The broker's Prometheus registry and record files, fed by the actor."""

    def __init__(self, actor: BrokerView, *, wall: Callable[[], float] = time.time) -> None:
        self.actor = actor
        self.wall = wall
        self.sinks = open_sinks(actor.cfg)  # first: one that cannot start is a ConfigError, before any file opens
        """TensorBoard and wandb, as ``[metrics]`` asks; a sink that fails is dropped (``sinks.failed``)."""
        b = actor.cfg.broker
        self.steps = JsonLines(b.metrics_file) if b.metrics_file else None
        self.timeline = JsonLines(b.timeline_file) if b.timeline_file else None
        self.evals = JsonLines(b.eval_file) if b.eval_file else None
        self.held_out: dict[str, float] = {}
        """The metrics of the latest held-out evaluation round."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.groups_leased = Counter("dora_groups_leased", "Groups leased to a worker (re-runs included)", registry=r)
        self.lease_latency = Histogram(
            "dora_lease_latency_seconds",
            "Seconds from a group's lease to its last sample accepted (a migrated group keeps its lease)",
            buckets=LEASE_BUCKETS_S,
            registry=r,
        )
        self.train_steps = Counter("dora_train_steps", "Train steps published by the learner", registry=r)
        self.eval_dropped = Counter("dora_eval_rounds_dropped", "Held-out evaluation rounds dropped (their version "
                                    "retired with rows left)", registry=r)  # fmt: skip
        self.step_time = Histogram(
            "dora_train_step_seconds", "Seconds between two published versions", buckets=STEP_BUCKETS_S, registry=r
        )
        self.peers_lost = Counter(
            "dora_peers_lost",
            "Peers declared dead (silent), stalled, or gone (goodbye, unreachable, ...), by role and reason",
            ["role", "reason"],
            registry=r,
        )
        self.loop_lag = Histogram(
            "dora_event_loop_lag_seconds",
            "Event-loop lag: how late the broker's loop woke a task that slept 50 ms",
            buckets=LAG_BUCKETS_S,
            registry=r,
        )
        r.register(self)
        self.learner: dict[str, float] = {}
        """The learner's metrics of the latest step."""
        self.workers = WorkerCounters()
        """The rollout workers' own counters, summed over the run."""
        self._leased_at: dict[GroupId, tuple[int, float]] = {}
        """group -> (attempt, when leased) for every group leased and not finished."""
        self._ready: dict[WorkerId, int] = {}
        """The version each worker has loaded, as last recorded on the timeline."""
        core = actor.core
        self.record("started", mode=core.cfg.mode.value, max_staleness=core.cfg.staleness,
                    train_groups=core.cfg.train_groups, group_size=core.cfg.group_size,
                    newest_version=core.view.newest, broker_epoch=actor.epoch)  # fmt: skip

    def close(self) -> None:
        for f in (self.steps, self.timeline, self.evals):
            if f is not None:
                f.close()
        self.sinks.close()

    # ------------------------------------------------------------------ what the actor reports

    def record(self, event: str, **fields: Any) -> None:
        if self.timeline is not None:
            self.timeline.write({"t": round(self.wall(), 4), "event": event, **fields})

    def fed(self, now: float, event: ev.Event, actions: list[ev.Action]) -> None:
        """One core event and the actions it gave: count leases, time finished groups, record worker events."""
        view = self.actor.core.view
        match event:
            case ev.WorkerJoined(worker_id=w) if (joined := view.worker(w)) is not None:
                self.record("joined", worker=w, slots=joined.slots)
            case ev.WorkerLost(worker_id=w, reason=reason):
                self._ready.pop(w, None)
                self.record("lost", worker=w, reason=reason)
            case ev.VersionLoaded(worker_id=w, version=v) if (loaded := view.worker(w)) is not None and loaded.ready:
                if self._ready.get(w) != v:
                    self._ready[w] = v
                    self.record("ready", worker=w, version=v)
            case ev.VersionPublished(version=v):
                self.record("published", version=v)
            case ev.ResultsReported(samples=samples):
                headers = cast("Sequence[m.SampleHeader]", samples)  # a broker's reports carry the wire's headers
                if any(s.reward_error for s in headers):
                    self.actor.counters.update(reward_failures(headers, actions))
                for group, attempt in {(s.group_id, s.attempt) for s in samples}:
                    leased = self._leased_at.get(group)
                    if leased is not None and leased[0] == attempt and not view.owes(group):
                        del self._leased_at[group]  # its last sample was taken: the group is finished
                        self.lease_latency.observe(now - leased[1])
        n_leased = 0
        for a in actions:
            match a:
                case ev.Lease():
                    n_leased += 1
                    self._leased_at[a.group_id] = (a.attempt, now)
                case ev.Pin():
                    self._ready.pop(a.worker_id, None)
                    self.record("assigned", worker=a.worker_id, version=a.version, interrupt=a.interrupt)
        if n_leased:
            self.groups_leased.inc(n_leased)  # once per event: the counter takes a lock per call

    def train_step(self, row: dict[str, Any], learner: dict[str, float], elapsed_s: float) -> None:
        """A published step: ``row`` as logged in ``train_step``, the learner's own metrics."""
        self.train_steps.inc()
        self.step_time.observe(row["step_s"])
        self.learner = dict(learner)
        line = dict(row, max_staleness=self.actor.core.cfg.staleness)
        theirs = learner.keys() - line.keys()
        line.update((k, v) for k, v in learner.items() if k in theirs)
        line.update(elapsed_s=round(elapsed_s, 3), t=round(self.wall(), 4))
        if self.steps is not None:
            self.steps.write(line)
        self.sinks.log(row["step"], step_scalars(line, learner=theirs))

    def scalars(self, step: int, prefix: str, values: Mapping[str, Any]) -> None:
        """Another stream's numbers at ``step`` to the sinks, named ``prefix/key`` (e.g. ``eval/reward_mean``)."""
        self.sinks.log(step, flatten(values, prefix))

    def eval_round(self, result: dict[str, Any]) -> None:
        """A held-out evaluation round of ``result["version"]``: its line, its scalars (``eval/...``), its gauges;
        or a round dropped (its version retired with rows left): counted and put on the timeline."""
        version = int(result["version"])
        if result.get("dropped"):
            self.eval_dropped.inc()
            self.record("eval_round_dropped", version=version)
            return
        self.held_out = {k: float(v) for k, v in result.items() if k != "version"}
        log.info("eval_round", **result)
        if self.evals is not None:
            self.evals.write({"step": version, **result, "t": round(self.wall(), 4)})
        self.scalars(version, "eval", self.held_out)

    def worker_counted(self, process: tuple[str, str, int], counters: Mapping[str, float]) -> None:
        """A rollout heartbeat's counters (none: nothing to do) from the worker process ``(name, host, pid)``."""
        if counters:
            self.workers.update(process, counters)

    def peer_lost(self, role: str, reason: str) -> None:
        self.peers_lost.labels(role=role, reason=reason.partition(":")[0]).inc()

    # ------------------------------------------------------------------ read at scrape time

    def collect(self) -> Iterator[Metric]:
        a = self.actor
        core, view = a.core, a.core.view
        rows = per_version(core)
        totals = view.totals()
        for key, name, doc in (
            ("workers", "dora_version_workers", "Rollout workers pinned to the version (loading or serving it)"),
            ("running", "dora_version_running_groups", "Groups of the version running on a worker"),
            ("queued", "dora_version_queued_groups", "Groups of the version waiting for a (re-)lease"),
        ):
            yield _by(GaugeMetricFamily, name, doc, "version", {str(v): r[key] for v, r in rows.items()})
        states = collections.Counter[str]({"loading": 0, "serving": 0, "leaving": 0})
        for w in view.workers():
            states["leaving" if w.leaving else "serving" if w.ready else "loading"] += 1
        yield _by(GaugeMetricFamily, "dora_workers", "Rollout workers by state", "state", states)
        yield _gauge("dora_newest_version", "Newest published policy version", view.newest)
        yield _gauge("dora_live_versions", "Versions alive (served or draining)", len(view.alive()))
        yield _gauge("dora_finished_groups_waiting", "Finished groups waiting for a train batch",
                     totals.finished_waiting)  # fmt: skip
        yield _gauge("dora_uptime_seconds", "Seconds since the broker started", a.clock() - a.started)
        hist = totals.staleness
        yield _staleness(hist, core.cfg.staleness)
        training, consumed = totals.in_training, totals.consumed
        yield _gauge("dora_batch_in_training", "1 while a delivered batch awaits its publish", training is not None)
        yield _counter("dora_consumed_groups", "Groups taken into train batches (the one in training too)", consumed)
        yield _counter("dora_consumed_samples", "Trajectories taken into train batches", sum(hist.values()))
        trained = consumed - (training or 0)
        yield _counter("dora_trained_groups", "Groups of published train steps", trained)
        yield _counter("dora_trained_tokens", "Completion tokens of published train steps", a.trained_tokens)
        yield _counter("dora_migrated_groups", "Groups handed to a same-version worker", totals.migrated_groups)
        yield _counter("dora_migrated_requests", "Running samples handed over", totals.migrated_requests)
        yield _counter("dora_requeued_groups", "Voided leases whose group runs again, whole", totals.requeued)
        yield _counter("dora_filtered_groups", "Groups consumed as filtered, all rewards equal (this broker's and "
                       "those its journal recorded)", totals.filtered)  # fmt: skip
        yield _by(CounterMetricFamily, "dora_malformed_frames", "Messages dropped as malformed", "reason", a.malformed)
        for prefix, name, doc in (
            ("handshake failed (", "dora_handshakes_failed", "CURVE handshakes refused"),
            (REWARD_FAILED, "dora_reward_failures", "Accepted samples whose reward failed"),
        ):
            counts = {k[len(prefix) : -1]: n for k, n in a.counters.items() if k.startswith(prefix)}
            yield _by(CounterMetricFamily, name, doc, "reason", counts)
        yield _by(CounterMetricFamily, "dora_core_decision_seconds", "Seconds in the core", "event", a.decision_s)
        yield _by(CounterMetricFamily, "dora_worker_counters", "What the rollout workers counted, summed over the "
                  "run's worker processes (reward service calls, failed episodes, ...)", "name",
                  self.workers.totals())  # fmt: skip
        yield _by(GaugeMetricFamily, "dora_learner_step_metric", "The learner's latest step", "name", self.learner)
        yield _by(GaugeMetricFamily, "dora_eval_metric", "The latest held-out evaluation round (accuracy, pass@k, ...)",
                  "name", self.held_out)  # fmt: skip
        yield _by(CounterMetricFamily, "dora_metrics_sink_failures", "Metrics sinks dropped on an error", "sink",
                  self.sinks.failed)  # fmt: skip


# ---------------------------------------------------------------------- rewards


def failure_reason(error: str) -> str:
    """A reward failure's reason, short and of few distinct values: up to the exception type (the text before the
    first ':'), at most 60 characters, without the leading 'reward '."""
    return error.partition(":")[0][:60].removeprefix("reward ").strip()


def reward_failures(samples: Sequence[m.SampleHeader], actions: Sequence[ev.Action]) -> collections.Counter[str]:
    """``REWARD_FAILED`` counters by reason for the samples of one report that the core took (the ones it refused,
    a copy sent twice or of a voided lease, are not counted again)."""
    refused = collections.Counter(
        (a.group_id, a.attempt, a.index) for a in actions if isinstance(a, ev.Refused) and a.index is not None
    )
    counts = collections.Counter[str]()
    for s in samples:
        key = (s.group_id, s.attempt, s.index)
        if refused[key] > 0:
            refused[key] -= 1
            continue
        error = s.reward_error
        if error:
            counts[f"{REWARD_FAILED}{failure_reason(error)})"] += 1
    return counts


def rounded(value: float) -> float:
    """A learner number as the broker logs and records it: 4 decimals, or 4 significant digits below 1 in size,
    where 4 decimals would leave a learning rate of 1e-6 or a log-prob gap of 3e-4 at nothing or one digit."""
    return float(f"{value:.4g}") if 0 < abs(value) < 1 else round(value, 4)


def step_row(core: Core, msg: m.WeightsPublished, step_s: float, rewards: dict[str, Any],
             workers: Mapping[str, float] | None = None) -> dict[str, Any]:  # fmt: skip
    """A published train step as the broker logs and records it (the learner's own numbers are kept apart);
    ``rewards``: its batch's reward stats (``batch_stats``); ``workers``: the workers' counters summed so far
    (``WorkerCounters.totals``), under ``worker_counters`` when there are any."""
    return {
        "step": msg.version - 1,
        "version": msg.version,
        "step_s": round(step_s, 3),
        "publish_s": msg.publish_s,
        "staleness": {str(k): n for k, n in sorted(core.view.totals().staleness.items())},
        "live_versions": core.view.alive(),
        "workers": core.view.worker_count(),
        **rewards,
        **({"worker_counters": dict(workers)} if workers else {}),
    }


def batch_stats(groups: Sequence[ev.ReadyGroup]) -> tuple[int, dict[str, Any]]:
    """A train step's batch in one pass over its samples: its completion tokens, and for the step's row how many
    of its samples' rewards failed and the mean of each reward component over the samples that have it (a reward
    function that returns a dict; a failed one has none)."""
    tokens, failed, counts = 0, 0, collections.Counter[str]()
    sums: collections.defaultdict[str, float] = collections.defaultdict(float)
    for g in groups:
        for s in g.samples:
            head: m.SampleHeader = s.payload[0]
            tokens += head.tokens
            if head.reward_error:
                failed += 1
            if head.reward_components:
                for name, part in head.reward_components.items():
                    sums[name] += part
                    counts[name] += 1
    means = {name: round(sums[name] / counts[name], 6) for name in sorted(sums)}
    return tokens, {"reward_failed": failed, "reward_components": means}


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _by(kind: type[Any], name: str, doc: str, label: str, values: Mapping[str, float]) -> Any:
    """A gauge or counter family with one sample per ``label`` value."""
    family = kind(name, f"{doc}, by {label}", labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([str(key)], value)
    return family


def _staleness(hist: Mapping[int, int], k: int) -> HistogramMetricFamily:
    """Trajectories consumed by staleness (learner version - dispatch version): buckets 0..max(K, worst seen)."""
    top, total = max([k, *hist]), sum(hist.values())
    buckets, below = [], 0
    for le in range(top):
        below += hist.get(le, 0)
        buckets.append((floatToGoString(le), below))
    buckets += [(floatToGoString(top), total), ("+Inf", total)]
    doc = "Staleness of trajectories taken into train batches (learner version - dispatch version)"
    return HistogramMetricFamily("dora_consumed_staleness_versions", doc, buckets=buckets,
                                 sum_value=sum(lag * n for lag, n in hist.items()))  # fmt: skip


# ---------------------------------------------------------------------- HTTP endpoint


async def serve_http(registry: CollectorRegistry, bind: str, public_host: str | None = None
                     ) -> tuple[asyncio.Server, str]:  # fmt: skip
    """Serve ``GET /metrics`` on ``bind`` (host:port) in this event loop. Returns the server and its URL, named
    by ``public_host`` (default: the host name) when ``bind`` is a wildcard address."""
    host, port = split_host_port(bind)
    server = await asyncio.start_server(functools.partial(_answer, registry), host, port)
    got = server.sockets[0].getsockname()
    shown = (public_host or socket.gethostname()) if host in ("0.0.0.0", "::") else host
    return server, f"http://{f'[{shown}]' if ':' in shown else shown}:{got[1]}/metrics"


async def _answer(registry: CollectorRegistry, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One HTTP/1.0 exchange: read the request line and headers, answer, close."""
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            request = (await reader.readline()).decode("latin-1").split()
            for _ in range(100 if request else 0):  # headers, up to the blank line; their content does not matter
                if (await reader.readline()).strip() in (b"", b"\r\n"):
                    break
        body: bytes | None
        if len(request) < 2:
            status, body, ctype = "400 Bad Request", b"bad request\n", "text/plain"
        elif request[0] not in ("GET", "HEAD"):
            status, body, ctype = "405 Method Not Allowed", b"GET /metrics\n", "text/plain"
        elif request[1].partition("?")[0] != "/metrics":
            status, body, ctype = "404 Not Found", b"dora broker: metrics are at /metrics\n", "text/plain"
        else:
            status, ctype, body = "200 OK", CONTENT_TYPE_PLAIN_0_0_4, _scrape(registry)
            if body is None:
                status, ctype, body = "500 Internal Server Error", "text/plain", b"the scrape failed: see the log\n"
        head = f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        writer.write(head.encode() + (b"" if request[:1] == ["HEAD"] else body))
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            await writer.drain()
    except (TimeoutError, ConnectionError, ValueError):
        pass  # a client that is slow, gone, or sent a line over the stream limit: nothing to answer
    finally:
        writer.close()


def _scrape(registry: CollectorRegistry) -> bytes | None:
    """The exposition text; None if a collector failed (logged: a scrape must never take the broker down)."""
    try:
        return generate_latest(registry)
    except Exception:
        log.exception("metrics_scrape_failed")
        return None
