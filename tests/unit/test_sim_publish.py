"""The simulated trainer's publish: a flat ``publish_s`` or per-GB costs, written in line or in the background.

With ``trainer.overlap_publish`` the step ends once the version is copied aside, the learner asks for the next batch
at once and the version is published when its write ends (one write in flight). These runs are small enough to
read every step's time off them: with fast rollouts the cadence drops from train + write to train + copy (or to
write + copy when the write is the longer), K = 0 is sync either way, and elastic workers' batches wait for the
publish, with the core's strict checks on throughout.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from dora.config import ConfigError
from dora.config.sim import SimConfig, TrainerSection
from dora.ids import Mode
from dora.sim import lora
from dora.sim.des import Simulation
from dora.sim.outcome import Outcome
from dora.sim.trainer import publish_cost_s
from tests.unit.simcfg import small

TRAIN_S = 2.0


def fast(*, k: int, overlap: bool, write_s_per_gb: float = 1.5, snapshot_s_per_gb: float = 0.1,
         placement: str = "disaggregated") -> SimConfig:  # fmt: skip
    """Eight workers that roll a batch out in about a second, a 2 s train step, a 1 GB version."""
    cfg = small(workers=8, credit=24, k=k, steps=8, median=4.0, sigma=0.2, cap=16, load_s=0.1, train_s=TRAIN_S,
                placement={m.value: placement for m in Mode})  # fmt: skip
    trainer = replace(cfg.trainer, weights_gb=1.0, write_s_per_gb=write_s_per_gb,
                      snapshot_s_per_gb=snapshot_s_per_gb, overlap_publish=overlap)  # fmt: skip
    return replace(cfg, trainer=trainer, cluster=replace(cfg.cluster, elastic_gpus=4))


def gaps(o: Outcome) -> list[float]:
    """Seconds between consecutive publishes."""
    published = [s.published_s for s in o.steps]
    return [b - a for a, b in itertools.pairwise(published)]


def test_the_per_gb_costs_replace_publish_s_only_when_the_weights_size_is_given():
    flat = TrainerSection(publish_s=0.7)
    assert (flat.write_s, flat.snapshot_s) == (0.7, 0.0)
    sized = TrainerSection(publish_s=0.7, weights_gb=16.0, write_s_per_gb=2.0, snapshot_s_per_gb=0.05)
    assert (sized.write_s, sized.snapshot_s) == (32.0, pytest.approx(0.8))
    assert publish_cost_s(sized, 10.0) == 32.0
    assert publish_cost_s(replace(sized, overlap_publish=True), 10.0) == pytest.approx(0.8 + 22.0)
    assert publish_cost_s(replace(sized, overlap_publish=True), 40.0) == pytest.approx(0.8)
    with pytest.raises(ConfigError):
        TrainerSection(weights_gb=-1.0)
    cfg = SimConfig(trainer=sized)  # an adapter run writes the adapter's bytes
    adapter = lora.priced(replace(cfg, lora=replace(cfg.lora, rank=16)))
    c = lora.costs(adapter)
    assert adapter.trainer.weights_gb == pytest.approx(16.0 * c.adapter_bytes / c.weight_bytes)


@pytest.mark.parametrize(("write_s_per_gb", "cadence"), [(1.5, TRAIN_S + 0.1), (3.0, 3.0 + 0.1)])
def test_overlap_takes_the_write_off_the_step_when_rollout_keeps_up(write_s_per_gb, cadence):
    """In line every step takes train + write; overlapped, train + copy, or write + copy when the write is the
    longer (a step that ends before the previous write waits for it)."""
    inline = Simulation(fast(k=2, overlap=False, write_s_per_gb=write_s_per_gb), Mode.DORA, strict=True).run()
    assert gaps(inline) == pytest.approx([TRAIN_S + write_s_per_gb] * 7)
    over = Simulation(fast(k=2, overlap=True, write_s_per_gb=write_s_per_gb), Mode.DORA, strict=True).run()
    assert gaps(over) == pytest.approx([cadence] * 7)
    assert over.c1_violations == 0 and max(over.staleness) <= 2
    assert len(over.trained) == len(set(over.trained)) == 8 * 4


def test_k0_stays_sync_the_early_request_waits_for_the_publish():
    """Without a copy cost the overlapped sync run is the in-line one, step for step; with one, each step is later
    by the copy, never earlier."""
    runs = {ov: Simulation(fast(k=0, overlap=ov, snapshot_s_per_gb=0.0), Mode.SYNC, strict=True).run()
            for ov in (False, True)}  # fmt: skip
    assert [(s.delivered_s, s.published_s) for s in runs[True].steps] == [
        (s.delivered_s, s.published_s) for s in runs[False].steps
    ]
    copied = Simulation(fast(k=0, overlap=True), Mode.SYNC, strict=True).run()
    assert gaps(copied) == pytest.approx([g + 0.1 for g in gaps(runs[False])])
    for s, nxt in itertools.pairwise(copied.steps):
        assert nxt.delivered_s >= s.published_s, "sync: no batch before the version it needs"


def test_elastic_workers_batches_wait_for_the_publish_with_the_core_strict():
    """With elastic workers the core holds the early batch until the publish: no step overlaps a write, every
    elastic worker yields once a step, and the strict core finds nothing wrong."""
    cfg = fast(k=2, overlap=True, placement="elastic")
    cfg = replace(cfg, cluster=replace(cfg.cluster, host_link_bytes_per_s=1e9),
                  engine=replace(cfg.engine, weight_bytes=1e8, wake_s=0.2),
                  trainer=replace(cfg.trainer, state_bytes=1e8))  # fmt: skip
    o = Simulation(cfg, Mode.DORA, deaths=((3.0, 1), (9.0, 5)), strict=True).run()
    assert o.elastic_workers == 4
    for s, nxt in itertools.pairwise(o.steps):
        assert nxt.delivered_s >= s.published_s, "an elastic fleet's next batch waits for the publish"
    assert o.c1_violations == 0 and max(o.staleness) <= 2
    assert len(o.trained) == len(set(o.trained)) == 8 * 4
    clean = Simulation(cfg, Mode.DORA, strict=True).run()
    assert clean.yields == 4 * 8, "every elastic worker yields for every step"
    assert min(gaps(clean)) >= TRAIN_S + 1.5 + 0.1, "the write is not hidden: the batch waited for it"
