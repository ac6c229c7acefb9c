"""A LoRA torch engine's adapter versions: several resident at once, each row of a batch run under its own.

Every linear layer PEFT gave adapters (``dora.hf.lora.inject``) keeps, beside its frozen ``base_layer``, the A and B
of each resident version stacked along the rank, one *lane* per version: A ``[lanes x r, in]``, B ``[out, lanes x
r]``, lane ``k`` in rows (of A) and columns (of B) ``k r .. k r + r - 1``. A forward computes, for each row ``b``,

    y_b = base(x_b) + scale * B (keep_b * (A x_b))

where ``keep_b`` is 1 on the rank block of the row's lane and 0 on every other: two matrix products over all the
lanes' ranks at once, in which the other lanes' terms are exact zeros. The cost is LoRA's times the lanes (small
beside the base layer's), nothing is gathered per row, and the shapes do not depend on which versions run. PEFT's
own adapter path is switched off in these layers; a forward hook adds the above.

Before a forward the engine says which lane each row reads (``use``: one lane per row, a view of the batch's state,
so a CUDA graph reads it like the step's tokens and positions). A forward outside the engine's batches (a test's, a
scorer's) runs every row under the current version. Loading a version copies its tensors into a lane no running
row reads, in place: rows of other versions are not disturbed and captured graphs stay valid. Version 0 of a run
(the start model) is a lane of zeros.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dora.hf.lora import NAME
from dora.rollout.engines.base import EngineError
from dora.rollout.engines.versions import Versions

A_STACK, B_STACK = "dora_lora_a", "dora_lora_b"
"""The buffers of the lanes' A and B in each adapted layer (not in its state dict: never published or loaded)."""


class Adapters:
    def __init__(self, model: torch.nn.Module, config: Any, lanes: int, version: int | None) -> None:
        """``config``: the PEFT config ``inject`` returned; ``lanes``: the versions held at most; ``version``: the
        label of the start model (lane 0, zeros), if the engine starts with one."""
        from peft.tuners.lora.layer import Linear, LoraLayer

        if lanes < 1:
            raise ValueError(f"max_versions must be >= 1; got {lanes}")
        self.rank = config.r
        self.layers: list[tuple[str, torch.nn.Module]] = []
        adapted = [name for name, module in model.named_modules() if isinstance(module, LoraLayer)]
        self.one_version = next((n for n in adapted if any("expert" in part for part in n.split("."))), None)
        """An adapted layer inside a mixture of experts, if any: its input is the tokens routed to it, not the batch's
        rows, so no row's lane reaches it. The engine then holds one version at a time (its rows all read it)."""
        self.lanes = 1 if self.one_version is not None else lanes
        lanes = self.lanes
        for name, module in model.named_modules():
            if not isinstance(module, LoraLayer):
                continue
            if not isinstance(module, Linear) or module.lora_variant:
                raise EngineError(f"the torch engine runs adapters of linear layers only; {name} is a "
                                  f"{type(module).__name__} (learner.lora.target_modules)")  # fmt: skip
            a, b = module.lora_A[NAME].weight, module.lora_B[NAME].weight
            module.register_buffer(A_STACK, a.new_zeros((lanes * self.rank, a.shape[1])), persistent=False)
            module.register_buffer(B_STACK, b.new_zeros((b.shape[0], lanes * self.rank)), persistent=False)
            module.enable_adapters(False)
            module.register_forward_hook(self._add)
            self.layers.append((name, module))
        first = self.layers[0][1]._buffers[A_STACK]
        self.dtype = first.dtype
        self.blocks = torch.arange(lanes, device=first.device).repeat_interleave(self.rank)
        """The lane of each of the stacked rank's columns."""
        self.versions: Versions[int] = Versions(lanes, version, 0)
        """The versions held, each by its lane (a relabel may give two versions one lane)."""
        self.everyone = self._keep(torch.zeros(1, dtype=torch.long, device=first.device))
        """The keep mask of a forward outside the engine's batches: the current version's lane, in every row."""
        self.keep: torch.Tensor | None = None

    # ------------------------------------------------------------------ forwards

    def _keep(self, lanes: torch.Tensor) -> torch.Tensor:
        return (lanes[:, None] == self.blocks[None, :]).to(self.dtype)

    def use(self, lanes: torch.Tensor | None) -> None:
        """The next forward's rows read these lanes (one per row); None: every row the current version's."""
        self.keep = None if lanes is None else self._keep(lanes)

    def _add(self, module: torch.nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        keep = self.everyone if self.keep is None else self.keep
        h = F.linear(args[0], module._buffers[A_STACK])
        h = h * keep.view(keep.shape[0], *[1] * (h.dim() - 2), keep.shape[1])
        return out + F.linear(h, module._buffers[B_STACK]) * module.scaling[NAME]

    # ------------------------------------------------------------------ versions

    def free_lane(self, version: int, kept: set[int]) -> int:
        """The lane ``version`` is loaded into when the versions ``kept`` stay (its own, if it is held already):
        EngineError if every lane is theirs."""
        held = self.versions.by_version
        if version in held:
            return held[version]
        busy = {lane for v, lane in held.items() if v in kept}
        free = [lane for lane in range(self.lanes) if lane not in busy]
        if not free:
            names = ", ".join(f"v{v}" for v in sorted(kept & held.keys()))
            raise EngineError(f"cannot load v{version}: the engine holds {self.lanes} versions at most "
                              f"(max_versions) and requests still run on {names}")  # fmt: skip
        return free[0]

    @torch.no_grad()
    def fill(self, version: int, lane: int, tensors: dict[str, torch.Tensor], kept: set[int]) -> None:
        """Put ``version``'s adapters (``tensors``, by the model's parameter names, as ``check_adapters`` gives them)
        in ``lane``, make it the current version, and drop the versions that are not in ``kept``."""
        lo, hi = lane * self.rank, (lane + 1) * self.rank
        for name, module in self.layers:
            module._buffers[A_STACK][lo:hi] = tensors[f"{name}.lora_A.{NAME}.weight"]
            module._buffers[B_STACK][:, lo:hi] = tensors[f"{name}.lora_B.{NAME}.weight"]
        self.versions.take(version, lane, kept)
        self.everyone = self._keep(torch.tensor([lane], device=self.blocks.device))
