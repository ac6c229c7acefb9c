"""Tool calls in each family's own format (dora.rollout.agents.toolcalls): the chat templates of dora's tiny model
and of the zoo's Qwen2, Qwen3, Llama 3 and Mistral list tools and write assistant tool calls, render every
conversation without them exactly as before, and vLLM's parser for the format reads the calls they write back.

The round trips take an assistant turn the template rendered as the completion a model would have sampled (the
text between the generation prompt and the turn end) and parse it."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys

import pytest

from dora.config import ConfigError
from dora.hf import tiny, zoo
from dora.rollout.agents.toolcalls import ToolCallParser, detect

FAMILIES = ("tiny", "qwen2", "qwen3", "llama3", "mistral")
FORMAT = {"tiny": "hermes", "qwen2": "hermes", "qwen3": "hermes", "llama3": "llama3_json", "mistral": "mistral"}
TURN_END = {
    "tiny": "<|im_end|>",
    "qwen2": "<|im_end|>",
    "qwen3": "<|im_end|>",
    "llama3": "<|eot_id|>",
    "mistral": "</s>",
}
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm")

# The templates as they were before they rendered tools, verbatim: without tools and tool calls the new ones must
# render every conversation to the same bytes (recorded datasets, SFT rows and runs depend on them).
OLD = {
    "tiny": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "qwen2": "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You "
             "are a helpful assistant.<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
             "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
             "{% endif %}",
    "qwen3": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not "
             "enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}",
    "llama3": "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
              "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}<|start_header_id|>system"
              "<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n\n{{ system }}<|eot_id|>{% for m in "
              "messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
              "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}",
    "mistral": "{{ bos_token }}{% set ns = namespace(system='') %}{% for m in messages %}{% if m['role'] == "
               "'system' %}{% set ns.system = m['content'] + '\n\n' %}{% elif m['role'] == 'user' %}[INST] "
               "{{ ns.system }}{{ m['content'] }}[/INST]{% set ns.system = '' %}{% else %}{{ m['content'] }}"
               "{{ eos_token }}{% endif %}{% endfor %}",
}  # fmt: skip
S, U, A = "system", "user", "assistant"
CONVERSATIONS = [
    [{"role": U, "content": "What is 2+3?"}],
    [{"role": S, "content": "Be brief."}, {"role": U, "content": "2+3?"}],
    [{"role": S, "content": " spaced\n"}, {"role": U, "content": "\n{x}\n"}, {"role": A, "content": " 5 "}],
    [{"role": U, "content": "a"}, {"role": A, "content": "b", "tool_calls": []}, {"role": U, "content": "c"}],
    [{"role": S, "content": "s"}, {"role": U, "content": "guess"}, {"role": A, "content": "50", "tool_calls": None},
     {"role": "tool", "content": "higher", "tool_call_id": "x"}, {"role": A, "content": "75"}],
]  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "Adds two integers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "say", "parameters": {"type": "object", "properties": {
        "text": {"type": "string"}}}}},
]  # fmt: skip
CALLS = [("add", {"a": 2, "b": 3}), ("say", {"text": 'héllo "x" {y}\n'})]


def tool_calls(calls: list[tuple[str, dict]]) -> list[dict]:
    return [{"id": f"call{i}abcd", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, (n, a) in enumerate(calls)]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizers() -> dict:
    """Each family's tokenizer (``zoo.tokenizer``), from one trained BPE copied (training it is the slow part)."""
    base = tiny.build_tokenizer()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tiny, "build_tokenizer", lambda vocab=1024: copy.deepcopy(base))
        built = {f: zoo.tokenizer(zoo.ZOO[f]) for f in FAMILIES if f != "tiny"}
    return {"tiny": base, **built}


