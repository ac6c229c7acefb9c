"""This stack's scoring and objective, plugged into dora by name:

    task.reward = "my_stack:reward"     # the rollout workers score every finished sample with it
    learner.loss = "my_stack:loss"      # dora's torch learner trains on it instead of its built-in loss

The module must be importable by every dora process (``run.py`` puts this folder on ``PYTHONPATH``).
The broker imports it too, to check the reward before the run starts, so nothing at module level
imports torch: ``loss`` imports what it needs when first called, in the learner.
"""

from __future__ import annotations

import structlog

from dora.tasks.rewards import answer_text
from dora.tasks.tasks import Item

KL_COEF = 0.1
"""Weight of the penalty on the divergence from the policy that sampled the batch."""

_reward_seen = False


def reward(completion: str, item: Item) -> float:
    """1 for the exact answer; otherwise partial credit: a quarter for an answer made of digits, a quarter
    for the share of the answer's leading digits that are right."""
    global _reward_seen
    if not _reward_seen:  # once per worker, so a run's logs show which reward scored it
        _reward_seen = True
        structlog.get_logger().info("custom_reward_in_use", reward="my_stack:reward", task=item.task)
    text = answer_text(completion)
    if text == item.answer:
        return 1.0
    if not text:
        return 0.0
    right = 0
    for got, want in zip(text, item.answer, strict=False):
        if got != want:
            break
        right += 1
    return 0.25 * sum(c.isdigit() for c in text) / len(text) + 0.25 * right / len(item.answer)


def loss(logp, logp_behaviour, advantages, mask, cfg, *, keep=None):
    """dora's clipped policy loss plus KL_COEF x an estimate of KL(behaviour || current) per token
    (k3: exp(r) - 1 - r with r = logp - logp_behaviour, never negative), reduced as the policy loss is.

    Called like ``dora.learner.loss.policy_loss``, once per micro-batch; returns its (loss, metrics)."""
    from dora.learner.loss import policy_loss

    pg, metrics = policy_loss(logp, logp_behaviour, advantages, mask, cfg, keep=keep)
    live = mask if keep is None else mask * keep[:, None].to(mask.dtype)
    r = logp - logp_behaviour
    per_token = (r.exp() - 1 - r) * live
    if cfg.token_level:
        kl = per_token.sum() / live.sum().clamp(min=1)
    else:
        rows = live.sum(1)
        kl = (per_token.sum(1) / rows.clamp(min=1)).sum() / (rows > 0).sum().clamp(min=1)
    structlog.get_logger().info("custom_loss", policy_loss=float(pg.detach()), kl=float(kl.detach()),
                                tokens=metrics["tokens"])  # fmt: skip
    return pg + KL_COEF * kl, metrics
