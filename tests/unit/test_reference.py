"""The configuration reference is generated from the config dataclasses; `dora config show` round-trips."""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys
import tomllib

import pytest

from dora.config import ConfigError, dumps_toml, load, reference
from dora.config.run import RunConfig
from dora.config.sim import SimConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / reference.DOC
REGENERATE = f"python -m dora config reference --write {reference.DOC}"


def test_docs_configuration_holds_the_generated_reference():
    text = DOC.read_text()
    assert reference.BEGIN in text and reference.END in text, (
        f"{reference.DOC} lost its reference markers; {REGENERATE}"
    )
    between = text[text.index(reference.BEGIN) + len(reference.BEGIN) : text.index(reference.END)]
    assert between == "\n\n" + reference.render() + "\n", (
        f"{reference.DOC}'s configuration reference differs from `dora config reference`; regenerate it: {REGENERATE}"
    )
    assert reference.splice(text, reference.render()) == text


def test_the_readme_points_at_the_reference_and_holds_no_copy():
    readme = (ROOT / "README.md").read_text()
    assert reference.BEGIN not in readme and reference.END not in readme
    assert "](docs/configuration.md)" in readme


def test_every_config_key_has_a_docstring():
    assert reference.undocumented() == [], "write a docstring under each of these fields (a string right after it)"


def test_every_section_and_key_is_in_the_reference():
    text = reference.render()
    for config in (RunConfig, SimConfig):
        for name, cls in reference.sections(config):
            assert f"`[{name}]`" in text, name
            for f in dataclasses.fields(cls):
                assert f"| `{f.name}` |" in text, (name, f.name)
    assert "| `liveness` | `int` | `20` | Missed heartbeat intervals" in text
    assert "| `rollout_groups` | `int \\| none` | `none` |" in text
    assert '`"sync" \\| "one_step" \\| "partial" \\| "dora" \\| "drop_stale"`' in text


def test_field_docs_read_the_string_under_each_field_only():
    @dataclasses.dataclass
    class Example:
        a: int = 1
        """About a,
        on two lines."""
        b: int = 2
        c: str = "x"
        """About c."""

    assert reference.field_docs(Example) == {"a": "About a,\non two lines.", "c": "About c."}


def test_splice_replaces_only_between_the_markers():
    text = f"before\n{reference.BEGIN}\nold\n{reference.END}\nafter\n"
    assert reference.splice(text, "new\n") == f"before\n{reference.BEGIN}\n\nnew\n\n{reference.END}\nafter\n"
    with pytest.raises(ConfigError, match="markers"):
        reference.splice("no markers here", "new\n")


@pytest.mark.parametrize(
    "overrides",
    [[], ["broker.journal=j.jsonl", "broker.discovery_file=none", "core.total_steps=none", "log.level=debug"],
     ["workload.distribution=mixture", 'workload.components=[{weight = 2.0, median = 300.0}, {median = 9000.0}]']],
)  # fmt: skip
def test_show_prints_toml_that_loads_back_to_the_same_config(tmp_path, overrides):
    cfg = load(RunConfig, path=str(ROOT / "examples" / "quickstart.toml"), overrides=overrides)
    shown = tmp_path / "shown.toml"
    shown.write_text(reference.show(cfg))
    assert load(RunConfig, path=str(shown)) == cfg


def test_show_of_the_sim_config_loads_back(tmp_path):
    paper = ROOT / "examples" / "sim" / "paper-64gpu.toml"
    cfg = load(SimConfig, path=str(paper), overrides=["cluster.rollout_gpus=32"])
    shown = tmp_path / "shown.toml"
    shown.write_text(reference.show(cfg))
    assert load(SimConfig, path=str(shown)) == cfg


def test_dumps_toml_writes_tables_inside_sections():
    data = {
        "workload": {"distribution": "mixture", "components": [{"weight": 1.0, "median": 30.0}]},
        "cluster": {"placement": {"dora": "colocated"}, "rollout_gpus": None},
        "task": {"name": 'a "quoted" é'},
    }
    back = tomllib.loads(dumps_toml(data))
    assert back == {"workload": data["workload"], "cluster": {"placement": {"dora": "colocated"}}, "task": data["task"]}


def test_dora_config_commands():
    def dora(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "dora", "config", *args], capture_output=True, text=True,
                              timeout=60, cwd=ROOT)  # fmt: skip

    r = dora("show", "--config", "examples/quickstart.toml", "--set", "core.total_steps=7")
    assert r.returncode == 0, r.stderr
    shown = tomllib.loads(r.stdout)
    assert shown["core"]["total_steps"] == 7 and shown["run"]["engine"] == "torch" and "journal" not in shown["broker"]
    r = dora("show", "--sim", "--set", "run.steps=3")
    assert r.returncode == 0 and tomllib.loads(r.stdout)["run"]["steps"] == 3, r.stderr
    r = dora("reference")
    assert r.returncode == 0 and r.stdout == reference.render()
    assert r.stdout in DOC.read_text(), f"{reference.DOC} differs from `dora config reference`; {REGENERATE}"
    for args, fragment in ((["show", "--set", "broker.liveness=1"], "liveness"),
                           (["show", "--config", "/nonexistent.toml"], "not found"),
                           (["reference", "--write", "pyproject.toml"], "no reference markers")):  # fmt: skip
        r = dora(*args)
        assert r.returncode == 2 and fragment in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_write_without_a_file_rewrites_docs_configuration_in_the_working_directory(tmp_path):
    stale = f"# Configuration\n\nWritten by hand.\n\n{reference.BEGIN}\n\nstale\n\n{reference.END}\n\nAfter.\n"
    doc = tmp_path / reference.DOC
    doc.parent.mkdir(parents=True)
    doc.write_text(stale)
    r = subprocess.run([sys.executable, "-m", "dora", "config", "reference", "--write"], capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0 and "updated" in r.stderr, r.stderr
    assert doc.read_text() == reference.splice(stale, reference.render())
    assert doc.read_text().startswith("# Configuration\n\nWritten by hand.\n") and doc.read_text().endswith("After.\n")
