"""Held-out evaluation during a run, by the rollout workers, outside everything the core decides.

Every ``eval.every_steps`` published versions (and version 0 when the fleet is first ready) a round opens:
each held-out row is to be sampled ``eval.samples`` times on exactly that version. ``EvalRounds`` is the
plain state of the rounds: which rows are done, which are out at which worker and since when. It reads
which workers serve a version (``serving``, taken from the core's ledger by the caller) and never writes
anything the core owns: no lease, no slot, no group, no deadline, no transfer-queue entry. So evaluation
traffic changes no training decision (a property test drives the core with and without it and compares
every action). The workers keep their version while they hold evaluation requests of it (C1 for the
evaluation too), so a round normally completes on the version it opened for; a round whose version is
retired first is dropped, counted and logged, never reported half done.

Every row of a round is sent at once, spread over the ready workers of its version, as soon as there are
any: the core may move those workers to a newer version at its next publish, and a worker holding
evaluation requests keeps its version until they are done, so the rows already out complete on the right
weights even after the core has retired that version. A row goes again to some worker of the version when
its worker is lost or no answer came within ``retry_s`` (requests are unnumbered and answers idempotent: a
row's first answer counts); a round with a row that no worker of its version can take any more is dropped.

When the last step is published the broker waits (as long as a row may take, ``retry_s``) for the rounds
that can still close before it lets the workers go, so the last rounds asked for are reported: a run ending
faster than its workers answer would otherwise lose them without a word. What is still open then is dropped
(under way) or ends unstarted (no row ever sent, such as the final version's when no worker loaded it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog

from dora.config import ConfigError
from dora.config.run import RunConfig
from dora.core.core import Core
from dora.ids import WorkerId
from dora.tasks.heldout import row_seed, summarize
from dora.tasks.prompts import eval_task
from dora.wire import messages as m

log = structlog.get_logger()


@dataclass(slots=True)
class Round:
    version: int
    opened: float
    results: dict[int, tuple[list[float], list[int], int]] = field(default_factory=dict)
    """row -> (rewards, completion lengths, failed rewards)."""
    out: dict[int, tuple[WorkerId, float]] = field(default_factory=dict)
    """row -> (worker, when sent) for rows sent and not answered."""


class EvalRounds:
    def __init__(self, prompts: Sequence[np.ndarray], *, every_steps: int, samples: int, temperature: float,
                 max_tokens: int, seed: int, retry_s: float) -> None:  # fmt: skip
        if every_steps < 1 or not prompts:
            raise ValueError("evaluation rounds need every_steps >= 1 and at least one held-out row")
        self.prompts = prompts
        self.every_steps = every_steps
        self.samples, self.temperature, self.max_tokens, self.seed = samples, temperature, max_tokens, seed
        self.retry_s = retry_s
        self.rounds: dict[int, Round] = {}
        self.dropped: list[int] = []
        """Versions whose round was dropped: retired before every row was answered."""

    def published(self, version: int, now: float) -> bool:
        """A version is out: open its round if it is due (version 0 counts). True if a round opened."""
        if version % self.every_steps or version in self.rounds:
            return False
        self.rounds[version] = Round(version=version, opened=now)
        return True

    def plan(self, now: float, serving: Mapping[int, Sequence[WorkerId]]) -> list[tuple[WorkerId, m.Evaluate]]:
        """The requests to send now: every row of an open round that is neither answered nor out (or out too
        long), spread over the ready workers of its version, least loaded first. ``serving``: version -> its
        ready workers."""
        load: dict[WorkerId, int] = {}
        for r in self.rounds.values():
            for w, _ in r.out.values():
                load[w] = load.get(w, 0) + 1
        sends = []
        for version, r in sorted(self.rounds.items()):
            workers = list(serving.get(version, ()))
            if not workers:
                continue
            for row in self._unsent(r, now):
                w = min(workers, key=lambda x: (load.get(x, 0), x))
                load[w] = load.get(w, 0) + 1
                r.out[row] = (w, now)
                sends.append((w, m.Evaluate(version=version, round=version, row=row, prompt_ids=self.prompts[row],
                                            n_samples=self.samples, max_tokens=self.max_tokens,
                                            temperature=self.temperature, seed=row_seed(self.seed, row))))  # fmt: skip
        return sends

    def _unsent(self, r: Round, now: float) -> list[int]:
        """Rows of a round neither answered nor out at a worker (a row out longer than retry_s counts as lost)."""
        return [row for row in range(len(self.prompts))
                if row not in r.results and not (row in r.out and now - r.out[row][1] < self.retry_s)]  # fmt: skip

    def finished(self, msg: m.EvalFinished) -> dict[str, Any] | None:
        """A row's answer; the round's metrics when it was the last row (the round then closes)."""
        r = self.rounds.get(msg.version)
        if r is None or msg.row in r.results or not 0 <= msg.row < len(self.prompts):
            return None  # a late copy, or for a round already closed
        if len(msg.rewards) != self.samples or len(msg.lengths) != self.samples:
            log.warning("eval_answer_malformed", version=msg.version, row=msg.row, samples=len(msg.rewards))
            return None
        r.out.pop(msg.row, None)
        r.results[msg.row] = ([float(x) for x in msg.rewards], [int(x) for x in msg.lengths], int(msg.failed))
        if len(r.results) < len(self.prompts):
            return None
        del self.rounds[msg.version]
        rows = [r.results[i] for i in range(len(self.prompts))]
        out: dict[str, Any] = summarize([x[0] for x in rows], [x[1] for x in rows])
        out.update(version=msg.version, reward_failures=float(sum(x[2] for x in rows)))
        return out

    def worker_lost(self, worker: WorkerId) -> None:
        """Its rows go to another worker of the version on the next plan."""
        for r in self.rounds.values():
            for row in [row for row, (w, _) in r.out.items() if w == worker]:
                del r.out[row]

    def answerable(self, serving: Mapping[int, Sequence[WorkerId]], now: float) -> bool:
        """Whether an open round can still close: each of its rows left is out at a worker (not for too long)
        or its version has a ready worker to take it. ``serving``: version -> its ready workers."""
        return any(serving.get(v) or not self._unsent(r, now) for v, r in self.rounds.items())

    def abandon(self) -> tuple[list[int], list[int]]:
        """Close every open round (the run is over and its workers leave): those under way are dropped, those
        not started yet (no row sent, e.g. the final version's, which its workers never loaded) simply end.
        The versions (dropped, not started)."""
        dropped = sorted(v for v, r in self.rounds.items() if r.results or r.out)
        unstarted = sorted(v for v in self.rounds if v not in dropped)
        for v in dropped:
            log.warning("eval_round_dropped", version=v, answered=len(self.rounds[v].results), rows=len(self.prompts),
                        reason="run ended")  # fmt: skip
        if unstarted:
            log.info("eval_rounds_not_started", versions=unstarted, reason="run ended")
        self.rounds.clear()
        self.dropped += dropped
        return dropped, unstarted

    def drop_retired(self, alive: Callable[[int], bool], now: float) -> list[int]:
        """Drop the rounds of versions no longer alive that still have a row to send (no worker can take it on
        that version any more; rows already out still come back); the versions dropped."""
        gone = [v for v, r in self.rounds.items() if not alive(v) and self._unsent(r, now)]
        for v in gone:
            log.warning("eval_round_dropped", version=v, answered=len(self.rounds[v].results), rows=len(self.prompts))
            del self.rounds[v]
        self.dropped += gone
        return gone


PLAN_EVERY_S = 0.05
"""How often the rounds are planned at most: soon after a version's workers are ready, without scanning the rows
on every turn of a busy broker's loop."""


class BrokerEval:
    """The actor's side of the rounds: opens them as versions come out, sends what ``EvalRounds`` plans to the
    ready workers of each round's version (read off the core, never written), and reports closed rounds (and
    dropped ones, as ``{"version": v, "dropped": True}``).
    With no rounds configured every call does nothing."""

    def __init__(self, rounds: EvalRounds | None, core: Core, send: Callable[[WorkerId, Any], None],
                 report: Callable[[dict[str, Any]], None]) -> None:  # fmt: skip
        self.rounds = rounds
        self.core = core
        self.send = send
        self.report = report
        self.started = False
        self.next_plan = 0.0

    def published(self, version: int, now: float) -> None:
        if self.rounds is not None:
            self.rounds.published(version, now)

    def tick(self, now: float) -> None:
        """Called on every turn of the actor's loop; plans at most every PLAN_EVERY_S while a round is open."""
        if self.rounds is None or not self.core.fleet_ready or now < self.next_plan:
            return
        self.next_plan = now + PLAN_EVERY_S
        if not self.started:  # the version the run starts from (0, or a resumed one)
            self.started = True
            self.rounds.published(self.core.view.newest, now)
        for version in self.rounds.drop_retired(lambda v: v in self.core.view.alive(), now):
            self.report({"version": version, "dropped": True})
        for worker, msg in self.rounds.plan(now, serving(self.core, self.rounds.rounds)):
            self.send(worker, msg)

    @property
    def drain_s(self) -> float:
        """How long the end of the run waits for open rounds at most: as long as one row may take to answer."""
        return self.rounds.retry_s if self.rounds is not None else 0.0

    def open(self, now: float) -> bool:
        """Whether a round is open that can still close: the broker waits for it at the end of the run, so the
        last rounds the run asked for are reported rather than lost."""
        if self.rounds is None or not self.rounds.rounds:
            return False
        return self.rounds.answerable(serving(self.core, self.rounds.rounds), now)

    def abandon(self) -> None:
        """The run is over and the wait for open rounds ran out: each is reported dropped."""
        if self.rounds is not None:
            for version in self.rounds.abandon()[0]:
                self.report({"version": version, "dropped": True})

    def finished(self, msg: m.EvalFinished) -> None:
        if self.rounds is not None and (result := self.rounds.finished(msg)) is not None:
            self.report(result)

    def worker_lost(self, worker: WorkerId) -> None:
        if self.rounds is not None:
            self.rounds.worker_lost(worker)


def serving(core: Core, versions: Iterable[int]) -> dict[int, list[WorkerId]]:
    """The ready workers of each version (pinned to it, loaded, not leaving), read off the core."""
    alive = core.view.alive()
    return {v: core.view.serving(v) for v in versions if v in alive}


def eval_rounds(cfg: RunConfig) -> EvalRounds | None:
    """The rounds ``[eval]`` asks for (every_steps > 0 with a dataset), with the held-out prompts encoded as the
    workers will sample them; None when evaluation rounds are off."""
    e = cfg.eval
    if not (e.dataset and e.every_steps):
        return None
    if not cfg.task.tokenizer:
        raise ConfigError("eval.every_steps needs task.tokenizer (the model folder), to encode the held-out rows")
    held = eval_task(cfg, cfg.task.tokenizer)
    rows = held.rows[: e.limit] if e.limit else held.rows
    prompts = [np.array(held.encode(held.texts[r.index]), dtype=np.int32) for r in rows]
    b = cfg.broker
    return EvalRounds(prompts, every_steps=e.every_steps, samples=e.samples, temperature=e.temperature,
                      max_tokens=e.max_tokens or cfg.run.max_tokens, seed=cfg.run.seed,
                      retry_s=max(30.0, 4 * b.heartbeat_interval_s * b.liveness))  # fmt: skip
