"""The torch trainer's scoring pass: a micro-batch's rows through a model, to the ``Stats`` of their sampled tokens.

A group's samples share their prompt, so each distinct prompt is run once, and every sample continues from its
prompt's keys and values (gradients flow back through them to the shared prompt pass, ``on_prompts``):
1. The distinct prompts, left-padded (position ids counted from each one's first token): their caches, and the
   last position, which predicts every sample's first token. Left, so each prompt's keys sit next to its samples'
   in the cache: a sliding window (Gemma 2, Mistral) counts cache slots.
2. Every sample's tokens but the last, on its prompt's cache: the positions predicting the rest. The attention
   mask leaves out the prompt's padding; position ids continue from the prompt's length.
Causal attention keeps every real position from seeing padding after it, so each sample computes what it would
alone (to float rounding). Only positions predicting a trained token (mask 1) are scored, a chunk at a time
(``dora.learner.scoring``); the rest are 0. A model that cannot be batched so (the trainer's ``whole_rows``) is
scored one whole row per sample instead (``as_whole_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dora.learner.logprobs import Stats
from dora.learner.scoring import Scorer
from dora.samples import TrainSample

Row = tuple[list[int], TrainSample, int]
"""A trajectory of a train batch: its prompt's ids, the sample, and its group's index in the batch."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Packed:
    """A micro-batch's rows as tensors: the distinct prompts [P, W], left-padded, and the samples [B, T]."""

    prompts: list[list[int]]
    """Each row's prompt."""
    which: torch.Tensor
    """Each row's distinct prompt."""
    plen: torch.Tensor
    """Each distinct prompt's length."""
    pids: torch.Tensor
    pattn: torch.Tensor
    lengths: list[int]
    """Each sample's tokens."""
    tokens: torch.Tensor
    beh: torch.Tensor
    """The behaviour log-probs."""
    real: torch.Tensor
    """Attended to: every token, an environment's too."""
    mask: torch.Tensor
    """Trained on: the model's tokens only."""


def packed(rows: list[Row]) -> Packed:
    distinct: dict[tuple[int, ...], int] = {}
    which = torch.tensor([distinct.setdefault(tuple(p), len(distinct)) for p, _, _ in rows])
    plen = torch.tensor([len(p) for p in distinct])
    width = int(plen.max())
    lengths = [len(s.token_ids) for _, s, _ in rows]
    longest = max(lengths)
    pids = torch.zeros((len(distinct), width), dtype=torch.long)
    pattn = torch.zeros((len(distinct), width), dtype=torch.long)
    for u, p in enumerate(distinct):
        pids[u, width - len(p) :] = torch.tensor(p)
        pattn[u, width - len(p) :] = 1
    tokens = torch.zeros((len(rows), longest), dtype=torch.long)
    beh = torch.zeros((len(rows), longest), dtype=torch.float32)
    real = torch.zeros((len(rows), longest), dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.float32)
    for b, ((_, s, _), n) in enumerate(zip(rows, lengths, strict=True)):
        tokens[b, :n] = torch.from_numpy(s.token_ids.astype("int64"))
        beh[b, :n] = torch.from_numpy(s.logprobs.astype("float32"))
        real[b, :n] = 1
        mask[b, :n] = 1 if s.loss_mask is None else torch.from_numpy(s.loss_mask.astype("float32"))
    return Packed(prompts=[p for p, _, _ in rows], which=which, plen=plen, pids=pids, pattn=pattn, lengths=lengths,
                  tokens=tokens, beh=beh, real=real, mask=mask)  # fmt: skip


def score(rows: list[Row], model: torch.nn.Module, scorer: Scorer, *, device: torch.device, whole_rows: bool,
          autocast: bool, sharded: bool) -> tuple[Stats, torch.Tensor, torch.Tensor, int]:  # fmt: skip
    """The ``Stats`` of the rows' sampled tokens under ``model``, the behaviour log-probs and the mask ([B, T] each,
    on ``device``), and the tokens the model's forward ran. ``autocast``: in bfloat16; ``sharded``: FSDP2's ranks,
    each running every pass."""
    p = packed(rows)
    at, pos = (p.mask > 0).nonzero(as_tuple=True)  # the trained positions: (sample, token)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        if whole_rows:
            scored, fed = as_whole_rows(p, model, scorer, at, pos, device)
        else:
            scored, at, pos, fed = on_prompts(p, model, scorer, at, pos, device, sharded=sharded)
    where, mask = (at.to(device), pos.to(device)), p.mask.to(device)
    stats = Stats(*(torch.zeros(p.mask.shape, dtype=torch.float32, device=device).index_put(where, x) * mask
                    for x in scored))  # fmt: skip
    return stats, p.beh.to(device), mask, fed


