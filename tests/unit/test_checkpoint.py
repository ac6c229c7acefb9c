"""A learner restored from a checkpoint continues exactly where it stopped."""

from __future__ import annotations

import torch

from dora.learner import checkpoint
from dora.learner.loss import LossConfig
from dora.learner.trainers.torch_trainer import TorchTrainer, TrainerConfig
from dora.store import WeightStore
from tests.unit.test_fsdp import batch

CFG = TrainerConfig(lr=1e-2, micro_batch=4)


def test_resume_continues_bit_for_bit_and_keeps_version_and_trained_groups(tiny_model, tmp_path):
    a = TorchTrainer(tiny_model, WeightStore(tmp_path / "a"), LossConfig(), CFG)
    a.train(batch())
    a.train(batch())
    saved = checkpoint.save(a.model, a.opt, tmp_path / "ckpt", version=2, trained_groups=[5, 1, 3])
    assert saved is not None and saved.name == "ckpt-v2"

    other_seed = TrainerConfig(lr=1e-2, micro_batch=4, seed=9)
    b = TorchTrainer(tiny_model, WeightStore(tmp_path / "b"), LossConfig(), other_seed)
    meta = checkpoint.load(b.model, b.opt, checkpoint.checkpoints(tmp_path / "ckpt")[-1])
    assert meta["version"] == 2 and meta["trained_groups"] == [1, 3, 5]
    a.train(batch())
    b.train(batch())  # the same third step from the restored weights and optimizer moments
    for (name, pa), (_, pb) in zip(a.model.state_dict().items(), b.model.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name


def test_only_the_newest_checkpoints_are_kept_and_partial_ones_are_ignored(tiny_model, tmp_path):
    t = TorchTrainer(tiny_model, WeightStore(tmp_path / "w"), LossConfig(), CFG)
    for v in (1, 2, 3):
        checkpoint.save(t.model, t.opt, tmp_path / "ckpt", version=v, trained_groups=[], keep=2)
    (tmp_path / "ckpt" / "ckpt-v9").mkdir()  # a crash before meta.json: not a checkpoint
    assert [p.name for p in checkpoint.checkpoints(tmp_path / "ckpt")] == ["ckpt-v2", "ckpt-v3"]


def test_without_a_checkpoint_an_undone_step_goes_back_to_the_model_folders_weights(tiny_model, tmp_path):
    trainer = TorchTrainer(tiny_model, WeightStore(tmp_path / "store"), LossConfig(), TrainerConfig(lr=1e-2))
    initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    assert trainer.restore() is None  # nothing trained yet: nothing to undo
    trainer.train(batch())
    assert any(not torch.equal(initial[k], v) for k, v in trainer.model.state_dict().items())
    assert trainer.restore() is None
    assert all(torch.equal(initial[k], v) for k, v in trainer.model.state_dict().items())
    assert not trainer.opt.state  # the undone step's moments are gone too
