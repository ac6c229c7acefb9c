"""The user's dataset as a task: the three layouts, chat templates, the epoch order, and every bad input as one
line that names the file, the row and the field."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dora.config import ConfigError, load
from dora.config.run import RunConfig, TaskSection
from dora.tasks import datasets, gsm_style
from dora.tasks.prompts import TaskRun, prompt_source

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "data" / "arithmetic"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> pathlib.Path:
    """The project's tokenizer with its ChatML template, saved like a model folder's."""
    from dora.hf.tiny import build_tokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer().save_pretrained(out)
    return out


def task(path: pathlib.Path | str, **kw) -> TaskSection:
    return TaskSection(dataset=str(path), prompt_field="question", reward="dora.tasks.rewards:exact_match", **kw)


def write_jsonl(path: pathlib.Path, rows: list[dict]) -> pathlib.Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_shipped_example_is_what_its_generator_writes(tmp_path):
    paths = gsm_style.write(tmp_path)
    for name in ("train", "test"):
        assert paths[name].read_bytes() == (EXAMPLE / f"{name}.jsonl").read_bytes()
    rows = gsm_style.splits()
    assert {r["question"] for r in rows["train"]}.isdisjoint(r["question"] for r in rows["test"])
    assert (len(rows["train"]), len(rows["test"])) == (gsm_style.TRAIN_ROWS, gsm_style.TEST_ROWS)
    terse = 0
    for r in rows["train"] + rows["test"]:
        expr = r["question"].removeprefix("What is ").removesuffix("?")
        terms = expr.split()
        assert len(terms) == 2 * gsm_style.NUMBERS - 1 and all(len(t) == 1 for t in terms), r
        *steps, result = r["answer"].split("\n")
        assert result == f"#### {eval(expr)}", r  # the question is digits and +/- only
        running = int(terms[0])
        for i, line in enumerate(steps):  # a worked answer: each step from the previous total, never below 0
            op, n = terms[2 * i + 1], int(terms[2 * i + 2])
            new = running + n if op == "+" else running - n
            assert line == f"{running} {op} {n} = {new}" and new >= 0, r
            running = new
        assert len(steps) in (0, gsm_style.NUMBERS - 1), r
        terse += not steps
    assert all("\n" in r["answer"] for r in rows["test"])  # test answers are all worked
    assert 0.4 < terse / gsm_style.TRAIN_ROWS < 0.6  # about half the train answers give the result alone


def test_jsonl_parquet_and_a_save_to_disk_folder_give_the_same_prompts_and_answers(tmp_path, tokenizer_dir):
    import datasets as hf

    jsonl = EXAMPLE / "test.jsonl"
    data = hf.Dataset.from_json(str(jsonl), cache_dir=str(tmp_path / "cache"))
    data.to_parquet(str(tmp_path / "test.parquet"))
    hf.DatasetDict({"train": data, "test": data.select(range(10))}).save_to_disk(str(tmp_path / "folder"))
    runs = [
        TaskRun(task(jsonl, chat_template=True), str(tokenizer_dir)),
        TaskRun(task(tmp_path / "test.parquet", chat_template=True), str(tokenizer_dir)),
        TaskRun(task(tmp_path / "folder", split="train", chat_template=True), str(tokenizer_dir)),
    ]
    n = len(runs[0].rows)
    assert n == gsm_style.TEST_ROWS and all(len(r.rows) == n for r in runs)
    for g in range(n + 5):  # into the second epoch
        items = [r.item(g) for r in runs]
        assert len({(i.prompt, i.answer, i.index) for i in items}) == 1, items
        assert [list(r.prompt_ids(g)) for r in runs[1:]] == [list(runs[0].prompt_ids(g))] * 2
    assert runs[0].about["fingerprint"] == runs[1].about["fingerprint"] == runs[2].about["fingerprint"]
    first = json.loads(jsonl.read_text().splitlines()[runs[0].item(0).index])
    assert runs[0].item(0).answer == first["answer"]
    assert runs[0].item(0).prompt == f"<|im_start|>user\n{first['question']}<|im_end|>\n<|im_start|>assistant\n"


def test_a_folder_with_several_splits_needs_one_named(tmp_path):
    import datasets as hf

    rows = hf.Dataset.from_list([{"prompt": "a", "answer": "1"}])
    hf.DatasetDict({"dev": rows, "eval": rows}).save_to_disk(str(tmp_path / "d"))
    with pytest.raises(ConfigError, match=r"holds the splits dev, eval; choose one with task.split"):
        datasets.read_table(str(tmp_path / "d"))
    assert datasets.read_table(str(tmp_path / "d"), "eval")[0] == [{"prompt": "a", "answer": "1"}]


def test_the_template_renders_as_transformers_does_and_the_broker_side_imports_no_torch(tokenizer_dir):
    code = f"""
import sys
from dora.config import load
from dora.config.run import RunConfig
from dora.tasks.prompts import prompt_source
from dora.tasks.templates import Renderer
r = Renderer({str(tokenizer_dir)!r}, True)
text = r.render([{{"role": "system", "content": "Be brief."}}, {{"role": "user", "content": "What is 2 + 2?"}}])
print(repr(text))
cfg = load(RunConfig, overrides=["task.dataset={EXAMPLE / "test.jsonl"}", "task.prompt_field=question",
                                 "task.chat_template=true", "task.tokenizer={tokenizer_dir}",
                                 "task.reward=dora.tasks.rewards:exact_match"])
prompts, about = prompt_source(cfg)  # what the broker loads
assert len(prompts(0)) > 5 and about["kept"] == {gsm_style.TEST_ROWS}
print("HEAVY", sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "vllm")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert "HEAVY []" in out, out
    from transformers import AutoTokenizer

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    expected = AutoTokenizer.from_pretrained(tokenizer_dir).apply_chat_template(msgs, tokenize=False,
                                                                                add_generation_prompt=True)  # fmt: skip
    assert out.splitlines()[0] == repr(expected)


