"""A tool-calling agent for long sums and products, written against the OpenAI API (``task.agent``).

The model is offered one function tool, ``calc``, which evaluates an integer expression; it may call it, reads the
value in a ``tool`` message, and ends with the number alone. The agent returns 1.0 when that number is the row's
answer and 0.0 otherwise. dora serves each call as one assistant turn of the episode it records and trains
(examples/agents/calculator.toml); the same function runs against any OpenAI-compatible server.

``SYSTEM`` and ``TOOLS`` are what every first request sends: the rows written for a warm start
(``python -m examples.agents.rows``) record conversations that open with them.
"""

from __future__ import annotations

import json
import re
from typing import Any

import openai

from dora.envs.calculator import evaluate

SYSTEM = "Compute the value. You may call calc; then reply with the number alone."
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "The value of an integer expression of + - * and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
MAX_CALLS = 3
"""Requests per episode at most (the run's task.max_turns may end it sooner)."""


def calc(arguments: str) -> str:
    """The tool: the value of ``{"expression": ...}``, or the error the model reads instead."""
    try:
        return str(evaluate(json.loads(arguments)["expression"]))
    except (ValueError, KeyError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        return f"error: {e}"


def final_number(content: str | None) -> str | None:
    """The last integer the answer's text holds."""
    found = re.findall(r"-?\d+", content or "")
    return found[-1] if found else None


async def agent(row: dict[str, Any], client: openai.AsyncOpenAI) -> float:
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": row["prompt"]}]
    try:
        for _ in range(MAX_CALLS):
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            message = reply.choices[0].message
            if not message.tool_calls:
                return float(final_number(message.content) == str(row["answer"]))
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                result = calc(call.function.arguments) if call.function.name == "calc" else "error: no such tool"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    except openai.BadRequestError:  # the episode's limits (turns, tokens) refuse the request: it ends unsolved
        return 0.0
    return 0.0
