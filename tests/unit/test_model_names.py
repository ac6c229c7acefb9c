"""``"dora:tiny"`` is dora's tiny model, built once into the user's cache, atomically, and reused; an unknown
``dora:`` name is an error naming the ones dora knows."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from dora.config import ConfigError
from dora.hf import tiny
from dora.hf.folder import resolve


def test_an_unknown_dora_name_is_refused_naming_the_ones_dora_knows(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ConfigError) as e:
        resolve("dora:huge", key="rollout.model")
    assert str(e.value) == "rollout.model = 'dora:huge': dora has no model of that name (it knows \"dora:tiny\")"
    assert not any(tmp_path.iterdir())


def fake_build(out: str | pathlib.Path) -> pathlib.Path:
    out = pathlib.Path(out)
    (out / "config.json").write_text("{}")
    (out / "built-by").write_text(str(os.getpid()))
    return out


def test_dora_tiny_is_built_once_into_the_users_cache_and_reused(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(tiny, "build_model", lambda out: calls.append(out) or fake_build(out))
    folder = resolve("dora:tiny", key="rollout.model")
    assert folder == tmp_path / ".cache" / "dora" / "tiny-model" and (folder / "config.json").is_file()
    assert "building dora:tiny into" in capsys.readouterr().err
    assert resolve("dora:tiny", key="sft.model") == folder and len(calls) == 1
    assert capsys.readouterr().err == ""  # reused, said nothing
    assert sorted(p.name for p in folder.parent.iterdir()) == ["tiny-model"]  # its temporary sibling is gone
    assert calls[0].parent == folder.parent  # built beside it, then renamed into place


def test_an_empty_cache_folder_is_built_into_and_a_foreign_one_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(tiny, "build_model", fake_build)
    (tmp_path / "tiny-model").mkdir()
    assert (tiny.cached(tmp_path) / "config.json").is_file()
    other = tmp_path / "other"
    (other / "tiny-model").mkdir(parents=True)
    (other / "tiny-model" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"holds no config\.json: remove it"):
        tiny.cached(other)
    assert sorted(p.name for p in (other / "tiny-model").iterdir()) == ["notes.txt"]


RACER = textwrap.dedent("""
    import os, pathlib, sys, time
    from dora.hf import tiny

    cache, gate = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])

    def build(out):
        (gate / str(os.getpid())).touch()
        deadline = time.monotonic() + 30
        while len(list(gate.iterdir())) < 2 and time.monotonic() < deadline:  # both are building now
            time.sleep(0.01)
        (out / "config.json").write_text("{}")
        (out / "built-by").write_text(str(os.getpid()))
        return out

    tiny.build_model = build
    print(tiny.cached(cache))
""")


def test_two_processes_asking_at_once_end_with_the_same_complete_folder(tmp_path):
    cache, gate = tmp_path / "cache", tmp_path / "gate"
    gate.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(cache), str(gate)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert len(list(gate.iterdir())) == 2  # both built
    folder = cache / "tiny-model"
    assert [o.strip() for o, _ in outs] == [str(folder)] * 2
    assert sorted(p.name for p in cache.iterdir()) == ["tiny-model"]  # the loser's folder is removed
    assert sorted(p.name for p in folder.iterdir()) == ["built-by", "config.json"]
    assert (folder / "built-by").read_text() in {str(p.pid) for p in procs}
