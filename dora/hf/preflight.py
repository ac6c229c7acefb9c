"""Before any process starts: the model a run names, found (dora:tiny, a folder or a hub id) and checked against the
run's settings, so a user's mistake is one line and exit 2 instead of a worker's traceback or a hang.

Used by `dora run` (for the whole run), `dora rollout` and `dora learner` (each on its own, as under Slurm) and
`dora sft`. What is checked is ``dora.hf.checks``: a model folder (config and fast tokenizer), a causal LM, a
tokenizer that fits the embedding, an architecture the engine runs, and lengths that fit the model.
"""

from __future__ import annotations

import pathlib
from typing import Any

from dora.config import ConfigError
from dora.hf.checks import check_lengths, check_model, model_limit
from dora.hf.folder import ModelFacts, resolve


def model_folder(name: str, *, key: str) -> pathlib.Path:
    """The local folder of ``name`` (``key``: the setting it came from): ``"dora:tiny"``'s (built on first use), a
    folder that exists and is not empty, or a hub id's cached snapshot. Anything else (a path that does not exist,
    an empty folder, an unknown ``dora:`` name, an id the hub does not have) is a ConfigError: one line and exit 2,
    never a folder made and filled with dora's tiny model."""
    if name.startswith("dora:"):
        from dora.hf import tiny

        if name not in tiny.NAMES:
            known = ", ".join(f'"{n}"' for n in tiny.NAMES)
            raise ConfigError(f"{key} = {name!r}: dora has no model of that name (it knows {known})")
        return tiny.cached()
    return resolve(name, key=key)


def sft_start(cfg: Any) -> tuple[str, str]:
    """The model `dora sft` starts from, as written, and the setting it came from: sft.model, else rollout.model."""
    name, key = (cfg.sft.model, "sft.model") if cfg.sft.model else (cfg.rollout.model, "rollout.model")
    if not name:
        raise ConfigError('dora sft needs sft.model or rollout.model (the model folder, hub id or "dora:tiny" to '
                          "start from)")  # fmt: skip
    return name, key


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
