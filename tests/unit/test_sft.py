"""`dora sft`: the answer-only loss, training, the written folder, the command, and a greedy held-out check."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch

from dora.config import ConfigError, load
from dora.config.models import SftSection
from dora.config.run import RunConfig
from dora.hf.folder import facts
from dora.learner import sft, sft_main
from dora.tasks import gsm_style
from dora.tasks.prompts import TaskRun

ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data" / "arithmetic"
TASK = ["task.prompt_field=question", "task.chat_template=true", "task.reward=numeric"]


def task_run(model: pathlib.Path, dataset: pathlib.Path, *extra: str) -> TaskRun:
    return TaskRun(load(RunConfig, overrides=[f"task.dataset={dataset}", *TASK, *extra]).task, str(model))


def rows_file(tmp_path: pathlib.Path, n: int, name: str = "rows.jsonl") -> pathlib.Path:
    path = tmp_path / name
    path.write_text("".join(line for line in (DATA / "train.jsonl").read_text().splitlines(True)[:n]))
    return path


@pytest.fixture
def examples(tiny_model, tmp_path) -> list[sft.Example]:
    return sft.encode(task_run(tiny_model, rows_file(tmp_path, 12)), eos=0, max_answer_tokens=64).items


def model_of(folder: pathlib.Path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)


# ---------------------------------------------------------------- encoding and the answer-only loss


def test_rows_are_the_rl_prompt_ids_then_the_answer_and_eos(tiny_model, tmp_path):
    run = task_run(tiny_model, rows_file(tmp_path, 5))
    data = sft.encode(run, eos=0, max_answer_tokens=64)
    assert [e.row for e in data.items] == [0, 1, 2, 3, 4] and data.truncated == 0
    for e in data.items:
        prompt = run.tokenizer.encode(run.texts[e.row]).ids
        assert run.texts[e.row].endswith("<|im_start|>assistant\n")  # the chat template, with the generation prompt
        assert list(e.ids[: e.prompt_len]) == prompt
        assert run.tokenizer.decode(list(e.ids[e.prompt_len : -1])) == run.rows[e.row].answer and e.ids[-1] == 0


def test_long_answers_are_cut_and_counted(tiny_model, tmp_path):
    run = task_run(tiny_model, rows_file(tmp_path, 20))
    full = sft.encode(run, eos=0, max_answer_tokens=64)
    lengths = [len(e.ids) - e.prompt_len for e in full.items]
    cap = sorted(lengths)[len(lengths) // 2]
    cut = sft.encode(run, eos=0, max_answer_tokens=cap)
    assert cut.truncated == sum(n > cap for n in lengths) > 0
    assert all(len(e.ids) - e.prompt_len == min(n, cap) for e, n in zip(cut.items, lengths, strict=True))
    assert cut.answer_tokens == sum(min(n, cap) for n in lengths)


def test_the_loss_is_the_mean_nll_of_the_answer_tokens_only(tiny_model, examples):
    model = model_of(tiny_model)
    ids, labels = sft.collate(examples, pad_id=0)
    loss, count = sft.answer_loss(model, ids, labels)
    nll, total = 0.0, 0
    with torch.no_grad():
        for e in examples:  # one unpadded row at a time, by hand
            logp = torch.log_softmax(model(input_ids=torch.tensor([e.ids])).logits[0].double(), -1)
            for t in range(e.prompt_len, len(e.ids)):
                nll -= float(logp[t - 1, e.ids[t]])
                total += 1
    assert count == total == sum(len(e.ids) - e.prompt_len for e in examples)
    assert float(loss.detach()) == pytest.approx(nll / total, rel=1e-5)


def test_prompt_and_padding_positions_get_no_gradient(tiny_model, examples):
    model = model_of(tiny_model)
    ids, labels = sft.collate(examples, pad_id=0)
    logits = model(input_ids=ids).logits
    logits.retain_grad()
    loss, _ = sft.answer_nll(logits, labels)
    loss.backward()
    norms = logits.grad.abs().sum(-1)  # [B, T]: how much each position's prediction moves the loss
    for b, e in enumerate(examples):
        targets = range(e.prompt_len - 1, len(e.ids) - 1)  # the positions predicting answer tokens
        assert all(norms[b, t] > 0 for t in targets)
        assert all(norms[b, t] == 0 for t in range(ids.shape[1]) if t not in targets)


def test_a_few_steps_lower_the_training_loss(tiny_model, examples):
    model = model_of(tiny_model)
    ids, labels = sft.collate(examples, pad_id=0)
    with torch.no_grad():
        before = float(sft.answer_loss(model, ids, labels)[0])
    reports = sft.train(model, examples, SftSection(epochs=4, lr=3e-3, batch_size=6), pad_id=0)
    with torch.no_grad():
        after = float(sft.answer_loss(model, ids, labels)[0])
    assert len(reports) == 4 and all(r.tokens == sum(len(e.ids) for e in examples) for r in reports)
    assert after < 0.8 * before and reports[-1].loss < reports[0].loss


# ---------------------------------------------------------------- the written folder


def test_the_written_folder_loads_like_the_start_folder(tiny_model, examples, tmp_path):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    model = model_of(tiny_model)
    sft.train(model, examples, SftSection(epochs=1, lr=1e-3, batch_size=12), pad_id=0)
    out = tmp_path / "sft" / "model"
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")  # an earlier result is replaced
    assert sft.write(model, tiny_model, out) == out
    assert [p.name for p in out.parent.iterdir()] == ["model"]  # no temporary folder left beside it
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    mine = model.state_dict()
    assert all(torch.equal(v, mine[k]) for k, v in loaded.state_dict().items())
    assert (out / "tokenizer.json").read_bytes() == (tiny_model / "tokenizer.json").read_bytes()
    chat = [{"role": "user", "content": "What is 1 + 2?"}]
    render = [PreTrainedTokenizerFast.from_pretrained(str(d)).apply_chat_template(chat, tokenize=False,
              add_generation_prompt=True) for d in (tiny_model, out)]  # fmt: skip
    assert render[0] == render[1] and "<|im_start|>assistant" in render[1]


def test_with_lora_the_adapters_alone_train_and_the_folder_is_the_base_with_them_merged(tiny_model, examples, tmp_path):
    """sft.lora: adapters shaped as [learner.lora] on the frozen start model; the optimizer holds them alone, the
    base weights do not move, and the folder written is a full model (no adapter tensors) whose logits are the
    adapted model's."""
    from transformers import AutoModelForCausalLM

    from dora.config.models import LoraSection
    from dora.hf.lora import inject, is_adapter

    spec = LoraSection(rank=4, alpha=8.0)
    model = model_of(tiny_model)
    inject(model, spec)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    reports = sft.train(model, examples, SftSection(epochs=3, lr=1e-2, batch_size=6, lora=True), pad_id=0)
    assert reports[-1].loss < reports[0].loss
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen), "the base moved"
    state = sft.merged(model.state_dict(), spec)
    assert not [k for k in state if is_adapter(k) or ".base_layer." in k]
    out = sft.write(model, tiny_model, tmp_path / "out", state=state)
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert loaded.state_dict().keys() == model_of(tiny_model).state_dict().keys()
    ids = torch.tensor([[11, 12, 13, 400, 401, 402]])
    with torch.no_grad():
        want, got, start = model(input_ids=ids).logits, loaded(input_ids=ids).logits, model_of(tiny_model)(ids).logits
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(start, want, atol=1e-4), "the adapters changed nothing"


