"""Agent episodes (``task.agent``) on a step-driven engine (torch, vllm): the user's agent asks, the engine answers.

Each sample of a group is one call ``await agent(row, client)`` on the worker's event loop. ``client`` is an
``openai.AsyncOpenAI`` bound to this worker's endpoint (``dora.rollout.agents.endpoint``) at an address that serves
that episode alone. Each completion the agent asks for is one assistant turn, sampled by the engine under the version
the group was dispatched on, and recorded with that version as a turn (C1, checked per turn by the learner):

- **The prompt.** A group's prompt is the chat template's opening (``TaskRun.opening``), shared by its episodes. The
  first request's conversation, rendered with its tools and the generation prompt, must start with it; the rest of it
  is recorded after the prompt with loss mask 0, and the turn is sampled after that.
- **Token-exact contexts.** A later request must extend the conversation recorded: the messages sent before, then
  each answer as it was returned. Its new messages (tool results, a user turn) are rendered by the chat template after
  the tokens the model sampled, which are never re-tokenized. A request that rewrites the recorded conversation or
  changes its tools is refused (HTTP 400) naming the first message that differs.
- **Limits.** A request that would pass ``task.max_turns`` turns or ``task.max_episode_tokens`` tokens is refused
  (HTTP 400), and the episode ends there (finish LENGTH) with what the agent returns; the agent's error from the
  refusal is not a failure. ``rollout.max_tokens`` (and a smaller ``max_tokens`` of the request) bounds each answer.
- **Failures.** An agent that raises, returns something other than a number or None, or leaves more than
  ``task.env_timeout_s`` between an answer and its next call (or its return) fails its episode as an environment
  would: reward 0 and the reason, counted; with ``task.env_failure = "mask"`` out of the loss. Its group is trained
  whole (C2). A call after the episode ended is refused (HTTP 404) and logged.
- **Reward.** The number the agent returns; None leaves the last answer to ``task.reward``, scored against the row.
- **No migration.** An agent talks to one worker, so its episodes never move: the broker runs agent tasks with
  migration off (``CoreConfig.migrate``), and ``export``/``import_`` refuse.

Engine calls (a first turn's submit, a next turn's extend, a release) happen only in ``take_answers``, between engine
steps, as for environments; a request waits on a future that ``turns_ended`` settles with the answer.
"""

from __future__ import annotations

import asyncio
import math
import secrets
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog

from dora.config import ConfigError
from dora.config.run import TaskSection
from dora.ids import AttemptId, Finish, GroupId
from dora.rollout.agents import openai_api as api
from dora.rollout.engines.base import EngineError, Sample, StepEngine, ran_under
from dora.samples import FinishedSample
from dora.tasks import rewards
from dora.tasks.prompts import TaskRun, stop_ids
from dora.tasks.tasks import Item
from dora.tasks.templates import observation_text
from dora.wire import messages as m

log = structlog.get_logger()


@dataclass(slots=True, kw_only=True)
class Ask:
    """A request accepted, waiting for ``take_answers`` to put it to the engine."""

    tokens: list[int]
    """The first: the whole rendered conversation (the engine's prompt); later: the new messages' tokens."""
    max_tokens: int
    request: api.ChatRequest


@dataclass(slots=True, kw_only=True)
class Answered:
    """A turn as returned: the message, its finish reason, and its usage."""

    message: dict[str, Any]
    finish: str
    prompt_tokens: int
    completion_tokens: int
    version: int


