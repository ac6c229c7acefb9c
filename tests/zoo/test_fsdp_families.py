"""Per family: one GRPO step sharded over 2 FSDP2 ranks (gloo) equals the step in one process, and the version the
sharded learner publishes holds the same weights: FSDP2 wraps the blocks each model declares (GPT-2's
``transformer.h`` as well as ``model.layers``), and tied tensors are published once.

The two ranks are started once and step every family in turn (each family its own trainer and store), so the
processes' start is paid once for the zoo."""

from __future__ import annotations

import pytest
import torch

from dora.hf import zoo
from dora.hf.tensors import tied_copies
from dora.learner.loss import LossConfig
from dora.learner.trainers.torch_trainer import TorchTrainer
from dora.store import WeightStore, load_verified
from tests.ranks import run_ranks
from tests.unit.test_fsdp import CFG, batch, free_port, steps_main

pytestmark = pytest.mark.timeout(300)


def test_a_two_rank_fsdp2_step_of_each_family_equals_the_one_process_step(zoo_model, tmp_path):
    models = {family: str(zoo_model(family)) for family in zoo.FAMILIES}
    runs = {family: (model, CFG) for family, model in models.items()}
    run_ranks(steps_main, (2, free_port(), runs, str(tmp_path / "sharded")))
    for family, model in models.items():
        out = torch.load(tmp_path / "sharded" / f"{family}.pt")
        single = TorchTrainer(model, WeightStore(tmp_path / "single" / family), LossConfig(), CFG)
        before = {k: v.clone() for k, v in single.model.state_dict().items()}
        want = single.train(batch())
        published = load_verified(out["uri"].removeprefix("file://"), None, name=f"{family} v1")
        copies = tied_copies(single.model)
        after = {k: v for k, v in single.model.state_dict().items() if k not in copies}
        assert sorted(published) == sorted(after) and zoo.ZOO[family].tied == bool(copies), family
        # AdamW's first step moves a weight by lr whatever its gradient's size, unless the gradient is near its eps
        # (no signal), where a sum in another order can move it otherwise. Where the one-process step moved a
        # weight by most of lr, the sharded step matches it to 1% of lr; anywhere, within the two opposite steps.
        moved = sum(int((v - before[k]).abs().ge(0.9 * CFG.lr).sum()) for k, v in after.items())
        assert moved >= 0.5 * sum(v.numel() for v in after.values()), (family, "most weights have a gradient")
        for k, v in after.items():
            diff = (published[k] - v).abs()
            clear = (v - before[k]).abs().ge(0.9 * CFG.lr)
            worst = float(diff[clear].max()) if clear.any() else 0.0
            assert worst <= 1e-4 and diff.max().item() <= 2 * CFG.lr, (family, k, worst)
        for k in ("loss", "grad_norm", "tokens"):
            assert out["metrics"][k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), (family, k)
