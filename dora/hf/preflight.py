"""Before any process starts: the model a run names, found (a folder or a hub id) and checked against the run's
settings, so a user's mistake is one line and exit 2 instead of a worker's traceback or a hang.

Used by `dora run` (for the whole run), `dora rollout` and `dora learner` (each on its own, as under Slurm) and
`dora sft`. What is checked is ``dora.hf.checks``: a model folder (config and fast tokenizer), a causal LM, a
tokenizer that fits the embedding, an architecture the engine runs, and lengths that fit the model.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any

from dora.hf.checks import check_lengths, check_model, model_limit
from dora.hf.folder import ModelFacts, is_path, resolve


def model_folder(name: str, *, key: str, build_tiny: bool = False, who: str = "dora") -> pathlib.Path:
    """The local folder of ``name``: a folder, or a hub id's cached snapshot. With ``build_tiny``, a folder written
    as a path that does not exist yet, or is empty (``./runs/tiny-model``), is built there as dora's tiny model."""
    path = resolve(name, key=key)
    if build_tiny and (is_path(name) or path.exists()) and not (path.exists() and any(path.iterdir())):
        from dora.hf.tiny import build_model

        print(f"{who}: building the tiny model into {path} (it has no config.json)", file=sys.stderr)
        build_model(path)
    return path


def check_run_model(cfg: Any, folder: pathlib.Path, engine: str,
                    about: dict[str, Any]) -> tuple[ModelFacts, int | None]:  # fmt: skip
    """``folder`` checked for a run of ``cfg`` (a RunConfig) on ``engine`` (torch, vllm; a sim engine beside a torch
    trainer runs no model: only the folder is checked). ``about``: what the task is (``TaskRun.about``, with the
    dataset's longest prompt). Returns the model's facts and the limit on prompt + completion the engines get."""
    found = check_model(folder, key="rollout.model", engine=engine if engine in ("torch", "vllm") else None,
                        chat_template=cfg.task.chat_template)  # fmt: skip
    limit = model_limit(found, cfg.rollout.max_model_len)
    if engine not in ("torch", "vllm"):
        return found, limit
    t = cfg.task
    if t.max_prompt_tokens is not None:
        prompt, prompt_from = t.max_prompt_tokens, "task.max_prompt_tokens"
    elif about.get("longest_prompt") is not None:
        prompt, prompt_from = about["longest_prompt"], f"the longest prompt of {about.get('dataset', 'the task')}"
    else:
        prompt, prompt_from = 0, "built-in task prompts, not counted"
    if t.env is not None:
        check_lengths(limit, prompt_tokens=prompt, prompt_from=prompt_from, completion_tokens=t.max_episode_tokens,
                      completion_from="task.max_episode_tokens")  # fmt: skip
    else:
        check_lengths(limit, prompt_tokens=prompt, prompt_from=prompt_from, completion_tokens=cfg.run.max_tokens,
                      completion_from="run.max_tokens")  # fmt: skip
    return found, limit
