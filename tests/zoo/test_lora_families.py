"""LoRA on every family of the zoo (tied embeddings, fused projections, GPT-2's Conv1D, a mixture of experts):
the learner trains adapters on the frozen model and publishes an adapter folder; a torch worker holding two
versions loads it beside the start model (version 0) and scores a batch whose rows carry either version, each
row as the trainer's policy of that version scores it. A mixture of experts' adapted experts see routed tokens, not
rows: its worker holds one version at a time."""

from __future__ import annotations

import pytest
import torch

from dora.config.models import LoraSection
from dora.hf import zoo
from dora.learner.loss import LossConfig
from dora.learner.trainers.torch_trainer import TorchTrainer, TrainerConfig
from dora.rollout.engines.base import EngineError
from dora.store import WeightStore
from tests.unit.test_fsdp import batch

pytestmark = pytest.mark.timeout(300)

LORA = TrainerConfig(lr=1e-2, micro_batch=2, lora=LoraSection(rank=4, alpha=8.0))


@pytest.mark.parametrize("family", zoo.FAMILIES)
def test_a_family_trains_adapters_and_a_two_version_worker_samples_each_row_under_its_own(zoo_model, tmp_path, family):
    from dora.rollout.engines.torch.engine import TorchEngine

    model = zoo_model(family)
    t = TorchTrainer(str(model), WeightStore(tmp_path / "store"), LossConfig(), LORA)
    frozen = {n: p.detach().clone() for n, p in t.model.named_parameters() if not p.requires_grad}
    t.train(batch())
    t.publish(1)
    assert all(torch.equal(p, frozen[n]) for n, p in t.model.named_parameters() if not p.requires_grad), family
    try:
        engine = TorchEngine(model, version=0, lora=LORA.lora, max_versions=2)
    except EngineError as e:  # a family whose adapted layers the engine cannot stack says so in one line
        pytest.fail(f"{family}: {e}")
    versions = (0, 1) if family != "qwen2_moe" else (1,)
    assert engine.max_versions == len(versions), family
    keep = frozenset(versions) - {1}  # the broker's Assign.keep
    engine.load_weights(1, t.store.path(1), t.store.digest(1), keep=keep)
    assert engine.held_versions() == set(versions)
    prompt = [11, 12, 13, 40, 41]
    for version in versions * 2:  # one batch: rows of both versions, each under its own adapters
        engine.submit(group_id=version, attempt=len(engine) + 1, prompt=prompt, n=1, max_tokens=4, temperature=1.0,
                      top_p=1.0, seed=7, version=version)  # fmt: skip
    done = []
    while len(engine):
        done += engine.step()
    assert len(done) == 2 * len(versions)
    base = TorchTrainer(str(model), WeightStore(tmp_path / "base"), LossConfig(), LORA)  # version 0: B is zero
    with torch.no_grad():
        for seq in done:
            policy = t.model if seq.group_id == 1 else base.model
            ids = torch.tensor([prompt + seq.tokens])
            logits = policy(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq.tokens)[:, None])[:, 0]
            got = torch.tensor(seq.logprobs)
            assert torch.allclose(got, want, atol=1e-4), (family, seq.group_id, got, want)
