"""Per family: `dora sft` trains the end of turn the chat template writes, every engine ends a turn on it (or on
any of the model's EOS ids), `dora eval` scores what comes before it, and the facts dora reads from the folder
(stop ids, limit) are the family's.

The sft rows all answer "7": a few dozen steps make a tiny random model answer exactly that, whatever the prompt,
so what it emits after the answer is what sft taught it, and where the engine stops shows its stop ids."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

from dora.actor.cluster import ClusterInfo
from dora.config import load
from dora.config.run import RunConfig
from dora.hf import zoo
from dora.hf.folder import facts

pytestmark = pytest.mark.timeout(180)


def rows(tmp_path: pathlib.Path, n: int = 24) -> pathlib.Path:
    path = tmp_path / "sevens.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i % 5} plus {7 - i % 5}?", "answer": "7"}) + "\n"
                            for i in range(n)))  # fmt: skip
    return path


def config(tmp_path: pathlib.Path, family: str, start: pathlib.Path) -> RunConfig:
    templated = zoo.ZOO[family].template is not None
    data = rows(tmp_path)
    sets = [f"task.dataset={data}", "task.prompt_field=question", "task.reward=numeric",
            f"task.chat_template={str(templated).lower()}", f"sft.model={start}", f"sft.out={tmp_path / 'sft'}",
            "sft.epochs=24", "sft.lr=3e-3", "sft.batch_size=8", "sft.threads=1", f"eval.dataset={data}", "eval.limit=8",
            "run.max_tokens=8"]  # fmt: skip
    return load(RunConfig, overrides=sets)


@pytest.mark.parametrize("family", zoo.FAMILIES)
def test_sft_trains_the_templates_end_of_turn_and_the_engine_stops_there(zoo_model, tmp_path, family):
    from dora.learner import sft
    from dora.ops.evaluate import evaluate_model
    from dora.rollout.engines.torch.engine import TorchEngine
    from dora.tasks.prompts import TaskRun

    fam = zoo.ZOO[family]
    start = zoo_model(family)
    found = facts(start)
    tok = TaskRun(config(tmp_path, family, start).task, str(start)).tokenizer
    end = tok.token_to_id(fam.turn_end) if fam.turn_end else tok.token_to_id(fam.config_eos[0])
    assert found.turn_end == (tok.token_to_id(fam.turn_end) if fam.turn_end else None)
    assert found.stop_ids == {tok.token_to_id(t) for t in (*fam.config_eos, *fam.generation_eos)} | {end}
    assert found.max_positions == fam.max_positions

    cfg = config(tmp_path, family, start)
    out = sft.run(cfg, ClusterInfo.from_env({}))
    task = TaskRun(cfg.task, str(out))
    engine = TorchEngine(out, version=0)
    prompt = task.prompt_ids(0).tolist()
    engine.submit(group_id=0, attempt=1, prompt=prompt, n=1, max_tokens=8, temperature=0.0)
    done = []
    while len(engine):
        done += engine.step()
    (seq,) = done
    seven = tok.encode("7", add_special_tokens=False).ids
    assert seq.tokens == [*seven, end], (tok.decode(seq.tokens, skip_special_tokens=False), seq.finish)
    metrics = evaluate_model(cfg, str(out))  # `dora eval`: the answer before the turn end, scored
    assert metrics["accuracy"] == 1.0 and metrics["mean_tokens"] == len(seven) + 1, metrics


@pytest.mark.vllm
@pytest.mark.parametrize("family", ["qwen2", "llama3"])
def test_vllm_stops_where_the_torch_engine_does(zoo_model, tmp_path, family):
    """vLLM ends the turn on the same token (its own generation-config stops and dora's together); two families
    here (a tied Qwen with its end of turn in both configs, and Llama-3's list of EOS ids), every family in
    ``python bench/zoo.py``."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vllm")
    from dora.learner import sft
    from dora.rollout.engines.vllm_engine import VllmEngine
    from dora.tasks.prompts import TaskRun

    cfg = config(tmp_path, family, zoo_model(family))
    out = sft.run(cfg, ClusterInfo.from_env({}))
    task = TaskRun(cfg.task, str(out))
    engine = VllmEngine(out, version=0, max_slots=4)
    engine.submit(group_id=0, attempt=1, prompt=task.prompt_ids(0).tolist(), n=1, max_tokens=8, temperature=0.0)
    done = []
    while len(engine):
        done += engine.step()
    (seq,) = done
    fam = zoo.ZOO[family]
    assert seq.tokens == [*task.tokenizer.encode("7", add_special_tokens=False).ids,
                          task.tokenizer.token_to_id(fam.turn_end)], seq.tokens  # fmt: skip
