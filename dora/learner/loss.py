"""The policy loss: GRPO advantages and a PPO-clipped surrogate against each trajectory's own behaviour
log-probs, with DAPO's options. Pure tensor functions (no model, no process group).

Notation, per sampled token t of trajectory i in group g:

- Advantage ``A_i = (r_i - mean_g r) / (std_g r + eps)``, the same for every token of i. Without
  ``scale_by_std`` it is ``r_i - mean_g r``, as in Dr. GRPO.
- Ratio ``rho_t = exp(logp_theta(t) - logp_beh(t))``. ``logp_beh`` is the log-prob the rollout
  engine recorded when it sampled t, under the version that generated the trajectory. In an
  asynchronous run that version is up to K steps old: the ratio's denominator is the trajectory's own
  policy, never the learner's previous step.
- Surrogate ``l_t = -min(rho_t A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) A_i)``. Symmetric clipping
  is PPO/GRPO; DAPO raises ``eps_high`` ("clip higher").
- Reduction. Sequence-level (GRPO): mean over each trajectory's tokens, then over trajectories.
  Token-level (DAPO): the sum over all tokens / the number of tokens, so long answers weigh per token.
- Truncated importance weight (optional; for a trainer whose numerics differ from the engine's).
  Given the learner's own recomputation ``logp_old`` under the behaviour version's weights, the ratio
  becomes ``exp(logp_theta - logp_old)``, and each token is weighted by
  ``min(exp(logp_old - logp_beh), tis_cap)``.
- Group filtering (DAPO dynamic sampling). A group whose rewards are all equal has zero advantage
  and contributes nothing. With ``filter_uniform_groups`` such groups are masked out of the
  reduction, and their number is reported. A batch still holds exactly ``train_groups`` groups: the
  filtering is visible, never a silently smaller batch.

A custom loss (``learner.loss = "module:function"``) replaces ``policy_loss`` in the torch trainer.
It is called exactly as ``policy_loss`` is, once per micro-batch:
``fn(logp, logp_behaviour, advantages, mask, cfg, *, keep)``, with the tensors described there and
this module's ``LossConfig`` (the run's ``learner.clip_low``, ``clip_high``, ... ). It returns
``(loss, metrics)``: a scalar tensor to back-propagate, the micro-batch's mean (per trajectory, or
per token with ``token_level``; the trainer weights micro-batches by their share), and a dict holding
at least the keys of ``METRICS``. Other keys are ignored. The simplest custom loss calls
``policy_loss`` and adds a term to its result.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dora.config import ConfigError, resolve_callable

METRICS = ("tokens", "clip_fraction", "ratio_mean", "ratio_min", "ratio_max")
"""What the trainer reads from a loss's metrics: sampled tokens counted (after ``keep``), the share of
tokens whose ratio was clipped, and the ratio's mean, min and max over those tokens."""

LossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True, slots=True, kw_only=True)
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.2
    token_level: bool = False
    scale_by_std: bool = True
    filter_uniform_groups: bool = False
    tis_cap: float | None = None
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if not (0 < self.clip_low < 1 and self.clip_high > 0):
            raise ValueError(f"need 0 < clip_low < 1 and clip_high > 0; got {self.clip_low}, {self.clip_high}")
        if self.tis_cap is not None and self.tis_cap < 1:
            raise ValueError(f"tis_cap must be >= 1; got {self.tis_cap}")


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, *, scale_by_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:  # fmt: skip
    """Per-trajectory advantages, normalised within each group (``groups[i]`` = group index of i)."""
    rewards = rewards.double()
    n = int(groups.max()) + 1
    count = torch.zeros(n, dtype=torch.float64).index_add_(0, groups, torch.ones_like(rewards))
    mean = torch.zeros(n, dtype=torch.float64).index_add_(0, groups, rewards) / count
    centred = rewards - mean[groups]
    if not scale_by_std:
        return centred.float()
    var = torch.zeros(n, dtype=torch.float64).index_add_(0, groups, centred**2) / (count - 1).clamp(min=1)
    return (centred / (var.sqrt()[groups] + eps)).float()


