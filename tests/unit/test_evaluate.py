"""Held-out evaluation: pass@k against brute force, the metrics of known answers, and `dora eval` on a model
folder and on a store version."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dora.config import load
from dora.config.run import RunConfig
from dora.rollout.engines.torch.engine import TorchEngine
from dora.rollout.evaluate import evaluate
from dora.tasks.heldout import pass_at_k, summarize
from dora.tasks.prompts import eval_task


@given(n=st.integers(1, 8), data=st.data())
def test_pass_at_k_is_the_chance_that_some_of_k_draws_is_correct(n, data):
    c = data.draw(st.integers(0, n))
    k = data.draw(st.integers(1, n))
    draws = list(itertools.combinations([True] * c + [False] * (n - c), k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(d) for d in draws) / len(draws))


def test_summarize_counts_rewards_of_one_as_correct():
    out = summarize([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]], [[3, 5], [2, 2], [4, 4]])
    assert out["accuracy"] == pytest.approx(3 / 6) and out["pass@1"] == pytest.approx(0.5)
    assert out["pass@2"] == pytest.approx(2 / 3) and out["mean_tokens"] == pytest.approx(20 / 6)
    with pytest.raises(ValueError):
        summarize([[1.0], [1.0, 0.0]], [[1], [1, 1]])


def greedy(model_dir, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """What the model answers greedily, by transformers' own generate (not the engine under test)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    eos = model.config.eos_token_id
    for p in prompts:
        ids = model.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos,
                             pad_token_id=eos)  # fmt: skip
        tokens = ids[0, len(p) :].tolist()
        out.append(tokens[: tokens.index(eos) + 1] if eos in tokens else tokens)
    return out


def test_greedy_accuracy_is_the_share_of_rows_answered_exactly(tmp_path, tiny_model):
    """Rows whose reference answer is what the model says greedily score 1; the others 0."""
    rows = [{"prompt": f"{a} plus {b} is", "answer": "?"} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = [f"eval.dataset={path}", "task.reward=dora.tasks.rewards:exact_match", f"task.tokenizer={tiny_model}"]
    task = eval_task(load(RunConfig, overrides=sets), str(tiny_model))
    said = greedy(tiny_model, [task.tokenizer.encode(t).ids for t in task.texts], 6)
    texts = [task.tokenizer.decode(s, skip_special_tokens=True) for s in said]
    from dora.tasks.rewards import answer_text

    for i in (0, 2):  # rows 0 and 2 get the model's own answer as reference
        rows[i]["answer"] = answer_text(texts[i]) or "unreachable"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = eval_task(load(RunConfig, overrides=sets), str(tiny_model))
    out = evaluate(TorchEngine(tiny_model, version=0), task, max_tokens=6)
    expected = sum(r["answer"] != "unreachable" and r["answer"] != "?" for r in rows) / 4
    assert out["rows"] == 4 and out["accuracy"] == pytest.approx(expected) and expected > 0
    assert out["mean_tokens"] == pytest.approx(sum(map(len, said)) / 4)


def dora_eval(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dora", "eval", *args], capture_output=True, text=True, timeout=120)


def test_dora_eval_reads_a_store_version_and_checks_its_digest(tmp_path, tiny_model, capsys):
    """The model folder through the command as a user runs it; the store version in this process (the same
    command's ``main``: a process of its own costs seconds of imports, and checks nothing more)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dora.store import WeightStore

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(6)))
    store = WeightStore(tmp_path / "store")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    store.publish(3, model.state_dict())
    args = ["--model", str(tiny_model), "--dataset", str(path), "--set", "task.reward=dora.tasks.rewards:exact_match",
            "--set", "run.max_tokens=4"]  # fmt: skip
    base = dora_eval(*args, "--json", str(tmp_path / "m.json"))
    assert base.returncode == 0, base.stderr
    from dora.ops.evaluate import main

    capsys.readouterr()
    assert main([*args, "--store", str(tmp_path / "store"), "--version", "3"]) == 0
    v3 = capsys.readouterr()
    got, got3 = json.loads(base.stdout), json.loads(v3.out)
    assert got == json.loads((tmp_path / "m.json").read_text()) | {"seconds": got["seconds"]}
    assert got["rows"] == got3["rows"] == 6 and got3["version"] == 3 and "accuracy 0.000 (0/6)" in base.stderr
    (store.path(3) / "model.safetensors").write_bytes(b"not the published bytes")
    assert main([*args, "--store", str(tmp_path / "store"), "--version", "3"]) == 2
    bad = capsys.readouterr().err
    assert "does not match the published" in bad and "Traceback" not in bad, bad


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dataset", "/nonexistent.jsonl"], "no such file or folder"),
        ([], "set eval.dataset"),
        (["--dataset", "x.jsonl", "--store", "s"], "--store and --version go together"),
        (["--dataset", "x.jsonl", "--set", "eval.samples=2"], "greedy decoding"),
    ],
)
def test_dora_eval_bad_input_is_one_line(tiny_model, args, message):
    r = dora_eval("--model", str(tiny_model), *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_sampled_rows_draw_independent_samples(tiny_model, tmp_path):
    """Rows sampled at a temperature get a seed each: with one seed for all, the same prompt in two rows would get
    the same completion, and a sampled success rate would move in steps of 1/samples."""
    rows = tmp_path / "same.jsonl"
    rows.write_text((json.dumps({"question": "What is 1 + 1?", "answer": "2"}) + "\n") * 6)
    cfg = load(RunConfig, overrides=[f"task.dataset={rows}", "task.prompt_field=question", "task.reward=numeric",
                                     f"eval.dataset={rows}", f"task.tokenizer={tiny_model}"])  # fmt: skip
    task = eval_task(cfg, str(tiny_model))
    engine = TorchEngine(tiny_model, version=0)
    made: list[list[int]] = []
    step = engine.step

    def record():
        done = step()
        made.extend(s.tokens for s in done)
        return done

    engine.step = record
    evaluate(engine, task, samples=1, temperature=1.0, max_tokens=12, seed=3)
    assert len(made) == 6 and len({tuple(t) for t in made}) > 1
