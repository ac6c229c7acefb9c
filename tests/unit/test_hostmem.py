"""dora.hostmem: a module's tensors parked in one reused host buffer and brought back, exactly, with parameters
keeping their identity (the optimizer's references) and tied tensors staying tied. On a GPU the buffer is pinned
(tests/unit/test_gpu.py and bench/role_switch.py); here it is plain host memory, through the same code."""

from __future__ import annotations

import pytest
import torch

from dora.hostmem import ALIGN, Parking, module_tensors


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.proj = torch.nn.Linear(6, 11, bias=False)
        self.proj.weight = self.emb.weight  # tied
        self.norm = torch.nn.LayerNorm(6).to(torch.bfloat16)
        self.register_buffer("steps", torch.arange(3))
        self.inner = torch.nn.Module()
        self.inner.register_buffer("mask", torch.tensor([True, False, True]))
        self.inner.register_buffer("steps", self.steps)  # one buffer held by two modules
        self.register_buffer("empty", torch.zeros(0, 4))


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict(keep_vars=True).items()}


def test_a_parked_module_comes_back_exactly_with_its_parameters_and_ties_kept():
    torch.manual_seed(0)
    net = Net()
    before, params = snapshot(net), list(net.parameters())
    parking = Parking(pin=False)
    tensors, put = module_tensors(net)
    assert len(tensors) == 3 + 3  # emb (tied with proj), the norm's two; steps (held twice), mask, empty
    put(parking.park(tensors))
    buffer = parking.buffer
    assert all(t.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr() for t in net.parameters())
    assert net.proj.weight is net.emb.weight and net.inner.steps is net.steps
    for name, t in net.state_dict().items():
        assert t.dtype == before[name].dtype and torch.equal(t, before[name]), name
    tensors, put = module_tensors(net)
    put(parking.unpark(tensors, torch.device("cpu")))
    assert list(net.parameters()) == params and all(a is b for a, b in zip(net.parameters(), params, strict=True))
    for name, t in net.state_dict().items():
        assert torch.equal(t, before[name]), name
    with torch.no_grad():
        net.emb.weight.add_(1.0)  # changed while awake
    tensors, put = module_tensors(net)
    put(parking.park(tensors))
    assert parking.buffer is buffer  # reused: the same sizes fit
    assert torch.equal(net.proj.weight, before["emb.weight"] + 1.0)


def test_every_tensor_starts_aligned_and_a_larger_set_gets_a_larger_buffer():
    parking = Parking(pin=False)
    small = [torch.ones(3, dtype=torch.int8), torch.full((5,), 2.0, dtype=torch.float64)]
    out = parking.park(small)
    assert [t.data_ptr() - parking.buffer.data_ptr() for t in out] == [0, ALIGN]
    assert [t.dtype for t in out] == [torch.int8, torch.float64] and torch.equal(out[1], small[1])
    first = parking.buffer
    big = [*small, torch.arange(1000, dtype=torch.int64)]
    out = parking.park(big)
    assert parking.buffer is not first and parking.buffer.numel() == 2 * ALIGN + 8192
    assert all(torch.equal(a, b) for a, b in zip(out, big, strict=True))


def test_a_trainer_whose_state_was_parked_between_steps_trains_as_one_whose_state_stayed(tiny_model, tmp_path):
    """The trainer's own move (``_move``: model and AdamW moments in one park); on a GPU it runs after each
    publish with learner.offload_between_steps, here it is called directly. Equal within rounding, not bit for bit:
    CPU kernels' vectorised sums depend on where tensors sit, and any copy of the state (a clone as well) moves
    the last bits."""
    from dora.learner.loss import LossConfig
    from dora.learner.trainers.torch_trainer import TorchTrainer
    from dora.store import WeightStore
    from tests.unit.test_fsdp import CFG, batch

    kept = TorchTrainer(tiny_model, WeightStore(tmp_path / "kept"), LossConfig(), CFG)
    moved = TorchTrainer(tiny_model, WeightStore(tmp_path / "moved"), LossConfig(), CFG)
    for step in range(3):
        want, got = kept.train(batch()), moved.train(batch())
        for k in ("loss", "grad_norm"):
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7), (step, k)
        moved._move(torch.device("cpu"))
        parked = moved.parking.buffer.untyped_storage().data_ptr()
        assert all(t.untyped_storage().data_ptr() == parked for t in moved.model.parameters())
        moments = [v for s in moved.opt.state.values() for k, v in s.items() if k != "step"]
        assert len(moments) == 2 * len(list(moved.model.parameters()))
        assert all(t.untyped_storage().data_ptr() == parked for t in moments)
        moved._move(torch.device("cpu"))
    for a, b in zip(kept.model.parameters(), moved.model.parameters(), strict=True):
        assert (a - b).abs().max().item() <= 2 * CFG.lr  # the same AdamW steps, within rounding


def test_put_refuses_a_wrong_count():
    _, put = module_tensors(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="1 tensors for 2 places"):
        put([torch.zeros(2, 2)])


def test_a_reserved_buffer_is_the_one_the_first_park_fills():
    net = Net()
    tensors, put = module_tensors(net)
    parking = Parking(pin=False)
    parking.reserve(tensors)
    parking.ready()
    reserved = parking.buffer
    assert reserved is not None and parking.reserve_s is not None
    put(parking.park(tensors))
    assert parking.buffer is reserved


def test_an_offloading_trainer_publishes_from_its_parked_weights(tiny_model, tmp_path):
    """With offload_between_steps the version is written from the parked host copies (views of one buffer, which
    safetensors takes as separate tensors). Forced on here: on the CPU a trainer does not offload by itself."""
    from safetensors.torch import load_file

    from dora.learner.loss import LossConfig
    from dora.learner.trainers.torch_trainer import TorchTrainer
    from dora.store import WeightStore
    from tests.unit.test_fsdp import CFG, batch

    store = WeightStore(tmp_path / "store")
    t = TorchTrainer(tiny_model, store, LossConfig(), CFG)
    t.offloads = True
    written, publish = [], store.publish

    def watched(version, state, **kwargs):
        written.append({k: x.untyped_storage().data_ptr() for k, x in state.items()})
        return publish(version, state, **kwargs)

    store.publish = watched
    t.train(batch())
    uri, _, _ = t.publish(1)
    assert t.offloaded
    buffer = t.parking.buffer.untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == buffer for p in t.model.parameters())
    assert set(written[0].values()) == {buffer}  # what was written: the parked copies
    published = load_file(uri.removeprefix("file://") + "/model.safetensors")
    state = t.model.state_dict()
    assert published.keys() == state.keys() and all(torch.equal(published[k], state[k]) for k in state)
    t.train(batch())  # back on its device for the next step, and parked again at the next publish
    assert not t.offloaded
    t.publish(2)
    assert t.offloaded
