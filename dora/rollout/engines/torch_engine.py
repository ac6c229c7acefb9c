"""The `torch` engine: a transformers causal LM with its own continuous batching.

- **Continuous batching.** Sequences join and leave at step boundaries. Joining sequences are prefilled
  together in one forward pass, a group's samples sharing one row (one prompt, n samples), then join the
  decode batch. Each decode step runs every
  running sequence once: their caches are left-padded to one length, masked, and given their own
  position ids, so a sequence computes what it would compute alone (to float rounding).
- **Per-sequence KV cache.** Each sequence keeps its own keys and values per layer. That is what
  makes migration cheap: ``export`` hands over the token prefix, the behaviour log-probs, the
  sampler's RNG state and the KV cache; ``import_`` resumes from them without a re-prefill. A
  request exported without KV is re-prefilled from prompt + prefix on import. Keys and values may differ in
  width (DeepSeek's latent attention). A model whose layers keep a state instead (linear attention, Mamba), or
  whose positions move with left padding, is refused at start (``dora.hf.tensors.padding_gap``).
- **Sampling.** Temperature and top-p, one ``torch.Generator`` per sequence seeded from the
  request's seed and the sample index, so a sample's tokens do not depend on what else runs.
- **Behaviour log-prob** of each sampled token: its log-probability under the distribution it was
  actually drawn from: ``softmax(logits / temperature)``, renormalised over the top-p nucleus when
  ``top_p < 1`` (vLLM's ``processed_logprobs``; the learner must score with the same temperature).

- **Stops.** A turn ends on any of the model's stop ids (``dora.hf.folder``: the config's and generation
  config's EOS ids and the chat template's end of turn), or on the request's own ``stops``.

Weights: ``load_weights(version, path, digest)`` reads a published version folder (or any model folder, or one
safetensors file), checks its digest (``dora.store``) and refuses a mismatch or a load while requests run; on
refusal the engine stays on its current version, bit for bit. A tied model's copies (``lm_head.weight``) are not in
a version: they follow the tensor they share. On a CPU, once a version was loaded from files, their private
mappings are kept (clean file pages, shared with every process mapping them): the next version is then checked
chunk by chunk as it is copied into the model (``dora.store.load_into``: every byte read once), and a chunk that
does not match puts the kept version's bytes back. The first load, one in another dtype, or one on another device,
checks every file before it touches the model (``dora.store.load_verified``).

Sleep (an elastic worker's yield, made with ``sleep_on_yield``): every sequence's cache is dropped and the model
moves to host memory, so a learner on the same GPU gets its memory; on wake the model comes back and each sequence
is re-prefilled from prompt + prefix and goes on with its own generator, as after a migration without KV (C1).
"""

from __future__ import annotations

import hashlib
import pathlib
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dora.hf.folder import facts
from dora.hf.tensors import padding_gap, tied_copies
from dora.hostmem import Parking, module_tensors
from dora.ids import Finish
from dora.rollout.engines.base import EngineError, Sample
from dora.store import InPlaceUnfit, load_into, load_verified


@dataclass(slots=True, kw_only=True)
class Sequence(Sample):
    generator: torch.Generator
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    """Per layer (keys, values) of shape [kv_heads, positions, head_dim]; positions = prompt + tokens - 1."""

    @property
    def positions(self) -> int:
        """Positions in its KV cache: the prompt and every sampled token but the newest (not yet fed)."""
        return len(self.prompt) + len(self.tokens) - 1


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


