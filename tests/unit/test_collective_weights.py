"""A version broadcast over a weight group (``dora.store.collective``) between real processes: a learner (rank 0)
and two workers, gloo on 127.0.0.1 (NCCL between GPUs in the ``gpu`` test). Each worker receives into its own
tensors of the model's shapes, checks the bytes against the version's manifest and adopts them; a version whose
bytes changed after it was published is refused by every worker with its tensors left as they were."""

from __future__ import annotations

import json
import pathlib
import threading
from typing import Any

import pytest
import torch

from dora.store.digest import DigestMismatch
from tests import collective_peers

pytestmark = pytest.mark.timeout(60)


def peers(tmp_path: pathlib.Path, backend: str, learner_device: str, worker_device: str, world: int) -> list[dict]:
    """The learner and world - 1 workers as processes started at once (they meet through tmp_path/ready.json), each
    killed by PID if it has not ended in 45 s; every worker's rows."""
    argvs = [["learner", str(tmp_path), str(world), backend, learner_device]]
    argvs += [["worker", str(tmp_path), str(rank), str(world), backend, worker_device] for rank in range(1, world)]
    codes = collective_peers.run(argvs, timeout_s=45)
    assert codes == [0] * world, f"exit codes {codes} (None: killed at the timeout)"
    files = [tmp_path / f"rank{r}.jsonl" for r in range(1, world)]
    return [json.loads(line) for f in files for line in f.read_text().splitlines()]


def check(rows: list[dict], workers: int, digests_differ: bool = True) -> None:
    assert len(rows) == 2 * workers, rows
    for row in rows:
        if row["version"] == 1:  # as published: received, checked, adopted
            assert "error" not in row and row["received"] == 1 and row["equal"], row
            assert row["digest"].startswith("xxh3_128/1MiB/dir:") and row["bytes"] > 1_000_000
        else:  # one element changed after publishing: refused, the model's tensors (v1's) untouched
            assert row["untouched"] and not row["equal"], row
            assert "chunks differ from the manifest" in row["error"] and "model-0000" in row["error"], row


def test_a_version_reaches_two_workers_checked_and_a_changed_one_is_refused(tmp_path):
    check(peers(tmp_path, "gloo", "cpu", "cpu", world=3), workers=2)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: 2 GPUs at least")
def test_nccl_broadcast_between_gpus(tmp_path):
    world = min(3, torch.cuda.device_count())
    check(peers(tmp_path, "nccl", "cuda:0", "cuda:RANK", world=world), workers=world - 1)


def learner_thread(tmp_path: pathlib.Path, versions: dict[int, dict[str, torch.Tensor]],
                   changed: dict[int, tuple[str, tuple[int, ...]]]) -> tuple[Any, dict[int, str], Any]:  # fmt: skip
    """The learner's side in a thread of this process (its own store and gloo group on 127.0.0.1): each version
    published, then sent, those in ``changed`` with that element changed after publishing. (the receiver of rank 1,
    the digests, a call that joins the thread and raises what it met)."""
    from dora.store.collective import Receiver, WeightGroup, send
    from dora.store.publish import WeightStore

    store = WeightStore(tmp_path / "store", chunk_bytes=1 << 20, fsync=False)
    digests = {v: store.publish(v, state)[1] for v, state in versions.items()}
    for v, (key, where) in changed.items():
        versions[v][key][where] += 1
    sender = WeightGroup("127.0.0.1", 0, 0, 2, timeout_s=20)
    errors: list[BaseException] = []

    def learner() -> None:
        try:
            for v, state in versions.items():
                send(sender, store.manifest(v), state, bucket_bytes=1 << 20)
        except BaseException as e:  # the test's thread reports it
            errors.append(e)

    thread = threading.Thread(target=learner, daemon=True)
    thread.start()

    def finish() -> None:
        thread.join(20)
        assert not thread.is_alive() and not errors, errors

    return Receiver(WeightGroup("127.0.0.1", sender.port, 1, 2, timeout_s=20)), digests, finish


def test_a_torch_engine_takes_a_broadcast_version_and_refuses_one_that_does_not_check(tiny_model, tmp_path):
    """v1 lands in the engine's model; v2, one element changed after it was published, is refused and the model
    keeps v1 bit for bit."""
    from dora.hf.tensors import publishable
    from dora.rollout.engines.base import EngineError
    from dora.rollout.engines.torch.engine import TorchEngine

    engine = TorchEngine(tiny_model, max_slots=4, version=0)
    original = {k: v.clone() for k, v in publishable(engine.model.state_dict(), engine.copies).items()}
    versions = {v: {k: t + 0.01 * v for k, t in original.items()} for v in (1, 2)}
    receiver, digests, finish = learner_thread(tmp_path, versions, {2: ("model.embed_tokens.weight", (3, 3))})
    engine.receive_weights(1, receiver, digests[1])
    assert engine.version == 1
    model = engine.model.state_dict()
    assert all(torch.equal(model[k], t) for k, t in versions[1].items())
    with pytest.raises(EngineError, match="chunks differ from the manifest"):
        engine.receive_weights(2, receiver, digests[2])
    finish()
    assert engine.version == 1 and all(torch.equal(model[k], t) for k, t in versions[1].items())


def test_a_worker_that_refuses_a_version_stays_in_step_with_the_group(tmp_path):
    """Tensors of another shape, another version than expected, a digest that is not the version's: each refused
    with what differs, nothing adopted, and the version after each still arrives whole."""
    versions = {v: {"w": torch.full((300, 500), float(v)), "b": torch.arange(7) + v} for v in (1, 2, 3, 4)}
    receiver, digests, finish = learner_thread(tmp_path, versions, {})
    into = {"w": torch.zeros(300, 501), "b": torch.zeros(7, dtype=torch.int64)}
    with pytest.raises(ValueError, match=r"tensor 'w' is \[300, 500\] sent, \[300, 501\] in the model"):
        receiver.receive(into=into, digest=digests[1])
    assert not into["w"].any() and not into["b"].any()
    with pytest.raises(ValueError, match="v2 was sent, v5 expected"):
        receiver.receive(digest=digests[2], version=5)
    with pytest.raises(DigestMismatch, match="not the published"):
        receiver.receive(digest=digests[1])
    got = receiver.receive(digest=digests[4], version=4)
    finish()
    assert got.version == 4 and set(got.tensors) == {"w", "b"}
    assert torch.equal(got.tensors["w"], versions[4]["w"]) and torch.equal(got.tensors["b"], versions[4]["b"])