def uniform_groups(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Per group: True when every reward in it is the same (zero advantage: no signal)."""
    n = int(groups.max()) + 1
    lo = torch.full((n,), float("inf"), dtype=rewards.dtype).scatter_reduce(0, groups, rewards, "amin")
    hi = torch.full((n,), float("-inf"), dtype=rewards.dtype).scatter_reduce(0, groups, rewards, "amax")
    return lo == hi


def policy_loss(
    logp: torch.Tensor,
    logp_behaviour: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    *,
    logp_old: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The surrogate over a padded batch.

    ``logp``, ``logp_behaviour``, ``mask``: [B, T] (mask 1 on sampled tokens); ``advantages``: [B];
    ``keep``: [B] bool (trajectories left after group filtering); ``logp_old``: [B, T] for the
    truncated importance weight. Returns the loss and its metrics.
    """
    mask = mask.to(logp.dtype)
    if keep is not None:
        mask = mask * keep[:, None].to(mask.dtype)
    denominator = logp_behaviour if logp_old is None or cfg.tis_cap is None else logp_old
    ratio = torch.exp(logp - denominator)
    adv = advantages[:, None].to(logp.dtype)
    clipped = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    if logp_old is not None and cfg.tis_cap is not None:
        per_token = per_token * torch.clamp(torch.exp(logp_old - logp_behaviour), max=cfg.tis_cap).detach()
    tokens = mask.sum()
    if cfg.token_level:
        loss = (per_token * mask).sum() / tokens.clamp(min=1)
    else:
        per_seq = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)
        rows = (mask.sum(1) > 0).to(logp.dtype)
        loss = (per_seq * rows).sum() / rows.sum().clamp(min=1)
    with torch.no_grad():
        live = mask > 0
        r = ratio[live]
        was_clipped = ((ratio < 1 - cfg.clip_low) & (adv < 0)) | ((ratio > 1 + cfg.clip_high) & (adv > 0))
        metrics = {
            "tokens": float(tokens),
            "clip_fraction": float(was_clipped[live].float().mean()) if r.numel() else 0.0,
            "ratio_mean": float(r.mean()) if r.numel() else 1.0,
            "ratio_min": float(r.min()) if r.numel() else 1.0,
            "ratio_max": float(r.max()) if r.numel() else 1.0,
        }
    return loss, metrics


def resolve_loss(spec: str | None) -> LossFn:
    """``learner.loss``: the function named by ``module:function``, or ``policy_loss`` when None. A spec that
    does not import, names nothing callable, or names a function that cannot take ``policy_loss``'s
    arguments is a ConfigError."""
    if spec is None:
        return policy_loss
    fn = resolve_callable(spec, "learner.loss")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some callables carry no signature: their first call will tell
        return fn
    try:
        signature.bind("logp", "logp_behaviour", "advantages", "mask", "cfg", keep="keep")
    except TypeError as e:
        raise ConfigError(f"learner.loss {spec!r} cannot be called as policy_loss is "
                          f"(logp, logp_behaviour, advantages, mask, cfg, *, keep): {e}") from None  # fmt: skip
    return fn


def checked(result: Any, fn: LossFn) -> tuple[torch.Tensor, dict[str, float]]:
    """A loss function's result, checked against the contract (a TypeError naming the function if not)."""
    ok = isinstance(result, tuple) and len(result) == 2
    loss, metrics = result if ok else (None, None)
    if not (ok and isinstance(loss, torch.Tensor) and loss.dim() == 0 and isinstance(metrics, dict)):
        raise TypeError(f"loss {fn.__module__}:{fn.__qualname__} must return (a scalar tensor, a dict of metrics); "
                        f"got {type(result).__name__}")  # fmt: skip
    missing = [k for k in METRICS if k not in metrics]
    if missing:
        raise TypeError(f"loss {fn.__module__}:{fn.__qualname__}: its metrics lack {', '.join(missing)}")
    return loss, metrics
