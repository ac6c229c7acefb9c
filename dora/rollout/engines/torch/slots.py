"""The torch engine's KV cache: one preallocated slot per running sequence, written in place.

Per layer, keys ``[slots, heads, capacity, dim]`` and values ``[slots, heads, capacity, dim']`` (keys and values are
each their own shape: DeepSeek's latent attention caches its compressed latent as keys and its rotary key as
values). A running sequence owns one slot, and the key of its token at position ``p`` lives at column ``p`` of that
slot: nothing is padded or shifted, so sequences join and leave without touching the others' caches. The running
sequences hold slots ``0..n-1`` (the engine keeps them packed: a sequence leaving from the middle is replaced by the
last one, whose cache moves into the freed slot), so a forward over them reads plain slices of the buffers.

What a forward sees (``SlotCache`` is a transformers ``Cache``): before each forward the engine ``plan``s it: which
slots are the batch's rows (a slice), the column each new key of each row goes to, and how many columns the
attention reads (``width``). ``update`` scatters the layer's new keys and values to their columns and returns the
rows' first ``width`` columns. Columns past a row's length hold zeros or stale keys of that slot; the attention mask
(``attention``) hides them. The buffers start zeroed: a masked column never holds a NaN that a zero
attention weight could turn into a NaN output.

Capacity grows to the next power of two when a sequence needs more columns (each layer copied once); ``free``
gives the memory back (an elastic worker's sleep).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""A sequence's own cache, outside a slot: per layer (keys [heads, positions, dim], values [heads, positions, dim'])."""


class SlotCache(Cache):
    def __init__(self, slots: int, device: torch.device) -> None:
        super().__init__(layers=[])
        self.slots = slots
        self.device = device
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._rows = slice(0, 0)
        self._at: torch.Tensor | None = None
        self._width = 0
        self._query = 0
        self._index: dict[tuple[int, ...], torch.Tensor] = {}
        """The scatter index of each shape of new keys, built once per forward."""

    # ------------------------------------------------------------------ what a forward sees

    def plan(self, rows: slice, at: torch.Tensor, width: int) -> None:
        """The next forward: its batch is slots ``rows``; ``at`` [rows, query] the column of each new token's key;
        the attention reads columns ``0..width-1``."""
        self._rows, self._at, self._width, self._query = rows, at, width, at.shape[1]
        self._index = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        if layer_idx >= len(self.keys):
            self._allocate(key_states, value_states)
        rows, width = self._rows, self._width
        for cache, new in ((self.keys[layer_idx], key_states), (self.values[layer_idx], value_states)):
            index = self._index.get(new.shape)  # one per shape and forward: every layer writes the same columns
            if index is None:
                assert self._at is not None  # planned
                index = self._index[new.shape] = self._at[:, None, :, None].expand(new.shape)
            cache[rows].scatter_(2, index, new if new.dtype == cache.dtype else new.to(cache.dtype))
        return self.keys[layer_idx][rows, :, :width], self.values[layer_idx][rows, :, :width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._width - self._query

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._width, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """Where transformers' own masks put the batch's first query: after the columns before it (one shared offset:
        the engine lets transformers build a mask only for batches whose rows all start at one column)."""
        return self._width - self._query

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.capacity

    @property
    def is_compileable(self) -> bool:
        return False

    def __len__(self) -> int:
        return len(self.keys)

    # ------------------------------------------------------------------ the engine's

    @property
    def allocated(self) -> bool:
        return bool(self.keys)

    def reserve(self, columns: int) -> None:
        """Make room for ``columns`` columns per slot (the capacity becomes the next power of two, at least 16)."""
        if columns <= self.capacity:
            return
        capacity = max(16, 1 << (columns - 1).bit_length())
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                grown = old.new_zeros((*old.shape[:2], capacity, old.shape[3]))
                grown[:, :, : self.capacity] = old
                buffers[i] = grown
        self.capacity = capacity

    def _allocate(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The next layer's buffers, shaped after its first keys and values ([.., heads, positions, dim])."""
        for buffers, like in ((self.keys, keys), (self.values, values)):
            buffers.append(torch.zeros((self.slots, like.shape[-3], self.capacity, like.shape[-1]), dtype=like.dtype,
                                       device=self.device))  # fmt: skip

    def write(self, slot: int, kv: KV) -> None:
        """Put a sequence's own cache into ``slot`` (columns from 0)."""
        for layer, (k, v) in enumerate(kv):
            if layer >= len(self.keys):
                self._allocate(k, v)
            n = k.shape[1]
            self.keys[layer][slot, :, :n] = k
            self.values[layer][slot, :, :n] = v

    def read(self, slot: int, length: int) -> KV:
        """A copy of the first ``length`` columns of ``slot``: a sequence's own cache, to keep or hand over."""
        pairs = zip(self.keys, self.values, strict=True)
        return [(k[slot, :, :length].clone(), v[slot, :, :length].clone()) for k, v in pairs]

    def share(self, source: int, targets: slice, length: int) -> None:
        """Copy the first ``length`` columns of slot ``source`` into the slots ``targets`` (a group's samples, whose
        prompt was prefilled once)."""
        for buffers in (self.keys, self.values):
            for b in buffers:
                b[targets, :, :length] = b[source, :, :length]

    def move(self, sources: list[int], targets: list[int], length: int) -> None:
        """Copy the first ``length`` columns of each of ``sources`` into the matching slot of ``targets``."""
        src = torch.tensor(sources, device=self.device)
        dst = torch.tensor(targets, device=self.device)
        for buffers in (self.keys, self.values):
            for b in buffers:
                b[dst, :, :length] = b[src, :, :length]

    def free(self) -> None:
        """Drop every buffer (their memory goes back to the allocator); the next write allocates anew."""
        self.keys, self.values, self.capacity = [], [], 0
