"""The `sim` engine: the simulator's timing model run in real time, producing synthetic tokens.

It uses the very same ``dora.sim.engine.Engine`` (slots, KV budget, preemption, prefill) and the
run's workload, so a live run is comparable to `dora sim` on the same config. Real time is scaled:
``time_scale`` real seconds per simulated second.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from dora.config.sim import EngineSection
from dora.ids import AttemptId, Finish, GroupId
from dora.rollout.engines.base import WorkerEngine
from dora.samples import FinishedSample
from dora.sim.engine import Engine, Request, decode_step_s
from dora.sim.workload import Workload
from dora.tasks.synthetic import completion, reward
from dora.wire import messages as m


class SimEngine(WorkerEngine):
    """It holds one version, the one it took last (``held_versions``)."""

    name = "sim"

    def __init__(self, cfg: EngineSection, workload: Workload, *, max_slots: int, time_scale: float,
                 now: float) -> None:
        self.cfg = cfg
        self.workload = workload
        self.scale = time_scale
        self.engine = Engine(max_slots, cfg.kv_budget_tokens)
        self.last = now
        self.debt_s = 0.0
        self.generated = 0
        self.paused = False
        self.finished: list[Request] = []
        """Samples done but not yet reported (``take_finished`` hands them over, in order)."""

    @property
    def tokens_generated(self) -> int:
        return self.generated

    @property
    def version(self) -> int | None:
        return self.engine.version

    def held_versions(self) -> set[int]:
        return set() if self.version is None else {self.version}

    def load_seconds(self) -> float:
        return self.cfg.load_s * self.scale

    def busy(self) -> bool:
        return len(self.engine) > 0

    def loaded(self, version: int, uri: str = "", sha256: str = "", keep: frozenset[int] = frozenset(),
               inline: Mapping[str, bytes] = {}) -> None:  # fmt: skip
        """The version's weights are in (the sim engine has none to read: ``uri`` names them only)."""
        if len(self.engine):
            self.debt_s += self.cfg.prefill_s_per_token * self.engine.swap_weights(version)
        self.engine.version = version

    def submit(self, gen: m.Generate, now: float) -> None:
        self.advance(now)
        prompt = len(gen.prompt_ids)
        reqs = [
            Request(gen.group_id, gen.attempt, i, self.workload.length(gen.group_id, i, gen.attempt), prompt)
            for i in range(gen.n_samples)
        ]
        self.debt_s += self.cfg.prefill_s_per_token * self.engine.submit(reqs)

    def export(self, group: int, attempt: int, now: float) -> list[m.RequestState]:
        self.advance(now)
        out = []
        for r in self.engine.remove(group, attempt):
            ids, lps = completion(self.workload, group, r.index, attempt, 0, round(r.generated))
            out.append(m.RequestState(index=r.index, token_ids=ids, logprobs=lps))
        return out

    def import_(self, mig: m.MigrateIn, now: float) -> None:
        self.advance(now)
        reqs = []
        for st in mig.requests:
            r = Request(
                mig.group_id,
                mig.attempt,
                st.index,
                self.workload.length(mig.group_id, st.index, mig.attempt),
                len(mig.prompt_ids),
                generated=float(len(st.token_ids)),
            )
            if len(st.token_ids):
                r.closed = [[mig.version, len(st.token_ids)]]
            r.open_at = r.generated
            r.has_kv = self.cfg.kv_transfer
            reqs.append(r)
        self.debt_s += self.cfg.prefill_s_per_token * self.engine.submit(reqs, front=True)

    def cancel(self, group: int, attempt: int, now: float) -> None:
        self.advance(now)
        self.engine.remove(group, attempt)

    def advance(self, now: float) -> None:
        """Bring the engine up to ``now``; what finishes waits in ``finished`` until taken."""
        dt = max(0.0, (now - self.last) / self.scale)
        self.last = now
        if self.paused or self.engine.version is None:
            return
        pay = min(self.debt_s, dt)
        self.debt_s -= pay
        dt -= pay
        if dt <= 0 or not self.engine.running:
            return
        before = self.engine.counter
        done, prefill = self.engine.run_for(dt / decode_step_s(self.cfg, len(self.engine.running)))
        self.generated += round((self.engine.counter - before) * max(len(self.engine.running), 1))
        self.debt_s += self.cfg.prefill_s_per_token * prefill
        self.finished.extend(done)

    def take_finished(self) -> list[Request]:
        done, self.finished = self.finished, []
        return done

    def next_event_s(self) -> float | None:
        """Real seconds until the next request finishes (or the KV cache fills); None when idle."""
        steps = self.engine.steps_to_next()
        if steps is None or self.engine.version is None or self.paused:
            return None
        return (self.debt_s + steps * decode_step_s(self.cfg, len(self.engine.running))) * self.scale

    def result(self, r: Request, broker_epoch: int) -> FinishedSample:
        ids, lps = completion(self.workload, r.group_id, r.index, r.attempt, 0, r.length)
        return FinishedSample(
            group_id=GroupId(r.group_id),
            attempt=AttemptId(r.attempt),
            index=r.index,
            segments=np.array(r.segments(), dtype=np.int32).reshape(-1, 2),
            token_ids=ids,
            logprobs=lps,
            reward=reward(self.workload, r.group_id, r.index, r.attempt),
            finish=Finish.LENGTH if r.length >= self.workload.spec.cap else Finish.STOP,
            broker_epoch=broker_epoch,
        )

    def load(self) -> tuple[int, float]:
        """(running sequences, KV use 0..1) for heartbeats."""
        return len(self.engine.running), max(0.0, min(1.0, self.engine.kv_used() / self.engine.kv_budget))

    def clear(self) -> None:
        self.engine.clear()
        self.finished.clear()
        self.debt_s = 0.0
