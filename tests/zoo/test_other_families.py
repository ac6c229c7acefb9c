"""Families beyond the zoo, each built tiny in its test (dora's tokenizer, a random model of the family's config):
the shapes dora meets when a user brings another causal LM.

- DeepSeek's multi-head latent attention caches its compressed latent as keys and the rotary key as values, of two
  widths (32 and 16 here, 512 and 64 in DeepSeek-V3): the torch engine's slot cache holds each in its own shape,
  and sequences joining a running batch still compute what they would alone.
- Layers that keep a state instead of one key and value per token (LFM2's convolutions, Qwen3-Next's linear
  attention, Mamba) cannot be cut per sequence nor padded into a batch: the torch engine refuses them in one line
  before any process starts (and at its own start), and the learner scores them one whole row per sample.
- A decoder whose forward takes no position ids and counts positions from the start of the batch (BART's) is
  refused by the torch engine and scored whole rows by the learner; BLOOM's ALiBi takes none either, but padding
  does not move it, so it is batched as every other family is.
- MPT and DBRX keep their limit on positions in ``max_seq_len``.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch

from dora.config import ConfigError
from dora.hf.checks import check_model
from dora.hf.folder import facts
from dora.hf.tensors import padding_gap
from dora.ids import Finish
from dora.learner.loss import LossConfig
from dora.learner.trainers.torch_trainer import TorchTrainer, TrainerConfig
from dora.rollout.engines.base import EngineError
from dora.rollout.engines.torch.engine import TorchEngine
from dora.samples import TrainSample
from dora.store import WeightStore
from tests.engines.test_torch_families import drain, full_logprobs

pytestmark = pytest.mark.timeout(120)

PROMPTS = ([40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [5, 6, 7], [17, 300, 45, 9, 88, 12])
"""Prompts of 11, 3 and 6 tokens: a batch of them is padded."""
LATENT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 2, "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 16,
          "qk_nope_head_dim": 32, "v_head_dim": 16, "moe_intermediate_size": 32, "n_routed_experts": 4,
          "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
          "first_k_dense_replace": 1}  # fmt: skip
"""DeepSeek-V3's shape, tiny: a latent of 32 (``kv_lora_rank``), a rotary key of 16; a dense layer, then an MoE
one."""
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
         "num_key_value_heads": 1}  # fmt: skip


def build(tiny_model: pathlib.Path, out: pathlib.Path, model_type: str, *, weights: bool = True,
          **config) -> pathlib.Path:  # fmt: skip
    """A ``model_type`` folder with dora's tokenizer (the tiny model's); without ``weights``, its config only."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    end = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = AutoConfig.for_model(model_type, vocab_size=len(tok), bos_token_id=end, eos_token_id=end, pad_token_id=end,
                               tie_word_embeddings=False, **config)  # fmt: skip
    if weights:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    else:
        cfg.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def scored_exactly(folder: pathlib.Path, tmp_path: pathlib.Path, *, whole_rows: bool) -> None:
    """The learner's log-probs of samples of every prompt (several distinct ones: a padded batch) are a full
    forward's."""
    trainer = TorchTrainer(folder, WeightStore(tmp_path / "store"), LossConfig(), TrainerConfig())
    assert trainer.whole_rows is whole_rows
    g = torch.Generator().manual_seed(0)
    rows = []
    for gi, prompt in enumerate(PROMPTS):
        for i, n in enumerate((1 + 4 * gi, 9 - 2 * gi)):
            tokens = torch.randint(0, 1000, (n,), generator=g).numpy().astype(np.int32)
            sample = TrainSample(index=i, token_ids=tokens, logprobs=np.zeros(n, np.float32), reward=0.0,
                                 finish=Finish.LENGTH)  # fmt: skip
            rows.append((list(prompt), sample, gi))
    with torch.no_grad():
        logp, _, mask = trainer._score(rows)
        logp = logp.logp
    for b, (prompt, s, _) in enumerate(rows):
        n = len(s.token_ids)
        assert mask[b].sum() == n and torch.all(logp[b, n:] == 0)
        torch.testing.assert_close(logp[b, :n], full_logprobs(trainer.model, prompt, s.token_ids.tolist()),
                                   atol=1e-4, rtol=0)  # fmt: skip


