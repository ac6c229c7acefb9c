"""The learner on a GPU (skipped without CUDA): `learner.device = auto` picks the rank's GPU, a step there
matches the CPU step, and the weights it publishes are plain CPU safetensors any worker loads."""

from __future__ import annotations

import pytest
import torch

from dora.actor.cluster import ClusterInfo
from dora.learner.loss import LossConfig
from dora.learner.ranks import learner_device
from dora.learner.trainers.torch_trainer import TorchTrainer
from dora.store import WeightStore
from tests.unit.test_fsdp import CFG, batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_the_learner_trains_on_its_gpu_like_on_the_cpu_and_publishes_loadable_weights(tiny_model, tmp_path):
    device = learner_device("auto", ClusterInfo(host="n1", local_rank=0))
    assert device == torch.device("cuda", 0)
    cpu = TorchTrainer(tiny_model, WeightStore(tmp_path / "cpu"), LossConfig(), CFG)
    gpu = TorchTrainer(tiny_model, WeightStore(tmp_path / "gpu"), LossConfig(), CFG, device=str(device))
    assert all(p.is_cuda for p in gpu.model.parameters())
    want, got = cpu.train(batch()), gpu.train(batch())
    for k in ("loss", "reward_mean", "grad_norm", "tokens"):
        assert got[k] == pytest.approx(want[k], rel=1e-3, abs=1e-5), k
    uri, _, _ = gpu.publish(1)
    from safetensors.torch import load_file

    published = load_file(uri.removeprefix("file://"))
    for k, v in cpu.model.state_dict().items():
        assert published[k].device.type == "cpu"
        assert (published[k] - v).abs().max().item() <= 2 * CFG.lr, k  # the same AdamW step, within rounding
