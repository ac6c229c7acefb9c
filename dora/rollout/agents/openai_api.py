"""The OpenAI chat-completions protocol as an agent's endpoint speaks it: requests read and checked, answers and
stream chunks built. Pure: no I/O, no engine.

What a request may ask is what the run samples: the behaviour policy the learner divides by is the engine's sampling
at the run's temperature and top-p, so a request naming other values, constrained decoding (a forced tool, a
response format), stop strings, penalties or several choices is refused (HTTP 400) with the reason, never served
from another distribution. ``model`` is not checked: the endpoint serves one policy, under the name it lists.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")

UNSERVED = {
    "stop": "stop strings would cut turns where the model did not end them",
    "response_format": "a response format constrains decoding",
    "logit_bias": "a logit bias changes the distribution sampled",
    "presence_penalty": "a penalty changes the distribution sampled",
    "frequency_penalty": "a penalty changes the distribution sampled",
    "seed": "episodes are seeded by the run (each sample's seed comes from its group's)",
    "logprobs": "log-probs are recorded for the learner, not returned",
    "top_logprobs": "log-probs are recorded for the learner, not returned",
}
"""Request fields refused when set to anything but their neutral value, and why."""
NEUTRAL: dict[str, Any] = {"presence_penalty": 0, "frequency_penalty": 0, "logprobs": False}


class Refused(Exception):
    """A request the endpoint does not serve: answered with ``status`` and an OpenAI error body."""

    def __init__(self, status: int, message: str, *, code: str = "invalid_request", param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    """Normalized (``message``): the conversation so far, the new turns last."""
    tools: list[dict[str, Any]] | None
    tool_choice: Any
    stream: bool
    include_usage: bool
    max_tokens: int | None
    """The answer's tokens at most (``max_completion_tokens`` or ``max_tokens``); None: the run's per-turn bound."""


def read_request(body: Any, *, temperature: float, top_p: float) -> ChatRequest:
    """A chat-completions request body, checked against what the run samples; ``Refused`` says what is wrong."""
    if not isinstance(body, dict):
        raise Refused(400, "the request body must be a JSON object")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise Refused(400, "messages must be a non-empty list", param="messages")
    for key, why in UNSERVED.items():
        if body.get(key) not in (None, NEUTRAL.get(key)):
            raise Refused(400, f"{key} is not served here: {why}", param=key)
    if body.get("n") not in (None, 1):
        raise Refused(400, "n must be 1: each sample of a group is its own episode", param="n")
    for key, run in (("temperature", temperature), ("top_p", top_p)):
        asked = body.get(key)
        if asked is not None and not (isinstance(asked, (int, float)) and math.isclose(asked, run, abs_tol=1e-6)):
            raise Refused(400, f"{key} = {asked!r}: the run samples at {key} = {run:g} (the learner's behaviour "
                               "policy); leave it out or send the run's value", param=key)  # fmt: skip
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise Refused(400, "tools must be a list of tool objects", param="tools")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise Refused(400, f"tool_choice = {json.dumps(choice)} is not served: forcing a call constrains decoding; "
                           "use auto or none", param="tool_choice")  # fmt: skip
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None and not (isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1):
        raise Refused(400, f"max_tokens must be a positive integer; got {limit!r}", param="max_tokens")
    options = body.get("stream_options") or {}
    return ChatRequest(messages=[message(x, i) for i, x in enumerate(raw)], tools=tools or None,
                       tool_choice=choice or "auto", stream=bool(body.get("stream")),
                       include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
                       max_tokens=limit)  # fmt: skip


def message(raw: Any, i: int) -> dict[str, Any]:
    """One chat message in the form recorded and rendered: role, content text (parts joined), tool calls with their
    arguments as JSON text, and a tool result's call id. Fields the client adds as null (refusal, audio) go."""
    if not isinstance(raw, dict) or raw.get("role") not in ROLES:
        raise Refused(400, f"messages[{i}] needs a role among {', '.join(ROLES)}", param=f"messages[{i}]")
    content = raw.get("content")
    if isinstance(content, list):  # content parts: only text is served
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise Refused(400, f"messages[{i}]: only text content parts are served", param=f"messages[{i}]")
        content = "".join(p["text"] for p in content)
    if content is not None and not isinstance(content, str):
        raise Refused(400, f"messages[{i}].content must be text", param=f"messages[{i}]")
    out: dict[str, Any] = {"role": raw["role"], "content": content or ""}
    if raw["role"] == "assistant" and raw.get("tool_calls"):
        out["tool_calls"] = [tool_call(c, i) for c in raw["tool_calls"]]
    if raw["role"] == "tool":
        out["tool_call_id"] = str(raw.get("tool_call_id") or "")
    return out


def tool_call(raw: Any, i: int) -> dict[str, Any]:
    fn = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise Refused(400, f"messages[{i}]: a tool call needs function.name", param=f"messages[{i}]")
    args = fn.get("arguments", "{}")
    return {"id": str(raw.get("id") or ""), "type": "function",
            "function": {"name": fn["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


def answer(content: str | None, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message returned (and recorded, normalized, as the conversation's next turn)."""
    out: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        out["tool_calls"] = calls
    return out


def completion(*, rid: str, model: str, created: int, fingerprint: str, msg: dict[str, Any], finish: str,
               prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:  # fmt: skip
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": fingerprint,
            "choices": [{"index": 0, "message": msg, "finish_reason": finish, "logprobs": None}],
            "usage": usage(prompt_tokens, completion_tokens)}  # fmt: skip


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


def chunk(*, rid: str, model: str, created: int, fingerprint: str, delta: dict[str, Any] | None,
          finish: str | None = None, used: dict[str, int] | None = None) -> dict[str, Any]:  # fmt: skip
    """A stream chunk: a delta of the one choice (and its finish), or (``delta`` None) the usage chunk."""
    out: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                           "system_fingerprint": fingerprint, "choices": []}  # fmt: skip
    if delta is not None:
        out["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
    if used is not None:
        out["usage"] = used
    return out


def call_deltas(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool calls as stream deltas, one whole call each."""
    return [{"tool_calls": [{"index": k, **c}]} for k, c in enumerate(calls)]


def models(name: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "dora"}]}
