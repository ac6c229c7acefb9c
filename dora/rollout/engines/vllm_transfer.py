"""A version's tensors pushed into a running vLLM engine through vLLM's weight-transfer API, from memory: no file
is read, and vLLM applies them as its own RL weight updates do (layerwise reload: each layer's weights loaded, then
processed once whole, as at start-up).

vLLM's API (``LLM.init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``) drives a transfer engine chosen by ``weight_transfer_config.backend`` when the ``LLM`` is
made. Its built-in backends move tensors from another process (``nccl``: a broadcast group; ``ipc``: CUDA IPC
handles), and need CUDA. dora's engine runs vLLM in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the
``uni`` executor), so the tensors it holds are already where vLLM's model is: ``MemoryTransferEngine``, registered
with vLLM's ``WeightTransferEngineFactory`` as ``dora_memory``, takes them as they are (``update_weights``'s
``update_info``: the names and the tensors themselves, passed by reference through ``collective_rpc``) and feeds
them to the model's ``load_weights`` between vLLM's layerwise ``initialize`` / ``finalize`` calls, exactly as
the ``ipc`` backend does with the tensors it maps. It runs on the CPU as on a GPU (CPU tensors go to the model's
device as each layer is loaded). It cannot reach the shard processes of a tensor-parallel engine (the ``mp``
executor's): there, and with a vLLM without the API, ``VllmEngine`` reloads with ``reload_weights``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

if TYPE_CHECKING:
    import torch

log = structlog.get_logger()

BACKEND = "dora_memory"
API = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")


def available() -> str | None:
    """None when this vLLM has the weight-transfer API and its engine registry, else why not (for the log)."""
    try:
        from vllm import LLM
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory  # noqa: F401
    except ImportError as e:
        return f"no weight-transfer engine registry ({e})"
    missing = [name for name in API if not hasattr(LLM, name)]
    return f"vllm.LLM has no {', '.join(missing)}" if missing else None


def options(tensor_parallel_size: int, *, lora: bool = False) -> tuple[dict[str, Any], str]:
    """The ``LLM`` options that enable the push (none where it cannot run), and the weight path taken:
    ``weight_transfer`` or ``reload_weights (<why>)``. A LoRA run's versions are adapters: no full weights to push."""
    why = "a LoRA run loads adapters" if lora else available()
    if why is None and tensor_parallel_size > 1:
        why = f"tensor_parallel_size {tensor_parallel_size}: the shards run in processes of their own"
    if why is not None:
        return {}, f"reload_weights ({why})"
    register()
    return {"weight_transfer_config": {"backend": BACKEND}}, "weight_transfer"


def started(llm: Any, path: str) -> None:
    """Once ``llm`` is made with ``options``: its transfer engine initialised (nothing to meet: the tensors are in
    this process) when the path is ``weight_transfer``, and the path logged (``vllm_weight_path``)."""
    if path == "weight_transfer":
        llm.init_weight_transfer_engine({"init_info": {}})
    log.info("vllm_weight_path", path=path.split(" ")[0], detail=path)


def register() -> None:
    """``MemoryTransferEngine`` in vLLM's registry as ``dora_memory`` (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, _engine_class())


def push(llm: Any, version: int, state: Mapping[str, torch.Tensor]) -> None:
    """Load ``state`` (checked already: the bytes a digest vouched for) into ``llm``'s model as version
    ``version`` through the weight-transfer API; vLLM records ``v<version>`` as its weight version."""
    llm.start_weight_update()
    llm.update_weights({"update_info": {"names": list(state), "tensors": list(state.values())}})
    llm.finish_weight_update(weight_version=f"v{version}")


@dataclass
class MemoryInitInfo:
    """Nothing to meet: the tensors are in this process."""


@dataclass
class MemoryUpdateInfo:
    """One update: the tensors, by name, as this process holds them."""

    names: list[str] = field(default_factory=list)
    tensors: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.names) != len(self.tensors):
            raise ValueError(f"{len(self.names)} names for {len(self.tensors)} tensors")


def _engine_class() -> type:
    """vLLM's ``WeightTransferEngine`` for tensors in this process (made here: its base class imports vLLM)."""
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    init_cls: type = dataclass(type("MemoryInitInfo", (MemoryInitInfo, WeightTransferInitInfo), {}))
    update_cls: type = dataclass(type("MemoryUpdateInfo", (MemoryUpdateInfo, WeightTransferUpdateInfo), {}))

    class MemoryTransferEngine(WeightTransferEngine):
        init_info_cls = init_cls
        update_info_cls = update_cls

        def init_transfer_engine(self, init_info: Any) -> None:
            pass

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def receive_weights(self, update_info: Any) -> None:
            self.model.load_weights(list(zip(update_info.names, update_info.tensors, strict=True)))

        def shutdown(self) -> None:
            pass

    return MemoryTransferEngine
