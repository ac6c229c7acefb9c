"""The torch side of a model folder: which parameters are tied, and which blocks FSDP2 shards.

- **Tied parameters.** Qwen2.5, Qwen3, Llama-3.2, Gemma and GPT-2 share one tensor between the input embedding
  and the output projection. ``tied_copies`` finds every name that shares a parameter with an earlier one (in the
  model's own order, so the embedding is kept and ``lm_head.weight`` is the copy, as ``save_pretrained`` does).
  A version is published without the copies (safetensors refuses tensors that share memory, and a model folder
  stores a tied tensor once); loading one into a model fills the copies by the tie itself.
- **Blocks.** FSDP2 wraps each decoder block on its own (one all-gather per block), then the root. Which classes
  are blocks is what the model declares for the same purpose: transformers' ``_no_split_modules``. That holds
  wherever a family keeps them (``model.layers``, GPT-2's ``transformer.h``, an MoE's layers).
- **Batching.** The torch engine and the scorer batch sequences of different lengths by padding them on the left:
  each sequence's cache is cut out of a batch's and padded back into the next one, and its positions are given as
  ``position_ids``. ``padding_gap`` says, from one forward of four tokens, why a model cannot be batched so: a
  cache layer that is not per-token keys and values (linear attention, convolutions, state-space layers: a
  state), or positions counted from the start of the batch (a model whose forward takes no ``position_ids`` and is
  changed by padding, as BART's decoder; BLOOM's and MPT's ALiBi is not).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

from dora.config import ConfigError


def tied_copies(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter name that is a second name of an earlier parameter -> that earlier name."""
    first: dict[int, str] = {}
    copies = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            copies[name] = first[id(p)]
        else:
            first[id(p)] = name
    return copies


def publishable(state: Mapping[str, Any], copies: Mapping[str, str]) -> dict[str, Any]:
    """``state`` without the tied copies (each tied tensor once, under its first name)."""
    return {k: v for k, v in state.items() if k not in copies}


def with_copies(state: Mapping[str, Any], copies: Mapping[str, str]) -> dict[str, Any]:
    """A published ``state`` with each tied copy filled from the tensor it shares (for a full load)."""
    out = dict(state)
    for name, source in copies.items():
        if name not in out and source in out:
            out[name] = out[source]
    return out


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder blocks, outermost first found: modules of the classes in ``_no_split_modules``. A model
    that declares none is a ConfigError (FSDP2 would gather it whole on every rank)."""
    declared = set(getattr(model, "_no_split_modules", None) or ())
    found: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            if type(child).__name__ in declared:
                found.append(child)  # its own sub-blocks stay inside its shard
            else:
                visit(child)

    visit(model)
    if not found:
        what = f"declares {sorted(declared)} but has none of them" if declared else "declares none"
        raise ConfigError(f"{type(model).__name__}: no decoder blocks to shard with FSDP2 (its _no_split_modules "
                          f"{what}); run it on one learner rank (learner.ranks = 1)")  # fmt: skip
    return found


PROBE_ERRORS = (RuntimeError, ValueError, IndexError, TypeError, AttributeError, KeyError)
"""How a model whose cache is its own (a recurrent or linear-attention state) fails when handed a cache of keys
and values."""


def padding_gap(model: torch.nn.Module) -> str | None:
    """Why a left-padded batch of ``model`` does not compute what each of its sequences computes alone (its cache is
    not per-token keys and values in every layer, or padding moves its positions), or None when it does."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    device = next(model.parameters()).device
    ids = torch.tensor([[5, 6, 7, 8]], device=device)
    try:
        with torch.no_grad():
            out = model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True)
    except PROBE_ERRORS as e:
        said = (str(e).strip().splitlines() or [""])[0][:160]
        return f"it does not run on a cache of keys and values ({type(e).__name__}: {said})"
    layers = getattr(getattr(out, "past_key_values", None), "layers", None)
    if not layers:
        return "it returns no cache of keys and values"
    odd = {type(x).__name__ for x in layers if type(x) is not DynamicLayer or x.keys.shape[-2] != ids.shape[1]}
    if odd:
        return f"its cache holds {', '.join(sorted(odd))} layers, not one key and value per token"
    if "position_ids" in inspect.signature(model.forward).parameters:
        return None
    pad = torch.zeros((1, 2), dtype=torch.long, device=device)
    mask = torch.cat([pad, torch.ones_like(ids)], 1)
    with torch.no_grad():
        padded = model(input_ids=torch.cat([pad, ids], 1), attention_mask=mask).logits[:, 2:]
    gap = (torch.log_softmax(out.logits.float(), -1) - torch.log_softmax(padded.float(), -1)).abs().max()
    if float(gap) > (1e-3 if out.logits.dtype in (torch.float32, torch.float64) else 0.1):
        return ("its forward takes no position_ids and counts positions from the start of the batch: a "
                "left-padded sequence computes other numbers than it does alone")  # fmt: skip
    return None
