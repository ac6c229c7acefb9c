"""The simulator's share of groups whose rewards are all equal, and what filtering and replacing them costs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dora.ids import Mode
from dora.sim.metrics import summarize
from dora.sim.report import kept
from dora.sim.runner import simulate
from dora.sim.workload import Workload
from tests.unit.simcfg import small


def test_the_uniform_share_is_drawn_per_group_and_attempt_and_moves_no_length():
    plain, flat = Workload.lognormal(seed=3), Workload.lognormal(seed=3, uniform_share=0.4)
    drawn = [flat.uniform(g, 1) for g in range(4000)]
    assert 0.37 < sum(drawn) / len(drawn) < 0.43
    assert [flat.uniform(g, 2) for g in range(4000)] != drawn, "a re-run draws afresh"
    assert all(plain.length(g, i, 1) == flat.length(g, i, 1) for g in range(200) for i in range(4))
    g = drawn.index(True)
    assert {flat.reward(g, i, 1) for i in range(4)} == {1.0}
    assert {flat.reward(drawn.index(False), i, 1) for i in range(4)} == {0.0, 1.0}
    assert not any(plain.uniform(g, 1) for g in range(200))
    with pytest.raises(ValueError, match="uniform_share"):
        Workload.lognormal(uniform_share=1.5)


@pytest.mark.parametrize("mode", [Mode.DORA, Mode.SYNC])
def test_dora_sim_reports_the_filtered_share_and_what_refilling_costs(mode):
    """Half the groups uniform: filtered and replaced, every step still trains train_groups groups with a signal,
    C2 counts them, and the same run without filtering (same lengths, same rewards) is faster in tokens trained
    per second, since nothing it decodes is thrown away."""
    cfg = small(workers=4, credit=12, steps=6, k=1, train_groups=4, group_size=3, seed=5)
    cfg = replace(cfg, workload=replace(cfg.workload, uniform_share=0.5))
    off = simulate(cfg, mode, strict=True).metrics
    on_cfg = replace(cfg, core=replace(cfg.core, filter_uniform=True))
    result = simulate(on_cfg, mode, strict=True)
    on = result.metrics
    assert off["groups_filtered"] == 0 and off["filtered_tokens"] == 0
    assert on["groups_trained"] == off["groups_trained"] == 6 * 4
    assert 0.25 < on["filtered_share"] < 0.75 and on["groups_filtered"] > 0 and on["filtered_tokens"] > 0
    assert on["groups_dispatched"] == on["groups_trained"] + on["groups_filtered"] + on["groups_in_flight_at_end"]
    assert "C2" in kept(on) and "C2" in kept(off)
    assert on["throughput_tokens_per_s"] < off["throughput_tokens_per_s"]
    assert on["step_time_s"] > off["step_time_s"]
    o = result.outcome  # the ids not trained are the filtered ones, each once
    assert len(set(range(o.groups_dispatched)) - set(o.trained)) == o.groups_filtered == on["groups_filtered"]
    assert summarize(o, on_cfg) == on


def test_a_solved_task_ends_with_every_step_filtering_its_cap():
    cfg = small(workers=2, credit=9, steps=3, k=1, train_groups=2, group_size=3)
    cfg = replace(cfg, core=replace(cfg.core, filter_uniform=True, max_filtered=3),
                  workload=replace(cfg.workload, uniform_share=1.0))  # fmt: skip
    m = simulate(cfg, Mode.DORA, strict=True).metrics
    assert (m["groups_trained"], m["groups_filtered"], m["groups_dispatched"]) == (3 * 2, 3 * 3, 3 * (2 + 3))
    assert "C2" in kept(m)