def dora_sft(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """`dora sft ARGV` through the command's own ``main``, in this process: its exit code and what it wrote to
    stderr. A process of its own costs seconds of imports and checks nothing more here (the command as a process,
    dora:tiny built on first use included, is tests/live/test_dora_run.py's README test; the one line of bad input
    with no traceback is test_bad_input_in_a_subprocess_has_no_traceback). The torch threads it sets are restored."""
    threads = torch.get_num_threads()
    capsys.readouterr()
    try:
        code = sft_main.main(list(argv))
    finally:
        torch.set_num_threads(threads)
    return code, capsys.readouterr().err


def test_dora_sft_with_lora_writes_a_merged_full_model(tiny_model, tmp_path, capsys):
    config = write_config(tmp_path, rows_file(tmp_path, 16), tiny_model, epochs=1, lora=True)
    code, err = dora_sft(capsys, "--config", str(config), "--set", "learner.lora.rank=4")
    assert code == 0, err
    from safetensors.torch import load_file

    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    start = load_file(str(tiny_model / "model.safetensors"))
    assert written.keys() == start.keys()
    moved = [k for k in start if not torch.equal(written[k], start[k])]
    assert moved and all(k.endswith("proj.weight") for k in moved), moved  # the merged adapters, nothing else


def test_a_folder_that_is_not_a_model_is_never_replaced(tiny_model, tmp_path):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a model folder"):
        sft.write(model_of(tiny_model), tiny_model, out)
    assert (out / "keep.txt").read_text() == "mine"


# ---------------------------------------------------------------- the command


def write_config(tmp_path: pathlib.Path, dataset: pathlib.Path, model: pathlib.Path | str, **sft_keys) -> pathlib.Path:
    keys = {"model": str(model), "out": str(tmp_path / "out"), "epochs": 1, "batch_size": 8, **sft_keys}
    sft_lines = [f"{k} = {json.dumps(v)}" for k, v in keys.items() if v is not None]
    lines = ["[task]", f'dataset = "{dataset}"', 'prompt_field = "question"', "chat_template = true",
             'reward = "numeric"', "[sft]", *sft_lines]  # fmt: skip
    path = tmp_path / "sft.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_dora_sft_builds_dora_tiny_on_first_use_trains_and_writes_the_folder(tmp_path, capsys, monkeypatch):
    config = write_config(tmp_path, rows_file(tmp_path, 24), "dora:tiny", epochs=2)
    home = tmp_path / "home"  # dora:tiny is built into the user's cache: this test's, not the real one
    monkeypatch.setenv("HOME", str(home))
    code, err = dora_sft(capsys, "--config", str(config))
    assert code == 0, err
    start = home / ".cache" / "dora" / "tiny-model"
    assert f"building dora:tiny into {start}" in err and f"epochs from {start}" in err, err
    assert "24 rows" in err and "0 answers cut" in err
    assert re.search(r"epoch 2/2  loss [\d.]+  [\d,]+ tok/s", err), err
    assert (tmp_path / "out" / "config.json").is_file() and (tmp_path / "out" / "chat_template.jinja").is_file()
    assert f"wrote {tmp_path / 'out'}" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "out", "rows.jsonl", "sft.toml"]
    assert sorted(p.name for p in start.parent.iterdir()) == ["tiny-model"] and (start / "config.json").is_file()


