from __future__ import annotations

import pathlib

import pytest
from hypothesis import Phase, settings

# Used by tests/mutation.py: a failing property run should stop at the first counterexample, not shrink it.
settings.register_profile("mutation", phases=[Phase.explicit, Phase.reuse, Phase.generate], database=None)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> pathlib.Path:
    """A tiny untied Qwen2 model and tokenizer, built offline once per session, loaded like any HF folder."""
    from dora.hf.tiny import build_model

    return build_model(tmp_path_factory.mktemp("tiny") / "model")
