"""The policy loss against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from dora.learner.loss import LossConfig, group_advantages, policy_loss, uniform_groups


def t(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def test_group_advantages_by_hand():
    # group 0: rewards 1, 0, 0, 1 -> mean 0.5, sample std sqrt(1/3); group 1: 2, 4 -> mean 3, std sqrt(2)
    adv = group_advantages(t(1, 0, 0, 1, 2, 4), torch.tensor([0, 0, 0, 0, 1, 1]), eps=0.0)
    s0, s1 = math.sqrt(1 / 3), math.sqrt(2)
    want = [0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0, -1 / s1, 1 / s1]
    assert torch.allclose(adv.double(), torch.tensor(want, dtype=torch.float64), atol=1e-6)
    plain = group_advantages(t(1, 0, 0, 1, 2, 4), torch.tensor([0, 0, 0, 0, 1, 1]), scale_by_std=False)
    assert plain.tolist() == [0.5, -0.5, -0.5, 0.5, -1.0, 1.0]


def test_a_uniform_group_has_zero_advantage_and_is_flagged():
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    rewards = t(1, 1, 0, 1, 0, 0)
    assert group_advantages(rewards, groups).tolist()[:2] == [0.0, 0.0]
    assert uniform_groups(rewards, groups).tolist() == [True, False, True]


def test_clipped_surrogate_by_hand():
    # one trajectory, two tokens, advantage +1; ratios e^0.5 = 1.6487 (clipped to 1.2) and e^-0.1 = 0.9048
    logp, beh = t([0.0, -0.1]), t([-0.5, 0.0])
    loss, m = policy_loss(logp, beh, t(1.0), t([1, 1]), LossConfig(clip_low=0.2, clip_high=0.2))
    want = -(1.2 + math.exp(-0.1)) / 2
    assert loss.item() == pytest.approx(want, abs=1e-9)
    assert m["clip_fraction"] == 0.5 and m["tokens"] == 2
    assert m["ratio_max"] == pytest.approx(math.exp(0.5)) and m["ratio_min"] == pytest.approx(math.exp(-0.1))
    # negative advantage: min(rho A, clip A) picks the larger loss; rho = 0.5 is clipped up to 0.8
    loss, m = policy_loss(t([math.log(0.5)]), t([0.0]), t(-1.0), t([1]), LossConfig())
    assert loss.item() == pytest.approx(0.8) and m["clip_fraction"] == 1.0


def test_clip_higher_lets_a_positive_advantage_rise_further():
    logp, beh = t([math.log(1.25)]), t([0.0])
    sym, _ = policy_loss(logp, beh, t(1.0), t([1]), LossConfig(clip_low=0.2, clip_high=0.2))
    dapo, _ = policy_loss(logp, beh, t(1.0), t([1]), LossConfig(clip_low=0.2, clip_high=0.28))
    assert sym.item() == pytest.approx(-1.2) and dapo.item() == pytest.approx(-1.25)


def test_sequence_vs_token_level_reduction():
    # trajectory a: 1 token, loss -1 (ratio 1, A = 1); trajectory b: 3 tokens, loss +1 each (A = -1)
    logp = t([0.0, 0.0, 0.0], [0.0, 0.0, 0.0])
    mask = t([1, 0, 0], [1, 1, 1])
    adv = t(1.0, -1.0)
    seq, _ = policy_loss(logp, logp, adv, mask, LossConfig())
    tok, _ = policy_loss(logp, logp, adv, mask, LossConfig(token_level=True))
    assert seq.item() == pytest.approx((-1 + 1) / 2) and tok.item() == pytest.approx((-1 + 3) / 4)


def test_the_ratio_uses_each_trajectorys_own_behaviour_log_probs():
    logp = t([-1.0], [-1.0])
    beh = t([-1.0], [-2.0])  # the second trajectory came from an older version that liked the token less
    loss, m = policy_loss(logp, beh, t(1.0, 1.0), t([1], [1]), LossConfig(clip_high=10))
    assert m["ratio_min"] == pytest.approx(1.0) and m["ratio_max"] == pytest.approx(math.e)
    assert loss.item() == pytest.approx(-(1 + math.e) / 2)


def test_capped_importance_weight_and_filtering():
    logp, prox, beh = t([0.0]), t([0.0]), t([-1.0])  # the learner thinks the token 2.7x likelier than the engine did
    loss, m = policy_loss(logp, beh, t(1.0), t([1]), LossConfig(is_cap=2.0), logp_prox=prox)
    assert loss.item() == pytest.approx(-1.0 * 2.0)  # ratio vs logp_prox = 1, weight min(e, 2) = 2
    assert m["is_weight_max"] == pytest.approx(2.0) and m["is_corrected"] == 1.0
    keep = torch.tensor([True, False])
    loss, m = policy_loss(t([0.0], [0.0]), t([0.0], [0.0]), t(1.0, -5.0), t([1], [1]), LossConfig(), keep=keep)
    assert loss.item() == pytest.approx(-1.0) and m["tokens"] == 1


def test_gradient_flows_only_through_the_new_log_probs():
    logp = torch.tensor([[0.1, -0.2]], dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(logp, t([0.0, 0.0]), t(2.0), t([1, 1]), LossConfig(clip_high=0.5))
    loss.backward()
    # unclipped tokens: d/dlogp of -(exp(logp) * A) / 2 = -exp(logp) * A / 2
    assert torch.allclose(logp.grad, torch.tensor([[-math.exp(0.1), -math.exp(-0.2)]], dtype=torch.float64))


def test_bad_config_is_refused():
    with pytest.raises(ValueError):
        LossConfig(clip_low=1.5)
    with pytest.raises(ValueError):
        LossConfig(is_cap=0.5)
