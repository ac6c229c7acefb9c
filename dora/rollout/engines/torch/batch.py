"""The torch engine's running batch: sequences in cache slots, filled, decoded and sampled on the device.

- **Slots.** Running sequence ``i`` owns slot ``i`` of the ``SlotCache`` (``slots``) and row
  ``i`` of the per-slot state kept on the device: the token to feed next, its position, the index of the next draw,
  the sampler's seed (two 32-bit words), the token limit, temperature, top-p and the stop ids. A sequence joins at
  the end; one leaving from the middle is replaced by the last (its cache and state rows move), so the batch is
  always slots ``0..n-1`` and nobody else's cache is rebuilt.
- **Joining (a fill).** Joining sequences with a cache of their own (an episode's next turn, a migrated request)
  have it copied into their slot; the tokens their cache lacks are fed in one forward, rows right-padded, each at
  its own positions. Fresh samples of one prompt share one row: the prompt is prefilled once and copied into its
  siblings' slots. Each fresh sample then draws its first token from that row's last logits, with its own seed.
- **A decode step** feeds every running sequence's newest token at its own position, reading the columns up to the
  longest one's (CPU) or the whole capacity (inside a CUDA graph, ``graphs``), and samples the
  next tokens on the device (``sampling``). One small transfer per step brings back the tokens,
  their log-probs and each row's outcome (runs on, stop id, limit): the only host round trip.
- **Adapter versions** (a LoRA run, ``adapters``): each slot's state also names the lane of
  its sequence's version, and every forward tells the adapters the lanes of its rows, so a batch runs rows of
  several versions at once, each under its own. Fresh samples share a prefill only within one version.
- **Leaving.** A sequence that ended, was cancelled or exported leaves its slot; one whose cache is still wanted (an
  episode between turns, an export with KV) takes a copy of its columns along (``Sequence.kv``).

Everything here runs in inference mode: the cache and state tensors are only ever changed inside it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from dora.ids import Finish
from dora.rollout.engines.torch.adapters import Adapters
from dora.rollout.engines.torch.attention import Masks
from dora.rollout.engines.torch.graphs import DecodeGraphs
from dora.rollout.engines.torch.sampling import STOPPED, outcome, sample, seed_halves, uniform_host
from dora.rollout.engines.torch.slots import SlotCache

TOK, POS, DRAW, LO, HI, LAST, LANE = range(7)
"""Columns of the per-slot integer state."""
TEMP, TOP_P = range(2)
"""Columns of the per-slot float state."""
HOST_DRAWS = 16
"""On a CPU, a decode step of fewer rows draws its uniforms in Python (``sampling.uniform_host``)."""
NO_LIMIT = 1 << 62
"""The LAST of a slot no sequence ever used."""


def agree(replayed: torch.Tensor, eager: torch.Tensor) -> bool:
    """Whether a graph's outputs (tokens, log-probs, outcomes per row) are the eager step's, to rounding: nine rows
    in ten draw the same token (a draw at a token's edge may go either way), their log-probs within 0.1."""
    same = replayed[0] == eager[0]
    close = (replayed[1] - eager[1]).abs()[same]
    return int(same.sum()) * 10 >= 9 * len(same) and bool((close < 0.1).all())


class Running:
    def __init__(self, model: torch.nn.Module, device: torch.device, slots: int, max_len: int, kernel: str,
                 cuda_graphs: bool | None = None, adapters: Adapters | None = None) -> None:  # fmt: skip
        """``max_len``: the model's limit on positions; ``kernel``: its own attention implementation (the masks'
        form); ``cuda_graphs``: decode steps replay CUDA graphs (None: on a CUDA device); ``adapters``: a LoRA
        run's adapter versions, each row run under its sequence's."""
        self.adapters = adapters
        self.model = model
        self.device = device
        self.slots = slots
        self.max_len = max_len
        self.seqs: list[Any] = []
        """The running sequences, in slot order."""
        self.made = 0
        """Tokens sampled so far."""
        self.cache = SlotCache(slots, device)
        self.masks = Masks(model, kernel)
        self.keep_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.ints = torch.zeros((slots, 7), dtype=torch.long, device=device)
        self.ints[:, LAST] = NO_LIMIT
        self.floats = torch.ones((slots, 2), dtype=torch.float32, device=device)
        self.stops = torch.full((slots, 8), -1, dtype=torch.long, device=device)
        self.out = torch.zeros((3, slots), dtype=torch.float64, device=device)
        """A step's tokens, log-probs and outcomes, per slot: what comes back to the host."""
        self.nucleus = 0
        """Running sequences with top_p < 1 (their batch sorts its probabilities)."""
        self.greedy = 0
        """Running sequences with temperature 0 (their batch takes an argmax; a graph always does)."""
        graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.graphs = DecodeGraphs(self._decode_rows, device, slots) if graphs else None

    def __len__(self) -> int:
        return len(self.seqs)

    # ------------------------------------------------------------------ joining

    @torch.inference_mode()
    def admit(self, joining: list[Any], stops: frozenset[int]) -> list[Any]:
        """Give each of ``joining`` a slot and its cache there, and sample the first token of fresh ones. Returns
        those that ended at their first token (they hold no slot)."""
        rows: dict[tuple[int | None, tuple[int, ...]], list[Any]] = {}
        caught, ready = [], []
        for s in joining:
            if s.kv is None:  # fresh, or re-prefilled from prompt + prefix: one row per version and prefix
                prefix = tuple(s.prompt + s.tokens[:-1] if s.tokens else s.prompt)
                rows.setdefault((s.version, prefix), []).append(s)
            elif s.kv[0][0].shape[1] < s.positions:
                caught.append(s)
            else:
                ready.append(s)
        leaders = [same[0] for same in rows.values()]
        fills = sorted(leaders + caught, key=lambda s: 0 if s.kv is None else s.kv[0][0].shape[1])
        followers = [s for same in rows.values() for s in same[1:]]
        base = len(self.seqs)
        self.seqs += fills + followers + ready
        slot = {id(s): i for i, s in enumerate(self.seqs[base:], base)}
        self._reserve(max(self._columns(s) for s in joining))
        self._state(base, stops)
        have = [0 if s.kv is None else s.kv[0][0].shape[1] for s in fills]
        for s in fills + ready:
            if s.kv is not None:
                self.cache.write(slot[id(s)], s.kv)
                s.kv = None
        logits = self._fill(base, fills, have)
        for (_, prefix), same in rows.items():
            if len(same) > 1:
                at = slot[id(same[1])]
                self.cache.share(slot[id(same[0])], slice(at, at + len(same) - 1), len(prefix))
        fresh = [(slot[id(s)], logits[id(same[0])]) for same in rows.values() for s in same if not s.tokens]
        if not fresh:
            return []
        index = torch.tensor([i for i, _ in fresh], device=self.device)
        self._sample(index, torch.stack([row for _, row in fresh]), bool(self.nucleus), bool(self.greedy))
        return self._took(index, [i for i, _ in fresh])

    def _reserve(self, columns: int) -> None:
        """Grow the cache to ``columns`` (the graphs read the old buffers: they are made anew)."""
        if columns > self.cache.capacity:
            self.cache.reserve(columns)
            self._reset_graphs()

    def _columns(self, s: Any) -> int:
        """The cache columns ``s`` may need: its positions until its limit (and a fill's padded ones: see _fill)."""
        return min(len(s.prompt) + self._limit(s), self.max_len) + 1

    def _limit(self, s: Any) -> int:
        """The index past which ``s`` may not draw in this turn."""
        return min(s.turn_start + s.max_tokens, self.max_len - len(s.prompt))

    def _state(self, base: int, stops: frozenset[int]) -> None:
        """Write the device state of the sequences in slots ``base..``."""
        joined = self.seqs[base:]
        held = self.adapters.versions if self.adapters is not None else None
        lane = (lambda s: 0) if held is None else (lambda s: held.of(s.version))
        ints = torch.tensor([[s.tokens[-1] if s.tokens else 0, s.positions, len(s.tokens), *seed_halves(s.seed),
                              self._limit(s) - 1, lane(s)] for s in joined], dtype=torch.long)  # fmt: skip
        floats = torch.tensor([[s.temperature, s.top_p] for s in joined], dtype=torch.float32)
        ids = [sorted(stops | s.stops) for s in joined]
        width = max(map(len, ids))
        if width > self.stops.shape[1]:  # a wider table (the graphs read the old one: they are made anew)
            self.stops = torch.full((self.slots, 1 << (width - 1).bit_length()), -1, dtype=torch.long,
                                    device=self.device)  # fmt: skip
            self._reset_graphs()
            self._state_stops(0, [sorted(stops | s.stops) for s in self.seqs])
        else:
            self._state_stops(base, ids)
        self.ints[base : base + len(joined)] = ints.to(self.device)
        self.floats[base : base + len(joined)] = floats.to(self.device)
        self.nucleus += sum(s.top_p < 1.0 for s in joined)
        self.greedy += sum(s.temperature <= 0 for s in joined)

    def _state_stops(self, base: int, ids: list[list[int]]) -> None:
        table = torch.full((len(ids), self.stops.shape[1]), -1, dtype=torch.long)
        for b, row in enumerate(ids):
            table[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        self.stops[base : base + len(ids)] = table.to(self.device)

    def _fill(self, base: int, fills: list[Any], have: list[int]) -> dict[int, torch.Tensor]:
        """Feed each of ``fills`` (slots ``base..``, ordered by how much cache each has: ``have``) the tokens its
        cache lacks, but the newest sampled one (a fresh sample's: its whole prompt); the last logits of each row, by
        ``id`` of its sequence."""
        if not fills:
            return {}
        if self.masks.shared_offset_only:  # one forward per starting column
            out: dict[int, torch.Tensor] = {}
            start = 0
            for end in range(1, len(fills) + 1):
                if end == len(fills) or have[end] != have[start]:
                    out.update(self._fill_rows(base + start, fills[start:end], have[start:end]))
                    start = end
            return out
        return self._fill_rows(base, fills, have)

    def _fill_rows(self, base: int, fills: list[Any], have: list[int]) -> dict[int, torch.Tensor]:
        feeds = [(s.prompt + s.tokens)[h : s.positions] if s.tokens else s.prompt[h:] for s, h in zip(fills, have,
                 strict=True)]  # fmt: skip
        query = max(map(len, feeds))
        ids = torch.zeros((len(fills), query), dtype=torch.long)
        for b, feed in enumerate(feeds):
            ids[b, : len(feed)] = torch.tensor(feed, dtype=torch.long)
        starts = torch.tensor(have, dtype=torch.long)
        at = starts[:, None] + torch.arange(query)[None, :]
        width = max(have) + query
        self._reserve(width)
        at = at.to(self.device)
        kwargs: dict[str, Any] = {}
        if len(set(have)) > 1:
            kwargs["attention_mask"] = self.masks.rows(starts.to(self.device), query, width)
        if self.masks.positions:
            kwargs["position_ids"] = at.clamp(max=self.max_len - 1)  # a padded query past the model's limit
        last = torch.tensor([len(f) - 1 for f in feeds])
        keep = torch.unique(last)
        if self.keep_logits:
            kwargs["logits_to_keep"] = keep.to(self.device)
        self.cache.plan(slice(base, base + len(fills)), at, width)
        logits = self._forward(slice(base, base + len(fills)), input_ids=ids.to(self.device), **kwargs)
        pick = torch.searchsorted(keep, last) if self.keep_logits else last
        return {id(s): logits[b, int(pick[b])] for b, s in enumerate(fills)}

    # ------------------------------------------------------------------ decoding

    @torch.inference_mode()
    def decode(self) -> list[Any]:
        """One token for every running sequence. Returns those that ended (they left their slots)."""
        n = len(self.seqs)
        nucleus = bool(self.nucleus)
        graph, fresh = (None, False) if self.graphs is None else self.graphs.lookup(n, self.cache.capacity, nucleus)
        if graph is not None:
            graph.replay()
        if graph is None or fresh:
            replayed = self.out[:, :n].clone() if fresh else None
            lo, hi = min(s.positions for s in self.seqs), max(s.positions for s in self.seqs)
            self._decode_rows(n, hi + 1, nucleus, masked=lo != hi, greedy=bool(self.greedy), draws=self.seqs)
            if replayed is not None and not agree(replayed, self.out[:, :n]):
                assert self.graphs is not None  # a fresh graph
                self.graphs.disable("a graph's first replay differed from the eager step")
        return self._took(slice(0, n), range(n))

    def _decode_rows(self, rows: int, width: int, nucleus: bool, masked: bool = True, greedy: bool = True,
                     draws: list[Any] | None = None) -> None:  # fmt: skip
        """The decode forward of slots ``0..rows-1``, reading ``width`` columns; its samples into ``self.out``. Not
        ``masked``: every row stands at column ``width - 1`` (a group in step), so transformers' own causal mask is
        each row's, and attention needs no mask at all. ``greedy``: some row may have temperature 0."""
        pos = self.ints[:rows, POS]
        self.cache.plan(slice(0, rows), pos[:, None], width)
        kwargs: dict[str, Any] = {"position_ids": pos[:, None]} if self.masks.positions else {}
        if masked:
            kwargs["attention_mask"] = self.masks.rows(pos, 1, width)
        logits = self._forward(slice(0, rows), input_ids=self.ints[:rows, TOK : TOK + 1], **kwargs)
        self._sample(slice(0, rows), logits[:, -1], nucleus, greedy, draws)

    def _forward(self, rows: slice, **kwargs: Any) -> torch.Tensor:
        """The model's logits for the batch of slots ``rows`` (the cache planned), each row under its version."""
        if self.adapters is None:
            return self.model(past_key_values=self.cache, use_cache=True, **kwargs).logits
        self.adapters.use(self.ints[rows, LANE])
        try:
            return self.model(past_key_values=self.cache, use_cache=True, **kwargs).logits
        finally:
            self.adapters.use(None)

    def _sample(self, rows: slice | torch.Tensor, logits: torch.Tensor, nucleus: bool, greedy: bool,
                draws: list[Any] | None = None) -> None:  # fmt: skip
        """Sample ``rows``' next tokens into ``self.out``. ``draws``: their sequences, when a CPU draws their
        uniforms one by one in Python (fewer than HOST_DRAWS: cheaper than the vectorised ops)."""
        ints, floats = self.ints[rows], self.floats[rows]
        u = None
        if draws is not None and len(draws) < HOST_DRAWS and self.device.type == "cpu":
            u = torch.tensor([uniform_host(s.seed, len(s.tokens)) for s in draws], dtype=torch.float64)
        token, logp = sample(logits, floats[:, TEMP], floats[:, TOP_P] if nucleus else None, ints[:, LO],
                             ints[:, HI], ints[:, DRAW], greedy, u)  # fmt: skip
        code = outcome(token, self.stops[rows], ints[:, DRAW], ints[:, LAST])
        if isinstance(rows, slice):  # the step's three rows, as float64: back to the host in one transfer
            self.out[0, rows], self.out[1, rows], self.out[2, rows] = token, logp, code
        else:
            self.out[:, rows] = torch.stack([token.double(), logp.double(), code.double()])

    def _took(self, rows: slice | torch.Tensor, slots: Any) -> list[Any]:
        """Advance the state of the sampled ``rows`` and append their tokens on the host; release those that ended."""
        self.ints[rows, TOK] = self.out[0, rows].long()
        self.ints[rows, POS : DRAW + 1] += 1
        tokens, logps, codes = self.out[:, rows].tolist()  # the step's one transfer to the host
        ended = []
        for i, token, logp, code in zip(slots, tokens, logps, codes, strict=True):
            s = self.seqs[i]
            s.tokens.append(int(token))
            s.logprobs.append(logp)
            s.mask.append(1)
            if code:
                s.finish = Finish.STOP if code == STOPPED else Finish.LENGTH
                ended.append(i)
        self.made += len(tokens)
        if not ended:
            return []
        done = [self.seqs[i] for i in ended]
        self.release(ended, lambda s: s.keep_kv)
        return done

    # ------------------------------------------------------------------ leaving

    @torch.inference_mode()
    def release(self, slots: list[int], keep: Callable[[Any], bool]) -> None:
        """Free ``slots``; a sequence ``keep`` accepts takes a copy of its cache along. The last running sequences
        move into the freed slots below them (their cache columns and state rows), so the batch stays packed."""
        if not slots:
            return
        for i in slots:
            s = self.seqs[i]
            if keep(s):
                s.kv = self.cache.read(i, s.positions)
            self.nucleus -= s.top_p < 1.0
            self.greedy -= s.temperature <= 0
        gone = set(slots)
        n = len(self.seqs) - len(gone)
        holes = sorted(i for i in gone if i < n)
        movers = [i for i in range(n, len(self.seqs)) if i not in gone]
        if holes:
            self.cache.move(movers, holes, max(self.seqs[i].positions for i in movers) + 1)
            src, dst = torch.tensor(movers, device=self.device), torch.tensor(holes, device=self.device)
            for state in (self.ints, self.floats, self.stops):
                state[dst] = state[src]
            for h, m in zip(holes, movers, strict=True):
                self.seqs[h] = self.seqs[m]
        del self.seqs[n:]

    @torch.inference_mode()
    def take(self, match: Callable[[Any], bool], keep: Callable[[Any], bool]) -> list[Any]:
        """Remove the running sequences ``match`` accepts (see ``release``); returns them."""
        slots = [i for i, s in enumerate(self.seqs) if match(s)]
        taken = [self.seqs[i] for i in slots]
        self.release(slots, keep)
        return taken

    def drop(self) -> list[Any]:
        """Every running sequence leaves without its cache, and the cache's memory goes back (a sleep)."""
        held, self.seqs, self.nucleus, self.greedy = self.seqs, [], 0, 0
        self.cache.free()
        self._reset_graphs()
        return held

    def _reset_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.clear()
