"""A model folder and what it says: where it is, which tokens end a turn, how long a sequence may be.

**Where.** ``resolve`` takes what a user writes in ``rollout.model``, ``learner.model``, ``sft.model`` or
``--model``:
- (a name dora knows, ``"dora:tiny"``, is ``dora.hf.preflight.model_folder``'s: it builds dora's tiny model on
  first use, so this module, which the broker reads, stays free of torch);
- a folder that exists, or a name that is plainly a path (``/...``, ``./...``, ``../...``, ``~...``): that folder,
  which must exist and hold something (a typo is an error, never a folder made and filled);
- otherwise a hub id (``Qwen/Qwen2.5-0.5B-Instruct``, ``gpt2``): its snapshot in huggingface_hub's cache,
  downloaded when there is a network (weights as safetensors only, with the config, generation config and
  tokenizer files). ``HF_HUB_OFFLINE=1`` is honoured: the cached copy or one line naming the id and the cache.

**What it says** (``facts``; config files and the tokenizer side of transformers only, no torch):
- ``eos_ids``: the end-of-sequence ids of ``config.json`` and ``generation_config.json`` together, in that order.
  A list is a list (Llama-3 instruct lists three); Gemma's ``<end_of_turn>`` is only in the generation config.
- ``turn_end``: the token the chat template writes right after an assistant turn's content (``<|im_end|>``,
  ``<|eot_id|>``, ``<end_of_turn>``, ``<|end|>``), found by rendering a two-turn chat: what a model trained on
  that template emits to end its answer. None without a template, or when what follows is not one special token.
- ``stop_ids``: both together, what every engine ends a turn on.
- ``max_positions``: the model's own limit on prompt + completion (``max_position_embeddings``, GPT-2's
  ``n_positions``, MPT's ``max_seq_len``, ...), which bounds ``rollout.max_model_len``. None where the config names
  none (BLOOM: ALiBi has no table of positions).
- ``layer_types``: each layer's kind, where the config lists them (what ``dora.hf.checks`` reads to refuse a model
  whose cache the torch engine cannot cut).
"""

from __future__ import annotations

import json
import pathlib
import sys
from dataclasses import dataclass
from typing import Any

from dora.config import ConfigError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".ckpt", ".index.json")
"""Files of a model folder that hold (or index) weights: a published version writes its own."""
HUB_FILES = ("*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken")
"""What is fetched of a hub model: safetensors weights, configs, the tokenizer and template (no .bin, .pth, onnx)."""
COMPANION_MAX_BYTES = 64 << 20
"""A non-weight file larger than this is not copied into published versions (a tokenizer is a few MB)."""
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx", "max_seq_len",
                 "model_max_length")  # fmt: skip
"""Where configs keep the longest sequence (MPT and DBRX: ``max_seq_len``; Kimi-Linear: ``model_max_length``)."""
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TINY_HINT = 'dora\'s tiny model is "dora:tiny"'
MARK = "\u27e6dora:turn\u27e7"
"""Stands for an assistant turn's content while the template is rendered to find what follows it."""


def is_path(name: str) -> bool:
    """Written as a path, never a hub id: absolute, ``./``, ``../`` or ``~``."""
    return name.startswith(("/", "./", "../", "~")) or name in (".", "..")


def resolve(name: str, *, key: str) -> pathlib.Path:
    """The local folder of ``name`` (``key``: the setting it came from, for errors): itself when it exists or is
    written as a path (a folder with something in it); else the
    cached (or now downloaded) snapshot of the hub model of that id. A name that does not resolve is a
    ConfigError."""
    path = pathlib.Path(name).expanduser()
    if path.is_dir() and not any(path.iterdir()):
        raise ConfigError(f"{key} = {name!r}: {path.absolute()} is an empty folder, not a model; {TINY_HINT}")
    if path.exists():
        return path
    if is_path(name):
        raise ConfigError(f"{key} = {name!r}: no such folder ({path.absolute()}); {TINY_HINT}")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ConfigError(f"{key} = {name!r}: no such folder, and not a hub id (org/name); {TINY_HINT}") from None
    try:
        return pathlib.Path(snapshot_download(name, allow_patterns=list(HUB_FILES)))
    except Exception as e:  # huggingface_hub's many ways of not having it: offline, no network, gated, missing
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        where = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub was not reachable or refused"
        raise ConfigError(f"{key} = {name!r}: no folder of that name here, and no copy of hub model {name} in the "
                          f"cache {constants.HF_HUB_CACHE} ({where}: {type(e).__name__}: {why})") from None  # fmt: skip


def read_json(path: pathlib.Path, *, what: str) -> dict[str, Any] | None:
    """A JSON object file, or None when absent; unreadable or not an object: a ConfigError naming ``what``."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{what}: {path} is not readable JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: {path} is not a JSON object")
    return data


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's settings: a multimodal config keeps them under ``text_config``."""
    inner = cfg.get("text_config")
    return {**cfg, **inner} if isinstance(inner, dict) else cfg


