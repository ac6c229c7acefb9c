"""Sampling on the device: counter-based uniforms, temperature, top-p, behaviour log-probs and stops, for a batch.

- **Counter-based randomness.** The uniform a sequence draws for its token at index ``t`` (its place in the
  sequence's tokens) is ``uniform(seed, t)``: a pure function of the sequence's 63-bit seed and ``t``, computed with
  integer tensor ops over the whole batch, on the device. So a sequence draws the same numbers whatever batch it
  shares, whichever worker it migrated to, and after a re-prefill: its state is its seed, nothing more (the index is
  where it stands). ``uniform`` is three rounds of a 32-bit integer mixer (Wellons' ``lowbias32``) keyed by the two
  halves of the seed, kept in int64 so that no product can overflow (a constant of 32 bits is split so each product
  stays below 2^63: the same numbers on a CPU and on a GPU), and its 32 bits are a float64 in [0, 1).
  ``uniform_host`` is the same function in plain Python, the reference the tests hold it to.
- **The draw.** Inverse CDF (summed in float64) over ``softmax(logits / temperature)``, renormalised over the top-p
  nucleus where a row has ``top_p < 1`` (the smallest set of most likely tokens whose mass reaches ``top_p``);
  temperature 0 is greedy. The behaviour log-prob of the token is its log-probability under the distribution it was
  drawn from (vLLM's ``processed_logprobs``).
- **Stops.** Each row ends on any of its stop ids (a ``-1``-padded table: the model's and the request's) or when its
  token index reaches its limit (``max_tokens`` in the turn, or the model's length). The outcome is a code per row:
  0 runs on, 1 stopped (STOP), 2 reached its limit (LENGTH).
"""

from __future__ import annotations

import numpy as np
import torch

MASK32 = 0xFFFFFFFF
MIX_A = 0x7FEB352D
"""lowbias32's first multiplier (below 2^31: the product of a 32-bit value by it fits in int64)."""
MIX_B = 0x846CA68B
"""Its second (at or above 2^31: multiplied as ``x * (MIX_B - 2^31) + (x & 1) << 31``, which is the same mod 2^32)."""
GOLDEN = 0x9E3779B9
"""Added to the first round's input, so that seed 0 at index 0 is not the mixer's fixed point 0."""
RUNS, STOPPED, REACHED = 0, 1, 2


def _mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding 32-bit values (every intermediate below 2^63)."""
    x = x ^ (x >> 16)
    x = (x * MIX_A) & MASK32
    x = x ^ (x >> 15)
    x = (x * (MIX_B - (1 << 31)) + ((x & 1) << 31)) & MASK32
    return x ^ (x >> 16)


def uniform(seed_lo: torch.Tensor, seed_hi: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Per row, the uniform in [0, 1) of the draw at ``index`` of the sequence seeded ``seed_hi << 32 | seed_lo``
    (int64 tensors of one shape; float64 out, 32 bits). On a CPU in numpy (unsigned arithmetic: a few array ops
    where torch's signed int64 takes five times as many small kernels), elsewhere in torch ops: the same numbers."""
    if index.device.type == "cpu":
        return torch.from_numpy(_uniform_numpy(seed_lo.numpy(), seed_hi.numpy(), index.numpy()))
    return uniform_tensor(seed_lo, seed_hi, index)


def uniform_tensor(seed_lo: torch.Tensor, seed_hi: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``uniform`` in torch int64 ops, on the tensors' device (inside a CUDA graph too)."""
    x = _mix((((index & MASK32) ^ seed_lo) + GOLDEN) & MASK32)
    x = _mix(x ^ seed_hi)
    x = _mix((x + seed_lo) & MASK32)
    return x.to(torch.float64) * (1.0 / (1 << 32))


def _mix_numpy(x: np.ndarray) -> np.ndarray:
    """lowbias32 on uint64 arrays holding 32-bit values (a product of two 32-bit values fits in 64 bits)."""
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(MIX_A)) & np.uint64(MASK32)
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(MIX_B)) & np.uint64(MASK32)
    return x ^ (x >> np.uint64(16))


