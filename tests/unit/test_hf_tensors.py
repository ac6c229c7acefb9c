"""Tied parameters and FSDP2's blocks, read from the model itself (``dora.hf.tensors``)."""

from __future__ import annotations

import pytest
import torch

from dora.config import ConfigError
from dora.hf.tensors import blocks, publishable, tied_copies, with_copies


def gpt2(tied: bool = True):
    from transformers import AutoModelForCausalLM, GPT2Config

    cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=3, n_head=2, n_positions=32, tie_word_embeddings=tied,
                     bos_token_id=0, eos_token_id=0)  # fmt: skip
    return AutoModelForCausalLM.from_config(cfg)


def test_a_tied_head_is_a_copy_of_the_embedding_and_an_untied_one_is_not():
    assert tied_copies(gpt2()) == {"lm_head.weight": "transformer.wte.weight"}
    assert tied_copies(gpt2(tied=False)) == {}


def test_a_published_state_leaves_the_copy_out_and_a_load_fills_it_from_the_tensor_it_shares():
    model = gpt2()
    copies = tied_copies(model)
    state = publishable(model.state_dict(), copies)
    assert "lm_head.weight" not in state and "transformer.wte.weight" in state
    full = with_copies(state, copies)
    assert full["lm_head.weight"] is full["transformer.wte.weight"]
    fresh = gpt2()
    fresh.load_state_dict(full)
    assert torch.equal(fresh.lm_head.weight, model.transformer.wte.weight)


def test_the_blocks_are_the_classes_the_model_declares_wherever_they_live():
    model = gpt2()
    found = blocks(model)
    assert [type(b).__name__ for b in found] == ["GPT2Block"] * 3
    assert all(a is b for a, b in zip(found, model.transformer.h, strict=True))


def test_a_model_that_declares_no_blocks_is_one_clear_error():
    class Plain(torch.nn.Module):
        _no_split_modules = None

        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])

    with pytest.raises(ConfigError, match=r"Plain: no decoder blocks to shard with FSDP2 .*declares none.*ranks = 1"):
        blocks(Plain())
    model = gpt2()
    model._no_split_modules = ["NoSuchBlock"]
    with pytest.raises(ConfigError, match=r"declares \['NoSuchBlock'\] but has none of them"):
        blocks(model)
