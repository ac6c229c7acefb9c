"""The torch trainer scores exactly the tokens the engine sampled, and its step does not depend on how the
batch is cut into micro-batches (rows are sorted by length and logits are kept only where sampled tokens are
predicted: neither may change what is computed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dora.ids import Finish
from dora.learner.loss import LossConfig
from dora.learner.trainers.torch_trainer import TorchTrainer, TrainerConfig
from dora.rollout.engines.torch.engine import TorchEngine
from dora.samples import Batch, TrainGroup, TrainSample
from dora.store import WeightStore

pytestmark = pytest.mark.timeout(120)

PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46, 47], [300], [9, 8, 7, 6, 5]]
"""Prompts of 1 to 8 tokens: the first predicting position differs from row to row."""


def sampled_batch(model_dir, temperature: float = 1.0, top_p: float = 1.0) -> Batch:
    torch.manual_seed(0)
    engine = TorchEngine(model_dir, version=0)
    for g, prompt in enumerate(PROMPTS):
        engine.submit(group_id=g, attempt=0, prompt=prompt, n=3, max_tokens=4 + 5 * g, temperature=temperature,
                      top_p=top_p, seed=g)  # fmt: skip
    done = []
    while len(engine):
        done += engine.step()
    groups = []
    for g, prompt in enumerate(PROMPTS):
        end = {s.key: Finish.LENGTH if s.finish is None else s.finish for s in done}
        mine = sorted((s for s in done if s.group_id == g), key=lambda s: s.index)
        samples = tuple(TrainSample(index=s.index, token_ids=np.array(s.tokens, np.int32),
                                    logprobs=np.array(s.logprobs, np.float32), reward=float(sum(s.tokens) % 5),
                                    finish=end[s.key]) for s in mine)  # fmt: skip
        groups.append(TrainGroup(group_id=g, version=0, prompt_ids=np.array(prompt, np.int32), samples=samples))
    return Batch(step=0, groups=tuple(groups))


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (1.0, 0.5), (0.8, 0.9)])
def test_the_learner_scores_the_engines_samples_at_their_behaviour_log_probs(tiny_model, tmp_path, temperature, top_p):
    """One distribution on both sides: at the behaviour version's own weights the learner's log-prob of every
    sampled token is the engine's (within 1e-4 in float32), under the temperature and the top_p nucleus, so every
    ratio of the step is 1."""
    batch = sampled_batch(tiny_model, temperature, top_p)
    lengths = {len(s.token_ids) for g in batch.groups for s in g.samples}
    assert len(lengths) > 3, "the rows must differ in length for padding to matter"
    trainer = TorchTrainer(tiny_model, WeightStore(tmp_path), LossConfig(),
                           TrainerConfig(temperature=temperature, top_p=top_p))  # fmt: skip
    rows = [(g.prompt_ids.tolist(), s, gi) for gi, g in enumerate(batch.groups) for s in g.samples]
    with torch.no_grad():
        logp, _, mask = trainer._score(rows)
        logp = logp.logp
    for b, (_, s, _) in enumerate(rows):
        n = len(s.token_ids)
        assert mask[b].sum() == n
        np.testing.assert_allclose(logp[b, :n].numpy(), s.logprobs, atol=1e-4, rtol=0)
        assert torch.all(logp[b, n:] == 0)
    metrics = trainer.train(batch)
    assert metrics["ratio_min"] == pytest.approx(1.0, abs=1e-4) and metrics["ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["mismatch_abs"] < 1e-4 and metrics["mismatch_tokens"] == sum(lengths_of(batch))
    if top_p < 1:  # the nucleus matters: over the whole vocabulary each token is less likely, by the nucleus's mass
        whole = TorchTrainer(tiny_model, WeightStore(tmp_path / "whole"), LossConfig(),
                             TrainerConfig(temperature=temperature)).train(batch)  # fmt: skip
        assert whole["ratio_max"] < 1 - 1e-3 and whole["ratio_min"] >= top_p - 1e-4, whole


def lengths_of(batch: Batch) -> list[int]:
    return [len(s.token_ids) for g in batch.groups for s in g.samples]


@pytest.mark.parametrize("micro_batch", [1, 5])
def test_the_step_is_the_same_whatever_the_micro_batch(tiny_model, tmp_path, micro_batch):
    batch = sampled_batch(tiny_model)
    whole = TorchTrainer(tiny_model, WeightStore(tmp_path / "a"), LossConfig(), TrainerConfig(lr=1e-2, micro_batch=64))
    cut = TorchTrainer(tiny_model, WeightStore(tmp_path / "b"), LossConfig(),
                       TrainerConfig(lr=1e-2, micro_batch=micro_batch))  # fmt: skip
    a, b = whole.train(batch), cut.train(batch)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    initial = TorchTrainer(tiny_model, WeightStore(tmp_path / "c"), LossConfig(), TrainerConfig()).model
    moved = 0.0
    for (name, p), q, p0 in zip(whole.model.named_parameters(), cut.model.parameters(), initial.parameters(),
                                strict=True):  # fmt: skip
        where = f"{name}'s gradient"
        torch.testing.assert_close(p.grad, q.grad, atol=1e-7, rtol=1e-4, msg=lambda e, w=where: f"{w}: {e}")
        moved = max(moved, float((p - p0).abs().max()))
    assert moved > 1e-3, "the step must move the weights for the comparison to mean anything"


def as_episodes(batch: Batch, env_logprob: float) -> Batch:
    """The same trajectories read as two-turn episodes: the middle third of each one's tokens is the
    environment's (loss mask 0), carrying ``env_logprob`` as its behaviour log-prob (an engine writes 0)."""
    groups = []
    for g in batch.groups:
        samples = []
        for s in g.samples:
            n = len(s.token_ids)
            a, b = n // 3, max(n // 3 + 1, 2 * n // 3)
            mask = np.ones(n, np.uint8)
            mask[a:b] = 0
            logprobs = s.logprobs.copy()
            logprobs[a:b] = env_logprob
            turns = np.array([t for t in ([0, a, g.version], [b, n, g.version]) if t[1] > t[0]], np.int32)
            samples.append(TrainSample(index=s.index, token_ids=s.token_ids, logprobs=logprobs, reward=s.reward,
                                       finish=s.finish, loss_mask=mask, turns=turns.reshape(-1, 3)))  # fmt: skip
        groups.append(TrainGroup(group_id=g.group_id, version=g.version, prompt_ids=g.prompt_ids,
                                 samples=tuple(samples)))  # fmt: skip
    return Batch(step=batch.step, groups=tuple(groups))


