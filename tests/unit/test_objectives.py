"""The learner's objectives against computations written out here: the chunked scorer's nucleus, entropy and
whole-vocabulary log-probs; the advantages; the KL estimators; GSPO's sequence ratio; the decoupled correction; the
learning-rate schedule; the mini-batch schedule; and a step with one mini-batch, one epoch and no correction, bit for
bit the same as the step taken before the schedule existed (written out below as it was)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dora.balance import plan
from dora.learner.logprobs import head_stats, sampled_stats
from dora.learner.loss import (LossConfig, advantages, group_advantages, importance_weight, kl_terms, policy_loss,
                               regularizers, uniform_groups)  # fmt: skip
from dora.learner.schedule import LrSchedule, mini_batches
from dora.learner.trainers.torch_trainer import TorchTrainer, TrainerConfig, trained_tokens
from dora.store import WeightStore
from tests.unit.test_fsdp import batch

pytestmark = pytest.mark.timeout(120)


def t(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


# ---------------------------------------------------------------- the scorer: nucleus, entropy, whole vocabulary


def plain(z: torch.Tensor, tokens: torch.Tensor, top_p: float) -> tuple[torch.Tensor, ...]:
    """The three outputs over the whole vocabulary at once: the nucleus cut as the engines cut it (most likely
    first, while the mass before a token is below top_p), with the sampled token in it, renormalised."""
    logp = torch.log_softmax(z, -1)
    p = logp.exp()
    entropy = -(p * logp).sum(-1)
    full = logp.gather(1, tokens[:, None]).squeeze(1)
    if top_p >= 1:
        return full, full, entropy
    sorted_p, order = torch.sort(p, descending=True, dim=-1)
    keep = torch.zeros_like(p, dtype=torch.bool).scatter(-1, order, (torch.cumsum(sorted_p, -1) - sorted_p) < top_p)
    keep = keep.scatter(1, tokens[:, None], True)
    nucleus = torch.log_softmax(z.masked_fill(~keep, float("-inf")), -1).gather(1, tokens[:, None]).squeeze(1)
    return nucleus, full, entropy


@pytest.mark.parametrize("top_p", [1.0, 0.8, 0.3])
@pytest.mark.parametrize("path", ["logits", "head"])
def test_the_chunked_stats_and_their_gradients_equal_the_whole_vocabulary_computation(top_p, path):
    torch.manual_seed(1)
    n, vocab, hidden, temperature = 11, 64, 8, 0.7
    h, w, b = torch.randn(n, hidden), torch.randn(vocab, hidden), torch.randn(vocab)
    tokens = torch.multinomial(torch.softmax((h @ w.T + b) / temperature, -1), 1).squeeze(1)
    tokens[0] = int(torch.argmin(h[0] @ w.T + b))  # a token outside any nucleus: scored with it added
    weights = [torch.randn(n) for _ in range(3)]
    chunk = 3 * 4 * vocab  # three positions a chunk, the last one short
    if path == "logits":
        x = (h @ w.T + b).requires_grad_()
        got = sampled_stats(x, tokens, temperature=temperature, top_p=top_p, chunk_bytes=chunk)
        ref_x = x.detach().clone().requires_grad_()
        want = plain(ref_x / temperature, tokens, top_p)
        leaves = [(x, ref_x)]
    else:
        h1, w1, h2, w2 = (v.clone().requires_grad_() for v in (h, w, h, w))
        got = head_stats(h1, w1, tokens, bias=b, softcap=4.0, temperature=temperature, top_p=top_p, chunk_bytes=chunk)
        want = plain(torch.tanh((h2 @ w2.T + b) / 4.0) * 4.0 / temperature, tokens, top_p)
        leaves = [(h1, h2), (w1, w2)]
    for mine, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(mine, theirs.float(), atol=2e-5, rtol=1e-5)
    assert torch.all(got.logp >= got.full - 1e-5)  # a nucleus holds less mass than the whole vocabulary
    sum((o * k).sum() for o, k in zip(got, weights, strict=True)).backward()
    sum((o * k).sum() for o, k in zip(want, weights, strict=True)).backward()
    for mine, theirs in leaves:
        torch.testing.assert_close(mine.grad, theirs.grad, atol=2e-5, rtol=1e-4)


# ---------------------------------------------------------------- advantages


def test_advantages_by_hand():
    rewards, groups = t(1, 0, 0, 1, 2, 4), torch.tensor([0, 0, 0, 0, 1, 1])
    assert torch.equal(advantages(rewards, groups, "grpo"), group_advantages(rewards, groups))
    assert advantages(rewards, groups, "dr_grpo").tolist() == [0.5, -0.5, -0.5, 0.5, -1.0, 1.0]
    # rloo: reward minus the mean of the group's others: 1 - 1/3, 0 - 2/3, ...; 2 - 4, 4 - 2
    want = [1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3, -2.0, 2.0]
    assert advantages(rewards, groups, "rloo").tolist() == pytest.approx(want)
    # reinforce++: the group-centred rewards whitened over the batch (sample std)
    centred = np.array([0.5, -0.5, -0.5, 0.5, -1.0, 1.0])
    want = (centred - centred.mean()) / (centred.std(ddof=1) + 1e-6)
    assert advantages(rewards, groups, "reinforce_pp").tolist() == pytest.approx(want.tolist(), rel=1e-6)


# ---------------------------------------------------------------- KL and entropy


def test_kl_estimators_and_the_regularizers_by_hand():
    logp, ref = t([-1.0, -2.0]), t([-1.5, -1.0])
    d = [0.5, -1.0]
    assert kl_terms(logp, ref, "k1").tolist() == [d]
    assert kl_terms(logp, ref, "k2").tolist() == [[0.5 * x * x for x in d]]
    assert kl_terms(logp, ref, "k3")[0].tolist() == pytest.approx([math.exp(-x) - 1 + x for x in d])
    entropy, mask = t([2.0, 4.0]), t([1, 1])
    cfg = LossConfig(kl_coef=0.1, kl_estimator="k2", entropy_coef=0.01)
    term, metrics = regularizers(logp, entropy, ref, mask, cfg)
    assert term.item() == pytest.approx(0.1 * (0.125 + 0.5) / 2 - 0.01 * 3.0)
    assert metrics["entropy"] == 3.0 and metrics["kl_ref"] == pytest.approx(sum(math.exp(-x) - 1 + x for x in d) / 2)
    assert regularizers(logp, entropy, None, mask, LossConfig())[0] is None  # no coefficients: no term


# ---------------------------------------------------------------- GSPO and the correction


def test_the_sequence_ratio_is_the_geometric_mean_and_its_gradient_gspos():
    logp = torch.tensor([[0.2, -0.1, 0.0]], dtype=torch.float64, requires_grad=True)
    beh, mask = t([0.0, 0.0, 0.0]), t([1, 1, 0])  # the third position is padding
    cfg = LossConfig(ratio="sequence", clip_low=0.5, clip_high=0.5)
    loss, metrics = policy_loss(logp, beh, t(2.0), mask, cfg)
    s = math.exp((0.2 - 0.1) / 2)
    assert metrics["ratio_mean"] == pytest.approx(s) and loss.item() == pytest.approx(-2.0 * s)
    loss.backward()  # d/dlogp_t of -(s A): -A s / 2 for each of the two tokens
    assert logp.grad[0].tolist() == pytest.approx([-s, -s, 0.0])
    clipped, metrics = policy_loss(logp.detach() + 1, beh, t(2.0), mask, cfg)  # s = e^1.05 > 1.5: clipped above
    assert clipped.item() == pytest.approx(-2.0 * 1.5) and metrics["clip_high_fraction"] == 1.0


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_the_decoupled_weight_is_proximal_over_behaviour_capped_or_masked(level):
    prox, beh, mask = t([0.0, 0.0, -1.0]), t([-1.0, 0.0, 0.0]), t([1, 1, 1])
    cap = LossConfig(is_cap=2.0, is_level=level)
    w, changed = importance_weight(prox, beh, mask, cap)
    if level == "token":  # e^1, e^0, e^-1 -> capped at 2
        assert w[0].tolist() == pytest.approx([2.0, 1.0, math.exp(-1)]) and changed.tolist() == [[True, False, False]]
    else:  # the geometric mean e^0 for each token: nothing capped
        assert w[0].tolist() == pytest.approx([1.0, 1.0, 1.0]) and not changed.any()
    w, changed = importance_weight(prox, beh, mask, LossConfig(is_mask=2.0, is_level=level))
    if level == "token":  # e and 1/e are outside [1/2, 2]: masked
        assert w[0].tolist() == pytest.approx([0.0, 1.0, 0.0]) and changed.tolist() == [[True, False, True]]
    else:
        assert w[0].tolist() == pytest.approx([1.0, 1.0, 1.0])
    # the clip is against the proximal policy: logp = prox, every ratio 1, the loss is -A x mean weight
    loss, metrics = policy_loss(prox, beh, t(1.0), mask, cap, logp_prox=prox)
    assert metrics["ratio_min"] == metrics["ratio_max"] == 1.0
    assert loss.item() == pytest.approx(-float(importance_weight(prox, beh, mask, cap)[0].mean()))
    with pytest.raises(ValueError, match="logp_prox"):
        policy_loss(prox, beh, t(1.0), mask, cap)


# ---------------------------------------------------------------- schedules


def test_the_learning_rate_schedule_by_hand():
    assert [LrSchedule(lr=1.0, warmup_steps=4).at(k) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    linear = LrSchedule(lr=2.0, kind="linear", warmup_steps=1, min_lr_ratio=0.5, total_steps=5)  # 1.0 at step 4
    assert [linear.at(k) for k in range(6)] == pytest.approx([2.0, 2.0, 2 - 1 / 3, 2 - 2 / 3, 1.0, 1.0])
    cosine = LrSchedule(lr=1.0, kind="cosine", total_steps=3)
    assert [cosine.at(k) for k in range(4)] == pytest.approx([1.0, 0.5, 0.0, 0.0])
    with pytest.raises(ValueError, match="total_steps"):
        LrSchedule(lr=1.0, kind="cosine")


def test_mini_batches_hold_whole_groups_and_cover_the_batch_once_per_epoch():
    first = mini_batches(10, 4, epoch=0, seed=3, step=7)
    assert first == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    later = mini_batches(10, 4, epoch=1, seed=3, step=7)
    assert sorted(g for part in later for g in part) == list(range(10)) and later != first
    assert later == mini_batches(10, 4, epoch=1, seed=3, step=7)  # every rank draws the same
    assert mini_batches(2, 4, epoch=0, seed=0, step=0) == [[0], [1]]


# ---------------------------------------------------------------- the trainer


def step_as_it_was(trainer: TorchTrainer, b) -> None:
    """The torch trainer's step before mini-batches, corrections and regularisers: gradients accumulated over the
    whole batch in the rank plan's micro-batches, clipped, one AdamW step."""
    rows = [(g.prompt_ids.tolist(), s, gi) for gi, g in enumerate(b.groups) for s in g.samples]
    rewards = torch.tensor([s.reward for _, s, _ in rows], dtype=torch.float64)
    groups = torch.tensor([gi for _, _, gi in rows])
    adv = group_advantages(rewards, groups, scale_by_std=True, eps=trainer.loss_cfg.eps)
    flat = uniform_groups(rewards, groups)
    keep = ~flat[groups] if trainer.loss_cfg.filter_uniform_groups else torch.ones(len(rows), dtype=torch.bool)
    keep &= torch.tensor([trained_tokens(s) > 0 for _, s, _ in rows])
    kept_rows = int(keep.sum())
    kept_tokens = sum(trained_tokens(s) for (_, s, _), k in zip(rows, keep.tolist(), strict=True) if k)
    trainer.opt.zero_grad(set_to_none=True)
    sizes = [len(p) + len(s.token_ids) for p, s, _ in rows]
    cfg = trainer.cfg
    for part in plan(sizes, [gi for _, _, gi in rows], rank=0, world=1, balance=cfg.balance,
                     micro_batch=cfg.micro_batch, micro_batch_tokens=cfg.micro_batch_tokens).micro_batches:  # fmt: skip
        if not any(keep[i] for i in part):
            continue
        stats, beh, mask = trainer._score([rows[i] for i in part])
        loss, met = policy_loss(stats.logp, beh, adv[list(part)], mask, trainer.loss_cfg, keep=keep[list(part)])
        share = met["tokens"] / max(kept_tokens, 1) if trainer.loss_cfg.token_level else (
            int(keep[list(part)].sum()) / max(kept_rows, 1))  # fmt: skip
        (loss * share).backward()
    torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), cfg.max_grad_norm)
    trainer.opt.step()


