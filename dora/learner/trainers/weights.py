"""The torch trainer's weights between steps: what a version holds beside them, offloaded to host memory and back,
checkpointed and restored, adopted from the weight store, and published into it.

``Weights`` is the part of ``TorchTrainer`` that handles them; the trainer sets the attributes declared here.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from dora.hf import lora as adapters
from dora.hf.folder import companion_files, with_dtype
from dora.hf.tensors import publishable, with_copies
from dora.hostmem import Parking, module_tensors
from dora.learner.setup import load_model, trainable
from dora.learner.trainers import PendingVersion, Published, timed_write
from dora.learner.trainers.torch_config import TrainerConfig
from dora.store import Manifest, WeightStore, inline
from dora.store.dirs import MANIFEST
from dora.store.snapshot import HostSnapshot


class Weights:
    """A torch trainer's weights and optimizer state, between its steps."""

    cfg: TrainerConfig
    device: torch.device
    rank: int
    world: int
    model_dir: str
    model: torch.nn.Module
    reference: torch.nn.Module | None
    opt: torch.optim.Optimizer
    store: WeightStore
    host: HostSnapshot
    """Where one rank copies each version aside at the end of its step (one buffer, reused)."""
    copies: dict[str, str]
    """Tied parameters' second names: published once, under the first (as ``save_pretrained`` does)."""
    lora: Any
    """The PEFT config of the adapters trained on the frozen model (a LoRA run), or None (full weights)."""
    initial_adapters: dict[str, torch.Tensor]
    """A LoRA run's adapters as made (B zero: the start model's policy), for going back to version 0."""
    publish_dtype: torch.dtype
    beside: dict[str, bytes]
    trained_steps: int
    """Steps taken since the weights were last loaded (from the model folder or a checkpoint)."""
    offloads: bool
    """Between steps the weights and optimizer state wait in host memory (elastic workers use the GPU)."""
    offloaded: bool
    parking: Parking
    """Host memory of the offloaded state (one pinned buffer, reused by every offload)."""

    def _parking(self) -> Parking:
        """Offloading on one rank: the pinned buffer, reserved in the background for the model's tensors and
        AdamW's two moments per trained parameter."""
        parking = Parking()
        if self.offloads and self.world == 1:
            trained = trainable(self.model)
            parking.reserve([*module_tensors(self.model)[0], *trained, *trained])
        return parking

    def _beside(self) -> dict[str, bytes]:
        """What a version holds besides its weights, so that every version is a model folder: the start folder's
        config (naming the dtype written), generation config and tokenizer files; with LoRA an adapter folder's
        config naming the base model, and on the rank that publishes ``BASE_FILE``, its digest."""
        if self.lora is not None:
            beside = {adapters.ADAPTER_CONFIG: adapters.config_file(self.lora, base=self.model_dir)}
            if self.rank == 0:
                beside[adapters.BASE_FILE] = adapters.base_record(self.model_dir)
            return beside
        beside = companion_files(self.model_dir)
        if "config.json" in beside:
            beside["config.json"] = with_dtype(beside["config.json"], self.cfg.publish_dtype)
        return beside

    # ------------------------------------------------------------------ offload between steps

    def _move(self, device: torch.device) -> None:
        """Weights and optimizer state to ``device``. One rank parks them in one pinned host buffer
        (``dora.hostmem``); FSDP2 ranks use the module's ``to``, on which FSDP2 re-registers its shards. The KL
        reference, if there is one, goes with its ``to``."""
        if self.reference is not None:
            self.reference.to(device)
        # AdamW keeps its step count on the CPU
        slots = [(state, key) for state in self.opt.state.values() for key, value in state.items()
                 if torch.is_tensor(value) and key != "step"]  # fmt: skip
        if self.world > 1:
            self.model.to(device)
            for state, key in slots:
                state[key] = state[key].to(device)
            return
        tensors, put = module_tensors(self.model)
        every = [*tensors, *(state[key] for state, key in slots)]
        moved = self.parking.park(every) if device.type == "cpu" else self.parking.unpark(every, device)
        put(moved[: len(tensors)])
        for (state, key), t in zip(slots, moved[len(tensors) :], strict=True):
            state[key] = t

    def offload(self) -> None:
        """The step is published: weights and optimizer state wait in host memory (with offload_between_steps)."""
        if self.offloads and not self.offloaded:
            self._move(torch.device("cpu"))
            torch.cuda.empty_cache()
            self.offloaded = True

    def _onload(self) -> bool:
        """Bring offloaded state back to the device; True if it was offloaded."""
        if not self.offloaded:
            return False
        self._move(self.device)
        self.offloaded = False
        return True

    @contextlib.contextmanager
    def _on_device(self) -> Iterator[None]:
        """Checkpoint, adopt, restore: on the device meanwhile, and back in host memory after if it was there."""
        was = self._onload()
        try:
            yield
        finally:
            if was:
                self.offload()

    # ------------------------------------------------------------------ checkpoints and versions

    def checkpoint(self, version: int, trained_groups: list[int]) -> float:
        """Save a checkpoint (a collective when sharded; rank 0 writes); returns the seconds it took."""
        from dora.learner import checkpoint

        started = time.perf_counter()
        assert self.cfg.checkpoint_dir is not None
        with self._on_device():
            checkpoint.save(self.model, self.opt, self.cfg.checkpoint_dir, version=version,
                            copies=self.copies if self.lora is None else {}, trained_groups=trained_groups,
                            keep=self.cfg.keep_checkpoints, frozen=self.lora is None)  # fmt: skip
        return time.perf_counter() - started

    def restore(self) -> dict[str, Any] | None:
        """Load the newest checkpoint, if there is one (every rank reads it); its meta, else None. With none,
        steps taken are undone by going back to the model folder's weights and a fresh optimizer."""
        from dora.learner import checkpoint

        with self._on_device():
            return self._restore(checkpoint)

    def _restore(self, checkpoint: Any) -> dict[str, Any] | None:
        found = checkpoint.checkpoints(self.cfg.checkpoint_dir) if self.cfg.checkpoint_dir else []
        if found:
            self.trained_steps = 0
            return checkpoint.load(self.model, self.opt, found[-1], copies=self.copies if self.lora is None else {},
                                   frozen=self.lora is None)  # fmt: skip
        if self.trained_steps:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            # with LoRA the frozen model is the folder's still: the adapters as made
            initial = self.initial_adapters if self.lora is not None else load_model(self.model_dir).state_dict()
            options = StateDictOptions(full_state_dict=True, strict=self.lora is None)
            set_model_state_dict(self.model, initial, options=options)
            self.opt.state.clear()
            self.trained_steps = 0
        return None

    def adopt(self, version: int) -> None:
        """Take a published version's weights from the store (the optimizer state stays as it is)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        with self._on_device():
            state = self.store.load(version)  # in the published dtype: made float32
            if self.lora is not None:  # an adapter folder: into the adapters, the frozen model as it is
                state = {adapters.model_key(k): v for k, v in state.items()}
            else:
                state = with_copies(state, self.copies)
            state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
            options = StateDictOptions(full_state_dict=True, strict=self.lora is None)
            set_model_state_dict(self.model, state, options=options)

    def publish(self, version: int) -> Published | None:
        """Write the version to the store now (``snapshot`` and its write in one go)."""
        pending = self.snapshot(version)
        return pending.write() if pending is not None else None

    def snapshot(self, version: int) -> PendingVersion | None:
        """Copy the version aside; rank 0 returns the write that makes it durable, to run while the next step
        trains (the others return None). Sharded, this is a collective: rank 0 gathers the whole state into fresh
        host memory. One rank copies it into the host snapshot (one buffer, reused: ``dora.store.snapshot``), or,
        offloading between steps, parks the weights first and writes from the parked copies (they cross the host
        link once; the parking buffer is not touched again before the next step's end, when the write is done). A
        LoRA version is serialized in memory too, carried inline, and written byte for byte. Then, with
        offload_between_steps, the weights and optimizer state go to host memory until the next step."""
        started = time.perf_counter()
        self._onload()
        try:
            if self.world == 1:
                if self.offloads:
                    self.offload()
                    return self._pending(version, self.model.state_dict(), started, copied=True)
                return self._pending(version, self.model.state_dict(), started, copied=False)
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            options = StateDictOptions(
                full_state_dict=True, cpu_offload=True, ignore_frozen_params=self.lora is not None
            )
            state = get_model_state_dict(self.model, options=options)
            return self._pending(version, state, started, copied=True) if self.rank == 0 else None
        finally:
            self.offload()

    def _pending(self, version: int, state: dict[str, torch.Tensor], started: float, *,
                 copied: bool) -> PendingVersion:  # fmt: skip
        """The write of ``state``; ``copied``: it is already a copy the next step leaves alone (else it is copied
        into the host snapshot first, here, on the critical path)."""
        if self.lora is not None:
            files, _ = self.inline_files(version, state)
            root = self.store.root

            def write_inline() -> Published:
                began = time.perf_counter()
                uri = inline.write(root, version, files, fsync=self.store.fsync)
                digest = str(Manifest.parse(files[MANIFEST], where=f"v{version}").digest)
                return uri, digest, time.perf_counter() - began

            return timed_write(version, write_inline, started, inline=files)
        tensors = publishable(state, self.copies)
        dtype: torch.dtype | None = self.publish_dtype
        if not copied:
            tensors, dtype = self.host.take(tensors, self.publish_dtype), None
        return timed_write(version, lambda: self.store.publish(version, tensors, beside=self.beside, dtype=dtype),
                           started)  # fmt: skip

    # ------------------------------------------------------------------ a LoRA version carried inline

    def inline_version(self, version: int) -> tuple[dict[str, bytes], str] | None:
        """A LoRA version as the files a message carries (``dora.store.inline``: ``WeightsPublished.inline``), with
        its digest: the adapters as ``publish`` writes them, serialized in memory, the files beside them and their
        manifest. The digest is the one the store gives the same files, and ``dora.store.inline.write`` puts these
        very bytes in the store. Sharded: a collective; rank 0 returns them, the others None. Full weights are never
        carried inline (ValueError): they go through the store."""
        if self.lora is None:
            raise ValueError(f"v{version}: full weights are not carried inline (a LoRA run's adapters are)")
        if self.world == 1:
            return self.inline_files(version, self.model.state_dict())
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        with self._on_device():
            state = get_model_state_dict(self.model, options=options)
        return self.inline_files(version, state) if self.rank == 0 else None

    def inline_files(self, version: int, state: dict[str, torch.Tensor]) -> tuple[dict[str, bytes], str]:
        """``inline_version`` of a model state already at hand (the one ``publish`` takes: the whole model's, or its
        adapters'): ``adapter_model.safetensors`` of its adapters in the publish dtype, ``self.beside``, the manifest;
        and the digest."""
        from safetensors.torch import save

        from dora.store import inline

        tensors, floats = {}, set()
        for key, t in adapters.adapter_state(state).items():
            t = t.detach()
            if t.is_floating_point():
                t = t.to(self.publish_dtype)
                floats.add(str(t.dtype).removeprefix("torch."))
            tensors[key] = t.contiguous().cpu()
        files = {adapters.ADAPTER_FILE: save(tensors, metadata={"format": "pt"}), **self.beside}
        return inline.pack(version, files, algo=self.store.algo, chunk_bytes=self.store.chunk_bytes,
                           dtype=",".join(sorted(floats)) or None)  # fmt: skip
