"""Log-probs of sampled tokens, a chunk of positions at a time: no full-vocabulary float32 tensor.

The learner needs, at every trained position, ``log p(token) = z[token] / T - logsumexp(z / T)`` of the logits
``z`` at the rollout temperature ``T``. Done plainly (``log_softmax(logits.float() / T)``) that is a float32
[B, T, V] tensor, and autograd keeps it for the backward: at a 152K vocabulary and 16K tokens a micro-batch,
10 GB each. Here positions go a chunk at a time (at most ``chunk_bytes`` of float32 logits), and a custom
backward recomputes each chunk's softmax instead of keeping it, so the float32 tensors alive at once are one
chunk's. Two entries:

- ``sampled_logprobs(logits, tokens)``: from logits a model made, in its dtype (only a chunk is upcast).
- ``head_logprobs(hidden, weight, tokens)``: from the last hidden states and the output embedding. The logits
  themselves are made a chunk at a time (and remade in the backward), so not even the model's dtype holds them
  whole. The matrix products run in ``dtype`` (autocast's, or the weight's), the softmax in float32; Gemma 2's
  final logit soft-capping (``cap x tanh(z / cap)``) is applied per chunk, in float32.

Both are exact: values and gradients are the plain computation's, to float rounding (tests/unit/
test_learner_speed.py compares them, float32 and bfloat16, at a temperature other than 1). Which one the
trainer uses for a model is ``dora.learner.scoring``'s choice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

CHUNK_BYTES = 256 << 20
"""Float32 logits made at once by default: 256 MiB, e.g. 441 positions of a 152K vocabulary."""


def chunk_rows(vocab: int, chunk_bytes: int) -> int:
    """Positions per chunk: as many as keep a chunk's float32 logits within ``chunk_bytes`` (at least one)."""
    return max(1, chunk_bytes // (4 * vocab))


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float = 1.0,
                     chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:  # fmt: skip
    """``log_softmax(logits.float() / temperature)`` at ``tokens``: logits [N, V] (any float dtype), tokens [N]
    -> float32 [N], differentiable with respect to the logits (their gradient comes in their dtype)."""
    if logits.shape[0] == 0:
        return logits.new_zeros(0, dtype=torch.float32) + 0 * logits.sum()
    return _FromLogits.apply(logits, tokens, float(temperature), chunk_rows(logits.shape[-1], chunk_bytes))


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, *,
                  bias: torch.Tensor | None = None, softcap: float | None = None, temperature: float = 1.0,
                  dtype: torch.dtype | None = None, chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:  # fmt: skip
    """The log-probs of ``tokens`` under the logits ``hidden @ weight.T + bias`` (soft-capped at ``softcap``,
    then divided by ``temperature``): hidden [N, H], weight [V, H], tokens [N] -> float32 [N]. The products run
    in ``dtype`` (default: the weight's), as a linear layer under autocast would; differentiable with respect to
    ``hidden``, ``weight`` and ``bias``."""
    dtype = weight.dtype if dtype is None else dtype
    if hidden.shape[0] == 0:
        return hidden.new_zeros(0, dtype=torch.float32) + 0 * (hidden.sum() + weight.sum())
    rows = chunk_rows(weight.shape[0], chunk_bytes)
    return _FromHead.apply(hidden, weight, bias, tokens, float(temperature), softcap, dtype, rows)


def _no_autocast(t: torch.Tensor) -> Any:
    return torch.autocast(t.device.type, enabled=False)


class _FromLogits(torch.autograd.Function):
    """Forward: per chunk, the float32 logits over T, their logsumexp and the sampled one. Backward: per chunk,
    ``d/dz = g x (onehot(token) - softmax(z / T)) / T``, the softmax remade from the logsumexp kept."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, tokens: torch.Tensor, temperature: float, rows: int) -> torch.Tensor:
        out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        with _no_autocast(logits):
            for s in range(0, logits.shape[0], rows):
                z = logits[s : s + rows].float() / temperature
                lse[s : s + rows] = torch.logsumexp(z, -1)
                out[s : s + rows] = z.gather(1, tokens[s : s + rows, None]).squeeze(1) - lse[s : s + rows]
        ctx.save_for_backward(logits, tokens, lse)
        ctx.temperature, ctx.rows = temperature, rows
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        logits, tokens, lse = ctx.saved_tensors
        temperature, rows = ctx.temperature, ctx.rows
        out = torch.empty_like(logits)
        with _no_autocast(logits):
            for s in range(0, logits.shape[0], rows):
                g = grad[s : s + rows, None].float()
                d = (logits[s : s + rows].float() / temperature).sub_(lse[s : s + rows, None]).exp_().mul_(-g)
                d.scatter_add_(1, tokens[s : s + rows, None], g).div_(temperature)
                out[s : s + rows] = d
        return out, None, None, None


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
                temperature: float, softcap: float | None, dtype: torch.dtype, rows: int) -> torch.Tensor:  # fmt: skip
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        with _no_autocast(hidden):
            w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
            for s in range(0, hidden.shape[0], rows):
                z, _ = _FromHead._logits(hidden[s : s + rows], w, b, softcap, dtype, temperature)
                lse[s : s + rows] = torch.logsumexp(z, -1)
                out[s : s + rows] = z.gather(1, tokens[s : s + rows, None]).squeeze(1) - lse[s : s + rows]
        ctx.save_for_backward(hidden, weight, bias, tokens, lse)
        ctx.temperature, ctx.softcap, ctx.dtype, ctx.rows = temperature, softcap, dtype, rows
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, bias, tokens, lse = ctx.saved_tensors
        temperature, softcap, dtype, rows = ctx.temperature, ctx.softcap, ctx.dtype, ctx.rows
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        gh = torch.empty_like(hidden) if need_h else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        gb = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b and bias is not None else None
        with _no_autocast(hidden):
            w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
            for s in range(0, hidden.shape[0], rows):
                h = hidden[s : s + rows].to(dtype)
                g = grad[s : s + rows, None].float()
                z, t = _FromHead._logits(h, w, b, softcap, dtype, temperature)
                d = z.sub_(lse[s : s + rows, None]).exp_().mul_(-g)
                d.scatter_add_(1, tokens[s : s + rows, None], g).div_(temperature)
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
                None, None, None, None, None)  # fmt: skip
