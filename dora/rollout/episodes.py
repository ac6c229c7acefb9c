"""Multi-turn episodes on a step-driven engine (torch, vllm): assistant turns, environment calls, one version.

Each sample of a group is an episode. The engine samples an assistant turn until EOS, a ``task.turn_end``
token or the turn's token budget; the sequence then leaves the decode batch (its slot goes to other
sequences) and keeps its keys and values (torch; vLLM leaves them to its prefix cache). The environment's
``step`` runs meanwhile, as a task on the worker's event loop (a coroutine) or on a daemon thread of its
own (a plain function, so a call that never returns cannot keep the worker from exiting), within
``task.env_timeout_s``.
Its observation is rendered with the chat template after the turn just sampled, encoded and appended
(loss mask 0, log-prob 0), and the next turn starts on the same sequence, prefilling only the new tokens.

C1: an episode's turns all run on this worker under the version its request named (the engine may hold several:
LoRA adapters; a load keeps every version an open episode runs under), and each turn is recorded with the version
that sampled it, for the learner to check. An
episode migrates (to a worker of the same version) with its tokens, loss mask, turns, RNG state and
cache; the target rebuilds the environment by ``reset`` and replaying the episode's answered actions
(environments are deterministic functions of the item and the actions: see ``dora.envs``).

An episode ends when the environment says done, after ``task.max_turns`` turns, when the next turn would
pass ``task.max_episode_tokens``, or when the environment fails (raises, times out, answers junk): then
it scores 0 with the reason, the failure is counted, and with ``task.env_failure = "mask"`` its loss mask
is all 0, so the learner keeps it out of the loss. Its group is trained whole either way (C2).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dora import envs
from dora.config import ConfigError
from dora.config.run import TaskSection
from dora.ids import AttemptId, Finish, GroupId
from dora.rollout.engines.base import Sample, SampleState, StepEngine, ran_under
from dora.samples import FinishedSample
from dora.tasks.prompts import TaskRun, stop_ids
from dora.tasks.tasks import Item
from dora.tasks.templates import observation_text
from dora.wire import messages as m


@dataclass(slots=True, kw_only=True)
class Episode:
    seq: Sample
    """The engine's sequence: tokens, log-probs, loss mask so far."""
    item: Item
    turns: list[tuple[int, int, int]] = field(default_factory=list)
    """(start, end, version) of each assistant turn sampled so far."""
    messages: list[dict[str, str]] = field(default_factory=list)
    """The chat so far: the opening, then each answered turn and its observation."""
    reward: float = 0.0
    reason: str = ""
    """Why the environment failed; empty while it has not."""
    env: Any = None
    ready: asyncio.Future | None = None
    """The environment made (``reset``, and a migrated episode's actions replayed): awaited before a step."""
    replay: list[str] = field(default_factory=list)
    turn_tokens: int = 0
    """Tokens per turn at most (the request's max_tokens)."""
    call: asyncio.Future | None = None
    """The environment's answer to the turn just sampled, while it is awaited."""

    @property
    def key(self) -> tuple[int, int, int]:
        return self.seq.key

    @property
    def length(self) -> int:
        return len(self.seq.tokens)


