"""A step-driven engine (torch or vllm) as a rollout worker's engine: protocol messages in, samples out.

The rollout actor drives every engine through the same calls (see ``dora.rollout.engines.base``).
Here a call to ``advance`` runs one engine step (a prefill of what joined, one decode step of what
runs) when there is work; finished samples are scored with the run's task reward and reported.

Weights: an ``Assign`` names the version's weights by URI. ``file://`` paths (or plain paths) are
loaded in place, checked against the published digest. ``sim://`` names the sim learner's versions,
which carry no weights: the engine keeps its tensors and takes the version label, so a live run with
the sim learner exercises versions, migration and C1 bookkeeping on a real model. A LoRA version's files may
come in the ``Assign`` itself (``inline``, ``dora.store.inline``): checked against the digest, they are loaded
and the URI is not read; a copy that does not check is logged and the URI read instead.

Versions: each Generate and MigrateIn names its version, and its samples run under that one (C1), which need not be
the newest: an engine of adapter versions (LoRA) holds several (``held_versions``, ``max_versions`` at most). Each
result's segments name the version its request ran under. Evaluation requests run under the current version.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import structlog

from dora.ids import AttemptId, Finish, GroupId
from dora.rollout.engines.base import Sample, SampleState, StepEngine, WorkerEngine, ran_under
from dora.rollout.engines.versions import ReadsVersions, Versions
from dora.samples import FinishedSample
from dora.store.inline import verified
from dora.tasks import combine
from dora.tasks.prompts import TaskRun
from dora.wire import messages as m

if TYPE_CHECKING:
    from dora.rollout.agents.episodes import AgentEpisodes
    from dora.rollout.episodes import Episodes

log = structlog.get_logger()


class KeepsVersions(StepEngine[Any], Protocol):
    """A step engine with its versions' bookkeeping (``dora.rollout.engines.versions``): the torch and vLLM engines.
    ``adapted``: its versions are adapters (a LoRA run), which may come inline."""

    versions: Versions[Any]

    @property
    def adapted(self) -> bool: ...


class StepWorkerEngine(ReadsVersions, WorkerEngine):
    def __init__(self, engine: KeepsVersions, task: TaskRun, held_out: TaskRun | None = None) -> None:
        """``engine``: a TorchEngine or VllmEngine; ``held_out``: the evaluation rows, when the broker runs
        evaluation rounds (``evaluate``)."""
        self.engine = engine
        self.versions = engine.versions
        """The engine's own (one bookkeeping, read by both)."""
        self.name = engine.name
        self.task = task
        self.held_out = held_out
        self.finished: list[Any] = []
        self.scored: dict[tuple[int, int, int], Any] = {}
        """(group, attempt, index) -> the reward of a finished sample, scored with the rest of its step at once (a
        reward service batches them: ``TaskRun.score_many``); ``result`` takes it."""
        self._paused = False
        self.eval_open: dict[tuple[int, int], tuple[m.Evaluate, list[Any]]] = {}
        """(round, row) -> the request and its finished samples. Evaluation sequences run beside the training
        ones under group ids below zero (-1 - row), never reported as training samples."""
        self.evaluated: list[m.EvalFinished] = []
        self.episodes: Episodes | AgentEpisodes | None = None
        """Multi-turn episodes, driven on this engine: an environment's (task.env, ``dora.rollout.episodes``) or an
        agent's (task.agent, ``dora.rollout.agents``)."""
        if getattr(task, "env", None) is not None:  # a custom task without environments has no env
            from dora.rollout.episodes import Episodes

            self.episodes = Episodes(engine, task)
        elif getattr(task, "agent", None) is not None:
            from dora.rollout.agents.episodes import AgentEpisodes

            self.episodes = AgentEpisodes(engine, task)

    @property
    def paused(self) -> bool:
        """Yielded to the trainer (elastic): nothing decodes; environments already called may still answer. The
        engine sleeps meanwhile (``sleep``/``wake``), and gives the accelerator's memory back if it can (vllm, and
        torch with ``rollout.sleep_on_yield``)."""
        return self._paused

    @paused.setter
    def paused(self, value: bool) -> None:
        if value != self._paused:
            self.engine.sleep() if value else self.engine.wake()
        self._paused = value

    @property
    def asleep(self) -> bool:
        """Paused with the accelerator's memory given back (the engine slept)."""
        return self.engine.asleep

    @property
    def tokens_generated(self) -> int:
        return self.engine.tokens_generated

    def busy(self) -> bool:
        return len(self.engine) > 0 or bool(self.episodes)

    def load_seconds(self) -> float:
        return 0.0  # loading happens in ``loaded``, synchronously

    def loaded(self, version: int, uri: str = "", sha256: str = "", keep: frozenset[int] = frozenset(),
               inline: Mapping[str, bytes] = {}) -> None:  # fmt: skip
        """``keep``: versions to go on holding beside the new one (the broker's ``Assign.keep``: groups of them run
        here, or are on their way here), besides those running or waiting requests name. ``inline``: the version's
        files carried in the ``Assign``; an adapter version whose files check against ``sha256`` is loaded from them
        and ``uri`` is not read (``inline_files``)."""
        if uri.startswith("sim://") or not (uri or inline):
            self.engine.relabel(version)
            return
        keep = keep | (self.episodes.versions() if self.episodes is not None else frozenset())
        files = self.inline_files(version, sha256, inline)
        self.engine.load_weights(version, uri.removeprefix("file://"), sha256 or None, keep=keep, inline=files)

    def inline_files(self, version: int, digest: str, inline: Mapping[str, bytes]) -> Mapping[str, bytes]:
        """The files of ``inline`` the engine loads instead of reading the version's URI: all of them (the manifest
        left out) once they are the ones ``digest`` names. Empty (the URI is read, and checked as ever) when none
        came, for an engine of full weights, or when they do not check: a tampered or torn copy is logged and the
        store's copy, written from the same bytes, is read instead."""
        if not inline:
            return {}
        if not self.engine.adapted:
            log.warning("inline_weights_ignored", version=version, reason="full weights are read from their uri")
            return {}
        try:
            return verified(inline, digest, f"v{version}")
        except ValueError as e:  # DigestMismatch, or a digest this dora cannot read
            log.warning("inline_weights_refused", version=version, error=str(e), fallback="uri")
            return {}

    def submit(self, gen: m.Generate, now: float) -> None:
        if self.episodes is not None:
            return self.episodes.submit(gen)
        self.engine.submit(group_id=gen.group_id, attempt=gen.attempt, prompt=gen.prompt_ids.tolist(),
                           n=gen.n_samples, max_tokens=gen.max_tokens, temperature=gen.temperature,
                           top_p=gen.top_p, seed=gen.seed, version=gen.version)  # fmt: skip

    def export(self, group: int, attempt: int, now: float) -> list[m.RequestState]:
        if self.episodes is not None:
            return self.episodes.export(group, attempt)
        return [m.RequestState(index=st.index, token_ids=st.token_ids, logprobs=st.logprobs, rng_state=st.rng_state,
                               kv=st.kv) for st in self.engine.export(group, attempt)]  # fmt: skip

    def import_(self, mig: m.MigrateIn, now: float) -> None:
        if self.episodes is not None:
            return self.episodes.import_(mig)
        states = [SampleState(index=r.index, token_ids=r.token_ids, logprobs=r.logprobs, rng_state=r.rng_state, kv=r.kv)
                  for r in mig.requests]  # fmt: skip
        self.engine.import_(group_id=mig.group_id, attempt=mig.attempt, prompt=mig.prompt_ids.tolist(),
                            requests=states, max_tokens=mig.max_tokens, temperature=mig.temperature,
                            top_p=mig.top_p, version=mig.version)  # fmt: skip

    def cancel(self, group: int, attempt: int, now: float) -> None:
        if self.episodes is not None:
            return self.episodes.cancel(group, attempt)
        self.engine.cancel(group, attempt)

    def advance(self, now: float) -> None:
        step = self.begin_step(now)
        self.end_step(step() if step is not None else [])

    def begin_step(self, now: float) -> Callable[[], list[Any]] | None:
        """The first half of ``advance``, on the worker's loop: the environments' answers join the engine. Returns
        the engine's step, or None when nothing is to decode. The step touches the engine only, so the worker runs
        it on a thread of its own while its loop goes on heartbeating (a prefill of long prompts, or a first step
        that compiles, can take longer than the broker's silence window); nothing else touches the engine until
        ``end_step``."""
        if self.paused:
            return None
        if self.episodes is not None:
            self.episodes.take_answers()
        return self.engine.step if len(self.engine) and self.engine.version is not None else None

    def end_step(self, seqs: list[Any]) -> None:
        """The second half, on the loop again: what the step finished (``seqs``) is scored and reported, the
        held-out evaluation samples are taken apart, and the episodes whose turn ended call their environment."""
        done = []
        for seq in seqs:
            if seq.group_id >= 0 or seq.keep_kv:  # an episode's turn, held-out or not: the episode goes on
                done.append(seq)
            else:
                self._eval_sample(seq)
        if self.episodes is None:
            self._score_together(done)
            self.finished.extend(done)
            return
        self.episodes.turns_ended(done)
        for ep in self.episodes.take_finished():
            self.finished.append(ep) if ep.key[0] >= 0 else self._eval_sample(ep)

    def _score_together(self, seqs: list[Any]) -> None:
        """Score a step's finished samples in one call (a custom task without ``score_many`` is scored by
        ``result``, one by one)."""
        score_many = getattr(self.task, "score_many", None)
        if score_many is None or not seqs:
            return
        for s, scored in zip(seqs, score_many([(s.group_id, s.tokens) for s in seqs]), strict=True):
            self.scored[(s.group_id, s.attempt, s.index)] = scored

    # ------------------------------------------------------------------ held-out evaluation

    def evaluate(self, msg: m.Evaluate, now: float) -> bool:
        """Sample a held-out row on the weights loaded now (the actor checks they are ``msg.version``'s); False
        if this worker cannot (started without eval.dataset, or the row is not among its rows)."""
        if self.held_out is None or not 0 <= msg.row < len(self.held_out.rows):
            return False
        if (msg.round, msg.row) in self.eval_open:
            return True  # a copy of a request in progress
        self.eval_open[(msg.round, msg.row)] = (msg, [])
        if self.episodes is not None:  # the row's episodes, with the held-out row's environment opening
            gen = m.Generate(group_id=GroupId(-1 - msg.row), attempt=AttemptId(msg.round), version=msg.version,
                             prompt_ids=msg.prompt_ids, n_samples=msg.n_samples, max_tokens=msg.max_tokens,
                             temperature=msg.temperature, seed=msg.seed)  # fmt: skip
            self.episodes.submit(gen, self.held_out.row_item(msg.row))
            return True
        self.engine.submit(group_id=-1 - msg.row, attempt=msg.round, prompt=msg.prompt_ids.tolist(),
                           n=msg.n_samples, max_tokens=msg.max_tokens, temperature=msg.temperature,
                           seed=msg.seed)  # fmt: skip
        return True

    def evaluating(self) -> bool:
        return bool(self.eval_open)

    def drop_evaluations(self) -> None:
        """Cancel every evaluation request (weights swapped under them: partial mode's interrupt)."""
        for (round_, row), _ in self.eval_open.items():
            (self.episodes or self.engine).cancel(-1 - row, round_)
        self.eval_open.clear()

    def take_evaluated(self) -> list[m.EvalFinished]:
        done, self.evaluated = self.evaluated, []
        return done

    def _eval_sample(self, sample: Any) -> None:
        """A finished held-out sample (a sequence, or an episode whose environment scored it)."""
        group, attempt, _ = sample.key
        key = (attempt, -1 - group)
        if key not in self.eval_open:
            return
        msg, samples = self.eval_open[key]
        samples.append(sample)
        if len(samples) < msg.n_samples:
            return
        del self.eval_open[key]
        assert self.held_out is not None
        samples.sort(key=lambda s: s.key[2])
        if self.episodes is not None:
            from dora.rollout.episodes import score

            scored = [score(ep) for ep in samples]
        else:
            scored = [(x.reward, x.reason) for x in (self.held_out.score_row(msg.row, s.tokens) for s in samples)]
        self.evaluated.append(m.EvalFinished(
            version=msg.version, round=msg.round, row=msg.row,
            rewards=np.array([reward for reward, _ in scored], dtype=np.float32),
            lengths=np.array([length(s) for s in samples], dtype=np.int32),
            failed=sum(bool(reason) for _, reason in scored),
        ))  # fmt: skip

    def take_finished(self) -> list[Any]:
        done, self.finished = self.finished, []
        return done

    def next_event_s(self) -> float | None:
        if self.paused:
            return None
        if len(self.engine):
            return 0.0
        return 0.002 if self.busy() else None  # episodes waiting on their environment only: look again soon

    def result(self, s: Any, broker_epoch: int) -> FinishedSample:
        if self.episodes is not None:
            return self.episodes.result(s, broker_epoch)
        scored = self.scored.pop((s.group_id, s.attempt, s.index), None)
        if scored is None:
            scored = self.task.score(s.group_id, s.tokens)
        return FinishedSample(
            group_id=s.group_id, attempt=s.attempt, index=s.index,
            segments=np.array([[ran_under(s, self.engine), len(s.tokens)]], dtype=np.int32),
            token_ids=np.array(s.tokens, dtype=np.int32), logprobs=np.array(s.logprobs, dtype=np.float32),
            reward=scored.reward, finish=Finish.LENGTH if s.finish is None else s.finish, broker_epoch=broker_epoch,
            reward_components=scored.components, reward_error=scored.reason,
        )  # fmt: skip

    def counters(self) -> dict[str, float]:
        """The reward services' counters (``combine.service_counters``: the training rows' and the held-out rows'
        clients, summed by service) and the episodes' (their ``counters``)."""
        out = combine.service_counters(*(getattr(run, "reward", None) for run in (self.task, self.held_out)))
        if self.episodes is not None:
            out.update(self.episodes.counters())
        return out

    def load(self) -> tuple[int, float]:
        return self.engine.load()

    def clear(self) -> None:
        if self.episodes is not None:
            self.episodes.clear()
        for group, attempt in self.engine.groups():
            self.engine.cancel(group, attempt)
        self.finished.clear()
        self.scored.clear()
        self.eval_open.clear()
        self.evaluated.clear()


def length(sample: Any) -> int:
    """A finished held-out sample's tokens: a sequence's, or an episode's (``Episode``, ``AgentEpisode``)."""
    return len(sample.tokens) if isinstance(sample, Sample) else int(sample.length)

