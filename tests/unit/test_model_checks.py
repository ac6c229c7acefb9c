"""A user's model mistakes are one line each and exit 2 before any process starts; a hub id resolves through
huggingface_hub's cache (offline: the cached copy, or one line naming the id and the cache)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from dora.config import ConfigError
from dora.hf.checks import check_lengths, check_model, model_limit
from dora.hf.folder import facts, is_path
from dora.launch import run as dora_run

ROOT = pathlib.Path(__file__).resolve().parents[2]
ROWS = ROOT / "examples" / "data" / "arithmetic" / "test.jsonl"


def copy_model(tiny_model: pathlib.Path, tmp_path: pathlib.Path, name: str = "model") -> pathlib.Path:
    folder = tmp_path / name
    shutil.copytree(tiny_model, folder)
    return folder


def edit_config(folder: pathlib.Path, **keys) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(keys)
    (folder / "config.json").write_text(json.dumps(cfg))


def no_config(folder):
    (folder / "config.json").unlink()


def no_tokenizer(folder):
    (folder / "tokenizer.json").unlink()


def not_causal(folder):
    edit_config(folder, model_type="vit", architectures=["ViTModel"])


def small_embedding(folder):
    edit_config(folder, vocab_size=100)


def no_template(folder):
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(tc))


def unknown_to_vllm(folder):
    edit_config(folder, architectures=["NoSuchLMForCausalLM"])


MISTAKES = [
    (no_config, [], "has no config.json: not a model folder"),
    (no_tokenizer, [], "has no tokenizer.json"),
    (not_causal, [], "is a vit (ViTModel), not a causal LM"),
    (small_embedding, [], "has 1024 tokens but the model's embedding 100 rows"),
    (no_template, [], "has no chat template"),
    (unknown_to_vllm, ["run.engine=vllm"], "(NoSuchLMForCausalLM): its registry names no such architecture"),
    (None, ["rollout.max_model_len=10000"], "rollout.max_model_len = 10000 is above what"),
    (None, ["task.max_prompt_tokens=200", "run.max_tokens=4000"],
     "run.max_tokens = 4000 after prompts of up to 200 tokens (task.max_prompt_tokens) needs 4200 positions; the "
     "engines hold 4096"),
    (None, ["rollout.max_model_len=60"], "the longest prompt of"),
]  # fmt: skip


@pytest.mark.parametrize(("mistake", "sets", "line"), MISTAKES,
                         ids=[m.__name__ if m else s[-1].split("=")[0] for m, s, _ in MISTAKES])  # fmt: skip
def test_a_model_mistake_is_one_line_and_exit_2_before_any_process_starts(tiny_model, tmp_path, capsys, mistake,
                                                                          sets, line):  # fmt: skip
    folder = copy_model(tiny_model, tmp_path)
    if mistake is not None:
        mistake(folder)
    if mistake is unknown_to_vllm and check_vllm_missing():
        pytest.skip("vllm is not installed")
    args = ["--set", f"rollout.model={folder}", "--set", f"run.dir={tmp_path / 'runs'}",
            "--set", f"task.dataset={ROWS}",
            "--set", "task.prompt_field=question", "--set", "task.chat_template=true", "--set", "task.reward=numeric",
            "--set", "run.engine=torch", "--set", "run.trainer=torch", "--set", "core.total_steps=1",
            "--set", "run.max_tokens=40"]  # fmt: skip
    for s in sets:
        args += ["--set", s]
    code = dora_run.main(args)
    err = capsys.readouterr().err
    errors = [x for x in err.splitlines() if x.startswith("dora run: ") and "dataset" not in x]
    assert code == 2 and len(errors) == 1 and line in errors[0], err
    assert not list((tmp_path / "runs").glob("*/*.log")), "a process was started"


def check_vllm_missing() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is None


def test_lengths_that_fit_pass_and_the_limit_is_the_models_own_unless_set_lower(tiny_model):
    found = facts(tiny_model)
    assert found.max_positions == 4096 and model_limit(found, None) == 4096 and model_limit(found, 512) == 512
    check_lengths(4096, prompt_tokens=96, prompt_from="x", completion_tokens=4000, completion_from="run.max_tokens")
    with pytest.raises(ConfigError, match=r"run.max_tokens = 4001 .* lower run.max_tokens to at most 4000"):
        check_lengths(4096, prompt_tokens=96, prompt_from="x", completion_tokens=4001, completion_from="run.max_tokens")
    assert check_model(tiny_model, key="rollout.model", engine="torch").stop_ids == {0, 2}  # endoftext, im_end


def test_names_written_as_paths_are_never_hub_ids():
    assert all(is_path(n) for n in ("/abs/m", "./runs/m", "../m", "~/m", "."))
    assert not any(is_path(n) for n in ("Qwen/Qwen2.5-0.5B-Instruct", "gpt2", "runs/tiny-model"))


def populate_cache(cache: pathlib.Path, repo: str, source: pathlib.Path) -> pathlib.Path:
    """The layout huggingface_hub's cache keeps a downloaded snapshot in (refs/main names the commit)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    shutil.copytree(source, snapshot)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    return snapshot


def sft_config(tmp_path: pathlib.Path, model: str) -> pathlib.Path:
    """`dora sft` from ``model`` on 32 of the held-out rows: one step, as the model's name is what is tested."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(ROWS.read_text().splitlines(keepends=True)[:32]))
    lines = ["[task]", f'dataset = "{rows}"', 'prompt_field = "question"', "chat_template = true",
             'reward = "numeric"', "[sft]", f'model = "{model}"', f'out = "{tmp_path / "out"}"', "epochs = 1",
             "batch_size = 32", "max_answer_tokens = 8"]  # fmt: skip
    path = tmp_path / "sft.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_hub_id_resolves_to_its_cached_snapshot_offline_and_a_missing_one_is_one_line(tiny_model, tmp_path):
    cache = tmp_path / "hub"
    snapshot = populate_cache(cache, "dora-test/tiny-qwen2", tiny_model)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    config = sft_config(tmp_path, "dora-test/tiny-qwen2")
    ok = subprocess.run([sys.executable, "-m", "dora", "sft", "--config", str(config), "--set", "sft.threads=1"],
                        capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert f"epochs from {snapshot}" in ok.stderr and (tmp_path / "out" / "config.json").is_file()
    missing = subprocess.run([sys.executable, "-m", "dora", "sft", "--config",
                              str(sft_config(tmp_path, "dora-test/not-cached"))],
                             capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
    lines = missing.stderr.strip().splitlines()
    assert missing.returncode == 2 and len(lines) == 1, missing.stderr
    assert "'dora-test/not-cached'" in lines[0] and str(cache) in lines[0] and "HF_HUB_OFFLINE is set" in lines[0]
