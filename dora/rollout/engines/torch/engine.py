"""The `torch` engine: a transformers causal LM with its own continuous batching.

- **Continuous batching in cache slots.** Each running sequence owns one slot of a preallocated KV cache
  (``slots``), its token at position ``p`` keyed at column ``p``: sequences join and leave at
  step boundaries without rebuilding anyone else's cache. Joining sequences are prefilled together in one forward
  pass, a group's samples sharing one row (one prompt, n samples); each decode step runs every running sequence once
  at its own position, under a mask that hides what is not its own (``attention``), so a sequence
  computes what it would compute alone (to float rounding). The batch, its fills and its steps:
  ``batch``; on CUDA a decode step replays a CUDA graph (``graphs``).
- **Migration.** ``export`` hands over the token prefix, the behaviour log-probs, the sampler's seed and the KV
  columns of the sequence's slot; ``import_`` copies them into a slot of its own and resumes without a re-prefill. A
  request exported without KV is re-prefilled from prompt + prefix on import. Keys and values may differ in width
  (DeepSeek's latent attention). A model whose layers keep a state instead (linear attention, Mamba), or whose
  positions move with padding, is refused at start (``dora.hf.tensors.padding_gap``).
- **Sampling on the device.** Temperature and top-p, by inverse CDF with one uniform per token that is a pure
  function of the sequence's seed (from the request's seed and the sample index) and the token's index in the
  sequence (``sampling``): a sample's tokens do not depend on what else runs, where it ran
  before a migration, or whether it was re-prefilled. A sequence's sampler state is its seed (``rng_state``: 8 bytes,
  little-endian). One small transfer per step brings the tokens back to the host.
- **Behaviour log-prob** of each sampled token: its log-probability under the distribution it was
  actually drawn from: ``softmax(logits / temperature)``, renormalised over the top-p nucleus when
  ``top_p < 1`` (vLLM's ``processed_logprobs``; the learner must score with the same temperature).

- **Stops.** A turn ends on any of the model's stop ids (``dora.hf.folder``: the config's and generation
  config's EOS ids and the chat template's end of turn), or on the request's own ``stops``, checked on the device.
- **Memory.** The slot cache holds, per layer, ``max_slots`` x capacity columns of keys and values, the capacity the
  next power of two of the longest a sequence may grow in its turn (prompt + ``max_tokens``, at most the model's
  limit), grown when a longer one joins: Qwen2.5-0.5B in bf16, 256 slots x 512 columns, 1.6 GB. It is sized by the
  longest sequence, not by the tokens held (a paged cache would be).

Weights: ``load_weights(version, path, digest)`` reads a published version folder (or any model folder, or one
safetensors file), checks its digest (``dora.store``) and refuses a mismatch or a load while requests run; on
refusal the engine stays on its current version, bit for bit. Every request runs under one version, the one it
names (``submit`` / ``import_``: ``version``, by default the current one); a full-weight engine holds one, its
loaded version, and refuses a request naming another. A tied model's copies (``lm_head.weight``) are not in
a version: they follow the tensor they share. On a CPU, once a version was loaded from files, their private
mappings are kept (clean file pages, shared with every process mapping them): the next version is then checked
chunk by chunk as it is copied into the model (``dora.store.load_into``: every byte read once), and a chunk that
does not match puts the kept version's bytes back. The first load, one in another dtype, or one on another device,
checks every file before it touches the model (``dora.store.load_verified``). ``receive_weights`` takes a version
the learner broadcasts to its weight group instead (``dora.store.collective``: NCCL between GPUs, gloo between
CPUs): checked against its manifest in a staging buffer, then copied into the model, no file read.

LoRA (``lora``): a version is an adapter folder, and the engine holds up to ``max_versions`` of them at once
(``adapters``), each request sampled under its own version's adapters, rows of several versions
in one batch (in one CUDA graph too). A load is taken while requests run: the new version goes into a lane no
running request reads; the versions requests still name stay, the others leave; a load that would need more than
``max_versions`` is refused before anything changes. A group's samples share their prompt's prefill only within
one version (the keys and values differ per adapter). A version carried inline (its files in the worker's
``Assign``, checked there: ``dora.store.inline``) is made from those bytes (``read_inline``): no file is read.

Sleep (an elastic worker's yield, made with ``sleep_on_yield``): every sequence's cache is dropped (the slot cache's
memory too) and the model moves to host memory, so a learner on the same GPU gets its memory; on wake the model comes
back and each sequence is re-prefilled from prompt + prefix and draws on from its seed, as after a migration without
KV (C1).
"""

