"""LoRA in the simulator: the derived adapter sizes and costs, and multi-version workers in a whole run."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dora.config import ConfigError, load
from dora.config.sim import ModelSection, SimConfig, SimLoraSection
from dora.ids import Mode
from dora.sim import lora
from dora.sim.des import Simulation

from .simcfg import small

# A small stated model: hidden 64, MLP 176, 2 blocks, 4 query heads and 2 KV heads of 16, vocabulary 100.
TINY = ModelSection(hidden_size=64, intermediate_size=176, layers=2, attention_heads=4, kv_heads=2, head_dim=16,
                    vocab_size=100, bytes_per_param=2.0, activation_recompute=False)  # fmt: skip
# Its linear layers (d_in, d_out): q 64->64, k 64->32, v 64->32, o 64->64, gate 64->176, up 64->176, down 176->64.
IN_PLUS_OUT = {"q_proj": 128, "k_proj": 96, "v_proj": 96, "o_proj": 128, "gate_proj": 240, "up_proj": 240,
               "down_proj": 240}  # fmt: skip
IN_TIMES_OUT = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 176  # 46,080 weights per block


@pytest.mark.parametrize(
    ("modules", "per_block"),
    [(("q_proj", "v_proj"), 128 + 96), (("all-linear",), sum(IN_PLUS_OUT.values()))],
)
def test_adapter_bytes_are_rank_times_in_plus_out_over_the_adapted_layers(modules, per_block):
    spec = SimLoraSection(rank=4, target_modules=modules)
    assert lora.adapter_params(TINY, spec) == 4 * 2 * per_block
    cfg = SimConfig(model=TINY, lora=spec)
    assert lora.costs(cfg).adapter_bytes == 4 * 2 * per_block * 2.0


@pytest.mark.parametrize("recompute", [False, True])
def test_the_training_cost_factor_drops_the_frozen_weights_gradients(recompute):
    m = replace(TINY, activation_recompute=recompute)
    spec = SimLoraSection(rank=4)
    n = 2 * IN_TIMES_OUT + 100 * 64  # every block's linear layers and the output layer: 98,560
    a = 4 * 2 * 1168  # 9,344 adapter weights
    assert lora.matmul_params(m) == n == 98_560
    # LoRA: forward (again, with recomputation), input gradients, and the adapters' own weight gradients
    lora_flop = (2 * n + 2 * n + 6 * a) + (2 * n + 2 * a if recompute else 0)
    full_flop = 6 * n + (2 * n if recompute else 0)
    expected = lora_flop / full_flop
    assert lora.train_cost_factor(m, spec) == pytest.approx(expected, rel=1e-12)
    assert lora.train_cost_factor(m, SimLoraSection()) == 1.0


def test_the_paper_model_trains_at_about_three_quarters_of_full_cost():
    """Qwen2.5-32B, rank 16, every linear layer: 134.2M adapter weights; 3/4 + A/N with recomputation."""
    m, spec = ModelSection(), SimLoraSection(rank=16)
    assert lora.adapter_params(m, spec) == 16 * 64 * (2 * 10240 + 2 * 6144 + 3 * 32768)
    assert lora.weight_params(m) * 2 == pytest.approx(65.5e9, rel=1e-3)
    assert lora.train_cost_factor(m, spec) == pytest.approx(0.75 + lora.adapter_params(m, spec) / lora.matmul_params(m))
    assert lora.train_cost_factor(replace(m, activation_recompute=False), spec) == pytest.approx(2 / 3, abs=0.01)


def test_priced_scales_the_trainer_and_the_loads_to_the_adapter():
    cfg = load(SimConfig, path="examples/sim/paper-64gpu.toml", overrides=["lora.rank=16"])
    c, p = lora.costs(cfg.for_mode(Mode.DORA)), lora.priced(cfg)
    assert c.holds == cfg.core.max_staleness + 1
    assert lora.costs(cfg.for_mode(Mode.PARTIAL)).holds == lora.costs(cfg.for_mode(Mode.SYNC)).holds == 1
    assert c.load_s == pytest.approx(c.adapter_bytes / cfg.engine.transfer_bytes_per_s + cfg.lora.load_fixed_s)
    assert p.trainer.gpu_s_per_token == pytest.approx(cfg.trainer.gpu_s_per_token * c.train_cost_factor)
    assert p.trainer.publish_s == pytest.approx(cfg.trainer.publish_s * c.adapter_bytes / c.weight_bytes)
    assert lora.priced(replace(cfg, lora=SimLoraSection())) == replace(cfg, lora=SimLoraSection())


def test_unknown_target_modules_are_refused():
    with pytest.raises(ConfigError, match="target_modules"):
        SimLoraSection(rank=4, target_modules=("c_attn",))


def lora_run(mode: Mode, rank: int):
    """Three workers, K = 2, a long tail, adapter loads of a stated second."""
    cfg = small(workers=3, k=2, steps=6, sigma=1.3, median=60.0, cap=3000, train_s=1.0, load_s=2.0)
    cfg = replace(cfg, model=TINY, lora=SimLoraSection(rank=rank, load_fixed_s=1.0))
    return Simulation(cfg, mode, strict=True).run(), cfg


def test_a_lora_run_keeps_every_invariant_with_workers_holding_several_versions():
    o, cfg = lora_run(Mode.DORA, rank=4)
    assert len(o.steps) == cfg.run.steps  # every step trained (the world raises on C1, C2, C3)
    assert max(o.staleness) <= 2 and o.c1_violations == 0
    assert o.keeping_assigns > 0 and o.max_versions_held > 1
    assert o.load_s == pytest.approx(o.loads * (lora.costs(cfg).adapter_bytes / cfg.engine.transfer_bytes_per_s + 1))


def test_an_adapter_load_decodes_the_kept_versions_a_full_weight_load_stalls():
    lo, _ = lora_run(Mode.DORA, rank=4)
    full, _ = lora_run(Mode.DORA, rank=0)
    partial, _ = lora_run(Mode.PARTIAL, rank=4)
    assert lo.tokens_decoded_while_loading > 0
    assert full.tokens_decoded_while_loading == 0 and full.keeping_assigns == 0 and full.max_versions_held == 1
    assert partial.tokens_decoded_while_loading == 0  # one version per worker: its swaps stall
