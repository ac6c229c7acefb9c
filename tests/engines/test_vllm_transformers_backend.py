"""Architectures vLLM runs through its Transformers backend: those its registry maps to ``TransformersForCausalLM``
(GPT-NeoX, OLMo 2, StarCoder2, ...) and any other transformers class that dispatches attention through transformers'
attention interface (Helium). They pass the model check for vLLM workers, sample with their weights' log-probs and
take a published version in place; a model whose layers keep a state is refused in one line, as that backend keeps
attention's keys and values only, and so is a folder whose architecture vLLM runs as a pooling model.

vLLM's Transformers backend decorates transformers' own decoder class (``Olmo2Model``) in the process that builds the
engine, for its compiler: the references are computed before the engine starts, and no other test runs OLMo 2.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dora.config import ConfigError
from dora.hf.checks import check_model
from dora.store import WeightStore
from tests.engines.test_engines import TOLERANCE, run
from tests.zoo.test_other_families import SMALL, build

NO_VLLM = importlib.util.find_spec("vllm") is None
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(300),
    pytest.mark.skipif(NO_VLLM, reason="the vllm extra is not installed"),
]

PROMPTS = ([17, 300, 45, 9, 88, 12], [5, 6, 7])
ZAMBA = {**SMALL, "num_hidden_layers": 6, "num_key_value_heads": 2, "attention_head_dim": 64, "mamba_d_state": 8,
         "n_mamba_heads": 2, "attn_layer_period": 6, "attn_layer_offset": 4, "use_mamba_kernels": False}  # fmt: skip
"""Zamba: Mamba layers and one shared attention layer; vLLM registers Zamba2 only."""


@pytest.mark.parametrize(
    ("model_type", "architecture"),
    [("gpt_neox", "GPTNeoXForCausalLM"), ("olmo2", "Olmo2ForCausalLM"), ("helium", "HeliumForCausalLM")],
)
def test_what_vllm_runs_through_its_transformers_backend_passes_the_check(tiny_model, tmp_path, model_type,
                                                                          architecture):  # fmt: skip
    folder = build(tiny_model, tmp_path / model_type, model_type, weights=False, architectures=[architecture], **SMALL)
    assert check_model(folder, key="rollout.model", engine="vllm").model_type == model_type


REFUSED = [
    ("zamba", "ZambaForCausalLM", ZAMBA,
     "it would run ZambaForCausalLM through its Transformers backend, which keeps attention's keys and values and no "
     "other state: transformers marks ZambaForCausalLM stateful; the torch engine cannot run it either"),
    ("qwen2", "Qwen2ForRewardModel", SMALL,
     "it runs Qwen2ForRewardModel as a pooling model (embeddings or scores, as the name's ending says), not as a "
     "generator (a reward or embedding model's folder, not a causal LM's)"),
]  # fmt: skip


@pytest.mark.parametrize(("model_type", "architecture", "config", "why"), REFUSED, ids=[r[0] for r in REFUSED])
def test_what_vllm_does_not_generate_with_is_refused_in_one_line(tiny_model, tmp_path, model_type, architecture,
                                                                 config, why):  # fmt: skip
    folder = build(tiny_model, tmp_path / model_type, model_type, weights=False, architectures=[architecture], **config)
    with pytest.raises(ConfigError) as refused:
        check_model(folder, key="rollout.model", engine="vllm")
    assert str(refused.value) == f"rollout.model: vLLM cannot run {folder} ({architecture}): {why}"


def next_token_logprobs(model, prompts) -> list[torch.Tensor]:
    with torch.no_grad():
        return [torch.log_softmax(model(input_ids=torch.tensor([p])).logits[0, -1].float(), -1) for p in prompts]


def greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=-1, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def test_olmo2_samples_with_its_weights_and_takes_a_published_version_in_place(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = build(tiny_model, tmp_path / "olmo2", "olmo2", **SMALL, initializer_range=0.3)
    check_model(folder, key="rollout.model", engine="vllm")
    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    want = {0: (next_token_logprobs(model, PROMPTS), greedy(model, PROMPTS[0], 12))}
    torch.manual_seed(1)
    changed = {k: (v + 0.05 * torch.randn_like(v)).contiguous() for k, v in model.state_dict().items()}
    model.load_state_dict(changed)
    want[1] = (next_token_logprobs(model, PROMPTS), greedy(model, PROMPTS[0], 12))
    assert want[1][1] != want[0][1]
    store = WeightStore(tmp_path / "store")
    _, digest, _ = store.publish(1, changed)
    del model
    from dora.rollout.engines.vllm_engine import VllmEngine

    e = VllmEngine(folder, max_slots=8, kv_cache_bytes=64 << 20, max_model_len=256, version=0)
    assert e.llm.llm_engine.model_config.architecture == "Olmo2ForCausalLM"  # its registry's Transformers entry

    def sampled(version: int) -> float:
        """The largest difference between the log-probs the engine reports and ``version``'s, sampling one token
        after each prompt; the greedy continuation is ``version``'s."""
        for i, prompt in enumerate(PROMPTS):
            e.submit(group_id=i, attempt=1, prompt=prompt, n=4, max_tokens=1, temperature=1.0, seed=3)
        ref = want[version][0]
        diff = max(abs(s.logprobs[0] - ref[s.group_id][s.tokens[0]].item()) for s in run(e).values())
        e.submit(group_id=9, attempt=1, prompt=PROMPTS[0], n=1, max_tokens=12, temperature=0.0)
        assert list(next(iter(run(e).values())).tokens) == want[version][1]
        return diff

    assert sampled(0) < TOLERANCE["vllm"]
    e.load_weights(1, store.path(1), digest)
    assert e.version == 1 and sampled(1) < TOLERANCE["vllm"]
