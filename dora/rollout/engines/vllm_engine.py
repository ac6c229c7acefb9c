"""The `vllm` engine: vLLM's continuous batching, in process, stepped by the rollout worker.

The engine core runs in the worker's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): it starts in seconds
instead of the 20–30 s of a separate engine-core process. The worker adds requests and calls ``step()``, exactly as
it drives the torch engine; vLLM schedules, batches and pages the KV cache itself.

- **Devices**: one device runs the model in the worker's own process (the ``uni`` executor); with
  ``tensor_parallel_size`` N > 1 vLLM's ``mp`` executor starts N shard processes beside it, one per device (on a
  GPU: ``cuda:0`` .. ``cuda:N-1`` of what CUDA_VISIBLE_DEVICES shows the worker). On the CPU each shard gets its
  share of this process's cores (``VLLM_CPU_OMP_THREADS_BIND``, unless set: vLLM's own default binds one shard per
  NUMA node and refuses a machine with fewer nodes than shards).
- **Platform defaults** (``"auto"``): dtype bfloat16 on CUDA or ROCm, float32 elsewhere; CUDA graphs captured on
  a GPU (``enforce_eager`` false), eager on the CPU; KV memory ``CPU_KV_CACHE_BYTES`` on the CPU when
  ``kv_cache_bytes`` is None, and on a GPU what ``gpu_memory_utilization`` leaves.

- **Log-probs**: ``logprobs_mode="processed_logprobs"``: the log-probability of each sampled token
  under the distribution it was drawn from (temperature, top-p), like the torch engine.
- **Seeds**: each sample gets its own seed from the request's seed and its index.
- **Stops**: every request ends on the model's stop ids (``dora.hf.folder``: the config's and generation
  config's EOS ids and the chat template's end of turn) as well as its own.
- **Length**: ``max_model_len`` None takes the model's own limit (``max_position_embeddings``).
- **KV memory**: ``kv_cache_bytes`` bounds it when given; vLLM's CPU default would size the cache to most of the
  machine's memory, so on the CPU it is always bounded.
- **Weights**: ``load_weights`` checks the file's digest, then loads the checked tensors in place, with no
  restart; ``load_tensors`` loads tensors the worker holds in memory already (checked by whoever got them: a
  version broadcast to the workers, ``dora.store.collective``). Where vLLM has its weight-transfer API and the
  model runs in this process, they are pushed through it (``vllm_transfer``: ``start_weight_update``,
  ``update_weights`` with the tensors themselves, ``finish_weight_update`` naming the version; vLLM's layerwise
  reload); otherwise with ``reload_weights``. ``weight_path`` says which, and the ``vllm_weight_path`` log line
  at start-up says why. A mismatch is refused, and so is a load of full weights while requests run.
  The prefix cache is reset, because its entries were computed with the old weights. Under tensor parallelism
  the checked tensors go to every shard (``collective_rpc``: vLLM's shared-memory queue carries CPU tensors as
  out-of-band buffers) and each shard's ``load_weights`` keeps its own slice: the shards load exactly the
  bytes that were checked, even if the version is retired meanwhile.
- **Episodes** (``keep_kv``): a turn ends at EOS, a stop token or the turn's budget; ``extend`` appends the
  environment's tokens and queues the next turn as a new request on the whole context, whose computed
  prefix vLLM's prefix cache keeps.
- **Sleep** (an elastic worker's yield, ``sleep_level``): its requests leave vLLM with their tokens so far, then
  vLLM sleeps: at level 1 its weights go to host memory and its KV cache is freed (vLLM's sleep mode: CUDA, ROCm,
  XPU), so the learner gets the accelerator's memory; level 0 only pauses its scheduler. Sleep and wake are
  collective: every shard of a tensor-parallel engine sleeps and wakes with it. On wake the weights come
  back bit for bit and each held request is re-prefilled on prompt + prefix and goes on, as after a migration: the
  same version samples every token (C1).
- **LoRA** (``lora``): a version is an adapter folder. ``load_weights`` checks its base model and digest and adds
  it to vLLM under the version's own name (``v<N>``, id N + 1), also while requests run; every request names the
  adapter of the version it runs under (``submit`` / ``import_``: ``version``, by default the current one), so
  requests of several versions share a batch, each sampled by its own version. The engine holds ``max_loras``
  versions at most (``max_versions``; ``held_versions``): a load keeps those requests still name and drops the
  others, and is refused before anything changes when it would need more. Version 0 is the base model itself (no
  adapter). A version carried inline (its files in the ``Assign``, checked by the worker) is not read from the
  store: vLLM takes adapters from a folder only, so its files are written to a directory on tmpfs (``/dev/shm``
  when there is one), memory to memory, kept while the version is held and removed with the engine. Full
  weights: one version, the loaded one; a request naming another is refused.
- **Migration**: vLLM cannot hand over a request's KV cache or sampler state. ``export`` aborts the
  request and returns its token prefix and log-probs. ``import_`` re-prefills prompt + prefix on a
  worker holding the same version, so the continuation is exact in distribution (C1 holds). Its
  random draws differ from the ones the source would have made.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dora.hf.folder import facts
from dora.hf.lora import VLLM_RANKS, check_base
from dora.ids import Finish
from dora.rollout.engines import vllm_transfer
from dora.rollout.engines.base import EngineError, Sample, SampleState
from dora.rollout.engines.torch.engine import hash_seed, read_weights
from dora.rollout.engines.versions import HoldsVersions, Versions
from dora.store import model_digest

if TYPE_CHECKING:
    import torch

    from dora.config.models import LoraSection

CPU_KV_CACHE_BYTES = 256 << 20
"""KV cache memory on the CPU when none is given (vLLM's own default there takes most of the machine's memory)."""


@dataclass(slots=True, kw_only=True)
class Request(Sample):
    seed: int
    prefix: int = 0
    """Tokens it had when its current vLLM request was made (an earlier turn's, or another worker's before a
    migration); the rest comes from that request."""
    adapter: Any = None
    """A LoRA run: the ``LoRARequest`` of the version it runs under (None: version 0, the base model). Each of its
    vLLM requests names it, whatever the engine loads meanwhile."""


class VllmEngine(HoldsVersions):
    name = "vllm"

    def __init__(self, model_dir: str | pathlib.Path, *, max_slots: int = 64, kv_cache_bytes: int | None = 64 << 20,
                 dtype: str = "float32", max_model_len: int | None = None, version: int | None = None,
                 seed: int = 0, sleep_level: int | None = None, gpu_memory_utilization: float = 0.9,
                 enforce_eager: bool | str = True, tensor_parallel_size: int = 1, lora: LoraSection | None = None,
                 max_loras: int = 1) -> None:  # fmt: skip
        """``sleep_level``: what ``sleep`` does (1: weights to host memory and KV cache freed, which needs
        ``sleep_mode_available()``; 0: the scheduler paused); None: ``sleep`` is a no-op (the worker only stops
        stepping). ``dtype`` and ``enforce_eager`` may be ``"auto"`` and ``kv_cache_bytes`` None: the platform's
        defaults (the module's docstring). ``lora``: the run trains these adapters and its versions are adapter
        folders, of which vLLM holds up to ``max_loras`` at once (K + 1 lets every live version run side by side)."""
        if sleep_level not in (None, 0, 1):
            raise ValueError(f"sleep_level must be None, 0 or 1; got {sleep_level}")
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1; got {tensor_parallel_size}")
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")  # vLLM's own sockets stay on loopback
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM
        from vllm.platforms import current_platform

        gpu = current_platform.is_cuda_alike()
        if dtype == "auto":
            dtype = "bfloat16" if gpu else "float32"
        if enforce_eager == "auto":
            enforce_eager = not gpu
        if kv_cache_bytes is None and current_platform.is_cpu():
            kv_cache_bytes = CPU_KV_CACHE_BYTES
        if tensor_parallel_size > 1 and current_platform.is_cpu():
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(tensor_parallel_size))
            from vllm import envs

            if hasattr(envs.__getattr__, "cache_clear"):  # an engine made earlier in this process froze vLLM's env
                envs.__getattr__.cache_clear()
        transfer, self.weight_path = vllm_transfer.options(tensor_parallel_size, lora=lora is not None)
        """How full weights are loaded: ``weight_transfer`` (vLLM's weight-transfer API) or ``reload_weights``."""
        self.llm = LLM(model=str(model_dir), tokenizer=str(model_dir), dtype=dtype, max_model_len=max_model_len,
                       enforce_eager=bool(enforce_eager), seed=seed, tensor_parallel_size=tensor_parallel_size,
                       distributed_executor_backend="mp" if tensor_parallel_size > 1 else "uni",
                       kv_cache_memory_bytes=kv_cache_bytes, gpu_memory_utilization=gpu_memory_utilization,
                       max_num_seqs=max_slots, logprobs_mode="processed_logprobs",
                       enable_sleep_mode=sleep_level == 1, **adapter_options(lora, max_loras), **transfer)  # fmt: skip
        vllm_transfer.started(self.llm, self.weight_path)
        self.dtype = dtype
        self.tensor_parallel_size = tensor_parallel_size
        self.engine = self.llm.llm_engine
        self.stops = facts(model_dir).stop_ids
        """Tokens that end every turn: the model's EOS ids and its chat template's end of turn."""
        self.max_slots = max_slots
        self.versions: Versions[Any] = Versions(max_loras if lora is not None else 1, version, None)
        """The versions held (requests name any of them), each by its ``LoRARequest`` (None: full weights, or the base
        model of a LoRA run)."""
        self.requests: dict[str, Request] = {}
        self.tokens_generated = 0
        self.sleep_level = sleep_level
        self.held: list[Request] | None = None
        """Asleep: the requests taken out of vLLM, in their order, re-queued on ``wake``; None: awake."""
        self.lora = lora
        self.base = (str(model_dir), model_digest(model_dir)) if lora is not None else None
        """A LoRA run's base model, by path and digest: versions trained on another are refused (``check_base``)."""
        self.inline_root: pathlib.Path | None = None
        """Where versions carried inline are written for vLLM to read (``_inline_folder``), once one came."""

    def __len__(self) -> int:
        return len(self.requests) + len(self.held or ())

    @property
    def adapted(self) -> bool:
        return self.lora is not None

    def named(self, keep: frozenset[int] = frozenset()) -> set[int]:
        """The versions a request here still runs under (in vLLM, or held while asleep), and ``keep``."""
        return {r.version for r in (*self.requests.values(), *(self.held or ()))} | set(keep)

    def _runs_under(self, version: int | None) -> tuple[int, Any]:
        """The version a new request runs under (None: the current one) and its adapter; EngineError if it is not
        held."""
        version = self.versions.runs_under(version)
        return version, self.versions.of(version)

    # ------------------------------------------------------------------ weights

    def load_weights(self, version: int, path: str | pathlib.Path, sha256: str | None,
                     keep: frozenset[int] = frozenset(), inline: Mapping[str, bytes] = {}) -> None:  # fmt: skip
        """Load a published version. Full weights: in place, refused while requests run. Adapters (a LoRA run): beside
        the versions requests still name (``keep``: an episode's between its turns too), which go on under their own
        adapters. ``inline``: an adapter version's files, carried in its ``Assign`` and already checked against
        ``sha256`` (``dora.store.inline.verified``): ``path`` is not read (``_inline_folder``)."""
        if self.lora is None and inline:
            raise EngineError(f"v{version}: full weights are read from the store, never carried inline")
        if self.lora is None:
            if len(self):
                raise EngineError(f"cannot load v{version}: {len(self)} requests are running")
            self.load_tensors(version, read_weights(version, path, sha256))
            return
        asleep = self.held is not None  # a load that ends after the worker yielded: awake for it, then asleep again
        if asleep:
            self.wake()
        try:
            self._load_adapter(version, pathlib.Path(path), sha256, self.named(keep), inline)
        finally:
            if asleep:
                self.sleep()

    def load_tensors(self, version: int, state: Mapping[str, torch.Tensor]) -> None:
        """Load full weights held in memory, checked already (``dora.store.collective``'s, ``read_weights``'), in
        place: through vLLM's weight-transfer API where it has one, else ``reload_weights``. Refused while
        requests run; an engine asleep wakes for the load and sleeps again."""
        if self.lora is not None:
            raise EngineError(f"v{version}: a LoRA run's versions are adapter folders (load_weights)")
        if len(self):
            raise EngineError(f"cannot load v{version}: {len(self)} requests are running")
        asleep = self.held is not None
        if asleep:
            self.wake()
        try:
            if self.weight_path == "weight_transfer":
                vllm_transfer.push(self.llm, version, state)
            else:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(state.items())})
            self.llm.reset_prefix_cache()
            self.versions.take(version, None)
        finally:
            if asleep:
                self.sleep()

    def _load_adapter(self, version: int, path: pathlib.Path, digest: str | None, kept: set[int],
                      inline: Mapping[str, bytes]) -> None:  # fmt: skip
        """A LoRA run's version: its base model and digest checked, vLLM adds the adapter folder under the version's
        own name and id (vLLM keys its prefix cache by adapter), and new requests name it. The folder is read by
        vLLM after the check: a published version's files do not change. A version carried inline is checked by
        then; vLLM reads a folder, so its files are written to one in memory first (``_inline_folder``). Versions not
        in ``kept`` (those requests still name) leave, and their adapters are removed, so vLLM holds at most the
        versions that still run."""
        from vllm.lora.request import LoRARequest

        stay = {v: a for v, a in self.versions.by_version.items() if v in kept and v != version}
        if len(stay) + 1 > self.max_versions:
            names = ", ".join(f"v{v}" for v in sorted(stay))
            raise EngineError(f"cannot load v{version}: the engine holds {self.max_versions} versions at most "
                              f"(max_loras) and requests still run on {names}")  # fmt: skip
        assert self.base is not None  # set with lora
        try:
            check_base(inline if inline else path, *self.base)
        except ValueError as e:
            raise EngineError(f"v{version}: {e}") from None
        if inline:
            path = self._inline_folder(version, inline)
        else:
            read_weights(version, path, digest)  # the digest: the same check as every engine's
        adapter = LoRARequest(lora_name=f"v{version}", lora_int_id=version + 1, lora_path=str(path))
        try:
            self.engine.add_lora(adapter)
        except (ValueError, RuntimeError) as e:  # another rank than max_lora_rank, modules vLLM cannot wrap
            self._drop_inline_folders()
            raise EngineError(f"v{version}: vLLM cannot load the adapters of {path}: {e}") from None
        ids = {a.lora_int_id for a in stay.values() if a is not None} | {adapter.lora_int_id}
        for old in set(self.engine.list_loras()) - ids:
            self.engine.remove_lora(old)
        self.versions.take(version, adapter, kept)
        self._drop_inline_folders()

    def _inline_folder(self, version: int, files: Mapping[str, bytes]) -> pathlib.Path:
        """An inline version's files as the adapter folder vLLM reads (a ``LoRARequest`` names a path): written to a
        directory of this engine's on tmpfs (``/dev/shm`` when there is one, else the temporary directory), so the
        bytes go from memory to memory and no disk is written or read. The folder stays while the version is held
        (vLLM may read it again) and the directory is removed with the engine."""
        if self.inline_root is None:
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self.inline_root = pathlib.Path(tempfile.mkdtemp(prefix="dora-lora-", dir=shm))
            weakref.finalize(self, shutil.rmtree, self.inline_root, ignore_errors=True)
        folder = self.inline_root / f"v{version}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        for name, data in files.items():
            (folder / name).write_bytes(data)
        return folder

    def _drop_inline_folders(self) -> None:
        """Remove the folders of inline versions whose adapters vLLM no longer holds."""
        if self.inline_root is None:
            return
        held = {str(a.lora_path) for a in self.versions.by_version.values() if a is not None}
        for folder in self.inline_root.iterdir():
            if str(folder) not in held:
                shutil.rmtree(folder, ignore_errors=True)

    # ------------------------------------------------------------------ requests

    def _add(self, req: Request) -> None:
        """Queue what is left of ``req``'s current turn as one vLLM request on prompt + everything so far (vLLM's
        prefix cache keeps what an earlier turn computed)."""
        from vllm import SamplingParams

        req.prefix = len(req.tokens)
        params = SamplingParams(max_tokens=req.max_tokens - (req.prefix - req.turn_start), temperature=req.temperature,
                                top_p=req.top_p, seed=hash_seed(req.seed, req.index + 7919 * req.prefix), logprobs=0,
                                stop_token_ids=sorted(self.stops | req.stops))  # fmt: skip
        rid = f"{req.group_id}:{req.attempt}:{req.index}:{uuid.uuid4().hex[:8]}"
        self.requests[rid] = req
        self.engine.add_request(rid, {"prompt_token_ids": req.prompt + req.tokens}, params, lora_request=req.adapter)

    def submit(self, *, group_id: int, attempt: int, prompt: list[int], n: int, max_tokens: int,
               temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, stops: frozenset[int] = frozenset(),
               keep_kv: bool = False, version: int | None = None, index: int = 0) -> list[Request]:  # fmt: skip
        """Queue ``n`` samples, indices ``index`` on; ``stops``: token ids besides EOS that end a turn; ``keep_kv``:
        episodes (their next turn starts with ``extend``); ``version``: the one they run under (held here; None: the
        current one)."""
        version, adapter = self._runs_under(version)
        out = []
        for i in range(index, index + n):
            req = Request(group_id=group_id, attempt=attempt, index=i, prompt=list(prompt), max_tokens=max_tokens,
                          temperature=temperature, top_p=top_p, seed=seed, stops=stops, keep_kv=keep_kv,
                          adapter=adapter, version=version)  # fmt: skip
            out.append(req)
            self._add(req)
        return out

    def extend(self, req: Request, tokens: list[int]) -> None:
        """Start an episode's next turn: append the environment's tokens (mask 0, log-prob 0) to a request whose
        turn ended, and queue the turn."""
        if self.lora is not None and req.version not in self.versions.by_version:
            raise EngineError(f"an episode of v{req.version} goes on: this engine no longer holds it")
        req.observe(tokens)
        self._add(req)

    def state(self, req: Request, *, with_kv: bool = False) -> SampleState:
        """Its prefix, log-probs, loss mask and seed (vLLM keeps its KV to itself)."""
        return SampleState(index=req.index, token_ids=np.array(req.tokens, dtype=np.int32),
                           logprobs=np.array(req.logprobs, dtype=np.float32), mask=np.array(req.mask, dtype=np.uint8),
                           rng_state=req.seed.to_bytes(8, "little"))  # fmt: skip

    def export(self, group_id: int, attempt: int, *, with_kv: bool = False) -> list[SampleState]:
        """Abort the group's requests; their state travels."""
        return [self.state(r) for r in self._take(group_id, attempt)]

    def import_(self, *, group_id: int, attempt: int, prompt: list[int], requests: list[SampleState],
                max_tokens: int, temperature: float = 1.0, top_p: float = 1.0, stops: frozenset[int] = frozenset(),
                keep_kv: bool = False, version: int | None = None) -> list[Request]:  # fmt: skip
        """Re-prefill prompt + prefix and go on, under ``version`` (held here; None: the current one); an episode's
        state carries ``mask`` and ``turn_start``, and one ``paused`` between turns is returned, not queued
        (``extend`` starts its next turn)."""
        version, adapter = self._runs_under(version)
        out = []
        for st in requests:
            tokens = [int(x) for x in st.token_ids]
            seed = int.from_bytes(st.rng_state[:8], "little")
            mask = st.mask
            req = Request(group_id=group_id, attempt=attempt, index=st.index, prompt=list(prompt),
                          max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, tokens=tokens,
                          logprobs=[float(x) for x in st.logprobs], stops=stops, keep_kv=keep_kv,
                          mask=[1] * len(tokens) if mask is None or not len(mask) else [int(x) for x in mask],
                          turn_start=st.turn_start, adapter=adapter, version=version)  # fmt: skip
            out.append(req)
            if st.paused:
                req.finish = Finish.STOP
            else:
                self._add(req)
        return out

    def cancel(self, group_id: int, attempt: int) -> None:
        self._take(group_id, attempt)

    def _take(self, group_id: int, attempt: int) -> list[Request]:
        ids = [rid for rid, r in self.requests.items() if (r.group_id, r.attempt) == (group_id, attempt)]
        if ids:
            self.engine.abort_request(ids)
        out = [self.requests.pop(rid) for rid in ids]
        if self.held:
            out += [r for r in self.held if (r.group_id, r.attempt) == (group_id, attempt)]
            self.held = [r for r in self.held if (r.group_id, r.attempt) != (group_id, attempt)]
        return sorted(out, key=lambda r: r.index)

    def groups(self) -> set[tuple[int, int]]:
        return {(r.group_id, r.attempt) for r in (*self.requests.values(), *(self.held or ()))}

    def load(self) -> tuple[int, float]:
        return len(self), min(1.0, len(self) / self.max_slots)

    # ------------------------------------------------------------------ sleep (elastic workers)

    def sleep(self) -> None:
        """The worker yielded its accelerators: every request leaves vLLM (tokens, log-probs and seed kept here),
        then vLLM sleeps at ``sleep_level``. A no-op without a sleep level, or when asleep already."""
        if self.sleep_level is None or self.held is not None:
            return
        held = list(self.requests.values())
        if self.requests:
            self.engine.abort_request(list(self.requests))
        self.requests.clear()
        self.llm.sleep(level=self.sleep_level)
        self.held = held

    @property
    def asleep(self) -> bool:
        return self.held is not None

    def wake(self) -> None:
        """Take the accelerators back: vLLM wakes (the same weights), and each held request is re-prefilled on
        prompt + its tokens so far and goes on."""
        if self.held is None:
            return
        self.llm.wake_up(tags=["scheduling"] if self.sleep_level == 0 else None)
        held, self.held = self.held, None
        for req in held:
            self._add(req)

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[Request]:
        if self.held is not None:
            return []  # asleep: nothing runs until ``wake``
        done = []
        for out in self.engine.step():
            req = self.requests.get(out.request_id)
            if req is None:
                continue  # aborted meanwhile
            c = out.outputs[0]
            new = list(c.token_ids)[len(req.tokens) - req.prefix :]
            for j, token in enumerate(new, start=len(req.tokens) - req.prefix):
                req.tokens.append(int(token))
                req.logprobs.append(float(c.logprobs[j][token].logprob))
                req.mask.append(1)
            self.tokens_generated += len(new)
            if out.finished:
                req.finish = Finish.STOP if c.finish_reason == "stop" else Finish.LENGTH
                del self.requests[out.request_id]
                done.append(req)
        return done


