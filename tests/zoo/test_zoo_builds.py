"""The model zoo: every family builds offline into an HF folder that loads as its architecture, with the quirks its
record declares, read back from the folder (config.json, generation_config.json, tokenizer, safetensors)."""

from __future__ import annotations

import json

import pytest
import torch

from dora.hf import zoo

pytestmark = pytest.mark.timeout(120)
CHAT = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "5"}]


@pytest.fixture(scope="module")
def folders(zoo_model):
    return {name: zoo_model(name) for name in zoo.FAMILIES}


def loaded(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(str(path)).eval(), AutoTokenizer.from_pretrained(str(path))


def ids_of(tok, value) -> list[str]:
    return tok.convert_ids_to_tokens(value if isinstance(value, list) else [value])


@pytest.mark.parametrize("name", zoo.FAMILIES)
def test_a_family_loads_as_its_architecture_tied_or_not(folders, name):
    from safetensors import safe_open

    fam = zoo.ZOO[name]
    model, tok = loaded(folders[name])
    block = model.get_submodule(fam.blocks_at)[0]
    assert f"{type(block).__module__}.{type(block).__name__}" == fam.block
    assert type(block).__name__ in model._no_split_modules
    assert model.config.model_type == fam.model_type
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert (head is embed) is fam.tied
    with safe_open(str(folders[name] / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    assert ("lm_head.weight" in saved) is not fam.tied  # a tied head is written once, as the embedding
    assert model.config.vocab_size >= len(tok) and model.config.vocab_size % fam.vocab_multiple == 0
    limit = model.config.n_positions if fam.model_type == "gpt2" else model.config.max_position_embeddings
    assert limit == fam.max_positions
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[17, 300, 45, 9]])).logits
    assert logits.shape == (1, 4, model.config.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.parametrize("name", zoo.FAMILIES)
def test_eos_ids_are_where_the_real_folders_put_them(folders, name):
    from transformers import AutoTokenizer

    fam = zoo.ZOO[name]
    tok = AutoTokenizer.from_pretrained(str(folders[name]))
    config = json.loads((folders[name] / "config.json").read_text())
    generation = json.loads((folders[name] / "generation_config.json").read_text())
    assert isinstance(config["eos_token_id"], list) is (len(fam.config_eos) > 1)
    assert ids_of(tok, config["eos_token_id"]) == list(fam.config_eos)
    assert ids_of(tok, generation["eos_token_id"]) == list(fam.generation_eos)
    assert tok.eos_token == fam.eos and tok.bos_token == fam.bos and tok.pad_token == fam.pad
    if fam.turn_end is not None:  # HF generate and vLLM stop at the turn end; config.eos_token_id may not list it
        assert fam.turn_end in ids_of(tok, generation["eos_token_id"])


def test_the_turn_end_is_listed_only_in_generation_config_for_gemma_and_phi3_and_in_config_for_llama3(folders):
    from transformers import AutoTokenizer

    for name, in_config in (("gemma", False), ("phi3", False), ("llama3", True), ("qwen2", True)):
        tok = AutoTokenizer.from_pretrained(str(folders[name]))
        config = json.loads((folders[name] / "config.json").read_text())
        assert (zoo.ZOO[name].turn_end in ids_of(tok, config["eos_token_id"])) is in_config, name


@pytest.mark.parametrize("name", [n for n in zoo.FAMILIES if zoo.ZOO[n].template is not None])
def test_the_turn_end_is_one_special_token_and_the_template_ends_turns_with_it(folders, name):
    from tokenizers import Tokenizer

    fam = zoo.ZOO[name]
    _, tok = loaded(folders[name])
    raw = Tokenizer.from_file(str(folders[name] / "tokenizer.json"))  # what dora's prompts and stop ids read
    end = raw.token_to_id(fam.turn_end)
    assert end is not None and end in tok.all_special_ids
    assert tok.encode(fam.turn_end, add_special_tokens=False) == [end]
    said = tok.apply_chat_template(CHAT, tokenize=False)
    ids = tok.encode(said, add_special_tokens=False)
    answer = tok.encode("5", add_special_tokens=False)
    after = max(i for i in range(len(ids)) if ids[i : i + len(answer)] == answer) + len(answer)
    assert ids[after] == end  # the assistant's turn ends on the turn-end token itself
    prompt = tok.apply_chat_template(CHAT[:1], tokenize=False, add_generation_prompt=True)
    assert not prompt.rstrip().endswith(fam.turn_end)  # the generation prompt opens a turn


def test_gpt2_has_no_chat_template(folders):
    _, tok = loaded(folders["gpt2"])
    assert tok.chat_template is None and not (folders["gpt2"] / "chat_template.jinja").exists()


@pytest.mark.parametrize("name", zoo.FAMILIES)
def test_bos_is_prepended_by_the_tokenizer_where_the_family_does(folders, name):
    fam = zoo.ZOO[name]
    _, tok = loaded(folders[name])
    ids = tok("2+3=").input_ids
    assert (ids[0] == tok.bos_token_id and ids[1:] == tok("2+3=", add_special_tokens=False).input_ids) is fam.adds_bos
    if fam.adds_bos and fam.template is not None and "bos_token" in fam.template:
        rendered = tok.apply_chat_template(CHAT[:1], tokenize=True, add_generation_prompt=True)
        rendered = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
        assert list(rendered).count(tok.bos_token_id) == 1  # the template writes it; applying it adds no second


def test_template_quirks_gemma_refuses_a_system_turn_qwen3_closes_thinking_qwen2_adds_a_system_turn(folders):
    from jinja2.exceptions import TemplateError

    _, gemma = loaded(folders["gemma"])
    with pytest.raises(TemplateError, match="System role"):
        gemma.apply_chat_template([{"role": "system", "content": "x"}, *CHAT[:1]], tokenize=False)
    _, qwen3 = loaded(folders["qwen3"])
    off = qwen3.apply_chat_template(CHAT[:1], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    _, qwen2 = loaded(folders["qwen2"])
    assert qwen2.apply_chat_template(CHAT[:1], tokenize=False).startswith("<|im_start|>system\nYou are Qwen")


def test_a_build_is_a_pure_function_of_family_and_seed(tmp_path):
    a, b, c = (zoo.build("mistral", tmp_path / str(i), seed=s) for i, s in enumerate((0, 0, 1)))
    same = (a / "model.safetensors").read_bytes()
    assert same == (b / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_text() == (c / "tokenizer.json").read_text()


def test_an_unknown_family_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown family"):
        zoo.build("bloom", tmp_path)
