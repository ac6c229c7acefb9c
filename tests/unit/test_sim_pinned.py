"""The simulator with ``core.migrate = false`` (agent episodes, whose agent talks to one worker's endpoint): the
flag is read from the sim config's ``[core]`` table, no group ever moves between workers, and a run of multi-turn
episodes still keeps C1, C2 and C3 and ends, whether its workers are standalone, elastic or both (fleets whose
runs move groups with migration on)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dora.config import load
from dora.config.sim import SimConfig
from dora.ids import Mode
from dora.sim.des import Simulation
from tests.unit.simcfg import small
from tests.unit.test_sim_agentic import agentic
from tests.unit.test_sim_properties import check_run


def test_the_sim_config_reads_migrate_from_its_core_table(tmp_path):
    path = tmp_path / "sim.toml"
    path.write_text("[core]\nmigrate = false\n")
    assert load(SimConfig, path=str(path)).core.migrate is False
    assert load(SimConfig).core.migrate is True


@pytest.mark.parametrize(("placement", "elastic_gpus"), [("disaggregated", None), ("elastic", 3), ("colocated", None)])
def test_episodes_finish_where_they_started_and_the_run_keeps_every_invariant(placement, elastic_gpus):
    cfg = small(workers=6, credit=12, steps=6, k=2, train_groups=6, group_size=3, sigma=1.4, median=20, cap=3000,
                train_s=4.0, seed=1, prefill_s_per_token=1e-3, placement={"dora": placement})  # fmt: skip
    cfg = agentic(cfg, turns=3.0, max_turns=10, tool_s=3.0)
    cfg = replace(cfg, cluster=replace(cfg.cluster, elastic_gpus=elastic_gpus))
    moved = Simulation(cfg, Mode.DORA, strict=True).run().migrated_groups
    assert moved > 0, "with migration on, this fleet moves groups"
    pinned = replace(cfg, core=replace(cfg.core, migrate=False))
    o = Simulation(pinned, Mode.DORA, strict=True).run()
    check_run(o, pinned, Mode.DORA)
    assert o.migrated_groups == 0, f"{o.migrated_groups} groups moved with migration off"