@pytest.mark.parametrize("loss", [LossConfig(), LossConfig(token_level=True, clip_high=0.28, filter_uniform_groups=True)])
def test_one_mini_batch_one_epoch_no_correction_is_the_step_as_it_was_bit_for_bit(tiny_model, tmp_path, loss):
    cfg = TrainerConfig(lr=1e-2, micro_batch=3, temperature=0.7)
    new = TorchTrainer(tiny_model, WeightStore(tmp_path / "new"), loss, cfg)
    old = TorchTrainer(tiny_model, WeightStore(tmp_path / "old"), loss, cfg)
    for _ in range(2):  # the second step runs on moved weights and AdamW's moments
        new.train(batch())
        step_as_it_was(old, batch())
    mine, theirs = new.model.state_dict(), old.model.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_several_mini_batches_take_as_many_optimizer_steps_clipped_against_the_batch_start(tiny_model, tmp_path):
    cfg = TrainerConfig(lr=1e-2, micro_batch=2, mini_batches=3, epochs=2, lr_schedule="linear", warmup_steps=2,
                        total_steps=4, weight_decay=0.1)  # fmt: skip
    trainer = TorchTrainer(tiny_model, WeightStore(tmp_path), LossConfig(is_cap=2.0, kl_coef=0.05, entropy_coef=0.01,
                                                                         advantage="rloo"), cfg)  # fmt: skip
    b = batch()  # three groups: one a mini-batch
    metrics = trainer.train(b)
    assert metrics["optimizer_steps"] == 6 and metrics["micro_batches"] == 12  # 4 rows a group, 2 a micro-batch
    assert metrics["lr"] == pytest.approx(LrSchedule(lr=1e-2, kind="linear", warmup_steps=2, total_steps=24).at(5))
    assert metrics["kl_ref"] > 0 and metrics["entropy"] > 0 and metrics["is_weight_max"] <= 2.0
    # the batch is of version 0, the learner's (staleness 0), but its behaviour log-probs were made up (about -7):
    # the gap is measured, and large
    assert metrics["mismatch_tokens"] == sum(len(s.token_ids) for g in b.groups for s in g.samples)
    assert metrics["mismatch_abs"] > 0.1 and metrics["mismatch_prob_max"] > 0
    # the clip is against the batch's starting weights: 1 in the first mini-batch (to float rounding: the proximal
    # pass cut the batch into other micro-batches), moved away from 1 in the later ones
    seen: list[tuple[float, float]] = []

    def recording(logp, logp_behaviour, adv, mask, cfg, *, keep, logp_prox):
        loss, met = policy_loss(logp, logp_behaviour, adv, mask, cfg, keep=keep, logp_prox=logp_prox)
        seen.append((met["ratio_min"], met["ratio_max"]))
        return loss, met

    first = TorchTrainer(tiny_model, WeightStore(tmp_path / "one"), LossConfig(is_cap=2.0),
                         TrainerConfig(lr=1e-2, micro_batch=4, mini_batches=3), loss_fn=recording)  # fmt: skip
    assert first.train(b)["optimizer_steps"] == 3 and len(seen) == 3  # a group of 4 rows a mini-batch
    assert seen[0] == pytest.approx((1.0, 1.0), abs=1e-5)
    assert all(abs(lo - 1) > 1e-3 or abs(hi - 1) > 1e-3 for lo, hi in seen[1:]), seen


