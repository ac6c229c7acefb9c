"""A rollout worker's OpenAI-compatible endpoint for its agent episodes (aiohttp, on the worker's event loop).

Each episode has its own address, ``http://127.0.0.1:<port>/<token>/v1``, where ``token`` is a secret made for it:
an agent's client reaches its own episode only, and a call to an episode that ended finds nothing there (404).

- ``POST …/v1/chat/completions``: a completion, streamed (server-sent events, as OpenAI's) or not. A stream sends the
  answer's text as the engine decodes it, a step at a time; when tools were offered, the text that no call can
  follow into (before the format's opening mark, held back while a tail may begin it), and the tool calls at the
  turn's end, once they are parsed (text the model wrote inside a call is not content).
- ``GET …/v1/models``: the one model served.

Refusals are OpenAI error bodies (``openai_api.Refused``), which the ``openai`` client raises as its own errors. The
endpoint binds loopback only: the agents run in this process.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any, Protocol

import structlog
from aiohttp import web

from dora.rollout.agents import openai_api as api


class Served(Protocol):
    """What the endpoint asks of the worker's agent episodes (``dora.rollout.agents.episodes.AgentEpisodes``)."""

    model_name: str
    stats: Counter[str]

    def episode(self, token: str) -> Any: ...
    def accept(self, ep: Any, request: api.ChatRequest) -> asyncio.Future: ...
    def streamable(self, ep: Any, request: api.ChatRequest) -> str: ...


log = structlog.get_logger()


class Endpoint:
    def __init__(self, episodes: Served, host: str = "127.0.0.1") -> None:
        self.episodes = episodes
        self.host = host
        self.runner: web.AppRunner | None = None

    async def start(self) -> str:
        """Serve on a free port of ``host``; the base URL (episodes' addresses are under it)."""
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/{token}/v1/chat/completions", self.completions)
        app.router.add_get("/{token}/v1/models", self.models)
        self.runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        base = f"http://{self.host}:{port}"
        log.info("agent_endpoint_ready", url=base)
        return base

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def models(self, request: web.Request) -> web.Response:
        try:
            self.episodes.episode(request.match_info["token"])
        except api.Refused as e:
            return refusal(e)
        return web.json_response(api.models(self.episodes.model_name))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            ep = self.episodes.episode(request.match_info["token"])
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise api.Refused(400, "the request body is not JSON") from None
            chat = api.read_request(body, temperature=ep.temperature, top_p=ep.top_p)
            answer = self.episodes.accept(ep, chat)
            ended = len(ep.seq.tokens) if ep.seq is not None else 0  # where the turn this request asks for will begin
        except api.Refused as e:
            self.episodes.stats["refused"] += 1
            log.warning("agent_request_refused", status=e.status, code=e.code, error=e.message[:200])
            return refusal(e)
        meta: dict[str, Any] = {"rid": f"chatcmpl-{uuid.uuid4().hex}", "model": self.episodes.model_name,
                                "created": int(time.time())}  # fmt: skip
        if chat.stream:
            return await self.stream(request, ep, chat, answer, meta, ended)
        try:
            turn = await asyncio.shield(answer)
        except api.Refused as e:
            return refusal(e)
        except Exception as e:  # the episode went away (cancelled, cleared) while the request waited
            return refusal(api.Refused(503, f"the episode went away: {e}", code="episode_gone"))
        return web.json_response(api.completion(**meta, fingerprint=f"dora-v{turn.version}", msg=turn.message,
                                                finish=turn.finish, prompt_tokens=turn.prompt_tokens,
                                                completion_tokens=turn.completion_tokens))  # fmt: skip

    async def stream(self, request: web.Request, ep: Any, chat: api.ChatRequest, answer: asyncio.Future,
                     meta: dict[str, Any], ended: int) -> web.StreamResponse:  # fmt: skip
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        fingerprint = f"dora-v{ep.version if ep.version is not None else ''}"
        try:
            async for chunk in self.chunks(ep, chat, answer, meta, fingerprint, ended):
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
        except ConnectionResetError:  # the agent hung up: its turn is recorded all the same
            log.info("agent_stream_dropped", group_id=ep.group_id, index=ep.index)
        return response

    async def chunks(self, ep: Any, chat: api.ChatRequest, answer: asyncio.Future, meta: dict[str, Any],
                     fingerprint: str, ended: int) -> AsyncIterator[dict[str, Any]]:  # fmt: skip
        """The stream's chunks: the role, the content as it decodes (with tools, the part no call can follow into),
        then the rest of the content and the tool calls, the finish, and the usage if asked. ``ended``: where the
        episode's tokens ended when the request came; until its turn begins past them, the sequence still holds the
        previous turn, and nothing is sent."""
        yield api.chunk(**meta, fingerprint=fingerprint, delta={"role": "assistant", "content": ""})
        sent = ""
        while not answer.done():
            ep.progress.clear()
            stepped = asyncio.ensure_future(ep.progress.wait())
            try:
                await asyncio.wait([stepped, answer], return_when=asyncio.FIRST_COMPLETED)
            finally:
                stepped.cancel()
            if answer.done() or ep.seq is None or ep.seq.turn_start < ended:
                continue
            text = self.episodes.streamable(ep, chat)
            if len(text) > len(sent) and not text.endswith("\ufffd") and text.startswith(sent):
                yield api.chunk(**meta, fingerprint=fingerprint, delta={"content": text[len(sent) :]})
                sent = text
        try:
            turn = await asyncio.shield(answer)
        except api.Refused as e:
            yield e.body()
            return
        except Exception as e:  # the episode went away while the request waited
            yield api.Refused(503, f"the episode went away: {e}", code="episode_gone").body()
            return
        fingerprint = f"dora-v{turn.version}"
        content = turn.message.get("content") or ""
        if content.startswith(sent) and len(content) > len(sent):
            yield api.chunk(**meta, fingerprint=fingerprint, delta={"content": content[len(sent) :]})
        for delta in api.call_deltas(turn.message.get("tool_calls", [])):
            yield api.chunk(**meta, fingerprint=fingerprint, delta=delta)
        yield api.chunk(**meta, fingerprint=fingerprint, delta={}, finish=turn.finish)
        if chat.include_usage:
            yield api.chunk(**meta, fingerprint=fingerprint, delta=None,
                            used=api.usage(turn.prompt_tokens, turn.completion_tokens))  # fmt: skip


def refusal(e: api.Refused) -> web.Response:
    return web.json_response(e.body(), status=e.status)