def ids_of(value: Any) -> list[int]:
    """An ``eos_token_id`` value as a list: one id, a list of ids, or none."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list | tuple):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelFacts:
    folder: pathlib.Path
    model_type: str
    architectures: tuple[str, ...]
    eos_ids: tuple[int, ...]
    turn_end: int | None
    max_positions: int | None
    vocab_size: int | None
    tied: bool
    experts: int = 0
    """Routed experts per MoE layer (0: a dense model)."""
    layer_types: tuple[str, ...] = ()
    """Each layer's kind (``config.layer_types``: ``full_attention``, ``sliding_attention``, ``linear_attention``,
    ``conv``, ...), when the config lists them."""

    @property
    def stop_ids(self) -> frozenset[int]:
        """Every token that ends a turn: the EOS ids and the template's end of turn."""
        return frozenset(self.eos_ids) | ({self.turn_end} if self.turn_end is not None else set())

    @property
    def answer_end(self) -> int | None:
        """The token a completion ends with: the template's end of turn, else the first EOS id."""
        return self.turn_end if self.turn_end is not None else (self.eos_ids[0] if self.eos_ids else None)


def facts(folder: str | pathlib.Path, *, chat_template: bool = True) -> ModelFacts:
    """What ``folder`` says (``chat_template``: look for the template's end of turn)."""
    folder = pathlib.Path(folder)
    raw = read_json(folder / "config.json", what="model")
    if raw is None:
        raise ConfigError(f"{folder} has no config.json: not a model folder")
    cfg = text_config(raw)
    gen = read_json(folder / "generation_config.json", what="model") or {}
    eos: list[int] = []
    for value in (cfg.get("eos_token_id"), gen.get("eos_token_id")):
        eos += [i for i in ids_of(value) if i not in eos]
    limits = [cfg[k] for k in POSITION_KEYS if isinstance(cfg.get(k), int) and cfg[k] > 0]
    vocab = cfg.get("vocab_size")
    return ModelFacts(folder=folder, model_type=str(cfg.get("model_type", "")),
                      architectures=tuple(raw.get("architectures") or ()), eos_ids=tuple(eos),
                      turn_end=template_turn_end(folder) if chat_template else None,
                      max_positions=min(limits) if limits else None,
                      vocab_size=vocab if isinstance(vocab, int) else None,
                      tied=bool(cfg.get("tie_word_embeddings", raw.get("tie_word_embeddings", True))),
                      experts=max([cfg[k] for k in EXPERT_KEYS if isinstance(cfg.get(k), int)], default=0),
                      layer_types=tuple(t for t in cfg.get("layer_types") or () if isinstance(t, str)))  # fmt: skip


def load_tokenizer(folder: pathlib.Path) -> Any:  # -> PreTrainedTokenizerFast
    """The folder's fast tokenizer (transformers' tokenizer side: no torch); a ConfigError when it has none."""
    if not (folder / "tokenizer.json").is_file():
        raise ConfigError(f"{folder} has no tokenizer.json (dora encodes with the fast tokenizer: save one with "
                          "AutoTokenizer.from_pretrained(...).save_pretrained(folder))")  # fmt: skip
    from transformers import PreTrainedTokenizerFast

    try:
        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"{folder}: its tokenizer does not load: {e}") from None


def template_turn_end(folder: pathlib.Path) -> int | None:
    """The special token the chat template writes right after an assistant turn's content, if any."""
    if not (folder / "tokenizer.json").is_file():
        return None
    tok = load_tokenizer(folder)
    if not tok.chat_template:
        return None
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": MARK}]
    try:
        text = tok.apply_chat_template(chat, tokenize=False)
    except Exception:  # a template is user code; one that cannot render this chat names no end of turn
        return None
    if not isinstance(text, str) or MARK not in text:
        return None
    after = text[text.index(MARK) + len(MARK) :]
    ids = tok.encode(after, add_special_tokens=False)
    if not ids:
        return None
    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    return ids[0] if ids[0] in special else None


def companion_files(folder: str | pathlib.Path) -> dict[str, bytes]:
    """The folder's files besides its weights (config, generation config, tokenizer, template): what makes a
    published version a model folder too. ``config.json`` first."""
    folder = pathlib.Path(folder)
    out: dict[str, bytes] = {}
    for p in sorted(folder.iterdir(), key=lambda p: (p.name != "config.json", p.name)):
        if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES) and p.name != "manifest.json":
            if p.stat().st_size <= COMPANION_MAX_BYTES:
                out[p.name] = p.read_bytes()
            else:
                print(f"dora: {p} is over {COMPANION_MAX_BYTES >> 20} MiB; not copied into versions", file=sys.stderr)
    return out


def with_dtype(config_json: bytes, dtype: str) -> bytes:
    """``config.json`` saying the weights are in ``dtype`` (``dtype``, and ``torch_dtype`` for older readers)."""
    cfg = json.loads(config_json)
    cfg["dtype"] = dtype
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = dtype
    return (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()