def render(tok, messages, **kw) -> str:
    return tok.apply_chat_template(messages, tokenize=False, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_without_tools_every_template_renders_as_it_did(tokenizers, family):
    tok = tokenizers[family]
    assert tok.chat_template == (tiny.CHAT_TEMPLATE if family == "tiny" else zoo.ZOO[family].template)
    for messages in CONVERSATIONS:
        for kw in ({}, {"add_generation_prompt": True}, {"add_generation_prompt": True, "tools": []},
                   {"add_generation_prompt": True, "enable_thinking": False}):  # fmt: skip
            assert render(tok, messages, **kw) == render(tok, messages, chat_template=OLD[family], **kw), (messages, kw)


def test_the_templates_write_tools_and_calls_in_each_familys_format(tokenizers):
    chat = [*CONVERSATIONS[1], {"role": A, "content": None, "tool_calls": tool_calls(CALLS[:1])},
            {"role": "tool", "content": "5", "tool_call_id": "call0abcd"}]  # fmt: skip
    qwen2 = render(tokenizers["qwen2"], chat, tools=TOOLS, add_generation_prompt=True)
    assert qwen2.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and qwen2.count("You are Qwen") == 0
    assert f"<tools>\n{json.dumps(TOOLS[0])}\n{json.dumps(TOOLS[1])}\n</tools>" in qwen2
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
            "<|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n") in qwen2  # fmt: skip
    alone = render(tokenizers["qwen2"], chat[1:2], tools=TOOLS)  # no system turn: Qwen2.5's default one lists them
    assert alone.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                            "assistant.\n\n# Tools\n")  # fmt: skip
    llama = render(tokenizers["llama3"], chat, tools=TOOLS, add_generation_prompt=True)
    assert llama.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n")
    assert "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions" in llama
    assert llama.endswith(
        '{"name": "add", "parameters": {"a": 2, "b": 3}}<|eot_id|><|start_header_id|>ipython'
        "<|end_header_id|>\n\n5<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    mistral = render(tokenizers["mistral"], chat, tools=TOOLS)
    assert mistral == (f"<s>[AVAILABLE_TOOLS] {json.dumps(TOOLS)}[/AVAILABLE_TOOLS][INST] Be brief.\n\n2+3?[/INST]"
                       '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2, "b": 3}, "id": "call0abcd"}]</s>'
                       '[TOOL_RESULTS] {"content": "5", "call_id": "call0abcd"}[/TOOL_RESULTS]')  # fmt: skip


def test_auto_picks_the_parser_of_each_templates_format():
    for family, name in FORMAT.items():
        assert detect(tiny.CHAT_TEMPLATE if family == "tiny" else zoo.ZOO[family].template) == name, family
    for family in ("gemma", "gemma3", "phi3"):  # no tool format: no parser, and the text is all content
        assert detect(zoo.ZOO[family].template) == ""
    parser = ToolCallParser(None, zoo.PHI3_TEMPLATE)
    assert parser.name == "" and parser.parse("<tool_call>{}</tool_call>", TOOLS) == ("<tool_call>{}</tool_call>", [])


def test_a_parser_named_without_vllm_is_a_config_error_naming_the_extra(monkeypatch):
    for name in ("vllm", "vllm.tool_parsers"):  # importing them fails, as where vllm is not installed (even when
        monkeypatch.setitem(sys.modules, name, None)  # an earlier test of this process imported them)
    with pytest.raises(ConfigError, match=r"vllm is not installed: pip install 'dora-rl\[vllm\]'"):
        ToolCallParser(None, tiny.CHAT_TEMPLATE)


def test_a_cached_tiny_model_gets_the_template_that_writes_tools(tmp_path):
    folder = tmp_path / "tiny-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "chat_template.jinja").write_text(OLD["tiny"])
    assert tiny.cached(tmp_path) == folder
    assert (folder / "chat_template.jinja").read_text() == tiny.CHAT_TEMPLATE
    assert sorted(p.name for p in folder.iterdir()) == ["chat_template.jinja", "config.json"]


def completion(tok, family: str, content: str | None, calls: list[tuple[str, dict]]) -> str:
    """What a model that wrote this assistant turn sampled: the text after the generation prompt, before the turn
    end (Mistral's template has no generation prompt: its prompt ends with ``[/INST]``)."""
    chat = CONVERSATIONS[1]
    prompt = render(tok, chat, tools=TOOLS, add_generation_prompt=True)
    said = render(tok, [*chat, {"role": A, "content": content, "tool_calls": tool_calls(calls)}], tools=TOOLS)
    assert said.startswith(prompt), (prompt, said)
    return said[len(prompt) :].split(TURN_END[family])[0]


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("family", FAMILIES)
def test_the_calls_a_template_writes_parse_back_to_the_same_calls(tokenizers, family):
    tok = tokenizers[family]
    parser = ToolCallParser(tok, tok.chat_template)
    assert parser.name == FORMAT[family]
    contents = (None,) if family == "llama3" else (None, "Let me add.")  # Llama 3.1 writes a call's JSON alone
    for content in contents:
        text = completion(tok, family, content, CALLS)
        found, calls = parser.parse(text, TOOLS)
        assert found == content, text
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == CALLS, text
        assert all(c["type"] == "function" and c["id"] for c in calls) and len({c["id"] for c in calls}) == 2
    said = "The sum is 5."
    assert parser.parse(said, TOOLS) == (said, [])  # no call: all content
    assert parser.parse(text, TOOLS, "none") == (text, []) and parser.parse(text, []) == (text, [])  # none offered
    assert parser.parse("", TOOLS) == (None, [])


@pytest.mark.parametrize(("name", "match"), [("nope", r"no vLLM tool-call parser; one of: auto, .*hermes"),
                                             ("llama3_json", r"cannot read this model's completions")])  # fmt: skip
@pytest.mark.vllm
@needs_vllm
def test_an_unknown_parser_or_one_the_tokenizer_lacks_tokens_for_is_a_config_error(tokenizers, name, match):
    with pytest.raises(ConfigError, match=match):  # the tiny tokenizer has no <|python_tag|>
        ToolCallParser(tokenizers["tiny"], tiny.CHAT_TEMPLATE, name)


@pytest.mark.vllm
@needs_vllm
def test_a_call_the_parser_cannot_read_is_content_counted_without_a_traceback(tokenizers):
    import logging

    tok = tokenizers["tiny"]
    parser = ToolCallParser(tok, tok.chat_template)
    logged: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = logged.append  # type: ignore[method-assign]
    logging.getLogger("vllm.tool_parsers.hermes_tool_parser").addHandler(handler)
    broken = '<tool_call>\n{"name": "add", "arguments": {"a": "2}}\n</tool_call>'  # an unterminated string
    assert parser.parse(broken, TOOLS) == (broken, []) and parser.unread == 1
    assert parser.parse("The sum is 5.", TOOLS) == ("The sum is 5.", []) and parser.unread == 1  # no call begun
    assert parser.parse(completion(tok, "tiny", None, CALLS), TOOLS)[1] and parser.unread == 1
    logging.getLogger("vllm.tool_parsers.hermes_tool_parser").removeHandler(handler)
    assert not logged, [r.getMessage() for r in logged]


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("family", FAMILIES)
def test_what_a_stream_sends_before_the_turn_ends_is_always_a_prefix_of_the_content_parsed_at_its_end(tokenizers,
                                                                                                     family):  # fmt: skip
    tok = tokenizers[family]
    parser = ToolCallParser(tok, tok.chat_template)
    for content, calls in (("Let me add.", CALLS), (None, CALLS), ("The sum is 5.\n", []), ("a < b <tool", [])):
        text = completion(tok, family, content, calls) if calls else content
        final = parser.parse(text, TOOLS)[0] or ""
        sure = [parser.content_so_far(text[:n]) for n in range(len(text) + 1)]
        assert all(final.startswith(s) for s in sure), (family, text, [s for s in sure if not final.startswith(s)])
        assert all(a == b[: len(a)] for a, b in zip(sure, sure[1:], strict=False)), "a stream never takes text back"
        # with a call, all its content was sent before it (Llama 3.1's calls open with no mark: its content waits
        # for the turn's end); without, a held-back tail (a mark's start, whitespace) follows at the end
        if calls and family != "llama3":
            assert sure[-1] == final, (family, sure[-1], final)
