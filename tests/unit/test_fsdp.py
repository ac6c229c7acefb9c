"""The torch trainer sharded with FSDP2 over 2 gloo ranks takes the same step as one process, and the
version it publishes, loaded into a torch engine, gives the learner's log-probs."""

from __future__ import annotations

import os
import pathlib
import socket

import numpy as np
import pytest
import torch

from dora.config.models import LoraSection
from dora.ids import Finish
from dora.learner.loss import LossConfig
from dora.learner.trainers.torch_trainer import TorchTrainer, TrainerConfig
from dora.samples import Batch, TrainGroup, TrainSample
from dora.store import WeightStore
from tests.ranks import run_ranks

pytestmark = pytest.mark.timeout(180)


def batch() -> Batch:
    rng = np.random.default_rng(0)
    groups = []
    for g in range(3):
        samples = []
        for i in range(4):
            n = int(rng.integers(3, 9))
            samples.append(TrainSample(index=i, token_ids=rng.integers(5, 900, n).astype(np.int32),
                                       logprobs=(-7 + rng.normal(0, 0.1, n)).astype(np.float32),
                                       reward=float(rng.random()), finish=Finish.STOP))  # fmt: skip
        groups.append(TrainGroup(group_id=g, version=0, prompt_ids=np.array([11, 12, 13 + g], np.int32),
                                 samples=tuple(samples)))  # fmt: skip
    return Batch(step=0, groups=tuple(groups))