def test_latent_attention_keys_and_values_of_two_sizes_are_batched_and_scored_exactly(tiny_model, tmp_path):
    folder = build(tiny_model, tmp_path / "deepseek", "deepseek_v3", **LATENT)
    engine = TorchEngine(folder, version=0)
    engine.submit(group_id=0, attempt=1, prompt=list(PROMPTS[0]), n=2, max_tokens=20, temperature=1.0, seed=1)
    for _ in range(4):
        engine.step()
    keys, values = engine.batch.cache.keys[0], engine.batch.cache.values[0]
    assert keys.shape[-1] == LATENT["kv_lora_rank"] and values.shape[-1] == LATENT["qk_rope_head_dim"]
    # these join the running batch, each in a cache slot of its own, while the others decode on
    engine.submit(group_id=1, attempt=1, prompt=list(PROMPTS[1]), n=2, max_tokens=16, temperature=0.8, seed=2)
    engine.submit(group_id=2, attempt=1, prompt=list(PROMPTS[2]), n=1, max_tokens=16, temperature=0.0)
    done = drain(engine)
    assert len(done) == 5
    for (group, _, _), s in done.items():
        if s.temperature > 0:
            ref = full_logprobs(engine.model, list(PROMPTS[group]), s.tokens, s.temperature)
            torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=1e-4, rtol=0)
    with torch.no_grad():
        greedy = engine.model.generate(torch.tensor([PROMPTS[2]]), max_new_tokens=16, do_sample=False,
                                       eos_token_id=sorted(engine.stops), pad_token_id=0)  # fmt: skip
    got = done[(2, 1, 0)].tokens
    assert got == greedy[0, len(PROMPTS[2]) :].tolist()[: len(got)]
    scored_exactly(folder, tmp_path, whole_rows=False)


STATEFUL = [
    ("lfm2", {**SMALL, "layer_types": ["conv", "full_attention"]}, "its layers include conv"),
    ("qwen3_next", {**SMALL, "layer_types": ["linear_attention", "full_attention"], "num_experts": 4,
                    "num_experts_per_tok": 2, "moe_intermediate_size": 32}, "its layers include linear_attention"),
    ("mamba", {"hidden_size": 64, "num_hidden_layers": 2}, "transformers marks MambaForCausalLM stateful"),
]  # fmt: skip


@pytest.mark.parametrize(("model_type", "config", "why"), STATEFUL, ids=[s[0] for s in STATEFUL])
def test_layers_that_keep_a_state_are_refused_on_the_torch_engine_in_one_line(tiny_model, tmp_path, model_type,
                                                                              config, why):  # fmt: skip
    folder = build(tiny_model, tmp_path / model_type, model_type, weights=False, **config)
    check_model(folder, key="rollout.model")  # a learner, or another engine, may run it
    with pytest.raises(ConfigError) as refused:
        check_model(folder, key="rollout.model", engine="torch")
    line = str(refused.value)
    assert "\n" not in line and line.startswith("rollout.model: the torch engine cannot run") and why in line
    assert "use run.engine = 'vllm'" in line


def test_a_model_with_a_state_is_scored_one_whole_row_per_sample_and_the_engine_refuses_it(tiny_model, tmp_path):
    folder = build(tiny_model, tmp_path / "lfm2", "lfm2", **{**SMALL, "layer_types": ["conv", "full_attention"]})
    with pytest.raises(EngineError, match="the torch engine cannot run Lfm2ForCausalLM"):
        TorchEngine(folder, version=0)  # a worker started without dora's checks
    scored_exactly(folder, tmp_path, whole_rows=True)


def test_positions_counted_from_the_batch_start_are_refused_and_alibi_is_batched(tiny_model, tmp_path):
    bart = build(tiny_model, tmp_path / "bart", "bart", d_model=64, decoder_layers=2, decoder_attention_heads=2,
                 decoder_ffn_dim=128, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=128,
                 is_decoder=True)  # fmt: skip
    with pytest.raises(EngineError, match="takes no position_ids and counts positions from the start of the batch"):
        TorchEngine(bart, version=0)
    scored_exactly(bart, tmp_path / "bart-score", whole_rows=True)

    bloom = build(tiny_model, tmp_path / "bloom", "bloom", hidden_size=64, n_layer=2, n_head=2)
    engine = TorchEngine(bloom, version=0)
    assert padding_gap(engine.model) is None and facts(bloom).max_positions is None  # ALiBi: no table of positions
    engine.submit(group_id=0, attempt=1, prompt=list(PROMPTS[0]), n=2, max_tokens=16, temperature=1.0, seed=1)
    for _ in range(3):
        engine.step()
    engine.submit(group_id=1, attempt=1, prompt=list(PROMPTS[1]), n=2, max_tokens=16, temperature=1.0, seed=2)
    for (group, _, _), s in drain(engine).items():
        torch.testing.assert_close(torch.tensor(s.logprobs), full_logprobs(engine.model, list(PROMPTS[group]),
                                                                           s.tokens), atol=1e-4, rtol=0)  # fmt: skip


@pytest.mark.parametrize(("model_type", "config"), [("mpt", {"max_seq_len": 4096}),
                                                    ("dbrx", {"max_seq_len": 8192})])  # fmt: skip
def test_a_limit_kept_in_max_seq_len_is_the_models(tiny_model, tmp_path, model_type, config):
    folder = build(tiny_model, tmp_path / model_type, model_type, weights=False, **config)
    assert json.loads((folder / "config.json").read_text())["max_seq_len"] == config["max_seq_len"]
    assert facts(folder).max_positions == config["max_seq_len"]
