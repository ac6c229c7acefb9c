"""A model name that does not resolve is an error: a path that does not exist, an empty folder or an unknown
``dora:`` name is one line and exit 2 before anything starts, never a folder made and filled. ``"dora:tiny"`` is
dora's tiny model, built once into the user's cache, atomically, and reused."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from dora.config import ConfigError
from dora.hf import tiny
from dora.hf.preflight import model_folder
from dora.learner import main as learner_main
from dora.rollout import main as rollout_main

ROOT = pathlib.Path(__file__).resolve().parents[2]


def dora(tmp_path: pathlib.Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HOME": str(tmp_path / "home")}  # dora:tiny, were it asked for, is built there
    return subprocess.run([sys.executable, "-m", "dora", *argv], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=60)  # fmt: skip


COMMANDS = {
    "run": lambda model, tmp: ["run", "--config", str(ROOT / "examples/arithmetic.toml"), "--set",
                               f"rollout.model={model}", "--set", f"run.dir={tmp / 'runs'}"],
    "sft": lambda model, tmp: ["sft", "--config", str(ROOT / "examples/arithmetic.toml"), "--set",
                               f"sft.model={model}", "--set", f"sft.out={tmp / 'out'}"],
}  # fmt: skip


@pytest.mark.parametrize(
    ("command", "empty"),
    [("run", False),
     # slow: dora run's one line for a path is [run-missing]; the empty folder's words are [sft-empty], from the same
     # check (dora.hf.preflight.model_folder); dora run costs seconds of torch imports before it checks
     pytest.param("run", True, marks=pytest.mark.slow), ("sft", False), ("sft", True)],
    ids=["run-missing", "run-empty", "sft-missing", "sft-empty"],
)  # fmt: skip
def test_a_model_path_that_does_not_exist_or_is_empty_is_one_line_and_exit_2(tmp_path, command, empty):
    model = tmp_path / "typo"
    if empty:
        model.mkdir()
    r = dora(tmp_path, *COMMANDS[command](f"./{model.name}", tmp_path))
    key = "rollout.model" if command == "run" else "sft.model"
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"dora {command}: {key} = './typo': ") and str(model) in r.stderr, r.stderr
    assert ("is an empty folder" if empty else "no such folder") in r.stderr
    assert 'dora\'s tiny model is "dora:tiny"' in r.stderr
    assert model.exists() == empty and (not empty or not any(model.iterdir()))  # neither made nor filled
    assert sorted(p.name for p in tmp_path.iterdir()) == (["typo"] if empty else [])  # no run dir, no out, no home


@pytest.mark.parametrize(
    ("main", "argv"),
    [(rollout_main.main, ["--broker", "ipc:///nowhere", "--engine", "torch", "--model"]),
     (learner_main.main, ["--broker", "ipc:///nowhere", "--trainer", "torch", "--model"])],
    ids=["rollout", "learner"],
)  # fmt: skip
@pytest.mark.parametrize("name", ["./missing", "dora:small"])
def test_the_processes_refuse_a_name_that_does_not_resolve_in_one_line(tmp_path, monkeypatch, capsys, main, argv,
                                                                        name):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    assert main([*argv, name]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and repr(name) in err and '"dora:tiny"' in err, err
    assert not any(tmp_path.iterdir())


def test_dora_eval_refuses_a_model_path_that_does_not_exist(tmp_path, monkeypatch, capsys):
    from dora.ops import evaluate

    monkeypatch.chdir(tmp_path)
    assert evaluate.main(["--config", str(ROOT / "examples/arithmetic.toml"), "--model", "./missing"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dora eval: --model = './missing': no such folder") and err.count("\n") == 1, err


def test_an_unknown_dora_name_is_refused_naming_the_ones_dora_knows(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ConfigError) as e:
        model_folder("dora:huge", key="rollout.model")
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
    folder = model_folder("dora:tiny", key="rollout.model")
    assert folder == tmp_path / ".cache" / "dora" / "tiny-model" and (folder / "config.json").is_file()
    assert "building dora:tiny into" in capsys.readouterr().err
    assert model_folder("dora:tiny", key="sft.model") == folder and len(calls) == 1
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
