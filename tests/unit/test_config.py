"""Configuration: precedence (defaults < base < TOML < env < CLI), unknown keys, type errors."""

from __future__ import annotations

import sys

import pytest

from dora.config import ConfigError, CoreConfig, load
from dora.config.run import RunConfig
from dora.config.sim import SimConfig
from dora.ids import Mode
from dora.sim.workload import Workload


@pytest.fixture
def toml(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[core]\nmax_staleness = 2\ntrain_groups = 16\nmode = "partial"\n[run]\nsteps = 5\n')
    return str(path)


def test_precedence_defaults_base_toml_env_cli(toml):
    assert load(SimConfig).core.max_staleness == CoreConfig().max_staleness
    assert load(SimConfig, base={"core": {"max_staleness": 4, "group_size": 2}}).core.max_staleness == 4
    cfg = load(SimConfig, path=toml, base={"core": {"max_staleness": 4, "group_size": 2}})
    assert (cfg.core.max_staleness, cfg.core.group_size, cfg.core.mode) == (2, 2, Mode.PARTIAL), "TOML over base"
    env = {"DORA_SIM__CORE__MAX_STALENESS": "3", "DORA_SIM__RUN__STEPS": "7", "UNRELATED": "x"}
    cfg = load(SimConfig, path=toml, env=env, env_prefix="DORA_SIM__")
    assert (cfg.core.max_staleness, cfg.run.steps, cfg.core.train_groups) == (3, 7, 16), "env over TOML"
    cfg = load(SimConfig, path=toml, env=env, env_prefix="DORA_SIM__", overrides=["core.max_staleness=1"])
    assert cfg.core.max_staleness == 1, "command line over env"


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["core.max_stalenes=1"], "unknown key 'core.max_stalenes'"),
        (["nosuch.key=1"], "unknown key 'nosuch'"),
        (["core.train_groups=many"], "core.train_groups must be int"),
        (["core.legacy_fill=perhaps"], "core.legacy_fill must be bool"),
        (["core.mode=fast"], "core.mode must be one of"),
        (["cluster.placement.dora=cloud"], "must be one of 'colocated', 'disaggregated'"),
        (["run.steps=0"], "run.steps"),
        (["core"], "section.key=value"),
        (["workload.distribution=mixture"], "needs [[workload.components]]"),
    ],
)
def test_bad_values_are_one_clear_error(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        load(SimConfig, overrides=overrides)


@pytest.mark.parametrize(
    ("overrides", "accepts"),
    [(["rollout.max_slots=1", "core.group_size=4"], 2), (["rollout.credit_slots=3", "core.group_size=4"], 3),
     (["rollout.max_slots=64", "rollout.credit_slots=2"], 2)],
)  # fmt: skip
def test_a_live_run_whose_workers_cannot_hold_one_group_is_refused(overrides, accepts):
    with pytest.raises(ConfigError, match=f"accepts {accepts} sequences at once.*core.group_size = "):
        load(RunConfig, overrides=overrides)
    load(RunConfig, overrides=[*overrides, f"core.group_size={accepts}"])  # one group fits: accepted


@pytest.mark.parametrize(
    ("key", "place"),
    [("engine.max_slots", "rollout.max_slots"), ("engine.credit_slots", "rollout.credit_slots"),
     ("rollout.slots", "rollout.max_slots")],
)  # fmt: skip
def test_a_live_run_sizes_its_workers_in_rollout_and_an_old_key_names_the_new_place(key, place):
    with pytest.raises(ConfigError, match=rf"^{key} is gone: .*{place}"):
        load(RunConfig, overrides=[f"{key}=64"])
    sim = load(SimConfig, overrides=["engine.max_slots=64", "engine.credit_slots=96"]).engine
    assert (sim.max_slots, sim.credit) == (64, 96), "`dora sim`'s replicas keep their slots in [engine]"


@pytest.mark.parametrize("elastic", [-1, 4])
def test_dora_run_cannot_make_more_workers_elastic_than_it_starts(elastic):
    with pytest.raises(ConfigError, match=rf"run.elastic_workers must be in \[0, run.workers = 3\]; got {elastic}"):
        load(RunConfig, overrides=["run.workers=3", f"run.elastic_workers={elastic}"])
    assert load(RunConfig, overrides=["run.workers=3", "run.elastic_workers=3"]).run.elastic_workers == 3


def test_bad_toml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[core\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load(SimConfig, path=str(bad))
    with pytest.raises(ConfigError, match="not found"):
        load(SimConfig, path=str(tmp_path / "none.toml"))


def test_mixture_workload_from_toml(tmp_path):
    path = tmp_path / "mix.toml"
    path.write_text(
        '[workload]\ndistribution = "mixture"\ncap = 4096\n'
        "[[workload.components]]\nweight = 3\nmedian = 100\nsigma = 0.3\n"
        "[[workload.components]]\nweight = 1\nmedian = 3000\nsigma = 0.3\n"
    )
    wl = Workload(load(SimConfig, path=str(path)).workload, seed=1)
    lengths = [wl.length(g, 0, 1) for g in range(2000)]
    short = sum(n < 600 for n in lengths) / len(lengths)
    assert 0.65 < short < 0.85, "a bimodal mixture: about three quarters short answers"
    assert max(lengths) <= 4096


def test_each_command_reads_only_its_own_environment_variables():
    """DORA_SIM__* is dora sim's; the run commands (DORA_SECTION__KEY) neither read it nor call it unknown."""
    env = {"DORA_SIM__RUN__STEPS": "7", "DORA_CORE__MAX_STALENESS": "3"}
    cfg = load(RunConfig, env=env, env_prefix="DORA_")
    assert cfg.core.max_staleness == 3
    assert load(SimConfig, env=env, env_prefix="DORA_SIM__").run.steps == 7
    with pytest.raises(ConfigError, match="unknown key 'brokr'"):  # a typo is still an error
        load(RunConfig, env={"DORA_BROKR__BIND": "x"}, env_prefix="DORA_")


@pytest.mark.parametrize(("value", "learner", "core"),
                         [("false", False, False), ("true", True, False), ("replace", "replace", True)])  # fmt: skip
def test_filter_uniform_groups_is_false_true_or_replace_and_replace_turns_the_cores_filtering_on(value, learner, core):
    cfg = load(RunConfig, overrides=[f"learner.filter_uniform_groups={value}"])
    assert (cfg.learner.filter_uniform_groups, cfg.core.filter_uniform) == (learner, core)
    assert load(RunConfig, base={"learner": {"filter_uniform_groups": learner}}) == cfg  # the TOML value too
    with pytest.raises(ConfigError, match=r"learner\.filter_uniform_groups must be bool or 'replace'; got 'refill'"):
        load(RunConfig, overrides=["learner.filter_uniform_groups=refill"])
    with pytest.raises(ConfigError, match=r"core\.filter_uniform is set by learner\.filter_uniform_groups = 'replace'"):
        load(RunConfig, overrides=["core.filter_uniform=true"])
    assert load(SimConfig, overrides=["core.filter_uniform=true", "workload.uniform_share=0.5"]).core.filter_cap == 32


def test_a_module_callable_is_found_in_the_working_directory_as_python_m_would(tmp_path, monkeypatch):
    """The ``dora`` script's path does not hold the directory it runs in: a ``module:function`` of the user's (an
    agent, a reward) is looked for there too; a module that is nowhere is still one clear error."""
    from dora.config import resolve_callable

    (tmp_path / "myagents_here").mkdir()
    (tmp_path / "myagents_here" / "__init__.py").write_text("async def agent(row, client):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    assert resolve_callable("myagents_here:agent", "task.agent").__name__ == "agent"
    with pytest.raises(ConfigError, match="No module named 'nowhere_at_all'"):
        resolve_callable("nowhere_at_all:f", "task.agent")