def test_environment_tokens_are_context_but_never_trained(tiny_model, tmp_path):
    """Masking is exact: the learner's mask is the loss mask; a model token after environment tokens is scored
    with them in its context; the loss has no gradient with respect to an environment token's log-prob; and the
    step does not depend on what behaviour log-probs environment tokens carry."""
    from dora.learner.loss import policy_loss

    plain = sampled_batch(tiny_model)
    episodes = as_episodes(plain, 0.0)
    assert any(s.loss_mask is not None and 0 < s.loss_mask.sum() < len(s.loss_mask)
               for g in episodes.groups for s in g.samples)  # fmt: skip
    trainer = TorchTrainer(tiny_model, WeightStore(tmp_path / "a"), LossConfig(), TrainerConfig())
    rows = [(g.prompt_ids.tolist(), s, gi) for gi, g in enumerate(episodes.groups) for s in g.samples]
    with torch.no_grad():
        logp, _, mask = trainer._score(rows)
        logp = logp.logp
        full = trainer._score([(p, plain.groups[gi].samples[s.index], gi) for p, s, gi in rows])[0].logp
    for b, (_, s, _) in enumerate(rows):
        n = len(s.token_ids)
        assert mask[b, :n].tolist() == s.loss_mask.astype(float).tolist() and not mask[b, n:].any()
        model = s.loss_mask.astype(bool)
        # the same tokens in the same context: every model token's log-prob is the unmasked run's
        np.testing.assert_allclose(logp[b, :n].numpy()[model], full[b, :n].numpy()[model], atol=1e-5)
        assert np.all(logp[b, :n].numpy()[~model] == 0)
    leaf = full.clone().requires_grad_(True)
    beh = torch.stack([torch.nn.functional.pad(torch.from_numpy(s.logprobs), (0, full.shape[1] - len(s.logprobs)))
                       for _, s, _ in rows])  # fmt: skip
    loss, _ = policy_loss(leaf, beh, torch.linspace(-1, 1, len(rows)), mask, LossConfig())
    loss.backward()
    assert torch.all(leaf.grad[mask == 0] == 0) and leaf.grad[mask == 1].abs().sum() > 0

    other = TorchTrainer(tiny_model, WeightStore(tmp_path / "b"), LossConfig(), TrainerConfig())
    trainer.train(episodes)
    other.train(as_episodes(plain, -7.0))  # junk behaviour log-probs on environment tokens change nothing
    for (name, p), q in zip(trainer.model.named_parameters(), other.model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=0, rtol=0, msg=lambda e, w=name: f"{w}: {e}")
        assert p.grad is not None


def test_an_episode_of_no_tokens_trains_nothing_and_its_batch_trains(tiny_model, tmp_path):
    """An agent that never asked for a completion is an episode of no tokens: its group is trained whole, the empty
    sample contributes nothing; a micro-batch of only such samples is no step at all, not an error."""
    batch = sampled_batch(tiny_model)
    empty = TrainSample(index=0, token_ids=np.zeros(0, np.int32), logprobs=np.zeros(0, np.float32), reward=1.0,
                        finish=Finish.STOP, loss_mask=np.zeros(0, np.uint8), turns=np.zeros((0, 3), np.int32))
    first = batch.groups[0]
    groups = (TrainGroup(group_id=first.group_id, version=0, prompt_ids=first.prompt_ids,
                         samples=(empty, *first.samples[1:])), *batch.groups[1:])  # fmt: skip
    metrics = TorchTrainer(tiny_model, WeightStore(tmp_path / "a"), LossConfig(),
                           TrainerConfig(lr=1e-2, micro_batch=1)).train(Batch(step=0, groups=groups))  # fmt: skip
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
