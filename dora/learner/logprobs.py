"""Log-probs of sampled tokens, a chunk of positions at a time: no full-vocabulary float32 tensor.

The learner needs, at every trained position, ``log p(token) = z[token] / T - logsumexp(z / T)`` of the logits
``z`` at the rollout temperature ``T``. Done plainly (``log_softmax(logits.float() / T)``) that is a float32
[B, T, V] tensor, and autograd keeps it for the backward: at a 152K vocabulary and 16K tokens a micro-batch,
10 GB each. Here positions go a chunk at a time (at most ``chunk_bytes`` of float32 logits), and a custom
backward recomputes each chunk's softmax instead of keeping it, so the float32 tensors alive at once are one
chunk's. Besides the log-prob, each chunk gives the tempered distribution's entropy, and, with ``top_p < 1``, the
log-prob under the nucleus the engines sampled from (``Stats``; the nucleus costs a sort of the chunk, about twice
its bytes more). Two entries, each with a ``*_stats`` twin that returns all three:

- ``sampled_logprobs(logits, tokens)``: from logits a model made, in its dtype (only a chunk is upcast).
- ``head_logprobs(hidden, weight, tokens)``: from the last hidden states and the output embedding. The logits
  themselves are made a chunk at a time (and remade in the backward), so not even the model's dtype holds them
  whole. The matrix products run in ``dtype`` (autocast's, or the weight's), the softmax in float32; Gemma 2's
  final logit soft-capping (``cap x tanh(z / cap)``) is applied per chunk, in float32.

Both are exact: values and gradients are the plain computation's, to float rounding (tests/unit/
test_learner_speed.py compares them, float32 and bfloat16, at a temperature other than 1; tests/unit/
test_objectives.py the nucleus and the entropy). Which one the
trainer uses for a model is ``dora.learner.scoring``'s choice.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

CHUNK_BYTES = 256 << 20
"""Float32 logits made at once by default: 256 MiB, e.g. 441 positions of a 152K vocabulary."""


def chunk_rows(vocab: int, chunk_bytes: int) -> int:
    """Positions per chunk: as many as keep a chunk's float32 logits within ``chunk_bytes`` (at least one)."""
    return max(1, chunk_bytes // (4 * vocab))


class Stats(NamedTuple):
    """Per scored position (float32 [N] each): the sampled token's log-prob under the distribution the engines
    sample from (temperature, then the ``top_p`` nucleus, renormalised), the same under the tempered distribution
    over the whole vocabulary, and that distribution's entropy.

    A sampled token the learner's nucleus leaves out (its weights have moved, or float rounding put it just past
    the nucleus's edge) is scored over the nucleus with it added: the engine's nucleus held it. So a token at the
    edge never turns a ratio into 0 or infinity, and the value is continuous as the token crosses the edge."""

    logp: torch.Tensor
    full: torch.Tensor
    entropy: torch.Tensor


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float = 1.0, top_p: float = 1.0,
                     chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:  # fmt: skip
    """``log_softmax(logits.float() / temperature)`` at ``tokens`` (over the ``top_p`` nucleus when below 1): logits
    [N, V] (any float dtype), tokens [N] -> float32 [N], differentiable with respect to the logits (their gradient
    comes in their dtype)."""
    return sampled_stats(logits, tokens, temperature=temperature, top_p=top_p, chunk_bytes=chunk_bytes).logp


def sampled_stats(logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float = 1.0, top_p: float = 1.0,
                  chunk_bytes: int = CHUNK_BYTES) -> Stats:  # fmt: skip
    """``Stats`` from logits [N, V]; each of the three is differentiable with respect to the logits."""
    if logits.shape[0] == 0:
        zero = logits.new_zeros(0, dtype=torch.float32) + 0 * logits.sum()
        return Stats(zero, zero.clone(), zero.clone())
    rows = chunk_rows(logits.shape[-1], chunk_bytes)
    return Stats(*_FromLogits.apply(logits, tokens, float(temperature), float(top_p), rows))


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, *,
                  bias: torch.Tensor | None = None, softcap: float | None = None, temperature: float = 1.0,
                  top_p: float = 1.0, dtype: torch.dtype | None = None,
                  chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:  # fmt: skip
    """The log-probs of ``tokens`` under the logits ``hidden @ weight.T + bias`` (soft-capped at ``softcap``,
    then divided by ``temperature``, then cut to the ``top_p`` nucleus): hidden [N, H], weight [V, H], tokens [N]
    -> float32 [N]. The products run in ``dtype`` (default: the weight's), as a linear layer under autocast would;
    differentiable with respect to ``hidden``, ``weight`` and ``bias``."""
    return head_stats(hidden, weight, tokens, bias=bias, softcap=softcap, temperature=temperature, top_p=top_p,
                      dtype=dtype, chunk_bytes=chunk_bytes).logp  # fmt: skip


def head_stats(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, *, bias: torch.Tensor | None = None,
               softcap: float | None = None, temperature: float = 1.0, top_p: float = 1.0,
               dtype: torch.dtype | None = None, chunk_bytes: int = CHUNK_BYTES) -> Stats:  # fmt: skip
    """``Stats`` from the last hidden states and the output embedding (as ``head_logprobs``)."""
    dtype = weight.dtype if dtype is None else dtype
    if hidden.shape[0] == 0:
        zero = hidden.new_zeros(0, dtype=torch.float32) + 0 * (hidden.sum() + weight.sum())
        return Stats(zero, zero.clone(), zero.clone())
    rows = chunk_rows(weight.shape[0], chunk_bytes)
    return Stats(*_FromHead.apply(hidden, weight, bias, tokens, float(temperature), float(top_p), softcap, dtype, rows))


def _no_autocast(t: torch.Tensor) -> Any:
    return torch.autocast(t.device.type, enabled=False)


class _Chunk:
    """The per-chunk arithmetic both paths share, on ``z``: a chunk's float32 logits already divided by T.

    Forward: the full logsumexp ``lse`` and entropy ``H = lse - sum(p z)``; with ``top_p < 1`` the nucleus as the
    engines cut it (tokens by probability, most likely first, while the mass before a token is below ``top_p``),
    kept as the smallest logit in it (``z_min``: the nucleus is ``z >= z_min``, with the sampled token added), and
    its logsumexp ``lse_k``. Backward, per position, for upstream gradients ``g`` of the three outputs (each may be
    absent): ``d logp/dz = onehot - softmax over the nucleus``, ``d full/dz = onehot - p``,
    ``d H/dz = -p (z - sum(p z))``."""

    @staticmethod
    def forward(z: torch.Tensor, tokens: torch.Tensor, top_p: float) -> tuple[torch.Tensor, ...]:
        lse = torch.logsumexp(z, -1)
        picked = z.gather(1, tokens[:, None]).squeeze(1)
        full = picked - lse
        p = (z - lse[:, None]).exp_()
        entropy = lse - (p * z).sum(-1)
        if top_p >= 1.0:
            return full, full, entropy, lse, lse, picked.new_full(picked.shape, float("-inf"))
        sorted_p, order = torch.sort(p, descending=True, dim=-1)
        inside = (torch.cumsum(sorted_p, -1) - sorted_p < top_p).sum(-1)  # >= 1: the first's mass before is 0
        z_min = z.gather(1, order.gather(1, (inside - 1)[:, None])).squeeze(1)
        lse_k = torch.logsumexp(z.masked_fill(z < z_min[:, None], float("-inf")), -1)
        lse_k = torch.where(picked >= z_min, lse_k, torch.logaddexp(lse_k, picked))  # the token added
        return picked - lse_k, full, entropy, lse, lse_k, z_min

    @staticmethod
    def backward(z: torch.Tensor, tokens: torch.Tensor, grads: tuple[torch.Tensor | None, ...], lse: torch.Tensor,
                 entropy: torch.Tensor, lse_k: torch.Tensor, z_min: torch.Tensor, truncated: bool) -> torch.Tensor:  # fmt: skip
        """The gradient with respect to ``z`` (``z`` is overwritten). ``grads``: the chunk's upstream gradients of
        (logp, full, entropy), each [n, 1] float32 or None."""
        g_logp, g_full, g_ent = grads
        if g_full is None and g_ent is None and not truncated:  # the plain log-prob: in place, a single tensor
            assert g_logp is not None
            d = z.sub_(lse[:, None]).exp_().mul_(-g_logp)
            return d.scatter_add_(1, tokens[:, None], g_logp)
        d = torch.zeros_like(z)
        p = (z - lse[:, None]).exp()
        if g_ent is not None:
            d.sub_(p * (z - (lse - entropy)[:, None]) * g_ent)
        if g_full is not None:
            d.sub_(p * g_full).scatter_add_(1, tokens[:, None], g_full)
        if g_logp is not None:
            if truncated:
                outside = (z < z_min[:, None]).scatter_(1, tokens[:, None], False)
                nucleus = (z - lse_k[:, None]).exp_().masked_fill_(outside, 0.0)
                d.sub_(nucleus * g_logp).scatter_add_(1, tokens[:, None], g_logp)
            else:
                d.sub_(p * g_logp).scatter_add_(1, tokens[:, None], g_logp)
        return d


def _gathered(grads: tuple[torch.Tensor | None, ...], s: int, rows: int) -> tuple[torch.Tensor | None, ...]:
    return tuple(None if g is None else g[s : s + rows, None].float() for g in grads)


class _FromLogits(torch.autograd.Function):
    """Forward: per chunk, the float32 logits over T and ``_Chunk.forward``. Backward: per chunk, the logits over T
    made again and ``_Chunk.backward``, divided by T."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, tokens: torch.Tensor, temperature: float, top_p: float,
                rows: int) -> tuple[torch.Tensor, ...]:  # fmt: skip
        n = logits.shape[0]
        out = [torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(6)]
        with _no_autocast(logits):
            for s in range(0, n, rows):
                z = logits[s : s + rows].float() / temperature
                for o, v in zip(out, _Chunk.forward(z, tokens[s : s + rows], top_p), strict=True):
                    o[s : s + rows] = v
        logp, full, entropy, lse, lse_k, z_min = out
        ctx.save_for_backward(logits, tokens, lse, entropy, lse_k, z_min)
        ctx.temperature, ctx.rows, ctx.top_p = temperature, rows, top_p
        ctx.set_materialize_grads(False)
        return logp, full, entropy

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        logits, tokens, lse, entropy, lse_k, z_min = ctx.saved_tensors
        temperature, rows = ctx.temperature, ctx.rows
        out = torch.zeros_like(logits) if all(g is None for g in grads) else torch.empty_like(logits)
        with _no_autocast(logits):
            for s in range(0, logits.shape[0] if any(g is not None for g in grads) else 0, rows):
                z = logits[s : s + rows].float() / temperature
                d = _Chunk.backward(z, tokens[s : s + rows], _gathered(grads, s, rows), lse[s : s + rows],
                                    entropy[s : s + rows], lse_k[s : s + rows], z_min[s : s + rows], ctx.top_p < 1)  # fmt: skip
                out[s : s + rows] = d.div_(temperature)
        return out, None, None, None, None


class _FromHead(torch.autograd.Function):
    """As ``_FromLogits``, with each chunk's logits made from the hidden states (forward) and made again
    (backward), then back through the soft-cap (``1 - tanh^2``) and the product: the hidden states' gradient a
    chunk at a time, the weight's (and bias's) summed over the chunks in float32."""

    @staticmethod
    def _logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, softcap: float | None, dtype: torch.dtype,
                temperature: float) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """A chunk's logits over T in float32, and the tanh of the soft-cap (None without one)."""
        z = F.linear(h.to(dtype), w, b).float()
        if softcap is None:
            return z.div_(temperature), None
        t = torch.tanh(z.div_(softcap))
        return t * (softcap / temperature), t

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tokens: torch.Tensor,
                temperature: float, top_p: float, softcap: float | None, dtype: torch.dtype,
                rows: int) -> tuple[torch.Tensor, ...]:  # fmt: skip
        n = hidden.shape[0]
        out = [torch.empty(n, dtype=torch.float32, device=hidden.device) for _ in range(6)]
        with _no_autocast(hidden):
            w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
            for s in range(0, n, rows):
                z, _ = _FromHead._logits(hidden[s : s + rows], w, b, softcap, dtype, temperature)
                for o, v in zip(out, _Chunk.forward(z, tokens[s : s + rows], top_p), strict=True):
                    o[s : s + rows] = v
        logp, full, entropy, lse, lse_k, z_min = out
        ctx.save_for_backward(hidden, weight, bias, tokens, lse, entropy, lse_k, z_min)
        ctx.temperature, ctx.softcap, ctx.dtype, ctx.rows, ctx.top_p = temperature, softcap, dtype, rows, top_p
        ctx.set_materialize_grads(False)
        return logp, full, entropy

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        hidden, weight, bias, tokens, lse, entropy, lse_k, z_min = ctx.saved_tensors
        temperature, softcap, dtype, rows = ctx.temperature, ctx.softcap, ctx.dtype, ctx.rows
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        gh = torch.zeros_like(hidden) if need_h else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        gb = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b and bias is not None else None
        with _no_autocast(hidden):
            w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
            for s in range(0, hidden.shape[0] if any(g is not None for g in grads) else 0, rows):
                h = hidden[s : s + rows].to(dtype)
                z, t = _FromHead._logits(h, w, b, softcap, dtype, temperature)
                d = _Chunk.backward(z, tokens[s : s + rows], _gathered(grads, s, rows), lse[s : s + rows],
                                    entropy[s : s + rows], lse_k[s : s + rows], z_min[s : s + rows], ctx.top_p < 1)  # fmt: skip
                d.div_(temperature)
                if t is not None:
                    d.mul_(t.square_().neg_().add_(1))
                dz = d.to(dtype)
                if gh is not None:
                    gh[s : s + rows] = dz @ w
                if gw is not None:
                    gw.add_(dz.t() @ h)
                if gb is not None:
                    gb.add_(dz.sum(0))
        return (gh, None if gw is None else gw.to(weight.dtype), None if gb is None else gb.to(bias.dtype),
                None, None, None, None, None, None)  # fmt: skip