class Episodes:
    def __init__(self, engine: StepEngine[Any], task: TaskRun) -> None:
        if task.env is None:
            raise ConfigError("episodes need task.env")
        self.make_env = task.env
        """Makes an episode's environment (``task.env``)."""
        self.engine = engine
        self.task = task
        self.cfg: TaskSection = task.section
        self.stops = frozenset(stop_ids(task, self.cfg.turn_end))
        self.open: dict[tuple[int, int, int], Episode] = {}
        self.finished: list[Episode] = []
        self.failures: Counter[str] = Counter()

    # ------------------------------------------------------------------ requests

    def submit(self, gen: m.Generate, item: Item | None = None) -> None:
        """Start the lease's episodes (``item``: the task's item of another kind of request, e.g. a held-out
        row; default the group's)."""
        item = item or self.task.item(gen.group_id)
        budget = min(gen.max_tokens, self.cfg.max_episode_tokens)
        seqs = self.engine.submit(group_id=gen.group_id, attempt=gen.attempt, prompt=gen.prompt_ids.tolist(),
                                  n=gen.n_samples, max_tokens=budget, temperature=gen.temperature,
                                  top_p=gen.top_p, seed=gen.seed, stops=self.stops, keep_kv=True,
                                  version=gen.version if gen.group_id >= 0 else None)  # fmt: skip
        for seq in seqs:
            self._start(Episode(seq=seq, item=item, messages=list(item.meta["messages"]), turn_tokens=budget))

    def _start(self, ep: Episode) -> None:
        self.open[ep.seq.key] = ep
        ep.ready = asyncio.ensure_future(self._open(ep))

    def export(self, group: int, attempt: int) -> list[m.RequestState]:
        """Hand over the group's open episodes (a migration): those decoding and those waiting on their
        environment alike. Their environment calls here are abandoned; the target replays."""
        out = []
        for ep in self._take(group, attempt):
            st = self.engine.state(ep.seq)
            out.append(m.RequestState(index=st.index, token_ids=st.token_ids, logprobs=st.logprobs,
                                      rng_state=st.rng_state, kv=st.kv, loss_mask=st.mask,
                                      turns=np.array(ep.turns, np.int32).reshape(-1, 3)))  # fmt: skip
        return out

    def import_(self, mig: m.MigrateIn) -> None:
        item = self.task.item(mig.group_id)
        states = []
        for r in sorted(mig.requests, key=lambda r: r.index):
            turns = [] if r.turns is None else [(int(a), int(b), int(v)) for a, b, v in r.turns.tolist()]
            paused = bool(turns) and turns[-1][1] == len(r.token_ids)
            mask = np.ones(len(r.token_ids), np.uint8) if r.loss_mask is None else r.loss_mask
            opened = int(np.flatnonzero(mask == 0)[-1]) + 1 if (mask == 0).any() else 0
            states.append(SampleState(index=r.index, token_ids=r.token_ids, logprobs=r.logprobs, mask=mask,
                                      rng_state=r.rng_state, kv=r.kv, turn_start=opened, paused=paused))  # fmt: skip
        seqs = self.engine.import_(group_id=mig.group_id, attempt=mig.attempt, prompt=mig.prompt_ids.tolist(),
                                   requests=states, max_tokens=min(mig.max_tokens, self.cfg.max_episode_tokens),
                                   temperature=mig.temperature, top_p=mig.top_p, stops=self.stops,
                                   keep_kv=True, version=mig.version)  # fmt: skip
        for seq, st, r in zip(seqs, states, sorted(mig.requests, key=lambda r: r.index), strict=True):
            turns = [] if r.turns is None else [(int(a), int(b), int(v)) for a, b, v in r.turns.tolist()]
            actions = [self._action(seq, start, end) for start, end, _ in turns]
            ep = Episode(seq=seq, item=item, turns=turns, messages=list(item.meta["messages"]),
                         replay=actions[:-1] if st.paused else actions, turn_tokens=mig.max_tokens)  # fmt: skip
            self._start(ep)
            if st.paused:
                ep.call = asyncio.ensure_future(self._call(ep, actions[-1]))

    def cancel(self, group: int, attempt: int) -> None:
        self._take(group, attempt)

    def _take(self, group: int, attempt: int) -> list[Episode]:
        self.engine.cancel(group, attempt)
        taken = sorted((ep for key, ep in self.open.items() if key[:2] == (group, attempt)), key=lambda e: e.seq.index)
        for ep in taken:
            self._close(ep)
        return taken

    def clear(self) -> None:
        for ep in list(self.open.values()):
            self._close(ep)
        self.finished.clear()

    def _close(self, ep: Episode) -> None:
        del self.open[ep.seq.key]
        for f in (ep.ready, ep.call):
            if f is not None and not f.cancel() and not f.cancelled():
                f.exception()  # done: its failure, if any, is read here (this episode is over) or by its call

    # ------------------------------------------------------------------ stepping

    def __len__(self) -> int:
        return len(self.open)

    def versions(self) -> frozenset[int]:
        """The versions open episodes run under (a load keeps them: an episode between turns holds no request)."""
        return frozenset(ep.seq.version for ep in self.open.values() if ep.seq.version is not None)

    def waiting(self) -> int:
        """Episodes waiting on their environment (holding no decode slot)."""
        return sum(ep.call is not None for ep in self.open.values())

    def advance(self) -> None:
        """Take the environments' answers (the next turns join the engine), then one engine step."""
        self.take_answers()
        self.turns_ended(self.engine.step() if len(self.engine) else [])

    def take_answers(self) -> None:
        """The environments that answered: their episodes' next turns join the engine (or the episodes end)."""
        for ep in [ep for ep in self.open.values() if ep.call is not None and ep.call.done()]:
            self._answered(ep)

    def turns_ended(self, seqs: list[Any]) -> None:
        """What an engine step finished: each open episode's turn that ended goes to its environment."""
        for seq in seqs:
            if seq.key in self.open and seq.keep_kv:
                self._turn_ended(self.open[seq.key])

    def _turn_ended(self, ep: Episode) -> None:
        seq = ep.seq
        ep.turns.append((seq.turn_start, len(seq.tokens), ran_under(seq, self.engine)))
        ep.call = asyncio.ensure_future(self._call(ep, self._action(seq, seq.turn_start, len(seq.tokens))))

    def _action(self, seq: Any, start: int, end: int) -> str:
        return self.task.tokenizer.decode(seq.tokens[start:end], skip_special_tokens=True)

    def _answered(self, ep: Episode) -> None:
        call, ep.call = ep.call, None
        assert call is not None  # answered
        try:
            answer, observation = call.result()
        except Exception as e:  # the environment's failure, whatever it was: the episode ends with it
            return self._end(ep, Finish.ERROR, failure(e, self.cfg.env_timeout_s))
        if answer.reward is not None:
            ep.reward += answer.reward
        if answer.done:
            return self._end(ep, Finish.STOP)
        if len(ep.turns) >= self.cfg.max_turns:
            return self._end(ep, Finish.LENGTH)
        seq = ep.seq
        room = self.cfg.max_episode_tokens - len(seq.tokens) - len(observation)
        if room < 1:
            return self._end(ep, Finish.LENGTH)
        seq.max_tokens = min(ep.turn_tokens, room)
        self.engine.extend(seq, observation)

    def _end(self, ep: Episode, finish: Finish, reason: str = "") -> None:
        self._close(ep)
        ep.seq.finish, ep.reason = finish, reason
        ep.seq.release()  # the episode is over: a cache kept for its next turn goes
        if reason:
            self.failures[reason.split(":")[0]] += 1
        self.finished.append(ep)

    # ------------------------------------------------------------------ the environment

    async def _open(self, ep: Episode) -> None:
        """Make the episode's environment: ``reset`` (checked to open as the broker's prompt did), then a migrated
        episode's answered actions replayed, rebuilding its chat and reward."""
        ep.env = self.make_env()
        opening = envs.messages(await self._run(ep.env.reset, ep.item.meta["source"]), "reset")
        if opening != ep.item.meta["messages"]:
            raise envs.EnvError("reset(item) opened differently here than for the prompt: it must be deterministic")
        for action in ep.replay:
            answer = envs.answer(await self._run(ep.env.step, action))
            ep.reward += answer.reward or 0.0
            ep.messages += [{"role": "assistant", "content": action}, *answer.observation]

    async def _call(self, ep: Episode, action: str) -> tuple[envs.Answer, list[int]]:
        """The environment's answer to ``action`` and its observation's tokens (what the chat template puts
        between the end of the sampled turn and the next turn's start)."""
        assert ep.ready is not None
        await ep.ready
        answer = envs.answer(await self._run(ep.env.step, action))
        turn = {"role": "assistant", "content": action}
        if answer.done or not answer.observation:
            if not answer.done:
                raise envs.EnvError("step answered no observation and not done")
            ep.messages.append(turn)
            return answer, []
        last, said = ep.seq.tokens[-1], ""
        if ep.seq.finish is Finish.STOP and last in self.stops:
            said = self.task.tokenizer.decode([last], skip_special_tokens=False)
        try:
            after = observation_text(self.task.renderer, ep.messages, answer.observation, said)
        except ConfigError as e:
            raise envs.EnvError(f"the observation does not render: {e}") from None
        ep.messages += [turn, *answer.observation]
        tokens = self.task.tokenizer.encode(after, add_special_tokens=False).ids
        if not tokens:
            raise envs.EnvError("the observation rendered to no tokens")
        return answer, tokens

    async def _run(self, fn: Any, *args: Any) -> Any:
        timeout = self.cfg.env_timeout_s
        if inspect.iscoroutinefunction(fn):
            return await asyncio.wait_for(fn(*args), timeout)
        return await asyncio.wait_for(in_thread(fn, *args), timeout)

    # ------------------------------------------------------------------ results

    def counters(self) -> dict[str, float]:
        """What a worker reports of its episodes (``WorkerEngine.counters``): those whose environment failed."""
        return {"env_failed": float(sum(self.failures.values()))}

    def take_finished(self) -> list[Episode]:
        done, self.finished = self.finished, []
        return done

    def result(self, ep: Episode, broker_epoch: int) -> FinishedSample:
        seq = ep.seq
        mask = np.array(seq.mask, np.uint8)
        turns = np.array(ep.turns, np.int32).reshape(-1, 3)
        masked = bool(ep.reason) and self.cfg.env_failure == "mask"
        # a failed environment is the episode's outcome (scored, counted, trained), not the engine's error: ERROR
        # would make the broker re-run the group, and a row whose environment always fails could never be trained
        finish = Finish.STOP if ep.reason else Finish.LENGTH if seq.finish is None else seq.finish
        return FinishedSample(
            group_id=GroupId(seq.group_id), attempt=AttemptId(seq.attempt), index=seq.index,
            segments=np.array([[ran_under(seq, self.engine), len(seq.tokens)]], dtype=np.int32),
            token_ids=np.array(seq.tokens, np.int32), logprobs=np.array(seq.logprobs, np.float32),
            reward=score(ep)[0], finish=finish, broker_epoch=broker_epoch,
            reward_components={"turns": float(len(ep.turns)), "env_failed": float(bool(ep.reason))},
            reward_error=ep.reason, loss_mask=np.zeros_like(mask) if masked else mask,
            turns=turns[:0] if masked else turns,
        )  # fmt: skip


def in_thread(fn: Any, *args: Any) -> asyncio.Future:
    """``fn(*args)`` on a daemon thread of its own, as a future of the running loop. A pool's threads are
    joined at exit, so one hung call would hold the process open; an abandoned daemon thread does not."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if fut.done():  # timed out and abandoned
            return
        if error is None:
            fut.set_result(value)
        else:
            fut.set_exception(error)

    def call() -> None:
        try:
            value, error = fn(*args), None
        except BaseException as e:  # handed to the awaiting episode, which scores it
            value, error = None, e
        with contextlib.suppress(RuntimeError):  # the loop closed while the call ran: nobody waits for it
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=call, name="env", daemon=True).start()
    return fut


def score(ep: Episode) -> tuple[float, str]:
    """An ended episode's reward (0 when its environment failed) and the failure, if any."""
    return (0.0, ep.reason) if ep.reason else (ep.reward, "")


def failure(e: BaseException, timeout_s: float) -> str:
    """The reason an environment call failed, one line."""
    if isinstance(e, TimeoutError):
        return f"env timeout: no answer within {timeout_s:g} s"
    if isinstance(e, envs.EnvError):
        return f"env malformed: {e}"
    return f"env raised: {type(e).__name__}: {e}"[:300]
