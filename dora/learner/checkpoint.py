"""Learner checkpoints: model, optimizer, RNG, version and the ids of every group trained so far.

``<root>/ckpt-v<N>/``, written atomically like the weight store. It holds ``state.safetensors``
(``model/<name>`` and ``optim/<name>/<key>`` tensors gathered whole from every rank, and
``meta/trained_groups``: the sorted ids of every group trained so far, one int64 tensor) and
``meta.json``: the version, the optimizer's parameter groups and the torch RNG state.

A restarted learner loads the newest checkpoint and tells the broker the version it holds (``Hello``);
it refuses any batch holding a group it trained before, so no group is trained twice across a restart.
Weights it published after that checkpoint come back from the weight store (the broker's journal is the
other half: it keeps the broker's own view of what was published and trained).
Collective under FSDP: every rank calls ``save`` and ``load``; rank 0 alone touches the files.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import uuid
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dora.hf.tensors import with_copies


class CheckpointMismatch(ValueError):
    """A checkpoint written by a run that trains other parameters (full weights against LoRA adapters)."""


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def save(model: torch.nn.Module, opt: torch.optim.Optimizer, root: str | pathlib.Path, *, version: int,
         trained_groups: list[int], keep: int = 2, copies: Mapping[str, str] | None = None,
         frozen: bool = True) -> pathlib.Path | None:  # fmt: skip
    """Write checkpoint ``version``; keep the newest ``keep``. Returns its path on rank 0, None elsewhere.
    ``copies``: tied parameters' second names (``dora.hf.tensors.tied_copies``), left out: a tied tensor is
    written once, under its first name. ``frozen`` False: parameters that take no gradient (a LoRA run's base
    model, which its folder holds) are left out."""
    from safetensors.torch import save_file

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=not frozen)
    model_sd = get_model_state_dict(model, options=options)
    opt_sd = get_optimizer_state_dict(model, opt, options=options)
    if _rank() != 0:
        return None
    root = pathlib.Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tensors = {f"model/{k}": v.contiguous() for k, v in model_sd.items() if k not in (copies or {})}
    for name, slots in opt_sd.get("state", {}).items():
        for key, value in slots.items():
            tensors[f"optim/{name}/{key}"] = torch.as_tensor(value).contiguous()
    tensors["meta/trained_groups"] = torch.tensor(sorted(trained_groups), dtype=torch.int64)
    meta = {"version": version, "trained_count": len(trained_groups), "adapters_only": not frozen,
            "param_groups": opt_sd.get("param_groups", []), "rng": torch.get_rng_state().tolist()}  # fmt: skip
    tmp = root / f".ckpt-v{version}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.mkdir()
    try:
        save_file(tensors, str(tmp / "state.safetensors"))
        (tmp / "meta.json").write_text(json.dumps(meta))
        final = root / f"ckpt-v{version}"
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def same_kind(path: pathlib.Path, meta: dict[str, Any], *, adapters_only: bool) -> None:
    """CheckpointMismatch if the checkpoint at ``path`` (its ``meta``) holds other parameters than a learner that
    trains LoRA adapters (``adapters_only``) or full weights would resume."""
    if meta.get("adapters_only", False) != adapters_only:
        held, wanted = ("full weights", "LoRA adapters") if adapters_only else ("LoRA adapters", "full weights")
        raise CheckpointMismatch(f"{path} holds {held}; this learner trains {wanted} (learner.lora): resume with "
                                 "the setting that wrote it, or point learner.checkpoint_dir elsewhere")  # fmt: skip


def check_resumable(root: str | pathlib.Path, *, adapters_only: bool) -> None:
    """Before any rank starts: the newest checkpoint under ``root``, if any, is one this learner can resume."""
    found = checkpoints(root)
    if found:
        same_kind(found[-1], json.loads((found[-1] / "meta.json").read_text()), adapters_only=adapters_only)


def checkpoints(root: str | pathlib.Path) -> list[pathlib.Path]:
    """Complete checkpoints, oldest first."""
    root = pathlib.Path(root)
    found = [p for p in root.glob("ckpt-v*") if p.name[6:].isdigit() and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[6:]))


def load(model: torch.nn.Module, opt: torch.optim.Optimizer, path: str | pathlib.Path,
         copies: Mapping[str, str] | None = None, frozen: bool = True) -> dict[str, Any]:  # fmt: skip
    """Restore a checkpoint into ``model`` and ``opt``; returns its meta (version, trained_groups). ``copies``:
    tied parameters' second names, filled from the tensor they share. ``frozen`` False: the checkpoint holds the
    trained parameters alone (``save``'s), the others stay as they are."""
    from safetensors.torch import load_file

    path = pathlib.Path(path)
    meta = json.loads((path / "meta.json").read_text())
    same_kind(path, meta, adapters_only=not frozen)
    tensors = load_file(str(path / "state.safetensors"))
    model_sd = with_copies({k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")},
                           copies or {})  # fmt: skip
    state: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in tensors.items():
        if k.startswith("optim/"):
            name, key = k.removeprefix("optim/").rsplit("/", 1)
            state.setdefault(name, {})[key] = v
    options = StateDictOptions(full_state_dict=True, strict=frozen)
    set_model_state_dict(model, model_sd, options=options)
    set_optimizer_state_dict(model, opt, {"state": state, "param_groups": meta["param_groups"]}, options=options)
    torch.set_rng_state(torch.tensor(meta["rng"], dtype=torch.uint8))
    meta["trained_groups"] = tensors["meta/trained_groups"].tolist()
    return meta