def test_with_lora_the_kl_reference_is_the_model_with_its_adapters_off(tiny_model, tmp_path):
    """No copy of the model: at the start (B = 0) the adapters change nothing and KL is 0; after a step it is not,
    and the reference's log-probs are still the start model's."""
    from dora.config.models import LoraSection

    cfg = TrainerConfig(lr=5e-2, micro_batch=4, lora=LoraSection(rank=4, alpha=8.0))
    trainer = TorchTrainer(tiny_model, WeightStore(tmp_path), LossConfig(kl_coef=0.1), cfg)
    assert trainer.reference is None
    b = batch()
    rows = [(g.prompt_ids.tolist(), s, gi) for gi, g in enumerate(b.groups) for s in g.samples][:4]
    with torch.no_grad():
        start = trainer._score(rows)[0].full
    assert trainer.train(b)["kl_ref"] == pytest.approx(0.0, abs=1e-7)
    second = trainer.train(b)
    assert second["kl_ref"] > 1e-6
    with torch.no_grad():
        torch.testing.assert_close(trainer._reference_logp(rows), start)
        assert not torch.allclose(trainer._score(rows)[0].full, start)


def test_a_correction_with_a_loss_that_cannot_take_the_proximal_log_probs_is_refused(tiny_model, tmp_path):
    from dora.config import ConfigError

    def mine(logp, logp_behaviour, advantages, mask, cfg, *, keep):
        return policy_loss(logp, logp_behaviour, advantages, mask, cfg, keep=keep)

    with pytest.raises(ConfigError, match="logp_prox"):
        TorchTrainer(tiny_model, WeightStore(tmp_path), LossConfig(is_mask=3.0), TrainerConfig(), loss_fn=mine)