def bad_row(tmp_path: pathlib.Path) -> pathlib.Path:
    path = rows_file(tmp_path, 3)
    path.write_text(path.read_text() + json.dumps({"question": "What is 1 + 1?"}) + "\n")
    return path


def broken_model(tmp_path: pathlib.Path, tiny_model: pathlib.Path) -> pathlib.Path:
    folder = tmp_path / "broken"
    shutil.copytree(tiny_model, folder)
    (folder / "config.json").write_text('{"model_type": "no-such-architecture"}')
    return folder


@pytest.mark.parametrize(
    ("case", "fragment"),
    [("no_out", "needs sft.out"), ("no_dataset", "no such file"), ("bad_row", "row 3"),
     ("broken_model", "not a causal LM"), ("zero_epochs", "sft.epochs must be >= 1"),
     ("out_is_start", "must differ")],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(case, fragment, tiny_model, tmp_path, capsys):
    dataset, model, keys = rows_file(tmp_path, 3), tiny_model, {}
    if case == "no_out":
        keys["out"] = None
    elif case == "no_dataset":
        dataset = tmp_path / "missing.jsonl"
    elif case == "bad_row":
        dataset = bad_row(tmp_path)
    elif case == "broken_model":
        model = broken_model(tmp_path, tiny_model)
    elif case == "zero_epochs":
        keys["epochs"] = 0
    elif case == "out_is_start":
        keys["out"] = str(tiny_model)
    code = sft_main.main(["--config", str(write_config(tmp_path, dataset, model, **keys))])
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and err.count("\n") == 1 and err.startswith("dora sft: "), err
    assert not (tmp_path / "out").exists()


def test_bad_input_in_a_subprocess_has_no_traceback(tiny_model, tmp_path):
    r = subprocess.run([sys.executable, "-m", "dora", "sft", "--set", f"task.dataset={bad_row(tmp_path)}",
                        "--set", "task.reward=numeric", "--set", "task.prompt_field=question",
                        "--set", f"sft.out={tmp_path / 'out'}", "--set", f"sft.model={tiny_model}"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert "row 3" in r.stderr and "answer" in r.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("key", "value"), [("epochs", 0), ("lr", 0.0), ("batch_size", 0), ("max_answer_tokens", 0), ("threads", -1),
                       ("out", "")],
)  # fmt: skip
def test_bad_values_name_their_key(key, value):
    with pytest.raises(ConfigError, match=f"sft.{key} must"):
        SftSection(**{key: value})


# ---------------------------------------------------------------- greedy held-out check

NUMBER = re.compile(r"-?\d+")


def final_number(text: str) -> str | None:
    """The number after the last ``####`` (on its line), else the last number of the text."""
    _, sep, tail = text.rpartition("####")
    found = NUMBER.search(tail.split("\n", 1)[0]) if sep else None
    if found:
        return found.group()
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def greedy(model, run: TaskRun, rows: range, max_new_tokens: int = 16) -> list[str]:
    """Greedy completions of ``rows`` (left-padded into one batch), decoded without special tokens."""
    stops = sorted(facts(run.renderer.model_dir).stop_ids)  # what the engines stop on
    prompts = [run.tokenizer.encode(run.texts[i]).ids for i in rows]
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), 0)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :], mask[b, width - len(p) :] = torch.tensor(p), 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=stops, pad_token_id=0)  # fmt: skip
    return [run.tokenizer.decode(out[b, width:].tolist(), skip_special_tokens=True) for b in range(len(prompts))]


