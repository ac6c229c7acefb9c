"""The model zoo (``dora.hf.zoo``): one tiny random-weight model per family, built once per test session."""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import pytest


@pytest.fixture(scope="session")
def zoo_model(tmp_path_factory) -> Callable[[str], pathlib.Path]:
    """``zoo_model(family)``: that family's model folder (built on first use)."""
    from dora.hf import zoo

    built: dict[str, pathlib.Path] = {}

    def get(family: str) -> pathlib.Path:
        if family not in built:
            built[family] = zoo.build(family, tmp_path_factory.mktemp(f"zoo-{family}") / "model")
        return built[family]

    return get
