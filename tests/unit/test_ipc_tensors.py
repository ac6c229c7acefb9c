"""Tensors mapped by another process, not copied (``dora.store.ipc``): the handles travel as msgpack bytes over a
pipe to a real process, which finds the same values in memory it shares with the sender: a write by either side is
seen by the other. Host memory here (torch's file_system sharing); CUDA IPC in the ``gpu`` test."""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch

from dora.store.ipc import share
from tests import forks, ipc_peer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def peer() -> Iterator[Any]:
    """A receiving process (forked from a server that imported torch) and a call that asks it one thing."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tests.ipc_peer"])
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=ipc_peer.serve, args=(theirs,))
    proc.start()

    def ask(req: dict[str, Any]) -> Any:
        mine.send_bytes(msgspec.msgpack.encode(req))
        assert mine.poll(45), "the receiving process did not answer in 45 s"
        return msgspec.msgpack.decode(mine.recv_bytes())

    try:
        yield ask
        mine.send_bytes(msgspec.msgpack.encode({}))
        proc.join(10)
        assert proc.exitcode == 0
    finally:
        if proc.exitcode is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(5)
        forks.stop()


def snapshot_like(device: str) -> dict[str, torch.Tensor]:
    """Two views of one buffer (as a ``HostSnapshot`` lays a version out) and a tensor of its own."""
    buffer = torch.arange(64, dtype=torch.float32, device=device)
    return {
        "a": buffer[:24].view(4, 6),
        "b": buffer[24:56].view(torch.int32)[:32],
        "c": torch.full((3, 2), 7, dtype=torch.bfloat16, device=device),
    }


def exercise(ask: Any, device: str) -> None:
    state = snapshot_like(device)
    handles = share(state)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(handles)) == handles  # plain values only
    seen = ask({"open": handles})
    for key, t in state.items():
        assert seen[key]["values"] == t.float().cpu().flatten().tolist(), key
        assert seen[key]["device"].split(":")[0] == device
    state["a"][0, 0] = 1234.0  # the sender writes: the receiver sees it
    if device == "cuda":
        torch.cuda.synchronize()
    assert ask({"look": "a"})[0] == 1234.0
    assert ask({"write": "c", "value": -3.0}) and state["c"][0, 0].item() == -3.0  # and the other way
    assert state["b"].untyped_storage().data_ptr() == state["a"].untyped_storage().data_ptr()


def test_host_tensors_are_shared_not_copied(peer):
    exercise(peer, "cpu")
    handles = share(snapshot_like("cpu"))
    assert len(handles["storages"]) == 2  # the buffer named once, whatever its views


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_are_mapped_by_ipc(peer):
    exercise(peer, "cuda")
