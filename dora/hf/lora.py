"""LoRA: the learner trains low-rank adapters on a frozen base model, and a version is an adapter folder.

The adapters are injected into the transformers model in place (``peft.inject_adapter_in_model``): the model keeps
its class and module tree, so scoring, FSDP2's blocks and checkpointing see the same model as with full weights,
with each targeted linear layer now holding its frozen ``base_layer`` and its ``lora_A`` / ``lora_B``. Only those
adapter tensors take gradients and optimizer state.

A published version holds the adapters alone, as PEFT saves them (what ``PeftModel.from_pretrained`` and vLLM's
``LoRARequest`` load): ``adapter_config.json`` and ``adapter_model.safetensors`` whose keys read
``base_model.model.<module>.lora_A.weight``. The base model is the run's start folder, named in the config; each
version also records it by digest (``BASE_FILE``), and an engine loads only versions trained on the model it holds.

A torch engine of a LoRA run injects the same adapters into its model when it starts, and keeps each version it
holds beside them (``dora.rollout.engines.torch.adapters``: version 0, all zeros, is the start model); loading a version
checks its tensors against the injected adapters (``check_adapters``) and copies them in. A version is a few hundred
KB, so its files also travel inside the messages (``dora.store.inline``); the checks here read a version's folder or
those files alike (``Version``).
"""

from __future__ import annotations

import json
import pathlib
import tempfile
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    import torch

    from dora.config.models import LoraSection

BASE_FILE = "dora_base_model.json"
"""Beside a version's adapters: the base model they were trained on, by path and by digest (``base_record``). It
is one of the version's files, so the version's digest vouches for it; PEFT and vLLM ignore it."""
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ranks vLLM sizes its adapter slots by (``max_lora_rank``): a vLLM worker takes the smallest that holds the
run's, and a run whose rank is above the last cannot have vLLM workers."""
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
NAME = "default"
"""The adapter's name inside the model (PEFT's default); published keys leave it out, as PEFT's saved files do."""
SAVED = "base_model.model."
"""The prefix of every key of a saved PEFT adapter (the PeftModel's path to the transformers model)."""
Version: TypeAlias = pathlib.Path | Mapping[str, bytes]
"""A published version's files: its folder, or their bytes (a version carried inline, ``dora.store.inline``)."""


def inject(model: torch.nn.Module, spec: LoraSection) -> Any:
    """Add adapters to ``model``'s target modules, in place, and freeze everything else; returns the PEFT config
    (its target modules resolved to the model's module names)."""
    from peft import LoraConfig, inject_adapter_in_model

    targets: str | list[str] = "all-linear" if spec.target_modules == ("all-linear",) else list(spec.target_modules)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=targets,
                        bias="none", task_type="CAUSAL_LM")  # fmt: skip
    try:
        inject_adapter_in_model(config, model, adapter_name=NAME)
    except ValueError as e:  # no module matched, or a module kind LoRA does not wrap
        from dora.config import ConfigError

        raise ConfigError(f"learner.lora.target_modules = {list(spec.target_modules)}: {e}") from None
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    return model.peft_config[NAME]


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def saved_key(name: str) -> str:
    """A model parameter's name as a saved adapter names it: ``...q_proj.lora_A.default.weight`` ->
    ``base_model.model....q_proj.lora_A.weight``."""
    return SAVED + name.replace(f".lora_A.{NAME}.", ".lora_A.").replace(f".lora_B.{NAME}.", ".lora_B.")


def model_key(key: str) -> str:
    """The inverse of ``saved_key``."""
    name = key.removeprefix(SAVED)
    return name.replace(".lora_A.", f".lora_A.{NAME}.").replace(".lora_B.", f".lora_B.{NAME}.")


