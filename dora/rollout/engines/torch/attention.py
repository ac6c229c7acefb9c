"""How a batch of cache slots attends: per-row masks, and a decode attention that reads each slot in place.

**Masks.** In a slot cache (``slots``), row ``b``'s token at position ``p`` has its key at
column ``p``. A query at position ``q`` of that row attends the columns ``j <= q`` (and ``j > q - window`` in a
sliding-window layer); the columns past the row's length are someone else's old keys or zeros and stay hidden.
transformers builds masks from one offset shared by every row, so ``Masks`` builds them wherever rows start at
different columns, in the form the model reads:

- **Per-layer-type masks.** A model whose forward takes a ready mapping ``{layer type: mask}`` (Qwen2/3, Gemma 2/3:
  those that mix full and sliding-window layers) gets one mask per layer type in its ``config.layer_types``, the
  sliding ones cut to ``config.sliding_window``. Any other takes one 4D mask, cut to ``config.sliding_window`` when
  its module builds sliding-window masks (Mistral, Phi-3 with a window set).
- **The attention kernel's form.** ``sdpa`` reads booleans (True: attend); ``eager`` adds a float mask (0, or the
  dtype's lowest value); the decode attention below reads either. Other kernels (flash, flex) take no dense mask:
  the engine loads such a model with ``sdpa``.
- **Positions from the mask (ALiBi).** A model whose forward takes no position ids (BLOOM, MPT) reads positions from
  a 2D padding mask (the count of attended columns before each one). It gets a 2D mask, ``j <= p`` per row, and
  transformers' causal mask with the query at the last column (``SlotCache.get_query_offset``): in a decode step that
  is exact, each row's own mask cutting it to its length. Its fills run one forward per starting column. A model of
  that kind with sliding windows is refused.

**Decode attention.** transformers' ``sdpa`` attention hands a masked batch to ``scaled_dot_product_attention`` only
after repeating each key/value head once per query head that shares it (``repeat_kv``): on CUDA, grouped-query
attention with a mask has no fused kernel to go to. In a decode step that copy is the largest memory traffic there
is (Qwen2.5-0.5B: 7 query heads per key head, so seven copies of the whole cache a step). A decode query is one
token, so the attention is two small matrix products per key head: its group of query heads against the slot's
keys, then the weights against its values, read in place from the slot cache, masked, softmax in float32. On a CPU,
``scaled_dot_product_attention`` takes the mask and the grouped heads as they are (``enable_gqa``), and is the faster
of the two: it is called so.

``install`` registers this as an attention implementation beside the model's own (``dora_sdpa``, ``dora_eager``),
with that implementation's mask builder, and switches the model to it. Queries of more than one token (a fill, a
scorer's full forward) go to the model's own implementation unchanged; so do calls with arguments this one does not
know (attention sinks). A decode step computes what the model's own implementation computes, to float rounding:
under ``eager`` it also caps the logits where the model does (Gemma 2's ``softcap``); ``sdpa`` ignores that, and so
does it. A model whose attention does not go through transformers' attention interface (BLOOM's ALiBi) keeps its
own.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Any

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from dora.rollout.engines.base import EngineError

KINDS = ("full_attention", "sliding_attention")


class Masks:
    def __init__(self, model: torch.nn.Module, kernel: str) -> None:
        """``kernel``: the model's own attention implementation (``sdpa`` or ``eager``)."""
        cfg = model.config
        self.positions = "position_ids" in inspect.signature(model.forward).parameters
        """False: positions come from a 2D mask (ALiBi)."""
        self.additive = kernel == "eager"
        self.dtype = model.dtype
        base = model.base_model
        source = inspect.getsource(sys.modules[type(base).__module__])
        self.mapping = "causal_mask_mapping := attention_mask, dict" in source
        window = getattr(cfg, "sliding_window", None) or None
        kinds = list(dict.fromkeys(getattr(cfg, "layer_types", None) or ["full_attention"]))
        odd = [k for k in kinds if k not in KINDS]
        if odd:
            raise EngineError(f"the torch engine cannot run {type(model).__name__}: its layers include {odd[0]}")
        if self.mapping:
            self.windows: dict[str | None, int | None] = {k: window if k == "sliding_attention" else None
                                                          for k in kinds}  # fmt: skip
        else:
            sliding = "create_sliding_window_causal_mask" in source or "sliding_attention" in kinds
            self.windows = {None: window if sliding else None}
        if not self.positions and any(self.windows.values()):
            raise EngineError(f"the torch engine cannot run {type(model).__name__}: it takes no position ids and has "
                              "sliding-window layers")  # fmt: skip

    @property
    def shared_offset_only(self) -> bool:
        """Fills must run one forward per starting column (positions from the mask)."""
        return not self.positions

    def rows(self, starts: torch.Tensor, query: int, width: int) -> Any:
        """What ``attention_mask`` the model takes for rows whose first query is at column ``starts[b]``, ``query``
        queries each (right-padded: a padded query attends as a real one would), reading columns ``0..width-1``."""
        cols = torch.arange(width, device=starts.device)
        at = (starts[:, None] + torch.arange(query, device=starts.device)[None, :])[:, None, :, None]  # [b, 1, q, 1]
        if not self.positions:  # a 2D mask: the row's columns up to its last query (decode: query = 1)
            return cols[None, :] <= at[:, 0, -1, :]
        out = {}
        for kind, window in self.windows.items():
            seen = cols <= at
            if window:
                seen = seen & (cols > at - window)
            out[kind] = torch.where(seen, 0.0, torch.finfo(self.dtype).min).to(self.dtype) if self.additive else seen
        return out if self.mapping else out[None]


