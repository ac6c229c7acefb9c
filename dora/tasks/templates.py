"""Prompts as the model expects them: the model folder's own chat template, or plain text.

``task.chat_template = true`` renders each prompt's messages with the template the model folder ships
(``chat_template.jinja``, or ``chat_template`` in ``tokenizer_config.json``), with
``add_generation_prompt``, through transformers' own ``apply_chat_template``, so a prompt reads exactly as
it would in transformers or vLLM. Only the tokenizer side of transformers is loaded (no torch: the broker
renders prompts and must stay free of it; a test checks ``sys.modules``).

Without a template a prompt is its text: the user turn, after the system prompt and a blank line when
there is one. A chat of several turns needs a template.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dora.config import ConfigError

Messages = Sequence[Mapping[str, Any]]


class Renderer:
    def __init__(self, model_dir: str, chat_template: bool) -> None:
        self.model_dir = model_dir
        self.tokenizer = None
        if chat_template:
            from transformers import PreTrainedTokenizerFast

            try:
                self.tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
            except (OSError, ValueError) as e:
                raise ConfigError(f"task.chat_template = true: cannot load the tokenizer of {model_dir}: {e}") from None
            if not self.tokenizer.chat_template:
                raise ConfigError(f"task.chat_template = true: {model_dir} has no chat template "
                                  "(chat_template.jinja, or chat_template in tokenizer_config.json)")  # fmt: skip

    def render(self, messages: Messages, where: str = "", tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt text of ``messages`` (and ``tools``, OpenAI function schemas the template lists); a template
        that fails is a ConfigError naming ``where``."""
        if self.tokenizer is None:
            roles = [m["role"] for m in messages]
            if roles not in (["user"], ["system", "user"]) or tools:
                raise ConfigError(f"{where}: a chat of turns {roles} needs task.chat_template = true")
            return "\n\n".join(m["content"] for m in messages)
        try:
            text = self.tokenizer.apply_chat_template([dict(m) for m in messages], tools=list(tools) if tools else None,
                                                      tokenize=False, add_generation_prompt=True)  # fmt: skip
        except Exception as e:  # a template is user code: any failure is that template's, named with the row
            raise ConfigError(
                f"{where}: the chat template of {self.model_dir} failed: {type(e).__name__}: {e}"
            ) from None
        if not isinstance(text, str):
            raise ConfigError(
                f"{where}: the chat template of {self.model_dir} rendered {type(text).__name__}, not text"
            )
        return text


ACTION = "\u27e6dora:action\u27e7"
"""Stands for an assistant turn's content while a chat is rendered (``observation_text``)."""


def observation_text(renderer: Renderer, chat: Messages, observation: Messages, said: str = "",
                     tools: Sequence[Mapping[str, Any]] | None = None) -> str:  # fmt: skip
    """What the chat template puts between an assistant turn (the one after ``chat``) and the next one: the turn's
    end (but ``said``, the end the model sampled itself), the observation's turns, the next turn's start. A
    placeholder stands for the turn's content, so the text does not depend on what the model said. A worker
    appends this after each turn of an episode, and `dora sft` renders recorded episodes with it."""
    text = renderer.render([*chat, {"role": "assistant", "content": ACTION}, *observation], tools=tools)
    return text[text.rindex(ACTION) + len(ACTION) :].removeprefix(said)


OPENINGS: tuple[tuple[dict[str, str], ...], ...] = (
    ({"role": "user", "content": "a"},),
    ({"role": "user", "content": "Z 1"},),
    ({"role": "system", "content": "b"}, {"role": "user", "content": "c"}),
    ({"role": "system", "content": "\n9"}, {"role": "user", "content": "{"}),
)
"""Conversations unlike each other: the tokens every rendering of them starts with are the chat template's own."""
PROBE_TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object",
              "properties": {"x": {"type": "string"}}, "required": ["x"]}}}  # fmt: skip


def opening_ids(renderer: Renderer, encode: Callable[[str], list[int]]) -> list[int]:
    """The tokens the chat template opens every conversation with (its BOS, a system header): the longest token prefix
    shared by the renderings of unlike conversations, with tools and without. An agent's episode is recorded after
    them, so every episode of a group shares them as its prompt. None shared is a ConfigError."""
    rendered = [encode(renderer.render(chat, "task.agent")) for chat in OPENINGS]
    rendered += [encode(renderer.render(chat, "task.agent", tools=[PROBE_TOOL])) for chat in OPENINGS]
    shared = rendered[0]
    for ids in rendered[1:]:
        n = next((i for i, (a, b) in enumerate(zip(shared, ids, strict=False)) if a != b), min(len(shared), len(ids)))
        shared = shared[:n]
    if not shared:
        raise ConfigError(f"task.agent: the chat template of {renderer.model_dir} opens conversations with no tokens "
                          "they all share (a BOS or a system header): an agent's episodes need one")  # fmt: skip
    return shared