def adapter_options(lora: LoraSection | None, max_loras: int) -> dict[str, Any]:
    """vLLM's LoRA settings for a run that trains ``lora`` (none without): up to ``max_loras`` adapters in one
    batch, and as many kept in host memory."""
    if lora is None:
        return {}
    if max_loras < 1:
        raise ValueError(f"max_loras must be >= 1; got {max_loras}")
    fits = [r for r in VLLM_RANKS if r >= lora.rank]
    if not fits:
        raise ValueError(f"learner.lora.rank {lora.rank}: vLLM serves adapters of rank {VLLM_RANKS[-1]} at most")
    return {"enable_lora": True, "max_loras": max_loras, "max_cpu_loras": max_loras, "max_lora_rank": fits[0]}


def cpu_binding(shards: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``shards`` CPU shards: this process's cores split into that many runs,
    ``0,1,2,3|4,5,6,7`` (cores repeat when there are fewer than shards)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < shards:
        return "|".join(str(cores[i % len(cores)]) for i in range(shards))
    size, extra = divmod(len(cores), shards)
    runs, start = [], 0
    for i in range(shards):
        end = start + size + (i < extra)
        runs.append(",".join(map(str, cores[start:end])))
        start = end
    return "|".join(runs)


def sleep_mode_available() -> bool:
    """Whether vLLM can sleep at level 1 here (weights to host memory, KV cache freed): CUDA, ROCm and XPU."""
    from vllm.platforms import current_platform

    return current_platform.is_sleep_mode_available()