from __future__ import annotations

import hashlib
import pathlib
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog
import torch

from dora.hf.folder import facts
from dora.hf.lora import ADAPTER_FILE, Version, check_adapters, check_base, inject
from dora.hf.tensors import padding_gap, tied_copies
from dora.hostmem import Parking, module_tensors
from dora.ids import Finish
from dora.rollout.engines.base import EngineError, Sample, SampleState
from dora.rollout.engines.torch.adapters import Adapters
from dora.rollout.engines.torch.attention import install
from dora.rollout.engines.torch.batch import Running
from dora.rollout.engines.versions import HoldsVersions, Versions
from dora.store import InPlaceUnfit, load_into, load_verified, model_digest

log = structlog.get_logger()

if TYPE_CHECKING:
    from dora.config.models import LoraSection
    from dora.store.collective import Receiver


@dataclass(slots=True, kw_only=True)
class Sequence(Sample):
    seed: int
    """The sampler's 63-bit seed: the draw for the token at index t is ``sampling.uniform(seed, t)``."""
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    """Its own cache while it holds no slot (an episode between turns, a migrated request, one taken out with its
    cache): per layer (keys, values) of shape [kv_heads, positions, head_dim]; positions = prompt + tokens - 1."""

    @property
    def positions(self) -> int:
        """Positions in its KV cache: the prompt and every sampled token but the newest (not yet fed)."""
        return len(self.prompt) + len(self.tokens) - 1

    def release(self) -> None:
        self.kv = None


def read_weights(version: int, path: str | pathlib.Path, digest: str | None, device: str = "cpu") -> dict[str, Any]:
    """A published version's tensors, its digest checked first (``dora.store.load_verified``: one read of a private
    mapping of the file, whose tensors are then cut from that same mapping). Every way the read can fail is an
    EngineError (the worker stays on its version and lets the broker re-plan), a file gone before it is opened
    included: the broker may retire a version it told this worker to load, once a newer assignment has replaced that
    order, and the newer one is then already on its way. Once opened, the file is read whole even if it is retired."""
    try:
        return load_verified(path, digest, name=f"v{version}", device=device)
    except OSError as e:
        raise EngineError(f"v{version}: cannot read {e.filename or path}: {e.strerror or e}") from None
    except ValueError as e:  # a digest mismatch, or a digest this dora cannot read
        raise EngineError(str(e)) from None