def test_without_a_template_the_prompt_is_its_text_and_a_system_prompt_goes_first(tmp_path, tokenizer_dir):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "2+2=", "answer": 4}])
    plain = TaskRun(task(path), str(tokenizer_dir))
    assert plain.item(0).prompt == "2+2=" and plain.item(0).answer == "4"
    system = TaskRun(task(path, system_prompt="Answer with a number."), str(tokenizer_dir))
    assert system.item(0).prompt == "Answer with a number.\n\n2+2="


def test_chat_rows_render_every_turn(tmp_path, tokenizer_dir):
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
             {"role": "user", "content": "2+2?"}]  # fmt: skip
    path = write_jsonl(tmp_path / "c.jsonl", [{"chat": turns, "answer": "4"}])
    run = TaskRun(task(path, messages_field="chat", chat_template=True), str(tokenizer_dir))
    assert run.item(0).prompt == ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
                                  "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")  # fmt: skip


def test_long_prompts_are_filtered_counted_and_never_dispatched(tmp_path, tokenizer_dir):
    rows = [{"question": "x " * n, "answer": str(n)} for n in (1, 50, 2, 60, 3)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    run = TaskRun(task(path, max_prompt_tokens=20), str(tokenizer_dir))
    assert run.about["filtered"] == 2 and run.about["filtered_rows"] == [1, 3] and run.about["kept"] == 3
    assert sorted(run.item(g).index for g in range(3)) == [0, 2, 4]
    assert {run.item(g).index for g in range(30)} == {0, 2, 4}


@given(n=st.integers(1, 40), seed=st.integers(0, 2**31), epochs=st.integers(1, 4))
def test_every_kept_row_is_dispatched_exactly_once_per_epoch(n, seed, epochs):
    kept = list(range(0, 3 * n, 3))
    e = datasets.Epochs(kept, seed)
    for epoch in range(epochs):
        rows = [e.row(g) for g in range(epoch * n, (epoch + 1) * n)]
        assert sorted(rows) == kept
    again = datasets.Epochs(kept, seed)  # a restarted broker: the same order from the same seed
    assert [again.row(g) for g in range(epochs * n)] == [e.row(g) for g in range(epochs * n)]


def test_epochs_are_differently_ordered():
    e = datasets.Epochs(list(range(50)), 0)
    assert list(e.order(0)) != list(e.order(1))


@pytest.mark.parametrize(
    ("content", "kw", "message"),
    [
        (None, {}, r"no such file or folder"),
        (b"", {}, r"holds no rows"),
        (b'{"q": "a", "answer": "1"}\n', {}, r"prompt_field = 'question': .* no such column \(columns: q, answer\)"),
        (b'{"question": "a", "answer": "1"}\n{"question": "b"}\n', {}, r"row 1: no answer in column 'answer'"),
        (b'{"question": "a", "answer": "1"}\n{"question": "", "answer": "2"}\n', {}, r"row 1: column 'question' must"),
        (b'{"question": "a", "answer": "1"}\n{"question": "\xff", "answer": "2"}\n', {}, r"line 2 is not UTF-8"),
        (b'{"question": "a", "answer": "1"}\n{"question": oops}\n', {}, r"line 2 is not JSON"),
        (b'{"question": "a", "answer": "1"}\n', {"split": "test"}, r"task.split = 'test': .* is one file"),
        (b'{"chat": [{"role": "user"}], "answer": "1"}\n', {"messages_field": "chat", "chat_template": True},
         r"row 0: column 'chat' turn 0 must be \{role, content\}"),
        (b'{"question": "a long question", "answer": "1"}\n', {"max_prompt_tokens": 1}, r"every row was filtered out"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_naming_file_row_and_field(tmp_path, tokenizer_dir, content, kw, message):
    path = tmp_path / "d.jsonl"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        TaskRun(task(path, **kw), str(tokenizer_dir))


def test_a_template_that_fails_names_the_row(tmp_path, tokenizer_dir):
    bad = tmp_path / "model"
    bad.mkdir()
    for f in tokenizer_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "chat_template.jinja").write_text("{% if messages[0]['content'] == 'b' %}{{ raise_exception('no b') }}"
                                             "{% endif %}{{ messages[0]['content'] }}")  # fmt: skip
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "a", "answer": "1"}, {"question": "b", "answer": "2"}])
    with pytest.raises(ConfigError, match=r"d.jsonl row 1: the chat template of .* failed: .*no b"):
        TaskRun(task(path, chat_template=True), str(bad))


def test_the_config_names_the_task_after_its_dataset_and_checks_keys():
    assert load(RunConfig, overrides=["task.dataset=x.jsonl"]).task.name == "dataset"
    with pytest.raises(ConfigError, match=r"needs task.chat_template = true"):
        TaskSection(dataset="x.jsonl", messages_field="chat")
    with pytest.raises(ConfigError, match="max_prompt_tokens must be >= 1"):
        TaskSection(dataset="x.jsonl", max_prompt_tokens=0)


def test_the_broker_gets_the_dataset_identity(tokenizer_dir):
    sets = [f"task.dataset={EXAMPLE / 'test.jsonl'}", "task.prompt_field=question", f"task.tokenizer={tokenizer_dir}",
            "task.reward=dora.tasks.rewards:exact_match"]  # fmt: skip
    cfg = load(RunConfig, overrides=sets)
    prompts, about = prompt_source(cfg)
    assert about["rows"] == about["kept"] == gsm_style.TEST_ROWS and about["filtered"] == 0
    assert len(about["fingerprint"]) == 16 and len(prompts(0)) > 3