@dataclass(slots=True, kw_only=True)
class AgentEpisode:
    group_id: int
    attempt: int
    index: int
    version: int | None
    """The version its group was dispatched on (None: a held-out row's, on the version loaded)."""
    item: Item
    token: str
    """Its address on the endpoint (a secret: no agent reaches another's episode)."""
    seed: int
    temperature: float
    top_p: float
    turn_tokens: int
    budget: int
    """Tokens after the prompt at most (task.max_episode_tokens)."""
    seq: Any = None
    """The engine's sequence, from the first request on."""
    lead: list[int] = field(default_factory=list)
    """The first request's tokens after the prompt: recorded with loss mask 0 before the first turn."""
    chat: list[dict[str, Any]] = field(default_factory=list)
    """The conversation recorded: the messages sent, then each answer as returned (``openai_api.message`` form)."""
    tools: list[dict[str, Any]] | None = None
    turns: list[tuple[int, int, int]] = field(default_factory=list)
    """(start, end, version) of each turn in ``seq.tokens``."""
    agent: asyncio.Future | None = None
    ask: Ask | None = None
    answer: asyncio.Future | None = None
    """Settled with the ``Answered`` turn, or an exception when the episode goes away mid-request."""
    request: api.ChatRequest | None = None
    """The request being served."""
    progress: asyncio.Event = field(default_factory=asyncio.Event)
    """Set after each engine step while a turn is sampled (a stream sends what decoded)."""
    idle_since: float = 0.0
    closed: str = ""
    """Why the episode ended at a limit (later requests are refused); empty while open."""
    reward: float = 0.0
    reason: str = ""
    """Why the agent failed; empty while it has not."""
    finish: Finish = Finish.STOP

    @property
    def key(self) -> tuple[int, int, int]:
        return self.group_id, self.attempt, self.index

    @property
    def length(self) -> int:
        return len(self.lead) + (len(self.seq.tokens) if self.seq is not None else 0)

    @property
    def busy(self) -> bool:
        """Inside one of its calls: asking, sampled, or scored (the agent's timeout does not run)."""
        return self.answer is not None


class EpisodeGone(RuntimeError):
    """The episode was cancelled or cleared while a request of it waited."""


