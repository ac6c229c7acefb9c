"""Tiny causal LMs built offline: a byte-level BPE tokenizer and a Qwen2-style model from a config.

There is no model hub here, so test and demo models are made locally and saved as an ordinary
Hugging Face folder (config, safetensors, tokenizer), then loaded through the same code path a real
checkpoint takes (``AutoModelForCausalLM.from_pretrained``). Embeddings are untied: a random tied
model's greedy decode repeats its last prompt token, which makes "new weights change the output"
checks pass vacuously, and vLLM's CPU in-place reload mishandles tied heads.

The tokenizer is trained on a fixed list of standard-library sources, so it is the same on every
machine with the same Python. The task alphabet (digits, operators, words used in prompts) is
always representable: byte-level BPE covers every byte.

**By name.** ``"dora:tiny"`` (in any setting that takes a model) is ``cached()``: built once into the user's cache
(``~/.cache/dora/tiny-model``) and reused after (its chat template brought up to date: ``refresh_template``).
``build_model`` is deterministic: the tokenizer is trained on fixed files and the weights are drawn after
``torch.manual_seed(spec.seed)``, so two builds with the same Python, torch and transformers are the same bytes
(processes on machines that do not share a home build the same model).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

CORPUS = ("textwrap.py", "argparse.py", "difflib.py", "json/__init__.py", "string.py", "fractions.py")
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
NAME = "dora:tiny"
NAMES = (NAME,)
"""The models dora builds itself, by name (``dora.hf.preflight.model_folder``)."""
"""What a user writes for dora's tiny model (``rollout.model = "dora:tiny"``)."""
HERMES_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
"""The tools section of a Hermes-style system turn (Qwen2.5's and Qwen3's words): each schema one JSON line."""
HERMES_SYSTEM = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{{ '\\n\\n' }}{% set messages = messages[1:] %}{% endif %}" + HERMES_TOOLS + "<|im_end|>\n{% endif %}"
)
"""With ``tools``, a system turn (the conversation's own system prompt first, if any) listing them, as Qwen3's."""
HERMES_TURNS = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['tool_calls'] %}{{ m['content'] or '' }}"
    "{% for c in m['tool_calls'] %}{% set f = c['function'] if c['function'] is defined else c %}"
    "{% if m['content'] or not loop.first %}{{ '\\n' }}{% endif %}<tool_call>\n{\"name\": \"{{ f['name'] }}\", "
    "\"arguments\": {{ f['arguments'] if f['arguments'] is string else f['arguments'] | tojson }}}\n</tool_call>"
    "{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
)
"""ChatML turns; an assistant turn's ``tool_calls`` follow its content, one ``<tool_call>`` block each, its
arguments the OpenAI JSON string as given (or a mapping, written as JSON), as Qwen3 writes them. Tool results are
``tool`` turns."""
TINY_SYSTEM = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{{ '\\n' }}{% set messages = messages[1:] %}{% endif %}<tools>{% for t in tools %}{{ '\\n' }}{{ t | tojson }}"
    "{% endfor %}{{ '\\n' }}</tools><|im_end|>\n{% endif %}"
)
"""With ``tools``, a system turn (the conversation's own system prompt first, if any) listing them, one JSON line
each, without Qwen's words around them: a 2-layer model attends over every token of its context, and the words
(156 tokens here) only dilute what a call must copy from the question."""
CHAT_TEMPLATE = TINY_SYSTEM + HERMES_TURNS + "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
"""ChatML, and with ``tools`` the Hermes format: the tools listed in ``<tools>``, calls written in ``<tool_call>``
blocks (no single token here: the text tokenizes to pieces), read by vLLM's ``hermes`` parser."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TinySpec:
    hidden: int = 128
    layers: int = 2
    vocab: int = 1024
    max_positions: int = 4096
    seed: int = 0


def build_tokenizer(vocab: int = 1024) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    std = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = [str(std / f) for f in CORPUS if (std / f).exists()]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tk.train(files, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=SPECIAL[0], pad_token=SPECIAL[0])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_model(out: str | pathlib.Path, spec: TinySpec = TinySpec()) -> pathlib.Path:
    """Write a tiny untied Qwen2 model and its tokenizer to ``out`` (an HF folder); returns the path."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    out = pathlib.Path(out)
    tok = build_tokenizer(spec.vocab)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=spec.hidden,
        intermediate_size=4 * spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=max(2, spec.hidden // 32),
        num_key_value_heads=max(1, spec.hidden // 64),
        max_position_embeddings=spec.max_positions,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def cached(cache: pathlib.Path | None = None) -> pathlib.Path:
    """The folder of ``"dora:tiny"``: ``<cache>/tiny-model`` (default cache: ``~/.cache/dora``), built on first use.

    Safe when several processes ask at once (xdist workers, a run's processes, ranks): each builds into a temporary
    sibling and renames it into place, which is atomic; a loser of the race finds the winner's complete folder and
    removes its own. A folder there is therefore always complete: one with no config.json is not ours, and is a
    ConfigError rather than something to build over."""
    from dora.config import ConfigError

    folder = (cache if cache is not None else pathlib.Path.home() / ".cache" / "dora") / "tiny-model"
    if (folder / "config.json").is_file():
        refresh_template(folder)
        return folder
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ConfigError(f"{folder} is where {NAME} is kept, but it holds no config.json: remove it and dora builds "
                          "the tiny model there again")  # fmt: skip
    folder.parent.mkdir(parents=True, exist_ok=True)
    print(f"dora: building {NAME} into {folder} (on first use only; later runs reuse it)", file=sys.stderr)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".tiny-model-", dir=folder.parent))
    try:
        build_model(tmp)
        tmp.chmod(0o755)  # mkdtemp's folder is the owner's alone; the cache's folders are not
        try:
            os.rename(tmp, folder)  # replaces an empty folder; fails on a full one
        except OSError:
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def refresh_template(folder: pathlib.Path) -> None:
    """Give a tiny model built by an older dora this dora's chat template (the weights and vocabulary are the same;
    the template learned to write tools, then listed them more briefly). Written beside it and renamed over it, so
    a reader sees one whole template; a cache dora may not write keeps its template, with a warning."""
    path = folder / "chat_template.jinja"
    if path.is_file() and path.read_text() == CHAT_TEMPLATE:
        return
    tmp = folder / f".chat_template.{os.getpid()}.jinja"
    try:
        tmp.write_text(CHAT_TEMPLATE)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        print(f"dora: {path} is an older chat template and cannot be replaced: {e}", file=sys.stderr)


def load(path: str | pathlib.Path, *, dtype: str = "float32") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and tokenizer of an HF folder, for inference (eval mode, no grad)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype))
    model.eval()
    return model, AutoTokenizer.from_pretrained(str(path))