def adapter_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a model state (full or adapters only), under their saved names."""
    return {saved_key(k): v for k, v in state.items() if is_adapter(k)}


def config_file(config: Any, base: str) -> bytes:
    """``adapter_config.json`` as PEFT writes it, naming ``base`` and the target modules by their last part (every
    module of that name is targeted, which is what the resolved list holds)."""
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        data = json.loads((pathlib.Path(tmp) / ADAPTER_CONFIG).read_text())
    data["base_model_name_or_path"] = base
    if isinstance(data.get("target_modules"), list):
        data["target_modules"] = sorted({m.rsplit(".", 1)[-1] for m in data["target_modules"]})
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()


def base_record(base: str | pathlib.Path) -> bytes:
    """``BASE_FILE`` for adapters trained on the model folder ``base``: its path and ``model_digest``."""
    from dora.store import model_digest

    return (json.dumps({"path": str(base), "digest": model_digest(base)}, indent=2) + "\n").encode()


def _read(folder: Version, name: str) -> bytes | None:
    """File ``name`` of a version (None: it has none), from its folder or the files carried inline."""
    if isinstance(folder, pathlib.Path):
        try:
            return (folder / name).read_bytes()
        except FileNotFoundError:
            return None
    return folder.get(name)


def _where(folder: Version) -> str:
    return str(folder) if isinstance(folder, pathlib.Path) else "its files carried inline"


def check_base(folder: Version, base: str | pathlib.Path, digest: str) -> None:
    """ValueError unless the adapter version in ``folder`` (or its files, carried inline) was trained on the model
    this engine holds (the folder ``base``, whose ``model_digest`` is ``digest``). A version without ``BASE_FILE``
    (published before it was written) is taken as it is."""
    try:
        data = _read(folder, BASE_FILE)
        if data is None:
            return
        theirs = json.loads(data)
    except (OSError, ValueError) as e:
        raise ValueError(f"{_where(folder)}: {BASE_FILE} is unreadable ({e})") from None
    if theirs.get("digest") != digest:
        raise ValueError(f"{_where(folder)}: its adapters were trained on the base model {theirs.get('path')} (digest "
                         f"{theirs.get('digest')}), not on this worker's {base} (digest {digest}): a LoRA run's "
                         "learner and workers must start from the same model")  # fmt: skip


def check_adapters(model: torch.nn.Module, folder: Version, state: Mapping[str, torch.Tensor],
                   config: Any) -> dict[str, torch.Tensor]:  # fmt: skip
    """A published adapter version (its checked tensors ``state``, under saved names, and the
    ``adapter_config.json`` of ``folder``, or of its files carried inline), under the names of the adapters ``inject``
    gave ``model`` (its PEFT ``config``). ValueError when the version's adapters are not those: another rank, scale or
    module set."""
    where = _where(folder)
    try:
        data = _read(folder, ADAPTER_CONFIG)
        theirs = json.loads(data) if data is not None else None
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: not an adapter folder ({ADAPTER_CONFIG}: {e})") from None
    if not isinstance(theirs, dict):
        raise ValueError(f"{where}: not an adapter folder ({ADAPTER_CONFIG} missing, or not a JSON object)")
    if (theirs.get("r"), float(theirs.get("lora_alpha", 0))) != (config.r, float(config.lora_alpha)):
        raise ValueError(f"{where}: adapters of rank {theirs.get('r')} and alpha {theirs.get('lora_alpha')}, this "
                         f"engine's have rank {config.r} and alpha {config.lora_alpha} (learner.lora)")  # fmt: skip
    params = {n: p for n, p in model.named_parameters() if is_adapter(n)}
    incoming = {model_key(k): v for k, v in state.items()}
    if incoming.keys() != params.keys():
        extra, missing = sorted(incoming.keys() - params.keys()), sorted(params.keys() - incoming.keys())
        raise ValueError(f"{where}: its adapters are not this engine's: extra {extra[:3]}, missing {missing[:3]}")
    bad = [n for n, p in params.items() if p.shape != incoming[n].shape]
    if bad:
        raise ValueError(f"{where}: adapter {bad[0]} is {tuple(incoming[bad[0]].shape)}, the engine's "
                         f"{tuple(params[bad[0]].shape)}")  # fmt: skip
    return incoming
