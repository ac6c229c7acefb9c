"""Tool calls read from a completion's text, in the model family's own format, by vLLM's tool-call parsers.

A model writes its tool calls the way its chat template shows them: Hermes ``<tool_call>`` blocks (Qwen2, Qwen3,
dora's tiny model), Llama 3.1's JSON ``{"name": ..., "parameters": ...}``, Mistral's ``[TOOL_CALLS] [...]``. The
endpoint an agent talks to answers them as OpenAI ``tool_calls``, read by the parser ``vllm serve
--tool-call-parser NAME`` would use (``task.tool_parser``), so a completion reads the same here as from vLLM's
own server. vLLM is imported only when a parser is made: ``dora.rollout`` imports without it.

The text handed to ``parse`` is the completion decoded with its special tokens kept (Mistral's ``[TOOL_CALLS]`` is
one) and without the stop token that ended the turn.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from dora.config import ConfigError

FORMATS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("<tool_call>",), "hermes"),
    (("[TOOL_CALLS]",), "mistral"),
    (("<|start_header_id|>", '"parameters"'), "llama3_json"),
)
"""What a chat template that writes tool calls holds (every text of an entry), and the vLLM parser that reads
them; the first entry found decides."""


def detect(chat_template: str) -> str:
    """The vLLM parser for the tool calls ``chat_template`` writes; "" when it writes none."""
    for marks, name in FORMATS:
        if all(mark in chat_template for mark in marks):
            return name
    return ""


def parser_class(name: str) -> Any:
    """vLLM's tool-call parser class registered as ``name``; a ConfigError without vLLM or for a name it lacks."""
    try:
        from vllm.tool_parsers import ToolParserManager
    except ImportError:
        raise ConfigError(f"task.tool_parser = {name!r}: tool calls are read by vLLM's parsers, and vllm is not "
                          "installed: pip install 'dora-rl[vllm]' (or vllm, on GPU machines)") from None  # fmt: skip
    names = ToolParserManager.list_registered()
    if name not in names:
        raise ConfigError(f"task.tool_parser = {name!r} is no vLLM tool-call parser; one of: auto, {', '.join(names)}")
    return ToolParserManager.get_tool_parser(name)


class ToolCallParser:
    """Reads a completion's text into OpenAI tool calls with vLLM's parser for the model's format."""

    def __init__(self, tokenizer: Any, chat_template: str, name: str = "auto") -> None:
        """``tokenizer``: the model folder's (a transformers ``PreTrainedTokenizerFast``); ``name``:
        ``task.tool_parser``, a vLLM parser's name or ``auto`` (``detect`` on ``chat_template``). A parser that
        refuses the tokenizer (Llama 3's needs ``<|python_tag|>`` in its vocabulary, Mistral's ``[TOOL_CALLS]``) is
        a ConfigError here, not at the first completion."""
        self.name: str = detect(chat_template) if name == "auto" else name
        """The vLLM parser in use; "" when the chat template writes no tool calls (``parse`` finds none)."""
        self._tokenizer: Any = None
        self._class: Any = None
        self.unread = 0
        """Completions that began a call in the format (its opening mark) that the parser could not read (a broken
        JSON, an unclosed block): answered as content, as vLLM's server answers them, and counted here."""
        if not self.name:
            return
        self._class = parser_class(self.name)
        # vLLM's parsers log a traceback for every completion they cannot read; a policy in training writes many,
        # and ``unread`` counts them instead
        logging.getLogger("vllm.tool_parsers").setLevel(logging.CRITICAL)
        from vllm.tokenizers.hf import get_cached_tokenizer

        self._tokenizer = get_cached_tokenizer(tokenizer)  # as vLLM's server hands it: its vocabulary read once
        try:
            self._class(self._tokenizer)
        except (RuntimeError, ValueError, KeyError) as e:
            raise ConfigError(f"task.tool_parser: vLLM's {self.name!r} parser cannot read this model's completions: "
                              f"{e}") from None  # fmt: skip

    def parse(self, text: str, tools: Sequence[Mapping[str, Any]] | None,
              tool_choice: Any = "auto") -> tuple[str | None, list[dict[str, Any]]]:  # fmt: skip
        """The content (None when empty) and the tool calls of a completion's ``text``, as OpenAI dicts
        ``{"id", "type": "function", "function": {"name", "arguments" (a JSON string)}}``, for a request that
        offered ``tools`` (OpenAI function schemas) with ``tool_choice``. No tools, ``tool_choice = "none"`` or no
        format: the text is all content, as vLLM's server answers. The ids are the parser's (Mistral's: nine
        letters and digits, as its templates require). When calls are found the content loses its trailing
        whitespace (what the template writes between it and the first call). Invalid tools or tool_choice (as
        vLLM's request checks them): ValueError."""
        if not self.name or not tools or tool_choice == "none":
            return _content(text), []
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest(model="dora", messages=[], tools=[dict(t) for t in tools],
                                        tool_choice=tool_choice)  # fmt: skip
        parser = self._class(self._tokenizer, request.tools)  # fresh: the parsers keep per-request state
        found = parser.extract_tool_calls(text, request)
        if not found.tools_called or not found.tool_calls:
            self.unread += any(mark in text for marks, name in FORMATS if name == self.name for mark in marks[:1])
            return _content(text), []
        calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                  "arguments": c.function.arguments}} for c in found.tool_calls]  # fmt: skip
        return _content((found.content or "").rstrip()), calls


    def content_so_far(self, text: str) -> str:
        """The part of a turn's text decoded so far (special tokens kept) that is its content whatever follows, for a
        stream with tools offered: the text before the format's opening mark, less a tail that may begin the mark and
        less trailing whitespace (an answer's content loses it when a call follows). It is always a prefix of the
        content ``parse`` reads from the whole turn. Llama 3.1's calls open with no mark: nothing is sure before the
        turn ends."""
        if not self.name:
            return text
        marks = [marks[0] for marks, name in FORMATS if name == self.name]
        if not marks or self.name == "llama3_json":
            return ""
        mark = marks[0]
        at = text.find(mark)
        if at >= 0:
            text = text[:at]
        else:
            held = next((k for k in range(min(len(mark) - 1, len(text)), 0, -1) if text.endswith(mark[:k])), 0)
            text = text[: len(text) - held]
        return text.rstrip()


def _content(text: str) -> str | None:
    return text if text.strip() else None
