"""Custom losses for the learner.loss tests, named as ``tests.unit.losses:<function>``."""

from __future__ import annotations

from dora.learner.loss import policy_loss

CALLS: list[dict[str, object]] = []
NOT_CALLABLE = 3


def recorded(logp, logp_behaviour, advantages, mask, cfg, *, keep=None):
    """The built-in loss, each call recorded."""
    CALLS.append({"rows": logp.shape[0], "clip_low": cfg.clip_low, "keep": keep is not None})
    return policy_loss(logp, logp_behaviour, advantages, mask, cfg, keep=keep)


def doubled(logp, logp_behaviour, advantages, mask, cfg, *, keep=None):
    loss, metrics = policy_loss(logp, logp_behaviour, advantages, mask, cfg, keep=keep)
    return 2 * loss, metrics


def nothing(logp, logp_behaviour, advantages, mask, cfg, *, keep=None):
    """A loss with no gradient signal: the step must leave the weights as they were."""
    loss, metrics = policy_loss(logp, logp_behaviour, advantages, mask, cfg, keep=keep)
    return 0 * loss, metrics


def two_arguments(logp, mask):
    return policy_loss(logp, logp, logp[:, 0], mask, None)


def no_metrics(logp, logp_behaviour, advantages, mask, cfg, *, keep=None):
    loss, _ = policy_loss(logp, logp_behaviour, advantages, mask, cfg, keep=keep)
    return loss, {"tokens": 1.0}
