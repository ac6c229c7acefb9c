"""`dora broker --config run.toml [--set section.key=value ...]`"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import secrets
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import structlog
import uvloop
import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from dora.actor.cluster import ClusterInfo
from dora.actor.discovery import advertised, announce, mark_finished
from dora.actor.security import Keys
from dora.actor.signals import ignore_sigterm_while_exiting
from dora.broker.actor import BrokerActor
from dora.broker.evaluation import EvalRounds, eval_rounds
from dora.broker.journal import Journal, JournalError, replay
from dora.broker.metrics import serve_http
from dora.config import ConfigError, load
from dora.config.run import RunConfig
from dora.core.core import Core
from dora.logging import configure_logging
from dora.store.dirs import retire_older
from dora.tasks.prompts import prompt_source

log = structlog.get_logger()

GC_THRESHOLDS = (2_000, 20, 50)
"""The broker's cyclic-GC thresholds (CPython's: 700, 10, 10). Its live state (finished groups waiting for a batch,
their samples' headers, outboxes) is tens of thousands of objects that outlive a few young collections, so with
the defaults a full collection ran about once a second at 1,024 workers and held the event loop 30-120 ms each
time (bench/many_workers.py: loop-lag p99 35 ms at B = 128, 91 ms at B = 512). With these, full collections are
rare and a middle one costs ~5-10 ms (p99 13.5 and 18 ms)."""


def tune_gc() -> None:
    """Freeze what the process built before serving (modules, config, the task's data: never garbage, no longer
    scanned) and make full collections rare (GC_THRESHOLDS). For the broker's process only, from ``main``."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="dora broker", description="The broker: ledger, scheduler, transfer queue, orchestrator."
    )
    p.add_argument("--config", metavar="FILE.toml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = p.parse_args(argv)
    try:
        cfg = load(RunConfig, path=args.config, env=os.environ, env_prefix="DORA_", overrides=args.set)
        cluster = ClusterInfo.from_env(os.environ)
    except (ConfigError, ValueError) as e:
        print(f"dora broker: {e}", file=sys.stderr)
        return 2
    try:
        prompts, about = prompt_source(cfg)
        evals = eval_rounds(cfg)
    except ValueError as e:
        print(f"dora broker: {e}", file=sys.stderr)
        return 2
    configure_logging(cfg.log, process="broker", **cluster.log_fields())
    log.info("task_loaded", **about, eval_rows=len(evals.prompts) if evals else 0)
    tune_gc()
    return uvloop.run(serve(cfg, prompts, cluster, about, evals))


def open_router(ctx: zmq.asyncio.Context, cfg: RunConfig, keys: Keys | None = None) -> tuple[zmq.asyncio.Socket, str]:
    """The broker's ROUTER: unroutable sends raise (never dropped silently), explicit HWMs, no linger,
    a cap on message size, CURVE when ``keys`` are given; bound to ``broker.bind``. Returns the socket
    and the endpoint it got."""
    sock = ctx.socket(zmq.ROUTER)
    if keys is not None:
        keys.serve(sock)
    for opt, value in (
        (zmq.ROUTER_MANDATORY, 1),
        (zmq.LINGER, 0),
        (zmq.SNDHWM, cfg.broker.hwm),
        (zmq.RCVHWM, cfg.broker.hwm),
        (zmq.MAXMSGSIZE, cfg.broker.max_message_bytes),
    ):
        sock.setsockopt(opt, value)
    sock.bind(cfg.broker.bind)
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


async def serve(cfg: RunConfig, prompts: Callable[[int], np.ndarray], cluster: ClusterInfo | None = None,
                task: dict[str, Any] | None = None, evals: EvalRounds | None = None) -> int:  # fmt: skip
    """Serve a run; ``task``: what the task is (``TaskRun.about``), a dataset's identity goes into the journal."""
    cluster = cluster or ClusterInfo(host=socket.gethostname())
    stop = _stop_on_signals()
    ctx = zmq.asyncio.Context()
    auth = None
    try:
        try:
            keys, auth = _curve(ctx, cfg)
        except ValueError as e:
            print(f"dora broker: {e}", file=sys.stderr)
            return 2
        sock, endpoint = open_router(ctx, cfg, keys)
        epoch = secrets.randbits(62)
        try:
            core, journal, weights = open_journal(cfg, epoch, cluster, task)
        except (JournalError, ConfigError) as e:
            log.error("journal_unusable", error=str(e))
            print(f"dora broker: {e}", file=sys.stderr)
            return 2
        ready = {"event": "ready", "endpoint": advertised(endpoint, cfg.broker.advertise or cluster.host),
                 "bound": endpoint, "pid": os.getpid(), "broker_epoch": epoch, "host": cluster.host}  # fmt: skip
        if cluster.job_id is not None:  # a later attempt of this job ignores a file an earlier one left
            ready.update(slurm_job_id=cluster.job_id, slurm_restart=cluster.restart_count)
        started = await _start(cfg, cluster, ready, lambda: BrokerActor(
            cfg, sock, core, prompts, epoch=epoch, journal=journal, weights=weights, keys=keys, evals=evals
        ))  # fmt: skip
        if isinstance(started, str):
            log.error("broker_unusable", error=started)
            print(f"dora broker: {started}", file=sys.stderr)
            return 2
        actor, http = started
        announce(ready, cfg.broker.discovery_file)
        await _run(actor, stop, ready, http, journal)
        return 0
    finally:
        if auth is not None:
            auth.stop()
        ignore_sigterm_while_exiting()  # first: a SIGTERM would cut short the wait for a Goodbye to leave
        ctx.destroy(linger=0)


def _stop_on_signals() -> asyncio.Event:
    """Set on SIGTERM or SIGINT. SIGUSR1 (Slurm's early warning, if sent to every step) is logged and ignored:
    the journal is already durable, nothing to do but not die of it, its default action."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, lambda: log.info("signal_ignored", signal="SIGUSR1"))
    return stop


def _curve(ctx: zmq.asyncio.Context, cfg: RunConfig) -> tuple[Keys | None, AsyncioAuthenticator | None]:
    """With ``security.keys``: the keys, and the authenticator started that admits only them (ValueError: the keys
    cannot be read). Without: neither."""
    if not cfg.security.keys:
        return None, None
    keys = Keys.load(cfg.security.keys)
    auth = AsyncioAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback("*", keys)
    log.info("curve_on", keys=cfg.security.keys, allowed=len(keys.roles))
    return keys, auth


async def _start(
    cfg: RunConfig, cluster: ClusterInfo, ready: dict[str, Any], make: Callable[[], BrokerActor]
) -> tuple[BrokerActor, asyncio.Server | None] | str:
    """The actor (``make``), and its metrics served over HTTP when ``broker.metrics_bind`` asks (their URL goes
    into ``ready``); or why the broker cannot start."""
    what = "cannot open broker.metrics_file or broker.timeline_file"
    try:
        actor = make()
        if not cfg.broker.metrics_bind:
            return actor, None
        what = f"cannot serve metrics on broker.metrics_bind={cfg.broker.metrics_bind}"
        http, ready["metrics_url"] = await serve_http(
            actor.metrics.registry, cfg.broker.metrics_bind, cfg.broker.advertise or cluster.host
        )
        return actor, http
    except OSError as e:
        return f"{what}: {e}"
    except ConfigError as e:  # a [metrics] sink that cannot start: its library missing, or wandb refused
        return str(e)


async def _run(
    actor: BrokerActor, stop: asyncio.Event, ready: dict[str, Any], http: asyncio.Server | None, journal: Journal | None
) -> None:
    """Run until the run is over or ``stop``; then close what was opened and let the last replies leave."""
    try:
        await actor.run(stop)
        if actor.done.is_set():  # the run is over (not stopped): a peer away at the goodbye reads it here
            mark_finished(ready, actor.cfg.broker.discovery_file)
    finally:
        if http is not None:
            http.close()
        actor.metrics.close()
        if journal is not None:
            journal.close()
    actor.flush()
    await asyncio.sleep(0.05)  # let the last replies (goodbyes) leave before the socket closes


def open_journal(cfg: RunConfig, epoch: int, cluster: ClusterInfo | None = None, task: dict[str, Any] | None = None
                 ) -> tuple[Core, Journal | None, dict[int, tuple[str, str]] | None]:  # fmt: skip
    """The core, fresh or rebuilt from ``broker.journal``; the journal to append to; the newest weights.

    A dataset's rows and fingerprint are part of the run's shape: the journal's cursor names positions in the
    dataset's epoch order (``dora.tasks.datasets.Epochs``), so a broker resumed on other rows would train
    some twice and some never; it is refused."""
    if not cfg.broker.journal:
        return Core(cfg.core, strict=cfg.broker.strict), None, None
    shape: dict[str, Any] = {"mode": cfg.core.mode.value, "max_staleness": cfg.core.max_staleness,
                             "train_groups": cfg.core.train_groups, "group_size": cfg.core.group_size}  # fmt: skip
    if cfg.core.filter_uniform:  # the ids a run hands out depend on it (the budget moves with every group filtered)
        shape["filter_uniform"] = True
    if task and "fingerprint" in task:
        shape["dataset"] = {"rows": task["kept"], "seed": cfg.task.seed, "fingerprint": task["fingerprint"]}
    past = replay(cfg.broker.journal)
    if past.epochs and past.shape != shape:
        raise ConfigError(f"the journal {cfg.broker.journal} was written by a run with {past.shape}, not {shape}")
    if past.weights is not None:  # the rebuilt ledger holds only the newest version: nothing would retire the rest
        for path in retire_older(past.weights[0]):
            log.info("version_retired", version=int(path.name[1:]), deleted=str(path), reason="restart")
    core = Core(cfg.core, initial_version=past.newest, start_cursor=past.reserved, strict=cfg.broker.strict)
    owed = past.owed
    past_budget = core.restore(owed, filtered=len(past.filtered))
    journal = Journal(cfg.broker.journal)
    about = {}
    if cluster is not None and cluster.job_id is not None:
        about = {"slurm_job_id": cluster.job_id, "slurm_restart": cluster.restart_count}
    journal.start(epoch, shape, past.reserved, about)
    if past.epochs:
        log.info("resumed_from_journal", version=past.newest, trained_groups=len(past.trained),
                 filtered_groups=len(past.filtered),
                 owed_groups=len(owed) - past_budget, reserved_past_budget=past_budget,
                 earlier_epochs=len(past.epochs), journal=cfg.broker.journal)  # fmt: skip
    return core, journal, {past.newest: past.weights} if past.weights else None