# ---------------------------------------------------------------------- decode attention

KNOWN = {
    "scaling",
    "dropout",
    "softcap",
    "sliding_window",
    "is_causal",
    "position_ids",
    "use_cache",
    "cache",
    "output_attentions",
}
"""Keyword arguments a decode step takes or may ignore (any other one that is set goes to the model's own
implementation)."""


def install(model: torch.nn.Module) -> str:
    """Switch ``model`` to grouped decode attention over its own implementation (``sdpa`` or ``eager``), where its
    attention goes through transformers' interface. Returns the model's own implementation's name."""
    base = model.config._attn_implementation
    name = f"dora_{base}"
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, lambda *a, **kw: attend(base, *a, **kw))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    with contextlib.suppress(ValueError):  # a model with attention of its own (BLOOM) refuses: it keeps it
        model.set_attn_implementation(name)
    return base


def attend(base: str, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
    """One attention call: query [b, heads, q, d], key [b, kv heads, w, d], value [b, kv heads, w, d'] ->
    ([b, q, heads, d'], None)."""
    odd = any(v is not None and k not in KNOWN for k, v in kwargs.items())
    if query.shape[2] != 1 or odd or query.shape[1] % key.shape[1] or kwargs.get("dropout"):
        own = (ALL_ATTENTION_FUNCTIONS["sdpa"] if base == "sdpa" else
               sys.modules[type(module).__module__].eager_attention_forward)  # fmt: skip
        return own(module, query, key, value, attention_mask, **kwargs)
    b, heads, _, d = query.shape
    groups = key.shape[1]
    scaling = kwargs.get("scaling")
    if base == "sdpa" and query.device.type == "cpu":  # its CPU kernel takes a mask and grouped heads as they are
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               scale=scaling, enable_gqa=heads != groups)  # fmt: skip
        return out.transpose(1, 2), None
    scores = torch.matmul(query.reshape(b, groups, heads // groups, d), key.transpose(2, 3))
    scores = scores * (d**-0.5 if scaling is None else scaling)
    softcap = kwargs.get("softcap")
    if base == "eager" and softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    weights = torch.softmax(scores, -1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(weights, value)  # [b, groups, heads per group, d']
    return out.reshape(b, heads, 1, value.shape[-1]).transpose(1, 2), None
