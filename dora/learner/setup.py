"""A trained model's setup, written once for the learner's torch trainer and `dora sft`.

1. ``load_model``: the start folder's causal LM, in float32 (the master weights, whatever the compute dtype).
2. ``adapt``: its tied parameters named (``dora.hf.tensors``, before any wrapping renames them), and with a
   ``LoraSection`` LoRA adapters injected, everything else frozen (``dora.hf.lora``).
3. ``shard``: over several ranks, FSDP2 on one mesh of them: ``fully_shard`` per decoder block the model declares,
   then the root; bfloat16 compute through ``MixedPrecisionPolicy`` with float32 gradient reduction (on one rank
   bfloat16 is autocast instead, in the step).
4. ``optimizer``: AdamW (betas 0.9, 0.99) over what is trained, its decoupled weight decay on matrices only.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dora.config import ConfigError
from dora.hf import lora as adapters
from dora.hf.tensors import blocks, tied_copies

if TYPE_CHECKING:
    from dora.config.models import LoraSection


def load_model(folder: str | pathlib.Path) -> torch.nn.Module:
    """The folder's causal LM in float32; a folder that does not load is a ConfigError naming it."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    except (OSError, ValueError, KeyError, TypeError) as e:  # transformers' ways of saying "not a model"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"the model folder {folder} does not load as a causal LM: {first}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Adapted:
    copies: dict[str, str]
    """Tied parameters' second names: written once, under the first (as ``save_pretrained`` does)."""
    lora: Any
    """The PEFT config of the adapters trained on the frozen model (a LoRA run), or None (full weights)."""


def adapt(model: torch.nn.Module, lora: LoraSection | None) -> Adapted:
    """The model's tied copies named, then, with ``lora``, adapters injected into it in place."""
    copies = tied_copies(model)
    return Adapted(copies=copies, lora=adapters.inject(model, lora) if lora is not None else None)


def shard(modules: Sequence[torch.nn.Module], *, device: torch.device, world: int, bf16: bool) -> None:
    """Over ``world > 1`` ranks, each module sharded in place with FSDP2 on one mesh: each decoder block, then the
    root; ``bf16``: computed in bfloat16 (``MixedPrecisionPolicy``), gradients reduced in float32."""
    if world == 1:
        return
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = dist.device_mesh.init_device_mesh(device.type, (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    for module in modules:
        for block in blocks(module):
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(module, mesh=mesh, mp_policy=mp)


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters that take gradients: every one, or with LoRA the adapters'."""
    return [p for p in model.parameters() if p.requires_grad]


def optimizer(params: list[torch.nn.Parameter], *, lr: float, weight_decay: float = 0.0) -> torch.optim.AdamW:
    """AdamW over ``params``; a ``weight_decay`` on matrices (two or more dimensions) only: biases and norms' gains
    keep their size."""
    groups: Any = params
    if weight_decay:
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