class AgentEpisodes:
    def __init__(self, engine: StepEngine[Any], task: TaskRun, *, model_name: str = "dora") -> None:
        if task.agent is None:
            raise ConfigError("agent episodes need task.agent")
        self.engine = engine
        self.task = task
        self.cfg: TaskSection = task.section
        self.agent = task.agent
        self.model_name = model_name
        self.stops = frozenset(stop_ids(task, self.cfg.turn_end))
        self.open: dict[tuple[int, int, int], AgentEpisode] = {}
        self.by_token: dict[str, AgentEpisode] = {}
        self.finished: list[AgentEpisode] = []
        self.failures: Counter[str] = Counter()
        self.stats: Counter[str] = Counter()
        """completions, refused, late_calls: what the endpoint served."""
        try:  # imported here, at the worker's start, not in an agent's first seconds
            import aiohttp  # noqa: F401
            import openai  # noqa: F401
        except ImportError as e:
            raise ConfigError(f"task.agent needs the agents extra ({e.name} is missing): pip install "
                              "'dora-rl[agents]'") from None  # fmt: skip

        self._parser: Any = None
        self._base: asyncio.Future | None = None
        self._http: Any = None
        """The HTTP connection pool the episodes' clients share (made on the loop, with the first)."""
        from dora.rollout.agents.endpoint import Endpoint

        self.endpoint = Endpoint(self)

    # ------------------------------------------------------------------ requests from the broker

    def submit(self, gen: m.Generate, item: Item | None = None) -> None:
        """Start one agent per sample of the lease (``item``: a held-out row's; default the group's)."""
        item = item or self.task.item(gen.group_id)
        if self._base is None:
            self._base = asyncio.ensure_future(self.endpoint.start())
        now = asyncio.get_running_loop().time()
        budget = self.cfg.max_episode_tokens
        for i in range(gen.n_samples):
            ep = AgentEpisode(group_id=gen.group_id, attempt=gen.attempt, index=i, item=item, seed=gen.seed,
                              version=gen.version if gen.group_id >= 0 else None, token=secrets.token_hex(12),
                              temperature=gen.temperature, top_p=gen.top_p, budget=budget,
                              turn_tokens=min(gen.max_tokens, budget), idle_since=now)  # fmt: skip
            self.open[ep.key] = ep
            self.by_token[ep.token] = ep
            ep.agent = asyncio.ensure_future(self._drive(ep))

    def export(self, group: int, attempt: int) -> list[m.RequestState]:
        raise EngineError(f"group {group}: agent episodes never migrate (their agent talks to this worker)")

    def import_(self, mig: m.MigrateIn) -> None:
        raise EngineError(f"group {mig.group_id}: agent episodes never migrate (their agent talks to one worker)")

    def cancel(self, group: int, attempt: int) -> None:
        self.engine.cancel(group, attempt)
        for ep in [ep for key, ep in self.open.items() if key[:2] == (group, attempt)]:
            self._drop(ep)

    def clear(self) -> None:
        for group, attempt in {key[:2] for key in self.open}:
            self.cancel(group, attempt)
        self.finished.clear()

    def _drop(self, ep: AgentEpisode) -> None:
        """Forget an episode that will not be reported (its lease went): its agent is cancelled, a request waiting
        is answered with an error."""
        self.open.pop(ep.key, None)
        self.by_token.pop(ep.token, None)
        if ep.agent is not None:
            ep.agent.cancel()
        if ep.request is not None and ep.answer is not None and not ep.answer.done():
            ep.answer.set_exception(EpisodeGone("the episode was cancelled"))
        if ep.seq is not None:
            ep.seq.release()

    # ------------------------------------------------------------------ stepping

    def __len__(self) -> int:
        return len(self.open)

    def versions(self) -> frozenset[int]:
        """The versions open episodes run under (a load keeps them: an agent between calls holds no request)."""
        return frozenset(ep.version for ep in self.open.values() if ep.version is not None)

    def waiting(self) -> int:
        """Episodes whose agent is between calls (holding no decode slot)."""
        return sum(not ep.busy for ep in self.open.values())

    def advance(self) -> None:
        self.take_answers()
        self.turns_ended(self.engine.step() if len(self.engine) else [])

    def take_answers(self) -> None:
        """Between engine steps: requests accepted go to the engine, agents that finished end their episodes, and
        agents silent past ``task.env_timeout_s`` fail theirs."""
        now = asyncio.get_running_loop().time()
        for ep in list(self.open.values()):
            if ep.ask is not None:
                self._feed(ep)
            elif ep.agent is not None and ep.agent.done() and not ep.busy:
                self._settle(ep)
            elif not ep.busy and not ep.reason and now - ep.idle_since > self.cfg.env_timeout_s:
                ep.reason = f"agent timeout: no call or return within {self.cfg.env_timeout_s:g} s of its last answer"
                if ep.agent is not None:
                    ep.agent.cancel()

    def _feed(self, ep: AgentEpisode) -> None:
        ask, ep.ask = ep.ask, None
        assert ask is not None and ep.answer is not None
        try:
            if ep.seq is None:
                [ep.seq] = self.engine.submit(group_id=ep.group_id, attempt=ep.attempt, index=ep.index,
                                              prompt=ask.tokens, n=1, max_tokens=ask.max_tokens,
                                              temperature=ep.temperature, top_p=ep.top_p, seed=ep.seed,
                                              stops=self.stops, keep_kv=True, version=ep.version)  # fmt: skip
            else:
                ep.seq.max_tokens = ask.max_tokens
                self.engine.extend(ep.seq, ask.tokens)
        except EngineError as e:
            ep.reason = f"agent episode: the engine refused its turn: {e}"
            if not ep.answer.done():
                ep.answer.set_exception(api.Refused(503, str(e), code="engine_error"))
            ep.answer = ep.request = None

    def turns_ended(self, seqs: list[Any]) -> None:
        """After an engine step: each agent episode's turn that ended is answered; streams hear of progress."""
        for seq in seqs:
            ep = self.open.get(seq.key)
            if ep is not None and ep.seq is seq and ep.request is not None and ep.answer is not None:
                self._answered(ep)  # recorded even when nobody waits any more (the agent's request was dropped)
        for ep in self.open.values():
            if ep.answer is not None:
                ep.progress.set()

    def _answered(self, ep: AgentEpisode) -> None:
        seq, request = ep.seq, ep.request
        assert ep.answer is not None and request is not None
        version = ran_under(seq, self.engine)
        start, end = seq.turn_start, len(seq.tokens)
        ep.turns.append((start, end, version))
        content, calls = self.read_turn(seq, start, end, request)
        msg = api.answer(content, calls)
        ep.chat = [*request.messages, api.message(msg, len(request.messages))]
        finish = "tool_calls" if calls else "length" if seq.finish is Finish.LENGTH else "stop"
        if len(ep.turns) >= self.cfg.max_turns:
            ep.closed = f"task.max_turns = {self.cfg.max_turns} turns"
        answered = Answered(message=msg, finish=finish, prompt_tokens=len(self.task.opening) + len(ep.lead) + start,
                            completion_tokens=end - start, version=version)  # fmt: skip
        if not ep.answer.done():
            ep.answer.set_result(answered)
        ep.answer = ep.request = None
        ep.idle_since = asyncio.get_running_loop().time()
        self.stats["completions"] += 1

    def streamable(self, ep: AgentEpisode, request: api.ChatRequest) -> str:
        """The content of the turn being sampled that a stream may send now: its text so far, without tools; with
        tools, the part no call can follow into (``ToolCallParser.content_so_far``). Always a prefix of the
        content ``read_turn`` gives the whole turn."""
        seq = ep.seq
        tokens = seq.tokens[seq.turn_start :]
        if tokens and tokens[-1] in self.stops:
            tokens = tokens[:-1]
        if not request.tools or request.tool_choice == "none":
            return str(self.task.tokenizer.decode(tokens, skip_special_tokens=True))
        text = self.task.tokenizer.decode(tokens, skip_special_tokens=False)
        return self.parser().content_so_far(text)

    def read_turn(self, seq: Any, start: int, end: int, request: api.ChatRequest) -> tuple[str | None, list[dict]]:
        """A sampled turn as the answer's content and tool calls (the model family's format, when tools were
        offered): its text without the token that ended it."""
        tokens = seq.tokens[start:end]
        if seq.finish is Finish.STOP and tokens:
            tokens = tokens[:-1]
        if not request.tools or request.tool_choice == "none":
            return self.task.tokenizer.decode(tokens, skip_special_tokens=True), []
        # a family's call marker may be a special token (Mistral's [TOOL_CALLS]): the parser reads them all
        text = self.task.tokenizer.decode(tokens, skip_special_tokens=False)
        return self.parser().parse(text, request.tools, request.tool_choice)

    def parser(self) -> Any:
        """The tool-call parser of the model's format (made on the first request offering tools)."""
        if self._parser is None:
            from dora.rollout.agents.toolcalls import ToolCallParser

            tokenizer = self.task.renderer.tokenizer
            assert tokenizer is not None  # task.agent needs task.chat_template
            self._parser = ToolCallParser(tokenizer, tokenizer.chat_template or "", self.cfg.tool_parser)
        return self._parser

    # ------------------------------------------------------------------ the endpoint's side

    def episode(self, token: str) -> AgentEpisode:
        """The open episode at ``token``; a call to any other is refused (and logged: a late call)."""
        ep = self.by_token.get(token)
        if ep is None:
            self.stats["late_calls"] += 1
            log.warning("agent_late_call", reason="no episode open at this address")
            raise api.Refused(404, "no episode is open at this address: it ended (its agent returned, failed or was "
                                   "cancelled), or the address is wrong", code="episode_ended")  # fmt: skip
        return ep

    def accept(self, ep: AgentEpisode, request: api.ChatRequest) -> asyncio.Future:
        """Take a request of ``ep``: checked and rendered (``Refused`` if it cannot be served), queued for the
        engine. Returns the future of its ``Answered`` turn."""
        if ep.busy:
            raise api.Refused(409, "this episode already waits on a completion: an episode's calls come one at a "
                                   "time", code="concurrent_call")  # fmt: skip
        if ep.closed:
            raise api.Refused(400, f"the episode has ended: {ep.closed}", code="episode_ended")
        if ep.reason:
            raise api.Refused(400, f"the episode has failed: {ep.reason}", code="episode_failed")
        if request.tools and request.tool_choice != "none":
            self._tools_served()
        ask = self._first(ep, request) if not ep.chat and ep.seq is None else self._next(ep, request)
        ep.ask, ep.request = ask, request
        ep.answer = asyncio.get_running_loop().create_future()
        ep.progress.clear()
        return ep.answer

    def _tools_served(self) -> None:
        """Refuse tools the model's format cannot be read for (no vLLM, no format in its chat template)."""
        try:
            name = self.parser().name
        except ConfigError as e:
            raise api.Refused(400, f"tools are not served: {e}", param="tools") from None
        if not name:
            raise api.Refused(400, "tools are not served: the model's chat template writes no tool calls (set "
                                   "task.tool_parser to the vLLM parser of its format)", param="tools")  # fmt: skip

    def _first(self, ep: AgentEpisode, request: api.ChatRequest) -> Ask:
        ids = self._encode(request.messages, request.tools)
        opening = self.task.opening
        if ids[: len(opening)] != opening:
            raise api.Refused(400, "the conversation does not render after the chat template's opening "
                                   f"{self.task.opening_text!r}, which every episode of a group shares as its prompt")
        lead = ids[len(opening) :]
        room = ep.budget - len(lead)
        if not lead or room < 1:
            raise self._limit(ep, f"the conversation takes {len(lead)} tokens of task.max_episode_tokens = "
                                  f"{ep.budget}", "context_length_exceeded")  # fmt: skip
        ep.lead, ep.tools = lead, request.tools
        return Ask(tokens=ids, max_tokens=self._bound(ep, request, room), request=request)

    def _next(self, ep: AgentEpisode, request: api.ChatRequest) -> Ask:
        known = len(ep.chat)
        sent = request.messages[:known]
        if sent != ep.chat:
            i = next((i for i, (a, b) in enumerate(zip(sent, ep.chat, strict=False)) if a != b), len(sent))
            raise api.Refused(400, f"messages[{i}] is not what this episode recorded there: a request must extend "
                                   "the conversation (the messages sent before, then each answer as returned), whose "
                                   "tokens are kept as sampled, never re-rendered", param=f"messages[{i}]")  # fmt: skip
        if request.tools != ep.tools:
            raise api.Refused(400, "tools differ from the episode's first request (they are part of its recorded "
                                   "prompt)", param="tools")  # fmt: skip
        new = request.messages[known:]
        if not new or new[-1]["role"] == "assistant":
            raise api.Refused(400, "a request must add messages to answer after the episode's last answer",
                              param="messages")
        if len(ep.turns) >= self.cfg.max_turns:
            raise self._limit(ep, f"task.max_turns = {self.cfg.max_turns} turns", "max_turns")
        seq = ep.seq
        said = ""
        if seq.finish is Finish.STOP and seq.tokens and seq.tokens[-1] in self.stops:
            said = self.task.tokenizer.decode([seq.tokens[-1]], skip_special_tokens=False)
        try:
            text = observation_text(self.task.renderer, ep.chat[:-1], new, said, tools=ep.tools)
        except ConfigError as e:
            raise api.Refused(400, f"the new messages do not render: {e}") from None
        tokens = self.task.encode(text)
        room = ep.budget - ep.length - len(tokens)
        if not tokens or room < 1:
            raise self._limit(ep, f"the episode would pass task.max_episode_tokens = {ep.budget}",
                              "context_length_exceeded")
        return Ask(tokens=tokens, max_tokens=self._bound(ep, request, room), request=request)

    def _encode(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        try:
            return self.task.encode(self.task.renderer.render(messages, "an agent's request", tools=tools))
        except ConfigError as e:
            raise api.Refused(400, str(e)) from None

    def _bound(self, ep: AgentEpisode, request: api.ChatRequest, room: int) -> int:
        return min(ep.turn_tokens, room, request.max_tokens or room)

    def _limit(self, ep: AgentEpisode, what: str, code: str) -> api.Refused:
        """A request past a limit: the episode ends there (finish LENGTH), and the request is refused."""
        ep.closed = what
        return api.Refused(400, f"the episode has reached its limit: {what}", code=code)

    # ------------------------------------------------------------------ the agent

    async def _drive(self, ep: AgentEpisode) -> float:
        """Run the agent on its episode's row with a client bound to the episode; its reward (None: task.reward's
        score of the last answer)."""
        import openai

        assert self._base is not None
        base = await self._base
        if self._http is None:  # one connection pool for every episode's client: a client of its own costs ~0.1 s
            self._http = openai.DefaultAsyncHttpxClient()
        client = openai.AsyncOpenAI(base_url=f"{base}/{ep.token}/v1", api_key="dora", max_retries=0, timeout=None,
                                    http_client=self._http)  # fmt: skip
        ep.idle_since = asyncio.get_running_loop().time()  # the agent's own time starts now
        value = await self.agent(row(ep.item), client)
        if value is None:
            return await self._score_last(ep)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TypeError(f"the agent returned {value!r}: a finite number (the reward) or None is needed")
        return float(value)

    async def _score_last(self, ep: AgentEpisode) -> float:
        reward_fn = self.task.reward
        if reward_fn is None:
            raise TypeError("the agent returned None, and task.reward is unset to score its last answer")
        text = "" if not ep.turns else self.task.tokenizer.decode(ep.seq.tokens[ep.turns[-1][0] : ep.turns[-1][1]],
                                                                   skip_special_tokens=True)  # fmt: skip
        source = ep.item.meta.get("source", ep.item)
        ep.answer = asyncio.get_running_loop().create_future()  # busy while scored: the agent's timeout waits
        try:
            scored = await asyncio.to_thread(rewards.score, reward_fn, text, source, timeout_s=self.task.timeout_s)
        finally:
            ep.answer = None
        if scored.reason:
            raise RuntimeError(f"task.reward failed on the last answer: {scored.reason}")
        return scored.reward

    def _settle(self, ep: AgentEpisode) -> None:
        """The agent finished (returned, raised, or was cancelled for its timeout): the episode ends."""
        assert ep.agent is not None
        if ep.agent.cancelled():
            ep.reason = ep.reason or "agent cancelled"
        elif (e := ep.agent.exception()) is not None:
            if not ep.closed:  # an agent's error from a refusal at a limit is not its failure
                ep.reason = f"agent raised: {type(e).__name__}: {e}"[:300]
        else:
            ep.reward = ep.agent.result()
        self._end(ep, Finish.ERROR if ep.reason else Finish.LENGTH if ep.closed else Finish.STOP)

    def _end(self, ep: AgentEpisode, finish: Finish) -> None:
        self.open.pop(ep.key, None)
        self.by_token.pop(ep.token, None)
        ep.finish = finish
        if ep.seq is not None:
            ep.seq.release()
        if ep.reason:
            ep.reward = 0.0
            self.failures[ep.reason.split(":")[0]] += 1
            log.warning("agent_failed", group_id=ep.group_id, index=ep.index, reason=ep.reason)
        self.finished.append(ep)

    # ------------------------------------------------------------------ results

    def counters(self) -> dict[str, float]:
        """What a worker reports of its agents (``WorkerEngine.counters``): completions served, requests refused,
        calls after their episode ended, episodes failed, and completions that began a tool call the parser could not
        read (answered as content)."""
        served = {f"agent_{key}": float(self.stats[key]) for key in ("completions", "refused", "late_calls")}
        unread = float(self._parser.unread) if self._parser is not None else 0.0
        return {**served, "agent_failed": float(sum(self.failures.values())), "agent_tool_calls_unread": unread}

    async def close(self) -> None:
        """Stop serving: the endpoint, and the connection pool the episodes' clients share."""
        await self.endpoint.close()
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    def take_finished(self) -> list[AgentEpisode]:
        done, self.finished = self.finished, []
        return done

    def result(self, ep: AgentEpisode, broker_epoch: int) -> FinishedSample:
        seq, lead = ep.seq, len(ep.lead)
        tokens = ep.lead + (list(seq.tokens) if seq is not None else [])
        logprobs = [0.0] * lead + (list(seq.logprobs) if seq is not None else [])
        mask = np.array([0] * lead + (list(seq.mask) if seq is not None else []), np.uint8)
        turns = np.array([(a + lead, b + lead, v) for a, b, v in ep.turns], np.int32).reshape(-1, 3)
        masked = bool(ep.reason) and self.cfg.env_failure == "mask"
        version = ran_under(seq, self.engine) if seq is not None else ep.version
        if version is None:
            version = self.engine.version if self.engine.version is not None else 0
        return FinishedSample(
            group_id=GroupId(ep.group_id), attempt=AttemptId(ep.attempt), index=ep.index,
            segments=np.array([[version, len(tokens)]], dtype=np.int32),
            token_ids=np.array(tokens, np.int32), logprobs=np.array(logprobs, np.float32),
            reward=0.0 if ep.reason else ep.reward, broker_epoch=broker_epoch,
            finish=Finish.STOP if ep.reason else ep.finish,  # a failed agent ends its episode: trained, not re-run
            reward_components={"turns": float(len(ep.turns)), "agent_failed": float(bool(ep.reason))},
            reward_error=ep.reason, loss_mask=np.zeros_like(mask) if masked else mask,
            turns=turns[:0] if masked else turns,
        )  # fmt: skip


def row(item: Item) -> dict[str, Any]:
    """What an agent is given: the row's prompt (its last user turn), reference answer, chat turns and index."""
    source = item.meta.get("source", item)
    return {"index": source.index, "prompt": source.prompt, "answer": source.answer,
            "messages": [dict(t) for t in item.meta.get("messages", ())]}  # fmt: skip


__all__ = ["AgentEpisode", "AgentEpisodes", "EpisodeGone", "Sample", "row"]
