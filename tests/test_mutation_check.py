"""Removing any fencing check from the core must make the tests fail (see tests/mutation.py)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_every_fencing_check_is_needed():
    r = subprocess.run([sys.executable, "-m", "tests.mutation"], cwd=ROOT, capture_output=True, text=True,
                       timeout=1700)  # fmt: skip
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(" killed ") == r.stdout.count("example tests failing") >= 6
