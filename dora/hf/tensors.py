"""The torch side of a model folder: which parameters are tied, and which blocks FSDP2 shards.

- **Tied parameters.** Qwen2.5, Qwen3, Llama-3.2, Gemma and GPT-2 share one tensor between the input embedding
  and the output projection. ``tied_copies`` finds every name that shares a parameter with an earlier one (in the
  model's own order, so the embedding is kept and ``lm_head.weight`` is the copy, as ``save_pretrained`` does).
  A version is published without the copies (safetensors refuses tensors that share memory, and a model folder
  stores a tied tensor once); loading one into a model fills the copies by the tie itself.
- **Blocks.** FSDP2 wraps each decoder block on its own (one all-gather per block), then the root. Which classes
  are blocks is what the model declares for the same purpose: transformers' ``_no_split_modules``. That holds
  wherever a family keeps them (``model.layers``, GPT-2's ``transformer.h``, an MoE's layers).
"""

from __future__ import annotations

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