def _uniform_numpy(seed_lo: np.ndarray, seed_hi: np.ndarray, index: np.ndarray) -> np.ndarray:
    mask = np.uint64(MASK32)
    lo, hi = seed_lo.view(np.uint64), seed_hi.view(np.uint64)  # non-negative int64: the same bits
    x = _mix_numpy((((index.view(np.uint64) & mask) ^ lo) + np.uint64(GOLDEN)) & mask)
    x = _mix_numpy(_mix_numpy(x ^ hi) + lo & mask)
    return x.astype(np.float64) * (1.0 / (1 << 32))


def _mix_host(x: int) -> int:
    x ^= x >> 16
    x = (x * MIX_A) & MASK32
    x ^= x >> 15
    x = (x * MIX_B) & MASK32
    return x ^ (x >> 16)


def uniform_host(seed: int, index: int) -> float:
    """``uniform`` for one draw, in plain Python integers: the reference."""
    lo, hi = seed & MASK32, seed >> 32
    x = _mix_host((((index & MASK32) ^ lo) + GOLDEN) & MASK32)
    x = _mix_host(_mix_host(x ^ hi) + lo & MASK32)
    return x / (1 << 32)


def seed_halves(seed: int) -> tuple[int, int]:
    """A 63-bit seed as the two int64 words ``uniform`` takes."""
    if not 0 <= seed < 1 << 63:
        raise ValueError(f"a sampler seed is 63 bits, got {seed}")
    return seed & MASK32, seed >> 32


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor | None, seed_lo: torch.Tensor,
           seed_hi: torch.Tensor, index: torch.Tensor, greedy: bool = True,
           u: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One token per row of ``logits`` [rows, vocab] and its behaviour log-prob (float32). ``top_p``: None when no row
    has one below 1 (the nucleus is then the whole vocabulary and its sort is skipped); ``greedy``: False when no row
    has temperature 0 (the argmax is skipped); ``u``: the rows' uniforms, drawn already (``uniform_host``)."""
    logp = torch.log_softmax(logits.float() / temperature.clamp_min(1e-6)[:, None], -1)
    probs = logp.exp()
    if top_p is not None:  # rows at top_p 1 keep every token and their numbers as they are, whatever the batch
        cut = top_p[:, None] < 1.0
        sorted_p, order = torch.sort(probs, descending=True, dim=-1)
        keep = (torch.cumsum(sorted_p, -1) - sorted_p < top_p[:, None]) | ~cut
        nucleus = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
        probs = torch.where(cut, nucleus, probs)
        logp = torch.where(cut, torch.log(nucleus / nucleus.sum(-1, keepdim=True)), logp)  # what is sampled from
    # the cumulative mass in float64 (the float32 probabilities summed all but exactly) and a 32-bit draw: a draw
    # never sits on the float32 grid the probabilities live on, so a tie with a token's edge, which a rounding
    # difference elsewhere in the batch could turn either way, does not happen
    cdf = torch.cumsum(probs, -1, dtype=torch.float64)
    u = uniform(seed_lo, seed_hi, index) if u is None else u
    # right=True: the first token whose cumulative mass exceeds u * total, so a draw of 0 never lands on a token of
    # no mass (one outside the nucleus)
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)
    chosen = torch.where(temperature <= 0, torch.argmax(logp, -1), drawn) if greedy else drawn
    return chosen, logp.gather(1, chosen[:, None]).squeeze(1)


def outcome(token: torch.Tensor, stops: torch.Tensor, index: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Per row: STOPPED if ``token`` is one of the row's ``stops`` [rows, k] (-1 pads), REACHED if its ``index`` is
    the ``last`` the row's limit allows, else RUNS (int64)."""
    stopped = (token[:, None] == stops).any(1)
    return torch.where(stopped, STOPPED, (index >= last) * REACHED)