CFG = TrainerConfig(lr=1e-2, micro_batch=2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BF16 = TrainerConfig(lr=1e-2, micro_batch=2, dtype="bfloat16")
LAYOUTS = {
    "stride": TrainerConfig(lr=1e-2, micro_batch=2, balance="stride"),
    "budget+checkpointing": TrainerConfig(lr=1e-2, micro_batch_tokens=16, activation_checkpointing=True),
}
"""Two ranks each: every world-th trajectory; and by tokens, in token-budget micro-batches (rank 0 needs six,
rank 1 five, so rank 1 runs an empty pass to keep the collectives paired) with activation checkpointing."""
LORA = TrainerConfig(lr=1e-2, micro_batch=2, lora=LoraSection(rank=4, alpha=8.0))
OBJECTIVES = TrainerConfig(lr=1e-2, micro_batch=2, mini_batches=3, epochs=2, weight_decay=0.1)
RUNS = {"fp32": CFG, "bf16": BF16, **LAYOUTS, "lora": LORA, "objectives": OBJECTIVES}
LOSSES = {"objectives": LossConfig(is_cap=2.0, kl_coef=0.05, entropy_coef=0.01, advantage="rloo")}
"""The loss of a run where it is not the default: every objective on, its reference model sharded as the model is."""
"""Every two-rank step of this file, taken by one pair of ranks (starting a pair costs more than its steps)."""


def steps_main(rank: int, world: int, port: int, runs: dict[str, tuple[str, TrainerConfig]], root: str) -> None:
    """One rank of ``world`` on gloo: for each run (a model folder and a trainer config), one step of ``batch()`` and a
    publish; rank 0 saves the step's metrics and the version's URI to ``<root>/<run>.pt``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    done = False
    try:
        for name, (model, cfg) in runs.items():
            trainer = TorchTrainer(model, WeightStore(pathlib.Path(root) / name), LOSSES.get(name, LossConfig()), cfg)
            metrics = trainer.train(batch())
            published = trainer.publish(1)
            assert (published is not None) == (rank == 0), "rank 0 publishes, and only rank 0"
            if rank == 0:
                torch.save({"metrics": metrics, "uri": published[0]}, pathlib.Path(root) / f"{name}.pt")
        done = True
    finally:
        dist.destroy_process_group()
    if done:  # skip exit-time destructors, where gloo's threads can abort a clean rank
        os._exit(0)


@pytest.fixture(scope="module")
def sharded(tiny_model, tmp_path_factory) -> pathlib.Path:
    """Each run of ``RUNS`` stepped once by the same two gloo ranks; ``<root>/<run>.pt`` holds rank 0's metrics
    and the URI of the version it published."""
    root = tmp_path_factory.mktemp("sharded")
    runs = {name: (str(tiny_model), cfg) for name, cfg in RUNS.items()}
    run_ranks(steps_main, (2, free_port(), runs, str(root)))
    os.environ.pop("MASTER_ADDR", None)
    return root


def test_two_rank_fsdp_step_equals_one_process_and_published_weights_serve(sharded, tiny_model, tmp_path):
    out = torch.load(sharded / "fp32.pt")
    single = TorchTrainer(tiny_model, WeightStore(tmp_path / "single"), LossConfig(), CFG)
    before = {k: v.clone() for k, v in single.model.state_dict().items()}
    want = single.train(batch())
    from safetensors.torch import load_file

    shards = load_file(out["uri"].removeprefix("file://") + "/model.safetensors")
    after = single.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in after), "the step changed nothing"
    # AdamW's first step moves each weight by about lr = 1e-2 whatever its gradient's size, so a gradient
    # summed in another order can move a weight differently by a little: 1e-4 is 1% of one step. A weight
    # whose gradient is near AdamW's eps is ill-conditioned (its step may flip): a handful may differ more,
    # never by more than the two opposite steps
    for k, v in after.items():
        diff = (shards[k] - v).abs()
        assert diff.gt(1e-4).sum().item() <= max(1, v.numel() // 10_000), (k, diff.max().item())
        assert diff.max().item() <= 2 * CFG.lr, k
    for k in ("loss", "reward_mean", "grad_norm", "tokens", "clip_fraction"):
        assert out["metrics"][k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k

    from dora.rollout.engines.torch.engine import TorchEngine

    engine = TorchEngine(tiny_model, version=0)
    engine.load_weights(1, out["uri"].removeprefix("file://"), None)
    seq = [11, 12, 13, 400, 401, 402]
    with torch.no_grad():
        got = engine.model(input_ids=torch.tensor([seq])).logits.float()
        ref = single.model.eval()(input_ids=torch.tensor([seq])).logits.float()
    assert torch.allclose(torch.log_softmax(got, -1), torch.log_softmax(ref, -1), atol=1e-4)


def test_two_rank_mini_batches_with_kl_entropy_and_correction_equal_one_process(sharded, tiny_model, tmp_path):
    """Three mini-batches, two epochs, the correction capped, KL to a reference sharded as the model is, an entropy
    bonus, RLOO: six optimizer steps on two ranks move the weights as one process does."""
    out = torch.load(sharded / "objectives.pt")
    single = TorchTrainer(tiny_model, WeightStore(tmp_path / "single"), LOSSES["objectives"], OBJECTIVES)
    want = single.train(batch())
    from safetensors.torch import load_file

    shards = load_file(out["uri"].removeprefix("file://") + "/model.safetensors")
    for k, v in single.model.state_dict().items():  # six AdamW steps of about lr each: 1% of one step
        diff = (shards[k] - v).abs()
        assert diff.gt(1e-4).sum().item() <= max(1, v.numel() // 1_000), (k, diff.max().item())
    for k in ("loss", "grad_norm", "entropy", "kl_ref", "is_weight_mean", "optimizer_steps", "clip_fraction"):
        assert out["metrics"][k] == pytest.approx(want[k], rel=1e-3, abs=1e-5), k


def test_bf16_mixed_precision_keeps_fp32_master_weights_and_follows_the_fp32_step(sharded, tiny_model, tmp_path):
    """learner.dtype = bfloat16: FSDP2's MixedPrecisionPolicy over 2 ranks, autocast on one. The published
    weights stay fp32, and each step moves the weights the way the fp32 step does (bf16 rounds the rest)."""
    out = torch.load(sharded / "bf16.pt")
    from safetensors.torch import load_file

    shards = load_file(out["uri"].removeprefix("file://") + "/model.safetensors")
    ref = TorchTrainer(tiny_model, WeightStore(tmp_path / "fp32"), LossConfig(), CFG)
    before = {k: v.clone() for k, v in ref.model.state_dict().items()}
    want = ref.train(batch())
    one = TorchTrainer(tiny_model, WeightStore(tmp_path / "one"), LossConfig(), BF16)
    got_one = one.train(batch())
    for name, got, weights in (("fsdp", out["metrics"], shards), ("autocast", got_one, one.model.state_dict())):
        assert all(v.dtype == torch.float32 for v in weights.values()), name
        assert got["loss"] == pytest.approx(want["loss"], rel=0.05, abs=1e-3), name
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=0.05), name
        delta = torch.cat([(weights[k] - before[k]).flatten() for k in before])
        delta_fp32 = torch.cat([(ref.model.state_dict()[k] - before[k]).flatten() for k in before])
        assert torch.cosine_similarity(delta, delta_fp32, dim=0) > 0.95, name
        assert not torch.equal(delta, delta_fp32), f"{name}: bf16 computed exactly like fp32 (not applied?)"


def test_two_rank_steps_by_stride_and_by_token_budget_with_checkpointing_equal_one_process(
    sharded, tiny_model, tmp_path
):
    from safetensors.torch import load_file

    from dora.balance import plan

    rows = [(g.prompt_ids.tolist(), s, gi) for gi, g in enumerate(batch().groups) for s in g.samples]
    sizes, groups = [len(p) + len(s.token_ids) for p, s, _ in rows], [gi for _, _, gi in rows]
    mine = [plan(sizes, groups, rank=r, world=2, balance="tokens", micro_batch=16, micro_batch_tokens=16)
            for r in range(2)]  # fmt: skip
    assert [sum(1 for part in p.micro_batches if part) for p in mine] == [6, 5], "an empty pass must be exercised"
    for name, cfg in LAYOUTS.items():
        out = torch.load(sharded / f"{name}.pt")
        single = TorchTrainer(tiny_model, WeightStore(tmp_path / "single" / name), LossConfig(), cfg)
        before = {k: v.clone() for k, v in single.model.state_dict().items()}
        want = single.train(batch())
        shards = load_file(out["uri"].removeprefix("file://") + "/model.safetensors")
        for k, v in single.model.state_dict().items():  # as in the test above: 1% of a step, a few ill-conditioned
            diff = (shards[k] - v).abs()
            assert diff.gt(1e-4).sum().item() <= max(1, v.numel() // 10_000), (name, k, diff.max().item())
            assert diff.max().item() <= 2 * cfg.lr, (name, k)
        assert any(not torch.equal(before[k], v) for k, v in single.model.state_dict().items()), name
        for k in ("loss", "grad_norm", "tokens", "clip_fraction"):
            assert out["metrics"][k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), (name, k)
        assert out["metrics"]["rank_imbalance"] >= 1.0 and out["metrics"]["micro_batches"] >= want["micro_batches"] / 2


def test_two_rank_lora_step_trains_the_adapters_as_one_process_does(sharded, tiny_model, tmp_path):
    """[learner.lora] over 2 FSDP2 ranks: the same adapter step as one process, published as an adapter folder."""
    from safetensors.torch import load_file

    from dora.hf.lora import adapter_state

    out = torch.load(sharded / "lora.pt")
    folder = pathlib.Path(out["uri"].removeprefix("file://"))
    assert (folder / "adapter_config.json").is_file() and not (folder / "model.safetensors").exists()
    shards = load_file(str(folder / "adapter_model.safetensors"))
    single = TorchTrainer(tiny_model, WeightStore(tmp_path / "single"), LossConfig(), LORA)
    want = single.train(batch())
    mine = adapter_state(single.model.state_dict())
    assert shards.keys() == mine.keys() and any(v.abs().sum() > 0 for k, v in mine.items() if ".lora_B." in k)
    for k, v in mine.items():  # as above: 1% of a step, a few ill-conditioned
        diff = (shards[k] - v).abs()
        assert diff.gt(1e-4).sum().item() <= max(1, v.numel() // 10_000), (k, diff.max().item())
        assert diff.max().item() <= 2 * LORA.lr, k
    for k in ("loss", "grad_norm", "tokens"):
        assert out["metrics"][k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k
