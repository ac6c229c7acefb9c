"""The policy loss: group advantages and a PPO-clipped surrogate against each trajectory's own behaviour log-probs,
with DAPO's options, the decoupled correction, GSPO's sequence ratio, and a KL and an entropy term. Pure tensor
functions (no model, no process group).

Three policies are named (per sampled token t of trajectory i in group g): the behaviour policy mu, the version that
sampled i, under the distribution the engine sampled from (temperature and ``top_p`` nucleus: the learner scores
with the same truncation, so at mu's own weights ``logp_theta = logp_mu``); the proximal policy pi_prox, the
learner's weights when it took the batch; and pi_theta, the weights being trained.

- Advantage (``advantage``), the same for every token of i:
  - ``grpo``: ``A_i = (r_i - mean_g r) / (std_g r + eps)`` (sample std);
  - ``dr_grpo``: ``A_i = r_i - mean_g r``;
  - ``rloo``: leave-one-out, ``A_i = r_i - mean_{j != i} r_j = (r_i - mean_g r) x n / (n - 1)``;
  - ``reinforce_pp``: REINFORCE++ with a group baseline, ``r_i - mean_g r`` whitened over the whole batch
    (``(x - mean) / (std + eps)``).
- Ratio. With no correction (``is_cap`` and ``is_mask`` unset) it is ``rho_t = exp(logp_theta - logp_mu)``: the
  behaviour policy is the proximal one, and the clipped ratio is itself the importance weight. With a correction
  (decoupled PPO) it is ``rho_t = exp(logp_theta - logp_prox)``, and each token's term is weighted by
  ``w_t = pi_prox / mu``, masked (0 outside ``[1 / is_mask, is_mask]``) and/or capped (``min(w, is_cap)``), per
  token or per sequence (``is_level``; a sequence's weight is the geometric mean of its tokens').
- ``ratio = "sequence"`` (GSPO): every token of i takes the sequence ratio ``s_i = exp(mean_t log rho_t)`` (the
  geometric mean), clipped as a whole; its gradient is ``s_i x grad logp_theta(t)`` per token (GSPO-token), so
  with sequence-level reduction the loss is GSPO's exactly. GSPO's own clip range is narrow (3e-4 / 4e-4).
- Surrogate ``l_t = -w_t min(rho_t A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) A_i)``. Symmetric clipping is
  PPO/GRPO; DAPO raises ``eps_high`` ("clip higher").
- Reduction. Sequence-level (GRPO): mean over each trajectory's tokens, then over trajectories. Token-level (DAPO):
  the sum over all tokens / the number of tokens, so long answers weigh per token.
- Group filtering (DAPO dynamic sampling). A group whose rewards are all equal has zero advantage and contributes
  nothing. With ``filter_uniform_groups`` such groups are masked out of the reduction, and their number is
  reported. A batch still holds exactly ``train_groups`` groups: the filtering is visible, never a silently smaller
  batch.
- Regularisers (``regularizers``), reduced as the surrogate is and added to it: ``kl_coef x KL(pi_theta ||
  pi_ref)`` per token by the estimator ``k1 = d``, ``k2 = d^2 / 2`` or ``k3 = exp(-d) - 1 + d`` with
  ``d = log pi_theta - log pi_ref`` (pi_ref is the start model), and ``-entropy_coef x H`` (the entropy of the
  distribution at each sampled position). Both are taken on the tempered distribution over the whole vocabulary
  (smooth, finite everywhere), not on the nucleus.

A custom loss (``learner.loss = "module:function"``) replaces ``policy_loss`` in the torch trainer (the
regularisers are still added). It is called exactly as ``policy_loss`` is, once per micro-batch:
``fn(logp, logp_behaviour, advantages, mask, cfg, *, keep)`` (plus ``logp_prox=`` if its signature takes it), with
the tensors described there and this module's ``LossConfig`` (the run's ``learner.clip_low``, ``clip_high``, ... ).
It returns ``(loss, metrics)``: a scalar tensor to back-propagate, the micro-batch's mean (per trajectory, or per
token with ``token_level``; the trainer weights micro-batches by their share), and a dict holding at least the
keys of ``METRICS``. Other keys are ignored. The simplest custom loss calls ``policy_loss`` and adds a term to its
result.
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

SUMMED = ("clip_low_fraction", "clip_high_fraction", "is_weight_mean", "is_corrected")
"""Further token means ``policy_loss`` reports (the trainer averages them over the batch by tokens, as it does
``clip_fraction``): clipped below (A < 0) and above (A > 0) apart, the importance weight's mean, and the share of
tokens whose weight was capped or masked."""

LOG_RATIO_BOUND = 20.0
"""Log-ratios are clamped to +-20 before ``exp`` (e^20 is 5e8): a ratio past it is clipped anyway, and an overflow
to infinity would make the loss NaN."""

ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp")
KL_ESTIMATORS = ("k1", "k2", "k3")

LossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True, slots=True, kw_only=True)
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.2
    token_level: bool = False
    advantage: str = "grpo"
    filter_uniform_groups: bool = False
    ratio: str = "token"
    is_cap: float | None = None
    is_mask: float | None = None
    is_level: str = "token"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if not (0 < self.clip_low < 1 and self.clip_high > 0):
            raise ValueError(f"need 0 < clip_low < 1 and clip_high > 0; got {self.clip_low}, {self.clip_high}")
        if self.advantage not in ADVANTAGES:
            raise ValueError(f"advantage must be one of {', '.join(ADVANTAGES)}; got {self.advantage!r}")
        if self.ratio not in ("token", "sequence") or self.is_level not in ("token", "sequence"):
            raise ValueError(f"ratio and is_level are token or sequence; got {self.ratio!r}, {self.is_level!r}")
        if self.is_cap is not None and self.is_cap < 1:
            raise ValueError(f"is_cap must be >= 1; got {self.is_cap}")
        if self.is_mask is not None and self.is_mask <= 1:
            raise ValueError(f"is_mask must be > 1 (weights outside [1/is_mask, is_mask] are masked); got {self.is_mask}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {', '.join(KL_ESTIMATORS)}; got {self.kl_estimator!r}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError(f"kl_coef and entropy_coef must be >= 0; got {self.kl_coef}, {self.entropy_coef}")

    @property
    def decoupled(self) -> bool:
        """Whether the clip is against the proximal policy, with the capped or masked weight pi_prox / mu."""
        return self.is_cap is not None or self.is_mask is not None


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, *, scale_by_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:  # fmt: skip
    """Per-trajectory advantages, normalised within each group (``groups[i]`` = group index of i): GRPO's, or
    Dr. GRPO's without ``scale_by_std``."""
    rewards = rewards.double()
    n = int(groups.max()) + 1
    count = torch.zeros(n, dtype=torch.float64).index_add_(0, groups, torch.ones_like(rewards))
    mean = torch.zeros(n, dtype=torch.float64).index_add_(0, groups, rewards) / count
    centred = rewards - mean[groups]
    if not scale_by_std:
        return centred.float()
    var = torch.zeros(n, dtype=torch.float64).index_add_(0, groups, centred**2) / (count - 1).clamp(min=1)
    return (centred / (var.sqrt()[groups] + eps)).float()