class TorchEngine:
    name = "torch"

    def __init__(self, model_dir: str | pathlib.Path, *, max_slots: int = 64, device: str = "cpu",
                 dtype: str = "float32", version: int | None = None, sleep_on_yield: bool = False,
                 max_model_len: int | None = None) -> None:  # fmt: skip
        """``sleep_on_yield``: ``sleep`` gives the accelerator's memory back (otherwise it is a no-op);
        ``max_model_len``: a sequence ends (LENGTH) when prompt + tokens reach it (None: the model's own limit)."""
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
        self.model.to(self.device).eval()
        why = padding_gap(self.model)
        if why:  # dora.hf.checks refuses the known kinds before any process starts; this is every other one
            raise EngineError(f"the torch engine cannot run {type(self.model).__name__} ({model_dir}): {why}; it "
                              "batches sequences by cutting each one's keys and values out of the cache and padding "
                              "them on the left")  # fmt: skip
        found = facts(model_dir)
        self.stops = found.stop_ids
        """Tokens that end every turn: the model's EOS ids and its chat template's end of turn."""
        self.max_len = max_model_len or found.max_positions or 1 << 62
        self.copies = tied_copies(self.model)
        """Tied parameters' second names (not in a published version: they follow the tensor they share)."""
        self.max_slots = max_slots
        self.version = version
        self.running: list[Sequence] = []
        self.waiting: deque[Sequence] = deque()
        self.tokens_generated = 0
        self._batch: list[Sequence] = []
        """The sequences whose caches live, in this order, as rows of the last decode step's batch cache."""
        self._cache: Any = None
        self._mask: torch.Tensor | None = None
        self._loaded_from: dict[str, torch.Tensor] | None = None
        """The tensors of the file the current weights were loaded from (on a CPU): what a refused load puts back."""
        self.sleep_on_yield = sleep_on_yield
        self.asleep = False
        self.parking = Parking()
        """The model's host memory while asleep (``dora.hostmem``: one pinned buffer, reused by every sleep)."""
        if sleep_on_yield:
            self.parking.reserve(module_tensors(self.model)[0])

    # ------------------------------------------------------------------ weights

    def load_weights(self, version: int, path: str | pathlib.Path, digest: str | None) -> None:
        """Load a published version in place. Refused while requests run or when the bytes do not match."""
        if self.asleep:  # a load that ends after the worker yielded: made awake, and the engine sleeps on
            self.wake()
            try:
                return self.load_weights(version, path, digest)
            finally:
                self.sleep()
        if self.running or self.waiting:
            raise EngineError(f"cannot load v{version}: {len(self.running) + len(self.waiting)} requests are running")
        if digest is not None and self._loaded_from is not None:
            try:
                self._loaded_from = self._load_in_place(version, path, digest)
                self.version = version
                return
            except InPlaceUnfit:
                pass  # checked whole first, then loaded
        state = read_weights(version, path, digest, device=str(self.device))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if unexpected or [k for k in missing if "rotary" not in k and k not in self.copies]:
            raise EngineError(f"v{version} does not fit the model: missing {missing[:3]}, extra {unexpected[:3]}")
        self.version = version
        self._loaded_from = state if self.device.type == "cpu" else None  # views of the file's mapping

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
               keep_kv: bool = False) -> list[Sequence]:  # fmt: skip
        """Queue ``n`` samples of a prompt. ``stops``: token ids besides EOS that end a turn; ``keep_kv``: the
        samples are episodes, whose caches outlive their turns (``extend`` starts the next one)."""
        if self.version is None:
            raise EngineError("no weights loaded")
        out = []
        for i in range(n):
            g = torch.Generator(device="cpu")
            g.manual_seed(hash_seed(seed, i))
            seq = Sequence(group_id=group_id, attempt=attempt, index=i, prompt=list(prompt), max_tokens=max_tokens,
                           temperature=temperature, top_p=top_p, generator=g, stops=stops, keep_kv=keep_kv)  # fmt: skip
            self.waiting.append(seq)
            out.append(seq)
        return out

    def extend(self, seq: Sequence, tokens: list[int]) -> None:
        """Start an episode's next turn: append the environment's tokens (not sampled: mask 0, log-prob 0) to a
        sequence whose turn ended, and queue it. Its cache is kept; the new tokens are prefilled on top of it."""
        seq.observe(tokens)
        self.waiting.append(seq)

    def export(self, group_id: int, attempt: int, *, with_kv: bool = True) -> list[dict[str, Any]]:
        """Remove the group's unfinished samples and return their state (prefix, log-probs, RNG, KV)."""
        return [self.state(seq, with_kv=with_kv) for seq in self._take(group_id, attempt)]

    def state(self, seq: Sequence, *, with_kv: bool = True) -> dict[str, Any]:
        """What ``import_`` resumes a sequence from: prefix, log-probs, loss mask, RNG state, KV (an episode's
        sequence between turns too: its kept cache)."""
        state: dict[str, Any] = {
            "index": seq.index,
            "token_ids": np.array(seq.tokens, dtype=np.int32),
            "logprobs": np.array(seq.logprobs, dtype=np.float32),
            "mask": np.array(seq.mask, dtype=np.uint8),
            "rng_state": seq.generator.get_state().numpy().tobytes(),
            "kv": (),
        }
        if with_kv and seq.kv is not None:
            state["kv"] = tuple(t.cpu().numpy() for pair in seq.kv for t in pair)
        return state

    def import_(self, *, group_id: int, attempt: int, prompt: list[int], requests: list[dict[str, Any]],
                max_tokens: int, temperature: float = 1.0, top_p: float = 1.0, stops: frozenset[int] = frozenset(),
                keep_kv: bool = False) -> list[Sequence]:  # fmt: skip
        """Resume exported samples here: with their KV cache as is, or re-prefilled from prompt + prefix.

        An episode's state (``keep_kv``) may carry ``mask`` and ``turn_start`` (where its open turn began); one
        with ``paused`` set ended its turn and waits on its environment: it is returned, not queued, and its
        next turn starts with ``extend``. Returns the sequences made, in the order of ``requests``."""
        out = []
        for st in requests:
            g = torch.Generator(device="cpu")
            g.set_state(torch.frombuffer(bytearray(st["rng_state"]), dtype=torch.uint8))
            tokens = [int(x) for x in st["token_ids"]]
            mask = st.get("mask")
            seq = Sequence(group_id=group_id, attempt=attempt, index=st["index"], prompt=list(prompt),
                           max_tokens=max_tokens, temperature=temperature, top_p=top_p, generator=g, tokens=tokens,
                           logprobs=[float(x) for x in st["logprobs"]],
                           mask=[1] * len(tokens) if mask is None or not len(mask) else [int(x) for x in mask],
                           turn_start=int(st.get("turn_start", 0)), stops=stops, keep_kv=keep_kv)  # fmt: skip
            out.append(seq)
            kv = st.get("kv") or ()
            if kv and seq.tokens:
                t = [torch.from_numpy(np.array(a)).to(self.device) for a in kv]
                seq.kv = [(t[2 * i], t[2 * i + 1]) for i in range(len(t) // 2)]
            if st.get("paused"):
                seq.finish = Finish.STOP
            elif seq.kv is not None and seq.kv[0][0].shape[1] == seq.positions and len(self.running) < self.max_slots:
                self.running.append(seq)
            else:
                self.waiting.appendleft(seq)  # (re-)prefilled, or its cache caught up, when admitted
        return out

    def cancel(self, group_id: int, attempt: int) -> None:
        self._take(group_id, attempt)

    def _take(self, group_id: int, attempt: int) -> list[Sequence]:
        self._materialize()
        match = [s for s in [*self.running, *self.waiting] if (s.group_id, s.attempt) == (group_id, attempt)]
        self.running = [s for s in self.running if (s.group_id, s.attempt) != (group_id, attempt)]
        self.waiting = deque(s for s in self.waiting if (s.group_id, s.attempt) != (group_id, attempt))
        return sorted(match, key=lambda s: s.index)

    def groups(self) -> set[tuple[int, int]]:
        return {(s.group_id, s.attempt) for s in [*self.running, *self.waiting]}

    def load(self) -> tuple[int, float]:
        """(running sequences, slot use 0..1)."""
        return len(self.running), len(self.running) / self.max_slots

    def __len__(self) -> int:
        return len(self.running) + len(self.waiting)

    # ------------------------------------------------------------------ sleep (elastic workers)

    def sleep(self) -> None:
        """The worker yielded its accelerators: every sequence's cache is dropped (each is re-prefilled at wake, the
        running ones first) and the model moves to host memory. A no-op without ``sleep_on_yield``."""
        if not self.sleep_on_yield or self.asleep:
            return
        held = [*self.running, *self.waiting]
        for seq in held:
            seq.kv = None
        self.running, self.waiting = [], deque(held)
        self._batch, self._cache, self._mask = [], None, None
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

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Admit waiting sequences (prefill), then one decode step of every running one. Returns those done."""
        if self.asleep:
            return []
        admitted: list[Sequence] = []
        while self.waiting and len(self.running) + len(admitted) < self.max_slots:
            admitted.append(self.waiting.popleft())
        self._prefill([s for s in admitted if s.kv is None])
        self._catch_up([s for s in admitted if s.kv is not None and s.kv[0][0].shape[1] < s.positions])
        done = [s for s in admitted if s.finish is not None]
        self.running += [s for s in admitted if s.finish is None]
        if self.running:
            self._decode(self.running)
            ended = [s for s in self.running if s.finish is not None]
            self._keep([s for s in ended if s.keep_kv])
            done += ended
            self.running = [s for s in self.running if s.finish is None]
        return done

    def _prefill(self, seqs: list[Sequence]) -> None:
        """Fill the caches of joining sequences in one forward pass, and sample each one's first token.

        A sequence's cache covers its prompt and any migrated prefix but the last token. Sequences with the
        same such tokens (a group's samples: one prompt, n samples) share one row and its cache; each still
        draws its first token with its own generator. Rows are right-padded: causal attention keeps every
        real position from seeing the padding after it, so each row computes what it would alone."""
        if not seqs:
            return
        rows: dict[tuple[int, ...], list[Sequence]] = {}
        for seq in seqs:
            rows.setdefault(tuple(seq.prompt + seq.tokens[:-1] if seq.tokens else seq.prompt), []).append(seq)
        lengths = [len(ids) for ids in rows]
        batch = torch.zeros((len(rows), max(lengths)), dtype=torch.long)
        for b, ids in enumerate(rows):
            batch[b, : len(ids)] = torch.tensor(ids)
        from transformers import DynamicCache

        # a cache of every position: a model's own keeps only a sliding window's last ones (Gemma 2), and each
        # sequence's cache is cut from this one whole; the attention mask applies the window
        out = self.model(input_ids=batch.to(self.device), past_key_values=DynamicCache(), use_cache=True)
        layers = out.past_key_values.layers
        first: list[Sequence] = []
        last: list[torch.Tensor] = []
        for b, (same, n) in enumerate(zip(rows.values(), lengths, strict=True)):
            kv = [(layer.keys[b, :, :n], layer.values[b, :, :n]) for layer in layers]
            for seq in same:
                seq.kv = kv  # read only: a decode batch copies it, a sequence leaving one gets its own copy
                if not seq.tokens:
                    first.append(seq)
                    last.append(out.logits[b, n - 1])
        if first:
            self._sample(first, torch.stack(last))

    def _catch_up(self, seqs: list[Sequence]) -> None:
        """Prefill the tokens episodes' sequences gained since their caches were made (the end of the last turn and
        the environment's answer, but the newest token), on top of those caches, in one forward pass: caches
        left-padded to the longest, new tokens right-padded, both masked; position ids continue each cache."""
        if not seqs:
            return
        from transformers import DynamicCache

        data, have = left_padded(seqs)
        feeds = [(s.prompt + s.tokens)[h : s.positions] for s, h in zip(seqs, have, strict=True)]
        past, width = max(have), max(map(len, feeds))
        ids = torch.zeros((len(seqs), width), dtype=torch.long)
        mask = torch.zeros((len(seqs), past + width), dtype=torch.long)
        for b, (h, feed) in enumerate(zip(have, feeds, strict=True)):
            ids[b, : len(feed)] = torch.tensor(feed)
            mask[b, past - h : past + len(feed)] = 1
        positions = torch.tensor(have)[:, None] + torch.arange(width)[None]
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                         position_ids=positions.to(self.device), past_key_values=DynamicCache(ddp_cache_data=data),
                         use_cache=True)  # fmt: skip
        for b, (s, h, feed) in enumerate(zip(seqs, have, feeds, strict=True)):
            span = slice(past - h, past + len(feed))
            s.kv = [(layer.keys[b, :, span].clone(), layer.values[b, :, span].clone())
                    for layer in out.past_key_values.layers]  # fmt: skip

    def _keep(self, seqs: list[Sequence]) -> None:
        """Copy the rows of the last decode batch's cache that belong to ``seqs`` (episodes whose turn just ended)
        before the next step drops them."""
        if not seqs or self._cache is None:
            return
        rows = {id(x): b for b, x in enumerate(self._batch)}
        width = self._mask.shape[1]
        for seq in seqs:
            b, n = rows[id(seq)], seq.positions
            seq.kv = [(layer.keys[b, :, width - n :].clone(), layer.values[b, :, width - n :].clone())
                      for layer in self._cache.layers]  # fmt: skip

    def _materialize(self) -> None:
        """Give each batched sequence its own copy of its rows of the batch cache (before the batch changes)."""
        if self._cache is None:
            return
        width = self._mask.shape[1]
        for b, seq in enumerate(self._batch):
            if seq.finish is None and seq.kv is None:  # a kv of its own: kept at a turn's end, newer than its row
                n = seq.positions
                seq.kv = [(layer.keys[b, :, width - n :].clone(), layer.values[b, :, width - n :].clone())
                          for layer in self._cache.layers]  # fmt: skip
        self._batch, self._cache, self._mask = [], None, None

    def _decode(self, seqs: list[Sequence]) -> None:
        """One token for every running sequence. While the batch stays the same, its cache is reused as
        is; sequences leaving drop their rows; a sequence joining makes the batch be rebuilt (left-padded)."""
        ids = {id(x): i for i, x in enumerate(self._batch)}
        if self._cache is not None and all(id(x) in ids and x.kv is None for x in seqs):
            rows = [ids[id(x)] for x in seqs]
            mask = self._mask
            if rows != list(range(len(self._batch))):
                index = torch.tensor(rows, device=self.device)
                self._cache.batch_select_indices(index)
                mask = mask[index]
            cache = self._cache
            mask = torch.cat([mask, mask.new_ones((len(seqs), 1))], 1)
        else:
            self._materialize()
            cache, mask = self._padded(seqs)
        out = self.model(
            input_ids=torch.tensor([[s.tokens[-1]] for s in seqs], device=self.device),
            attention_mask=mask,
            position_ids=torch.tensor([[s.positions] for s in seqs], device=self.device),
            past_key_values=cache,
            use_cache=True,
        )
        self._batch, self._cache, self._mask = list(seqs), out.past_key_values, mask
        for s in seqs:
            s.kv = None  # the batch cache holds it now
        self._sample(seqs, out.logits[:, -1])

    def _padded(self, seqs: list[Sequence]) -> tuple[Any, torch.Tensor]:
        """A batch cache from the sequences' own caches, left-padded to the longest, and its mask (one more column
        for the token about to be fed)."""
        from transformers import DynamicCache

        data, lengths = left_padded(seqs)
        longest = max(lengths)
        mask = torch.ones((len(seqs), longest + 1), dtype=torch.long, device=self.device)
        for b, n in enumerate(lengths):
            mask[b, : longest - n] = 0
        return DynamicCache(ddp_cache_data=data), mask

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Sample every row at once by inverse CDF; each row's uniform draw comes from its own generator."""
        temps = torch.tensor([max(s.temperature, 1e-6) for s in seqs], device=logits.device)
        logp = torch.log_softmax(logits.float() / temps[:, None], -1)
        probs = logp.exp()
        top_p = torch.tensor([s.top_p for s in seqs], device=logits.device)
        if bool((top_p < 1.0).any()):
            sorted_p, order = torch.sort(probs, descending=True, dim=-1)
            keep = torch.cumsum(sorted_p, -1) - sorted_p < top_p[:, None]
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
            logp = torch.log(probs / probs.sum(-1, keepdim=True))  # the distribution actually sampled from
        cdf = torch.cumsum(probs, -1)
        u = torch.stack([torch.rand((), generator=s.generator) for s in seqs]).to(logits.device)
        drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(1).clamp(max=probs.shape[-1] - 1)
        greedy = torch.argmax(logp, -1)
        chosen = torch.where(torch.tensor([s.temperature <= 0 for s in seqs], device=logits.device), greedy, drawn)
        picked = logp.gather(1, chosen[:, None]).squeeze(1)
        for s, token, lp in zip(seqs, chosen.tolist(), picked.tolist(), strict=True):
            s.tokens.append(token)
            s.logprobs.append(lp)
            s.mask.append(1)
            self.tokens_generated += 1
            if token in self.stops or token in s.stops:
                s.finish = Finish.STOP
            elif len(s.tokens) - s.turn_start >= s.max_tokens or len(s.prompt) + len(s.tokens) >= self.max_len:
                s.finish = Finish.LENGTH


def left_padded(seqs: list[Sequence]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[int]]:
    """Per layer (keys, values) of the sequences' own caches stacked into a batch, each left-padded with zeros to
    the longest; and each one's cache length. Keys and values are each their own shape: DeepSeek's multi-head latent
    attention caches its compressed latent (512 wide in DeepSeek-V3) as keys and the rotary key (64) as values."""
    lengths = [s.kv[0][0].shape[1] for s in seqs]
    longest = max(lengths)
    data = []
    for layer in range(len(seqs[0].kv)):
        k0, v0 = seqs[0].kv[layer]
        keys = k0.new_zeros((len(seqs), k0.shape[0], longest, k0.shape[2]))
        values = v0.new_zeros((len(seqs), v0.shape[0], longest, v0.shape[2]))
        for b, (s, n) in enumerate(zip(seqs, lengths, strict=True)):
            keys[b, :, longest - n :], values[b, :, longest - n :] = s.kv[layer]
        data.append((keys, values))
    return data, lengths


def hash_seed(seed: int, index: int) -> int:
    """A 63-bit sampler seed per (request seed, sample index)."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
