"""The simulator's measured window: ``run.steps`` steps, then a cooldown (K + 2 steps by default) during which the
core still dispatches, left out of the metrics, so that the window does not end in the run's drain."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dora.config import ConfigError
from dora.config.sim import RunSection
from dora.ids import Mode
from dora.sim.des import Simulation
from dora.sim.metrics import summarize
from tests.unit.simcfg import small


def test_the_window_is_the_first_steps_of_a_run_that_goes_on_past_them():
    cfg = small(workers=3, steps=6, k=2, sigma=1.5, train_groups=3, cooldown_steps=None)
    o = Simulation(cfg, Mode.DORA).run()
    m = summarize(o, cfg)
    assert (m["steps"], m["cooldown_steps"], len(o.steps)) == (6, 4, 10)
    assert m["groups_trained"] == 10 * 3  # the core dispatched through the cooldown, and it all trained
    # the same simulation as a 10-step run measured whole (total_steps 10 both): the window is its first 6 steps
    whole = Simulation(replace(cfg, run=replace(cfg.run, steps=10, cooldown_steps=0)), Mode.DORA).run()
    tokens = sum(s.tokens for s in whole.steps[:6])
    assert m["throughput_tokens_per_s"] == pytest.approx(tokens / whole.totals_at_step[5].t)
    assert m["step_time_s"] == pytest.approx(whole.totals_at_step[5].t / 6)


def test_sync_has_nothing_ahead_to_drain_and_the_cooldown_defaults_to_k_plus_2():
    cfg = small(workers=2, steps=4, k=3, cooldown_steps=None)
    for mode, k in ((Mode.SYNC, 0), (Mode.ONE_STEP, 1), (Mode.DORA, 3)):
        assert cfg.for_mode(mode).core.total_steps == 4 + k + 2, mode
    with pytest.raises(ConfigError, match="cooldown_steps must be >= 0"):
        RunSection(steps=4, cooldown_steps=-1)