def held_out(model, run: TaskRun, rows: range) -> tuple[float, float]:
    """(exact-match accuracy, share of completions in one of the train answers' layouts: the steps
    ``a op b = n`` a line each, then ``#### n``; or ``#### n`` alone)."""
    texts = greedy(model, run, rows)
    refs = [final_number(run.rows[i].answer) for i in rows]
    steps = gsm_style.NUMBERS - 1
    layout = re.compile(rf"(\d+ [+-] \d+ = \d+\n){{{steps}}}#### \d+$|#### \d+$")
    exact = sum(final_number(t) == r for t, r in zip(texts, refs, strict=True))
    return exact / len(texts), sum(bool(layout.match(t)) for t in texts) / len(texts)


def test_final_number_reads_the_answer_after_the_marks():
    assert final_number("47 + 38 = 85\n#### 85") == "85" and final_number("so 12 then 7") == "7"
    assert final_number("#### -3\nmore 9") == "-3" and final_number("####\n5") == "5" and final_number("") is None


def test_one_epoch_teaches_the_answer_layout_on_held_out_prompts(tiny_model):
    model = model_of(tiny_model)
    test = task_run(tiny_model, DATA / "test.jsonl")
    before = held_out(model, test, range(50))
    train = task_run(tiny_model, DATA / "train.jsonl")
    end = sft.answer_end(tiny_model, chat_template=True)
    assert end == train.tokenizer.token_to_id("<|im_end|>")  # what the template writes after an answer
    data = sft.encode(train, eos=end, max_answer_tokens=64)
    sft.train(model, data.items, SftSection(epochs=1, lr=1e-3, batch_size=32), pad_id=0)
    after = held_out(model, test, range(50))
    print(f"held-out (50 rows) exact, layout: before {before}, after one epoch {after}")
    assert before[0] <= 0.1 and before[1] == 0.0  # answers are numbers below 40: a random model hits a few
    assert after[1] >= 0.8  # every answer ends in the layout the reward reads, and stops (its end of turn)


def test_help_lists_sft_and_never_imports_torch():
    code = (
        "import sys\nfrom dora.cli import main\ntry:\n    main(['sft', '--help'])\nexcept SystemExit:\n    pass\n"
        "print('HEAVY', sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in r.stdout and "sft.out" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "dora", "--help"], capture_output=True, text=True, timeout=60)
    assert "sft" in r.stdout and "warm start" in r.stdout


def test_recorded_episodes_train_the_assistant_turns_with_the_workers_rendering(tiny_model, tmp_path):
    """An environment's rows: the opening is the RL prompt, each assistant turn and its end token are trained on,
    and the tool's turn in between is context, rendered exactly as a worker appends it after a sampled turn."""
    from dora.tasks.templates import observation_text

    rows = tmp_path / "calc.jsonl"
    rows.write_text("".join((ROOT / "examples/data/calculator/train.jsonl").read_text().splitlines(True)[:4]))
    run = TaskRun(load(RunConfig, overrides=[f"task.dataset={rows}", "task.prompt_field=question",
                                             "task.chat_template=true", "task.env=dora.envs.calculator:Calculator",
                                             "sft.trace_field=trace"]).task, str(tiny_model))  # fmt: skip
    data = sft.encode_episodes(run, "trace", max_answer_tokens=64)
    tool, alone = data.items[0], data.items[1]
    decode = run.tokenizer.decode
    for e in (tool, alone):
        assert list(e.ids[: e.prompt_len]) == run.tokenizer.encode(run.texts[e.row]).ids
    after = tool.ids[tool.prompt_len :]
    trained = [t for t, keep in zip(after, tool.trained, strict=True) if keep]
    context = [t for t, keep in zip(after, tool.trained, strict=True) if not keep]
    answer = run.rows[0].answer
    question = run.rows[0].messages[-1]["content"].rstrip("=")
    assert decode(trained, skip_special_tokens=False) == f"calc {question}<|im_end|>answer {answer}<|im_end|>"
    chat = [*run.row_item(0).meta["messages"], {"role": "assistant", "content": f"calc {question}"}]
    expected = observation_text(run.renderer, chat[:-1], [{"role": "tool", "content": f"= {answer}"}], "<|im_end|>")
    rendered = f"\n<|im_start|>tool\n= {answer}<|im_end|>\n<|im_start|>assistant\n"
    assert decode(context, skip_special_tokens=False) == expected == rendered
    assert all(alone.trained) and decode(list(alone.ids[alone.prompt_len :]), skip_special_tokens=False) == (
        f"answer {run.rows[1].answer}<|im_end|>"
    )
    _, labels = sft.collate([tool], pad_id=0)
    assert (labels[0] != sft.IGNORE).sum() == sum(tool.trained)
