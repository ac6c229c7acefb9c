"""The receiving process of tests/unit/test_ipc_tensors.py: it opens the handles it is sent
(``dora.store.ipc.open_shared``), answers with what it sees, sees again on request, and writes where it is told."""

from __future__ import annotations

import multiprocessing.connection
from typing import Any

import msgspec
import torch

from dora.store.ipc import open_shared


def serve(conn: multiprocessing.connection.Connection) -> None:
    """Requests (msgpack): {"open": handles} -> every tensor's values (as float lists, on the CPU) and data
    pointer; {"look": key} -> its values again; {"write": key, "value": x} -> sets its first element; {} -> exit."""
    tensors: dict[str, torch.Tensor] = {}
    while True:
        req: dict[str, Any] = msgspec.msgpack.decode(conn.recv_bytes())
        if not req:
            return
        if "open" in req:
            tensors = open_shared(req["open"])
            reply: Any = {k: {"values": t.float().cpu().flatten().tolist(), "ptr": t.data_ptr(),
                              "device": str(t.device)} for k, t in tensors.items()}  # fmt: skip
        elif "look" in req:
            if tensors[req["look"]].is_cuda:
                torch.cuda.synchronize()
            reply = tensors[req["look"]].float().cpu().flatten().tolist()
        else:
            tensors[req["write"]].view(-1)[0] = req["value"]
            if tensors[req["write"]].is_cuda:
                torch.cuda.synchronize()
            reply = True
        conn.send_bytes(msgspec.msgpack.encode(reply))