def as_whole_rows(p: Packed, model: torch.nn.Module, scorer: Scorer, at: torch.Tensor, pos: torch.Tensor,
                  dev: torch.device) -> tuple[Stats, int]:  # fmt: skip
    """The trained positions ``(at, pos)`` scored on one whole row per sample (``row_inputs``); the tokens fed."""
    ids, attn, starts = row_inputs(p.prompts, p.tokens, p.lengths)
    scored, _ = scorer(model, {"input_ids": ids.to(dev), "attention_mask": attn.to(dev), "use_cache": False},
                       at.to(dev), (starts[at] + pos).to(dev), p.tokens[at, pos].to(dev))  # fmt: skip
    return scored, int(attn.sum())


def on_prompts(p: Packed, model: torch.nn.Module, scorer: Scorer, at: torch.Tensor, pos: torch.Tensor,
               dev: torch.device, *, sharded: bool) -> tuple[Stats, torch.Tensor, torch.Tensor, int]:  # fmt: skip
    """The trained positions scored on the distinct prompts' caches: each sample's first token from its prompt's
    pass, the rest from the samples' pass. The Stats, the positions in the order scored, and the tokens fed."""
    from transformers import DynamicCache

    first = pos == 0
    at, pos = torch.cat([at[first], at[~first]]), torch.cat([pos[first], pos[~first]])
    n_first = int(first.sum())
    # a cache of every position (a model's own would keep only a sliding window's last ones)
    inputs = {"input_ids": p.pids.to(dev), "attention_mask": p.pattn.to(dev), "use_cache": True,
              "past_key_values": DynamicCache(),
              "position_ids": (p.pattn.cumsum(1) - 1).clamp(min=0).to(dev)}  # fmt: skip
    b = at[:n_first]
    firsts, out = scorer(model, inputs, p.which[b].to(dev), torch.full_like(b, p.pids.shape[1] - 1).to(dev),
                         p.tokens[b, 0].to(dev))  # fmt: skip
    fed_tokens = int(p.pattn.sum())
    scored = [firsts]
    # sharded, every rank runs both passes, even on completions of one token (then on that token)
    longest = p.tokens.shape[1]
    fed = max(longest - 1, 1 if sharded else 0)
    if fed:
        index = p.which.to(dev)
        cache = DynamicCache(ddp_cache_data=[(layer.keys[index], layer.values[index])
                                             for layer in out.past_key_values.layers])  # fmt: skip
        attn = torch.cat([p.pattn[p.which], p.real[:, :fed]], 1)
        inputs = {"input_ids": p.tokens[:, :fed].to(dev), "attention_mask": attn.to(dev),
                  "position_ids": (p.plen[p.which][:, None] + torch.arange(fed)[None]).to(dev),
                  "past_key_values": cache, "use_cache": True}  # fmt: skip
        b, t = at[n_first:], pos[n_first:]
        rest, _ = scorer(model, inputs, b.to(dev), (t - 1).to(dev), p.tokens[b, t].to(dev))
        fed_tokens += int(p.real[:, : longest - 1].sum())
        scored.append(rest)
    return Stats(*(torch.cat(parts) for parts in zip(*scored, strict=True))), at, pos, fed_tokens


def row_inputs(prompts: list[list[int]], tokens: torch.Tensor,
               lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """One right-padded row per sample: its prompt, then its tokens but the last (the prompt runs once per sample);
    the attention mask; and per sample the position predicting its first token (token t is predicted t positions
    after it). Each position sees only what precedes it, through attention or a recurrent state alike, so the
    padding after it changes nothing."""
    plen = torch.tensor([len(p) for p in prompts])
    ids = torch.zeros((len(prompts), int(plen.max()) + tokens.shape[1] - 1), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        fed = [*p, *tokens[b, : max(n - 1, 0)].tolist()]
        ids[b, : len(fed)] = torch.tensor(fed)
        attn[b, : len(fed)] = 1
    return ids, attn, plen - 1
