from __future__ import annotations

import pathlib

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> pathlib.Path:
    """A tiny untied Qwen2 model and tokenizer, built offline once per session, loaded like any HF folder."""
    from dora.tasks.model import build_model

    return build_model(tmp_path_factory.mktemp("tiny") / "model")
