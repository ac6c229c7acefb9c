"""A version's tensors mapped by another process on the same machine, not copied: CUDA IPC for a worker on one of
the learner's GPUs, shared memory for tensors in host memory.

``share(state)`` returns handles: plain values (ints, strings, bytes), so they travel as msgpack (or in any message)
as well as pickled. ``open_shared(handles)`` in another process returns the same tensors, views of the sender's own
memory: a write by either side is seen by the other, and nothing is copied.

- **CUDA** (``torch.multiprocessing.reductions``: ``reduce_tensor`` on the sender, ``rebuild_cuda_tensor`` on the
  receiver): each handle names the CUDA allocation its tensor lies in, the GPU by its UUID, and torch's IPC
  reference counter, so the sender's caching allocator does not reuse the memory while a receiver holds it. The
  receiver opens it on its own index of that GPU (CUDA_VISIBLE_DEVICES may number it differently); a receiver
  without that GPU gets ValueError. Tensors of one allocation (a snapshot's views of one buffer) are opened once
  (torch caches the mapping by handle). CUDA IPC cannot open an allocation in the process that made it.
- **Host memory** (torch's ``file_system`` sharing strategy: a file in ``/dev/shm`` per storage, named in the
  handle, its lifetime kept by ``torch_shm_manager``): a storage not yet in shared memory is moved there on its first
  share (one copy, then none: the sender's tensors keep their values and are the shared memory from then on), so a
  buffer reused for every version (``HostSnapshot``'s) is moved once. Each storage is named once, whatever the
  number of tensors in it.

The sender must keep its tensors alive while a receiver uses them; the receiver's tensors keep the memory mapped.
What a receiver holds is what the sender holds: a version shared this way is checked (its digest) where it was
made, and the sender must not overwrite it while receivers use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["open_shared", "share"]

DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16,
                                                      torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                                                      torch.bool)}  # fmt: skip


def share(state: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Handles to every tensor of ``state`` (CUDA or CPU), for ``open_shared`` in another process: plain values
    only (msgpack encodes them). CPU storages not yet in shared memory are moved there (their tensors stay valid)."""
    tensors: dict[str, Any] = {}
    storages: dict[str, Any] = {}
    for key, t in state.items():
        t = t.detach()
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise ValueError(f"{key}: dtype {t.dtype} cannot be shared")
        if t.device.type == "cuda":
            tensors[key] = {"dtype": dtype, "cuda": _cuda_handle(t)}
        elif t.device.type == "cpu":
            manager, file, size = t.untyped_storage()._share_filename_cpu_()  # moved on the first share only
            name = bytes(file).decode()
            storages[name] = {"manager": bytes(manager), "file": bytes(file), "bytes": int(size)}
            tensors[key] = {"dtype": dtype, "storage": name, "shape": list(t.shape), "stride": list(t.stride()),
                            "offset": t.storage_offset()}  # fmt: skip
        else:
            raise ValueError(f"{key}: tensors on {t.device} cannot be shared (cuda or cpu)")
    return {"tensors": tensors, "storages": storages}


def _cuda_handle(t: torch.Tensor) -> dict[str, Any]:
    """``reduce_tensor``'s arguments for ``rebuild_cuda_tensor`` as plain values, with the GPU's UUID."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(t)
    (_, size, stride, offset, _, _, device, handle, storage_bytes, storage_offset, _, counter, counter_offset,
     event, event_sync) = args  # fmt: skip
    return {"uuid": str(torch.cuda.get_device_properties(device).uuid), "shape": list(size), "stride": list(stride),
            "offset": int(offset), "handle": bytes(handle), "storage_bytes": int(storage_bytes),
            "storage_offset": int(storage_offset), "counter": bytes(counter), "counter_offset": int(counter_offset),
            "event": None if event is None else bytes(event), "event_sync": bool(event_sync)}  # fmt: skip


def open_shared(handles: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors ``share`` made ``handles`` of, in another process: views of the sender's memory, nothing copied."""
    opened: dict[str, torch.UntypedStorage] = {}
    out = {}
    for key, h in handles["tensors"].items():
        dtype = DTYPES[h["dtype"]]
        if "cuda" in h:
            out[key] = _open_cuda(h["cuda"], dtype)
            continue
        name = h["storage"]
        if name not in opened:
            s = handles["storages"][name]
            opened[name] = torch.UntypedStorage._new_shared_filename_cpu(s["manager"], s["file"], s["bytes"])
        out[key] = torch.empty(0, dtype=dtype).set_(opened[name], h["offset"], h["shape"], h["stride"])
    return out


def _open_cuda(h: Mapping[str, Any], dtype: torch.dtype) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    device = local_device(h["uuid"])
    return rebuild_cuda_tensor(torch.Tensor, torch.Size(h["shape"]), tuple(h["stride"]), h["offset"],
                               torch.storage.TypedStorage, dtype, device, h["handle"], h["storage_bytes"],
                               h["storage_offset"], False, h["counter"], h["counter_offset"], h["event"],
                               h["event_sync"])  # fmt: skip


def local_device(uuid: str) -> int:
    """This process's index of the GPU with ``uuid``; ValueError when it sees no such GPU."""
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise ValueError(f"GPU {uuid} is not one of this process's {torch.cuda.device_count()} GPUs (CUDA IPC maps "
                     "memory between processes on the same GPU only)")  # fmt: skip
