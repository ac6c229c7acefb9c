"""Every family of the zoo (``dora.hf.zoo``) through the torch engine's slot cache: prompts of three lengths decode
side by side under per-row masks (Gemma 2 and 3 past their sliding windows of 64 and 16), samples join while others
run, episodes' next turns are prefilled on their kept caches from different columns in one pass, and every sampled
token's log-prob is a full forward's, a sample's tokens those it makes alone. GPT-2's learned positions, Phi-3's
one sliding mask, Qwen2-MoE's experts are in the zoo; DeepSeek's latent attention and BLOOM's ALiBi are in
tests/zoo/test_other_families.py."""

from __future__ import annotations

import pytest
import torch

from dora.hf import zoo
from dora.rollout.engines.torch.engine import TorchEngine

pytestmark = pytest.mark.timeout(300)

PROMPTS = ([40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [5, 6, 7], [17, 300, 45, 9, 88, 12])


@pytest.fixture(scope="module")
def family_model(tmp_path_factory):
    built = {}

    def get(family: str):
        if family not in built:
            built[family] = zoo.build(family, tmp_path_factory.mktemp(f"zoo-{family}") / "model")
        return built[family]

    return get


def full_logprobs(model, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, -1)
    return logp[torch.arange(len(tokens)), torch.tensor(tokens)]


def drain(e: TorchEngine) -> dict:
    done = {}
    while len(e):
        done.update({s.key: s for s in e.step()})
    return done


def batched(folder) -> None:
    e = TorchEngine(folder, max_slots=4, version=0)
    e.stops = frozenset()  # random weights: every sample runs to its length
    e.submit(group_id=0, attempt=1, prompt=PROMPTS[0], n=2, max_tokens=70, temperature=1.0, seed=1)
    for _ in range(5):
        e.step()
    e.submit(group_id=1, attempt=1, prompt=PROMPTS[1], n=2, max_tokens=12, temperature=0.8, seed=2)
    e.submit(group_id=2, attempt=1, prompt=PROMPTS[2], n=1, max_tokens=20, temperature=1.0, seed=3)
    done = drain(e)
    assert len(done) == 5
    for (group, _, _), s in done.items():
        ref = full_logprobs(e.model, PROMPTS[group], s.tokens, s.temperature)
        torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=1e-4, rtol=0)
    alone = TorchEngine(folder, version=0)
    alone.stops = frozenset()
    alone.submit(group_id=2, attempt=1, prompt=PROMPTS[2], n=1, max_tokens=20, temperature=1.0, seed=3)
    assert drain(alone)[(2, 1, 0)].tokens == done[(2, 1, 0)].tokens


def turns(folder) -> None:
    e = TorchEngine(folder, max_slots=4, version=0)
    e.stops = frozenset()
    seqs = e.submit(group_id=5, attempt=1, prompt=PROMPTS[0], n=2, max_tokens=9, seed=4, keep_kv=True)
    seqs[1].max_tokens = 5  # their caches differ in length at the turn's end
    e.submit(group_id=6, attempt=1, prompt=PROMPTS[1], n=1, max_tokens=40, seed=5)
    queries = []
    rows = e.batch.masks.rows

    def spy(starts, query, width):
        queries.append(query)
        return rows(starts, query, width)

    e.batch.masks.rows = spy
    while any(s.finish is None for s in seqs):
        e.step()
    for s, obs in zip(seqs, ([60, 61, 62, 63, 64, 65, 66], [70, 71]), strict=True):
        s.max_tokens = 12
        e.extend(s, obs)  # different lengths: one fill, rows from different columns
    while any(s.finish is None for s in seqs):
        e.step()
    assert max(queries) == 7, "the two next turns were prefilled in one pass, from different columns"
    for s in seqs:
        sampled = torch.tensor(s.mask, dtype=torch.bool)
        assert int(sampled.sum()) > 9
        ref = full_logprobs(e.model, PROMPTS[0], s.tokens)[sampled]
        torch.testing.assert_close(torch.tensor(s.logprobs)[sampled], ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", zoo.FAMILIES)
def test_a_family_batches_in_slots_exactly(family_model, family):
    folder = family_model(family)
    batched(folder)
    turns(folder)


def test_eager_attention_masks_add_and_gemmas_logits_are_capped_as_its_own_forward_caps_them(family_model,
                                                                                             monkeypatch):  # fmt: skip
    from transformers import AutoModelForCausalLM

    opened = AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **kw: opened(*a, **kw, attn_implementation="eager"))  # fmt: skip
    folder = family_model("gemma")
    e = TorchEngine(folder, version=0)
    assert e.model.config._attn_implementation == "dora_eager" and e.batch.masks.additive
    assert e.model.config.attn_logit_softcapping
    batched(folder)
    turns(folder)
