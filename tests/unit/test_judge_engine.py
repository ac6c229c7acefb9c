"""The LLM judge of `dora reward` on dora's own torch engine: its answers to a batch of filled templates, submitted
to the engine at once and stepped until done, are the greedy answers transformers' ``generate`` gives for each
prompt alone from the same folder, ending on the same stop ids (the EOS ids and the chat template's end of turn: the
tiny model's end of turn is made to outscore one token its greedy answers write, so answers end on it); a prompt
longer than the model leaves for the answer keeps its end. The vLLM engine's judge is
``test_the_vllm_judge_answers_as_the_torch_one`` (slow)."""

from __future__ import annotations

import importlib.util
import pathlib
import shutil
from typing import Any

import pytest

from dora.config.run import TaskSection
from dora.reward.scorers import Judge, complete

REQUESTS = [{"id": "a", "prompt": "What is 3 + 4?", "completion": "= 7", "answer": "7"},
            {"id": "b", "prompt": "Say hi.", "completion": "hi there, friend", "answer": "hi"},
            {"id": "c", "prompt": "", "completion": "no prompt at all", "answer": ""},
            {"id": "d", "prompt": "Add 5 and 7.", "completion": "5 + 7 = 12 " * 6, "answer": "12"}]  # fmt: skip


@pytest.fixture(scope="module")
def judge_folder(tiny_model: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The tiny model with its end of turn's output row 1.5 times that of the 4th token of request a's greedy
    answer: wherever that token would come next, the answer ends instead."""
    import torch
    from transformers import AutoModelForCausalLM

    judge = Judge(TaskSection(name="arithmetic", reward_judge=str(tiny_model), judge_max_tokens=4))
    ([*_, token],) = complete(judge.engine, [0], [judge.encode(REQUESTS[0])], max_tokens=4, stops=judge.stops)
    out = tmp_path_factory.mktemp("judge") / "model"
    shutil.copytree(tiny_model, out)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight[judge.tokenizer.convert_tokens_to_ids("<|im_end|>")] = 1.5 * model.lm_head.weight[token]
    model.save_pretrained(out)
    return out


def generated(folder: pathlib.Path, judge: Judge, requests: list[dict[str, Any]]) -> list[str]:
    """Each request's greedy answer from ``generate``, one prompt at a time, stopping on the judge's stop ids."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    out = []
    for r in requests:
        ids = torch.tensor([judge.encode(r)])
        with torch.inference_mode():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=judge.max_tokens,
                                 do_sample=False, eos_token_id=sorted(judge.stops),
                                 pad_token_id=judge.tokenizer.pad_token_id)  # fmt: skip
        out.append(str(judge.tokenizer.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)))
    return out


def test_the_judge_on_the_torch_engine_answers_as_greedy_generate(judge_folder: pathlib.Path) -> None:
    judge = Judge(TaskSection(name="arithmetic", reward_judge=str(judge_folder), judge_max_tokens=12))
    assert judge.engine.name == "torch" and judge.engine.held_versions() == {0}
    end = judge.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert judge.stops == {judge.tokenizer.convert_tokens_to_ids("<|endoftext|>"), end}
    answers = judge.answers(REQUESTS)
    assert answers == generated(judge_folder, judge, REQUESTS)
    assert len(set(answers)) > 1 and all(answers), answers  # the prompts differ, and so do the answers
    tokens = complete(judge.engine, [1, 2, 3, 4], [judge.encode(r) for r in REQUESTS], max_tokens=12,
                      stops=judge.stops)  # fmt: skip
    assert tokens[0][-1] == end and len(tokens[0]) <= 4  # an answer ended on the end of turn, before its budget
    assert judge.answers(REQUESTS[::-1]) == answers[::-1]  # the same answers in another batch, in its order
    assert len(judge.engine) == 0  # nothing is left in the engine between batches


def test_a_long_judge_prompt_keeps_its_end(tiny_model: pathlib.Path) -> None:
    judge = Judge(TaskSection(name="arithmetic", reward_judge=str(tiny_model), judge_max_tokens=12))
    long = {"id": "x", "prompt": "word " * 5000, "completion": "the end", "answer": "1"}
    whole = judge.tokenizer(judge.prompt(long), add_special_tokens=False)["input_ids"]
    ids = judge.encode(long)
    assert len(whole) > judge.max_length == 4096 - 12 and ids == whole[-judge.max_length :]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the vllm extra is not installed")
def test_the_vllm_judge_answers_as_the_torch_one(judge_folder: pathlib.Path) -> None:
    vllm = Judge(TaskSection(name="arithmetic", reward_judge=str(judge_folder), judge_max_tokens=12,
                             judge_engine="vllm"))  # fmt: skip
    assert vllm.engine.name == "vllm" and vllm.engine.held_versions() == {0}
    torch = Judge(TaskSection(name="arithmetic", reward_judge=str(judge_folder), judge_max_tokens=12))
    assert vllm.answers(REQUESTS) == torch.answers(REQUESTS)