def advantages(rewards: torch.Tensor, groups: torch.Tensor, kind: str = "grpo", *, eps: float = 1e-6) -> torch.Tensor:
    """Per-trajectory advantages by ``kind`` (one of ``ADVANTAGES``; the formulas are in the module's doc)."""
    if kind in ("grpo", "dr_grpo"):
        return group_advantages(rewards, groups, scale_by_std=kind == "grpo", eps=eps)
    centred = group_advantages(rewards, groups, scale_by_std=False).double()
    if kind == "rloo":
        count = torch.zeros(int(groups.max()) + 1, dtype=torch.float64).index_add_(
            0, groups, torch.ones_like(centred))[groups]  # fmt: skip
        return (centred * count / (count - 1).clamp(min=1)).float()
    if kind == "reinforce_pp":
        std = centred.std() if centred.numel() > 1 else centred.new_zeros(())
        return ((centred - centred.mean()) / (std + eps)).float()
    raise ValueError(f"unknown advantage {kind!r}")


def uniform_groups(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Per group: True when every reward in it is the same (zero advantage: no signal)."""
    n = int(groups.max()) + 1
    lo = torch.full((n,), float("inf"), dtype=rewards.dtype).scatter_reduce(0, groups, rewards, "amin")
    hi = torch.full((n,), float("-inf"), dtype=rewards.dtype).scatter_reduce(0, groups, rewards, "amax")
    return lo == hi


def reduce(per_token: torch.Tensor, mask: torch.Tensor, token_level: bool) -> torch.Tensor:
    """The loss's reduction of a [B, T] term over the tokens ``mask`` keeps: per token (DAPO), or per trajectory
    and then over trajectories (GRPO)."""
    if token_level:
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    per_seq = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)
    rows = (mask.sum(1) > 0).to(per_token.dtype)
    return (per_seq * rows).sum() / rows.sum().clamp(min=1)


def _sequence_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per trajectory, the mean of ``x`` over its masked tokens, as a [B, 1] column."""
    return ((x * mask).sum(1) / mask.sum(1).clamp(min=1))[:, None]


def importance_weight(logp_prox: torch.Tensor, logp_behaviour: torch.Tensor, mask: torch.Tensor,
                      cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The decoupled correction ``pi_prox / mu`` per token ([B, T], no gradient), masked and/or capped at the
    configured level, and where it was changed (bool [B, T])."""
    with torch.no_grad():
        log_w = logp_prox - logp_behaviour
        if cfg.is_level == "sequence":
            log_w = _sequence_mean(log_w, mask).expand_as(log_w)
        w = torch.exp(log_w.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        changed = torch.zeros_like(w, dtype=torch.bool)
        if cfg.is_mask is not None:
            out = (w > cfg.is_mask) | (w < 1 / cfg.is_mask)
            w, changed = w.masked_fill(out, 0.0), changed | out
        if cfg.is_cap is not None:
            over = w > cfg.is_cap
            w, changed = torch.clamp(w, max=cfg.is_cap), changed | over
    return w, changed


def policy_loss(
    logp: torch.Tensor,
    logp_behaviour: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    *,
    keep: torch.Tensor | None = None,
    logp_prox: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The surrogate over a padded batch.

    ``logp``, ``logp_behaviour``, ``mask``: [B, T] (mask 1 on sampled tokens); ``advantages``: [B];
    ``keep``: [B] bool (trajectories left after group filtering); ``logp_prox``: [B, T], the proximal policy's
    log-probs (needed with a correction: ``cfg.decoupled``). Returns the loss and its metrics.
    """
    mask = mask.to(logp.dtype)
    if keep is not None:
        mask = mask * keep[:, None].to(mask.dtype)
    if cfg.decoupled and logp_prox is None:
        raise ValueError("a correction (is_cap or is_mask) needs the proximal log-probs (logp_prox)")
    denominator = logp_prox if cfg.decoupled else logp_behaviour
    if cfg.ratio == "sequence":  # GSPO-token: the value is the sequence's ratio, the gradient each token's
        log_ratio = _sequence_mean(logp - denominator, mask).detach() + logp - logp.detach()
    else:
        log_ratio = logp - denominator
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    adv = advantages[:, None].to(logp.dtype)
    clipped = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    weight, changed = None, None
    if cfg.decoupled:
        assert logp_prox is not None
        weight, changed = importance_weight(logp_prox, logp_behaviour, mask, cfg)
        per_token = per_token * weight
    tokens = mask.sum()
    loss = reduce(per_token, mask, cfg.token_level)
    with torch.no_grad():
        live = mask > 0
        r = ratio[live]
        low = (ratio < 1 - cfg.clip_low) & (adv < 0)
        high = (ratio > 1 + cfg.clip_high) & (adv > 0)
        w = weight[live] if weight is not None else None

        def share(x: torch.Tensor) -> float:
            return float(x[live].float().mean()) if r.numel() else 0.0

        metrics = {
            "tokens": float(tokens),
            "clip_fraction": share(low | high),
            "ratio_mean": float(r.mean()) if r.numel() else 1.0,
            "ratio_min": float(r.min()) if r.numel() else 1.0,
            "ratio_max": float(r.max()) if r.numel() else 1.0,
            "clip_low_fraction": share(low),
            "clip_high_fraction": share(high),
            "is_weight_mean": float(w.mean()) if w is not None and w.numel() else 1.0,
            "is_weight_max": float(w.max()) if w is not None and w.numel() else 1.0,
            "is_corrected": share(changed) if changed is not None else 0.0,
        }
    return loss, metrics


def kl_terms(logp: torch.Tensor, logp_ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per token, the estimate of KL(pi_theta || pi_ref) at the sampled token: k1, k2 or k3 of
    ``d = logp - logp_ref`` (the module's doc)."""
    d = logp - logp_ref
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d**2
    if estimator == "k3":
        return torch.exp(-d) - 1 + d
    raise ValueError(f"unknown kl_estimator {estimator!r}")


def regularizers(logp_full: torch.Tensor, entropy: torch.Tensor, logp_ref: torch.Tensor | None, mask: torch.Tensor,
                 cfg: LossConfig) -> tuple[torch.Tensor | None, dict[str, float]]:  # fmt: skip
    """``kl_coef x KL - entropy_coef x H``, reduced as the surrogate is (None when both coefficients are 0), and the
    micro-batch's token means of the entropy and of KL (k3, whatever the estimator trained; with a reference)."""
    term: torch.Tensor | None = None
    live = mask > 0
    with torch.no_grad():
        metrics = {"entropy": float(entropy[live].mean()) if live.any() else 0.0}
        if logp_ref is not None:
            metrics["kl_ref"] = float(kl_terms(logp_full, logp_ref, "k3")[live].mean()) if live.any() else 0.0
    if cfg.kl_coef > 0:
        if logp_ref is None:
            raise ValueError("kl_coef > 0 needs the reference log-probs")
        term = cfg.kl_coef * reduce(kl_terms(logp_full, logp_ref, cfg.kl_estimator), mask, cfg.token_level)
    if cfg.entropy_coef > 0:
        bonus = -cfg.entropy_coef * reduce(entropy, mask, cfg.token_level)
        term = bonus if term is None else term + bonus
    return term, metrics


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


def takes_prox(fn: LossFn) -> bool:
    """Whether a loss function takes the proximal log-probs (``logp_prox=``), as ``policy_loss`` does."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "logp_prox" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


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
