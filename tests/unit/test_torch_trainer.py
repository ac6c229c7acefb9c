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
from dora.rollout.engines.torch_engine import TorchEngine
from dora.store import WeightStore
from dora.wire import messages as m

pytestmark = pytest.mark.timeout(120)

PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46, 47], [300], [9, 8, 7, 6, 5]]
"""Prompts of 1 to 8 tokens: the first predicting position differs from row to row."""


def sampled_batch(model_dir) -> m.TrainBatch:
    torch.manual_seed(0)
    engine = TorchEngine(model_dir, version=0)
    for g, prompt in enumerate(PROMPTS):
        engine.submit(group_id=g, attempt=0, prompt=prompt, n=3, max_tokens=4 + 5 * g, temperature=1.0, seed=g)
    done = []
    while len(engine):
        done += engine.step()
    groups = []
    for g, prompt in enumerate(PROMPTS):
        mine = sorted((s for s in done if s.group_id == g), key=lambda s: s.index)
        samples = tuple(m.TrainSample(index=s.index, token_ids=np.array(s.tokens, np.int32),
                                      logprobs=np.array(s.logprobs, np.float32), reward=float(sum(s.tokens) % 5),
                                      finish=s.finish or Finish.LENGTH) for s in mine)  # fmt: skip
        groups.append(m.TrainGroup(group_id=g, version=0, prompt_ids=np.array(prompt, np.int32), samples=samples))
    return m.TrainBatch(step=0, groups=tuple(groups))


def test_the_learner_scores_the_engines_samples_at_their_behaviour_log_probs(tiny_model, tmp_path):
    batch = sampled_batch(tiny_model)
    lengths = {len(s.token_ids) for g in batch.groups for s in g.samples}
    assert len(lengths) > 3, "the rows must differ in length for padding to matter"
    trainer = TorchTrainer(tiny_model, WeightStore(tmp_path), LossConfig(), TrainerConfig())
    rows = [(g.prompt_ids.tolist(), s, gi) for gi, g in enumerate(batch.groups) for s in g.samples]
    with torch.no_grad():
        logp, _, mask = trainer._score(rows)
    for b, (_, s, _) in enumerate(rows):
        n = len(s.token_ids)
        assert mask[b].sum() == n
        np.testing.assert_allclose(logp[b, :n].numpy(), s.logprobs, atol=2e-4)
        assert torch.all(logp[b, n:] == 0)
    metrics = trainer.train(batch)
    assert metrics["ratio_min"] == pytest.approx(1.0, abs=1e-3) and metrics["ratio_max"] == pytest.approx(1.0, abs=1e-3)


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