def read_inline(version: int, files: Mapping[str, bytes], device: str = "cpu") -> dict[str, torch.Tensor]:
    """An adapter version's tensors made from its files carried inline (checked by then: ``dora.store.inline``),
    with no file read. EngineError if they hold no adapters, or not as safetensors."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    data = files.get(ADAPTER_FILE)
    if data is None:
        raise EngineError(f"v{version}: no {ADAPTER_FILE} among its files carried inline")
    try:
        return {k: t.to(device) for k, t in load(bytes(data)).items()}
    except (SafetensorError, ValueError) as e:
        raise EngineError(f"v{version}: its inline {ADAPTER_FILE} is not safetensors ({e})") from None


class TorchEngine(HoldsVersions):
    name = "torch"

    def __init__(self, model_dir: str | pathlib.Path, *, max_slots: int = 64, device: str = "cpu",
                 dtype: str = "float32", version: int | None = None, sleep_on_yield: bool = False,
                 max_model_len: int | None = None, cuda_graphs: bool | None = None,
                 lora: LoraSection | None = None, max_versions: int = 1) -> None:  # fmt: skip
        """``sleep_on_yield``: ``sleep`` gives the accelerator's memory back (otherwise it is a no-op);
        ``max_model_len``: a sequence ends (LENGTH) when prompt + tokens reach it (None: the model's own limit);
        ``cuda_graphs``: decode steps replay CUDA graphs (None: on a CUDA device); ``lora``: the run trains these
        adapters (``dora.hf.lora``), and its versions are adapter folders, of which the engine holds up to
        ``max_versions`` at once (full weights: one)."""
        if max_versions != 1 and lora is None:
            raise ValueError(f"max_versions {max_versions}: an engine of full weights holds one version")
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
        if self.model.config._attn_implementation not in ("sdpa", "eager"):  # kernels that take no dense mask
            self.model.set_attn_implementation("sdpa")
        self.model.to(self.device).eval()
        why = padding_gap(self.model)
        if why:  # dora.hf.checks refuses the known kinds before any process starts; this is every other one
            raise EngineError(f"the torch engine cannot run {type(self.model).__name__} ({model_dir}): {why}; it "
                              "batches sequences by keeping each one's keys and values in a cache slot of its own "
                              "and reading them at the sequence's own positions")  # fmt: skip
        found = facts(model_dir)
        self.stops = found.stop_ids
        """Tokens that end every turn: the model's EOS ids and its chat template's end of turn."""
        self.max_len = max_model_len or found.max_positions or 1 << 62
        self.copies = tied_copies(self.model)
        """Tied parameters' second names (not in a published version: they follow the tensor they share)."""
        self.lora = None
        """The PEFT config of the adapters a LoRA run's versions fill (B zero until then: the start model)."""
        self.base = (str(model_dir), model_digest(model_dir)) if lora is not None else None
        """A LoRA run's base model, by path and digest: versions trained on another are refused (``check_base``)."""
        self.adapters: Adapters | None = None
        """A LoRA run: the adapter versions held, one lane each."""
        if lora is not None:  # before the attention kernel and the decode graphs take the model's modules
            self.lora = inject(self.model, lora)
            self.model.to(self.device, dtype=getattr(torch, dtype)).eval()
            self.adapters = Adapters(self.model, self.lora, max_versions, version)
            if self.adapters.one_version is not None and max_versions > 1:
                log.warning("lora_one_version_at_a_time", max_versions=max_versions, layer=self.adapters.one_version,
                            reason="an adapted layer of a mixture of experts sees routed tokens, not rows")  # fmt: skip
        self.versions = self.adapters.versions if self.adapters is not None else Versions(1, version, 0)
        """The versions held (requests name any of them), each by its adapters' lane (full weights: lane 0)."""
        self.max_slots = max_slots
        kernel = install(self.model)  # grouped decode attention over the model's own
        self.batch = Running(self.model, self.device, max_slots, self.max_len, kernel, cuda_graphs, self.adapters)
        self.waiting: deque[Sequence] = deque()
        self._loaded_from: dict[str, torch.Tensor] | None = None
        """The tensors of the file the current weights were loaded from (on a CPU): what a refused load puts back."""
        self.sleep_on_yield = sleep_on_yield
        self.asleep = False
        self.parking = Parking()
        """The model's host memory while asleep (``dora.hostmem``: one pinned buffer, reused by every sleep)."""
        if sleep_on_yield:
            self.parking.reserve(module_tensors(self.model)[0])

    @property
    def adapted(self) -> bool:
        return self.adapters is not None

    def named(self, keep: frozenset[int] = frozenset()) -> set[int]:
        """The versions a request here still runs under (running or waiting), and ``keep``."""
        return {s.version for s in (*self.running, *self.waiting) if s.version is not None} | set(keep)

    @property
    def running(self) -> list[Sequence]:
        """The sequences decoding, in slot order."""
        return self.batch.seqs

    @property
    def tokens_generated(self) -> int:
        return self.batch.made

    # ------------------------------------------------------------------ weights

    def load_weights(self, version: int, path: str | pathlib.Path, digest: str | None,
                     keep: frozenset[int] = frozenset(), inline: Mapping[str, bytes] = {}) -> None:  # fmt: skip
        """Load a published version. Full weights: in place, refused while requests run. Adapters (a LoRA run): beside
        the versions requests still name (running, waiting, or in ``keep``: an episode's between its turns), which
        go on under their own; the others leave. Refused when the bytes do not match, or when it would take more than
        ``max_versions``; the engine is then as it was. ``inline``: an adapter version's files, carried in its
        ``Assign`` and already checked against ``digest`` (``dora.store.inline.verified``): the adapters are made
        from these bytes, and ``path`` is not read."""
        if self.asleep:  # a load that ends after the worker yielded: made awake, and the engine sleeps on
            self.wake()
            try:
                return self.load_weights(version, path, digest, keep, inline)
            finally:
                self.sleep()
        if self.adapters is not None:
            return self._load_adapters(version, pathlib.Path(path), digest, self.named(keep), inline)
        if inline:
            raise EngineError(f"v{version}: full weights are read from the store, never carried inline")
        if self.batch or self.waiting:
            raise EngineError(f"cannot load v{version}: {len(self.running) + len(self.waiting)} requests are running")
        if digest is not None and self._loaded_from is not None:
            try:
                self._loaded_from = self._load_in_place(version, path, digest)
                self.versions.take(version, 0)
                return
            except InPlaceUnfit:
                pass  # checked whole first, then loaded
        state = read_weights(version, path, digest, device=str(self.device))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if unexpected or [k for k in missing if "rotary" not in k and k not in self.copies]:
            raise EngineError(f"v{version} does not fit the model: missing {missing[:3]}, extra {unexpected[:3]}")
        self.versions.take(version, 0)
        self._loaded_from = state if self.device.type == "cpu" else None  # views of the file's mapping

    def receive_weights(self, version: int, receiver: Receiver, digest: str | None) -> None:
        """Full weights the learner broadcasts to its weight group (``dora.store.collective``): received into the
        receiver's staging buffer, checked against the version's manifest (and the manifest against ``digest``),
        then copied into this engine's own tensors; no file, no store. A broadcast is collective, so the engine
        takes part even when it cannot take the version (requests running, a LoRA run, bytes that do not check,
        another version sent): it receives, then raises EngineError and keeps the version it holds."""
        if self.asleep:
            self.wake()
            try:
                return self.receive_weights(version, receiver, digest)
            finally:
                self.sleep()
        refused = None
        if self.adapters is not None:
            refused = "a LoRA run's versions are adapter folders"
        elif self.batch or self.waiting:
            refused = f"{len(self.running) + len(self.waiting)} requests are running"
        into = {k: t for k, t in self.model.state_dict().items() if "rotary" not in k and k not in self.copies}
        try:
            receiver.receive(into=None if refused else into, digest=digest, version=version)
        except ValueError as e:  # a digest mismatch, a manifest or tensors that do not fit: nothing was copied
            raise EngineError(str(e)) from None
        if refused:
            raise EngineError(f"cannot load v{version}: {refused}")
        self.versions.take(version, 0)
        self._loaded_from = None  # no file mapping to put back from: the next in-place load reads whole first

    def _load_adapters(self, version: int, path: pathlib.Path, digest: str | None, kept: set[int],
                       inline: Mapping[str, bytes]) -> None:  # fmt: skip
        assert self.adapters is not None and self.base is not None
        lane = self.adapters.free_lane(version, kept)
        source: Version = inline if inline else path
        try:
            check_base(source, *self.base)
        except ValueError as e:
            raise EngineError(f"v{version}: {e}") from None
        if inline:
            state = read_inline(version, inline, device=str(self.device))
        else:
            state = read_weights(version, path, digest, device=str(self.device))
        try:
            tensors = check_adapters(self.model, source, state, self.lora)
        except ValueError as e:
            raise EngineError(f"v{version}: {e}") from None
        self.adapters.fill(version, lane, tensors, kept)

    def _load_in_place(self, version: int, path: str | pathlib.Path, digest: str) -> dict[str, torch.Tensor]:
        into = {k: t for k, t in self.model.state_dict().items() if "rotary" not in k and k not in self.copies}
        kept = self._loaded_from

        def undo() -> None:  # the version this engine holds, from the mapping of the file it was loaded from
            self.model.load_state_dict(kept, strict=False)

        try:
            return load_into(path, digest, name=f"v{version}", into=into, undo=undo)
        except OSError as e:
            raise EngineError(f"v{version}: cannot read {e.filename or path}: {e.strerror or e}") from None
        except ValueError as e:  # a digest mismatch (the model was put back), or a file that is not safetensors
            raise EngineError(str(e)) from None

    # ------------------------------------------------------------------ requests

    def submit(self, *, group_id: int, attempt: int, prompt: list[int], n: int, max_tokens: int,
               temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, stops: frozenset[int] = frozenset(),
               keep_kv: bool = False, version: int | None = None, index: int = 0) -> list[Sequence]:  # fmt: skip
        """Queue ``n`` samples of a prompt, indices ``index`` on (an agent's episode is a sample submitted alone).
        ``stops``: token ids besides EOS that end a turn; ``keep_kv``: the samples are episodes, whose caches outlive
        their turns (``extend`` starts the next one); ``version``: the one they run under (held here; None: the
        current one)."""
        version = self.versions.runs_under(version)
        out = []
        for i in range(index, index + n):
            seq = Sequence(group_id=group_id, attempt=attempt, index=i, prompt=list(prompt), max_tokens=max_tokens,
                           temperature=temperature, top_p=top_p, seed=hash_seed(seed, i), stops=stops,
                           keep_kv=keep_kv, version=version)  # fmt: skip
            self.waiting.append(seq)
            out.append(seq)
        return out

    def extend(self, seq: Sequence, tokens: list[int]) -> None:
        """Start an episode's next turn: append the environment's tokens (not sampled: mask 0, log-prob 0) to a
        sequence whose turn ended, and queue it. Its cache is kept; the new tokens are prefilled on top of it."""
        if self.adapters is not None and seq.version not in self.versions.held():
            raise EngineError(f"an episode of v{seq.version} goes on: this engine no longer holds it")
        seq.observe(tokens)
        self.waiting.append(seq)

    def export(self, group_id: int, attempt: int, *, with_kv: bool = True) -> list[SampleState]:
        """Remove the group's unfinished samples and return their state (prefix, log-probs, seed, KV)."""
        return [self.state(seq, with_kv=with_kv) for seq in self._take(group_id, attempt, with_kv=with_kv)]

    def state(self, seq: Sequence, *, with_kv: bool = True) -> SampleState:
        """What ``import_`` resumes a sequence from: prefix, log-probs, loss mask, the sampler's seed, KV (an
        episode's sequence between turns too: its kept cache)."""
        kv: tuple[np.ndarray, ...] = ()
        if with_kv and seq.kv is not None:
            # numpy has no bfloat16: such a cache travels as float32 (exact) and is cast back on import
            kv = tuple((t.float() if t.dtype == torch.bfloat16 else t).cpu().numpy() for pair in seq.kv for t in pair)
        return SampleState(index=seq.index, token_ids=np.array(seq.tokens, dtype=np.int32),
                           logprobs=np.array(seq.logprobs, dtype=np.float32), mask=np.array(seq.mask, dtype=np.uint8),
                           rng_state=seq.seed.to_bytes(8, "little"), kv=kv)  # fmt: skip

    def import_(self, *, group_id: int, attempt: int, prompt: list[int], requests: list[SampleState],
                max_tokens: int, temperature: float = 1.0, top_p: float = 1.0, stops: frozenset[int] = frozenset(),
                keep_kv: bool = False, version: int | None = None) -> list[Sequence]:  # fmt: skip
        """Resume exported samples here, under ``version`` (held here; None: the current one): with their KV cache
        as is, or re-prefilled from prompt + prefix. They join at the next step, before anything already waiting, in
        the order of ``requests``.

        An episode's state (``keep_kv``) carries ``mask`` and ``turn_start`` (where its open turn began); one
        with ``paused`` set ended its turn and waits on its environment: it is returned, not queued, and its
        next turn starts with ``extend``. Returns the sequences made, in the order of ``requests``."""
        version = self.versions.runs_under(version)
        out, queued = [], []
        for st in requests:
            tokens = [int(x) for x in st.token_ids]
            mask = st.mask
            seq = Sequence(group_id=group_id, attempt=attempt, index=st.index, prompt=list(prompt),
                           max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed_of(st.rng_state),
                           tokens=tokens, logprobs=[float(x) for x in st.logprobs],
                           mask=[1] * len(tokens) if mask is None or not len(mask) else [int(x) for x in mask],
                           turn_start=st.turn_start, stops=stops, keep_kv=keep_kv, version=version)  # fmt: skip
            out.append(seq)
            kv = st.kv
            if kv and seq.tokens:
                dtype = self.model.dtype  # the model's own: a bf16 cache came as float32
                t = [torch.from_numpy(np.array(a)).to(self.device, dtype=dtype) for a in kv]
                seq.kv = [(t[2 * i], t[2 * i + 1]) for i in range(len(t) // 2)]
            if st.paused:
                seq.finish = Finish.STOP
            else:
                queued.append(seq)
        self.waiting.extendleft(reversed(queued))
        return out

    def cancel(self, group_id: int, attempt: int) -> None:
        self._take(group_id, attempt)

    def _take(self, group_id: int, attempt: int, *, with_kv: bool = False) -> list[Sequence]:
        """Remove the group's sequences, running or waiting. A running one takes a copy of its cache along if
        ``with_kv`` or if it is an episode's (whose state its caller may still hand over)."""

        def match(s: Sequence) -> bool:
            return (s.group_id, s.attempt) == (group_id, attempt)

        taken = self.batch.take(match, lambda s: with_kv or s.keep_kv)
        taken += [s for s in self.waiting if match(s)]
        self.waiting = deque(s for s in self.waiting if not match(s))
        return sorted(taken, key=lambda s: s.index)

    def groups(self) -> set[tuple[int, int]]:
        return {(s.group_id, s.attempt) for s in [*self.running, *self.waiting]}

    def load(self) -> tuple[int, float]:
        """(running sequences, slot use 0..1)."""
        return len(self.batch), len(self.batch) / self.max_slots

    def __len__(self) -> int:
        return len(self.batch) + len(self.waiting)

    # ------------------------------------------------------------------ sleep (elastic workers)

    def sleep(self) -> None:
        """The worker yielded its accelerators: every sequence's cache is dropped (each is re-prefilled at wake, the
        running ones first) and the model moves to host memory. A no-op without ``sleep_on_yield``."""
        if not self.sleep_on_yield or self.asleep:
            return
        held = [*self.batch.drop(), *self.waiting]
        for seq in held:
            seq.kv = None
        self.waiting = deque(held)
        tensors, put = module_tensors(self.model)
        put(self.parking.park(tensors))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.asleep = True

    def wake(self) -> None:
        """Take the accelerators back: the model returns to its device (the same weights)."""
        if self.asleep:
            tensors, put = module_tensors(self.model)
            put(self.parking.unpark(tensors, self.device))
            self.asleep = False

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[Sequence]:
        """Admit waiting sequences (prefill), then one decode step of every running one. Returns those done."""
        if self.asleep:
            return []
        room = self.max_slots - len(self.batch)
        joining = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
        done = self.batch.admit(joining, self.stops) if joining else []
        if self.batch:
            done += self.batch.decode()
        return done


def seed_of(rng_state: bytes) -> int:
    """The sampler's seed from an exported ``rng_state`` (8 bytes, little-endian)."""
    if len(rng_state) != 8:
        raise EngineError(f"a torch engine's sampler state is its 8-byte seed, got {len(rng_state)} bytes (a state "
                          "exported by another engine or another dora)")  # fmt: skip
    return int.from_bytes(rng_state, "little")


def hash_seed(seed: int, index: int) -> int:
    """A 63-bit sampler seed per (request seed, sample index)."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
