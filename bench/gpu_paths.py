"""bench/gpu.py's ``transfer`` part: how fast a version moves along the GPU weight paths, for bf16 states of
``--transfer-gb`` GB (default 1 and 4), each as 64 MiB tensors on the device:

- ``h2d_gb_s``: pinned host -> device, one flat copy (what a worker pays to put a version it holds in host memory
  on its GPU);
- ``snapshot_gb_s``: device -> pinned host, ``HostSnapshot.take`` of the state (the learner's copy of a version
  before it is published), its second take (the first allocates and pins the buffer: ``snapshot_first_s``);
- ``ipc_open_s``: ``dora.store.ipc.open_shared`` of the state's handles in another process on the same GPU, and
  ``ipc_read_gb_s``: that process reading every byte it mapped (a sum), i.e. the version without a copy;
- ``nccl_gb_s``: ``dora.store.collective``'s bucketed broadcast (``WeightGroup``, 64 MiB buckets) from GPU 0 to
  a process on GPU 1, with 2 GPUs or more; with one, ``nccl_skipped`` says why not (NCCL needs a GPU per rank).

Without CUDA only the snapshot's copy is measured (from host tensors) and the rest is ``skipped`` with the reason.
The child processes are this file run as a script (``--ipc-child``, ``--nccl-child``), given the time left.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

TENSOR_BYTES = 64 << 20
BUCKET_BYTES = 64 << 20


def state_of(gb: float, device: torch.device) -> dict[str, torch.Tensor]:
    """A bf16 state of ``gb`` GB as tensors of 64 MiB (the last one smaller)."""
    total = int(gb * 1e9) // 2 * 2
    out, at = {}, 0
    while at < total:
        n = min(TENSOR_BYTES, total - at)
        out[f"layers.{len(out)}.weight"] = torch.empty(n // 2, dtype=torch.bfloat16, device=device).normal_()
        at += n
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_of(device: torch.device, fn: Any, reps: int = 3) -> float:
    """The fastest of ``reps`` timed calls (seconds)."""
    times = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return min(times)


def part_transfer(device: torch.device, sizes_gb: list[float], deadline: float) -> dict[str, Any]:
    """Each size's row (the module's docstring); a size not started for lack of time says so."""
    from dora.store.snapshot import HostSnapshot

    out: dict[str, Any] = {"dtype": "bfloat16", "sizes_gb": sizes_gb, "gpus": torch.cuda.device_count()}
    if device.type != "cuda":
        out["skipped"] = "no CUDA device: pinned copies, CUDA IPC and NCCL need one (the snapshot's copy only)"
    snapshot = HostSnapshot(pin=device.type == "cuda")
    for gb in sizes_gb:
        if deadline - time.monotonic() < 30:
            out[f"gb_{gb:g}"] = {"skipped": "no time left in the budget"}
            continue
        state = state_of(gb, device)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        row: dict[str, Any] = {"bytes": nbytes}
        first = time.perf_counter()
        snapshot.take(state)
        row["snapshot_first_s"] = time.perf_counter() - first
        snapshot.take(state)
        row["snapshot_s"] = snapshot.seconds
        row["snapshot_gb_s"] = nbytes / snapshot.seconds / 1e9
        if device.type == "cuda":
            row.update(copies(state, nbytes, device))
            row.update(ipc_open(state, nbytes, deadline))
            try:
                row.update(nccl(nbytes, device, deadline))
            except Exception as e:  # recorded: the other figures of the size stand
                row["nccl_error"] = f"{type(e).__name__}: {e}"
        out[f"gb_{gb:g}"] = row
        state = {}
        if device.type == "cuda":
            torch.cuda.empty_cache()
    snapshot.buffer = None
    return out


def copies(state: dict[str, torch.Tensor], nbytes: int, device: torch.device) -> dict[str, Any]:
    """Pinned host -> device, one flat copy of the state's size."""
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    seconds = best_of(device, lambda: flat.copy_(pinned, non_blocking=True))
    return {"h2d_s": seconds, "h2d_gb_s": nbytes / seconds / 1e9}


def child(args: list[str], stdin: bytes, timeout_s: float) -> dict[str, Any]:
    """This file run as a script with ``args``, ``stdin`` given; its last stdout line as JSON (or an error)."""
    try:
        r = subprocess.run([sys.executable, __file__, *args], input=stdin, capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    lines = r.stdout.decode().strip().splitlines()
    if r.returncode != 0 or not lines:
        return {"error": f"exit {r.returncode}: " + r.stderr.decode()[-800:]}
    return dict(json.loads(lines[-1]))


def ipc_open(state: dict[str, torch.Tensor], nbytes: int, deadline: float) -> dict[str, Any]:
    """Another process on this GPU maps the state through CUDA IPC handles, then reads every byte."""
    import msgspec

    from dora.store.ipc import share

    torch.cuda.synchronize()
    got = child(["--ipc-child"], msgspec.msgpack.encode(share(state)), min(120, deadline - time.monotonic()))
    if "error" in got:
        return {"ipc_error": got["error"]}
    return {"ipc_open_s": got["open_s"], "ipc_read_s": got["read_s"], "ipc_read_gb_s": nbytes / got["read_s"] / 1e9,
            "ipc_tensors": got["tensors"]}  # fmt: skip


def nccl(nbytes: int, device: torch.device, deadline: float) -> dict[str, Any]:
    """``WeightGroup``'s bucketed broadcast from this GPU to a process on the next one (2 GPUs or more)."""
    if torch.cuda.device_count() < 2:
        return {"nccl_skipped": f"{torch.cuda.device_count()} GPU: NCCL needs one GPU per rank, so 2 at least"}
    from dora.store.collective import WeightGroup

    group = WeightGroup("127.0.0.1", 0, 0, 2, backend="nccl", device=device, timeout_s=120)
    proc = subprocess.Popen([sys.executable, __file__, "--nccl-child", str(group.port), str(nbytes)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
        group.broadcast(flat[:BUCKET_BYTES]).wait()  # the communicator made, both ranks in step
        torch.cuda.synchronize()
        started = time.perf_counter()
        works = [group.broadcast(flat[lo : lo + BUCKET_BYTES]) for lo in range(0, nbytes, BUCKET_BYTES)]
        for w in works:
            w.wait()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        proc.wait(timeout=max(5, deadline - time.monotonic()))
        return {"nccl_s": seconds, "nccl_gb_s": nbytes / seconds / 1e9}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        group.close()


def ipc_child() -> int:
    import msgspec

    from dora.store.ipc import open_shared

    handles = msgspec.msgpack.decode(sys.stdin.buffer.read())
    torch.cuda.init()
    started = time.perf_counter()
    tensors = open_shared(handles)
    opened = time.perf_counter() - started
    torch.cuda.synchronize()
    started = time.perf_counter()
    total = sum(float(t.sum(dtype=torch.float32)) for t in tensors.values())
    torch.cuda.synchronize()
    read = time.perf_counter() - started
    print(json.dumps({"open_s": opened, "read_s": read, "tensors": len(tensors), "sum": total}), flush=True)
    return 0


def nccl_child(port: int, nbytes: int) -> int:
    from dora.store.collective import WeightGroup

    group = WeightGroup("127.0.0.1", port, 1, 2, backend="nccl", device="cuda:1", timeout_s=120)
    flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    group.broadcast(flat[:BUCKET_BYTES]).wait()
    works = [group.broadcast(flat[lo : lo + BUCKET_BYTES]) for lo in range(0, nbytes, BUCKET_BYTES)]
    for w in works:
        w.wait()
    torch.cuda.synchronize()
    group.close()
    return 0


def summary(r: dict[str, Any]) -> str:
    rows = []
    for k, v in r.items():
        if not k.startswith("gb_"):
            continue
        if "skipped" in v:
            rows.append(f"{k}: {v['skipped']}")
            continue
        parts = [f"snapshot {v['snapshot_gb_s']:.1f} GB/s"]
        if "h2d_gb_s" in v:
            parts.append(f"H2D {v['h2d_gb_s']:.1f} GB/s")
        if "ipc_open_s" in v:
            parts.append(f"IPC open {v['ipc_open_s'] * 1e3:.0f} ms, read {v['ipc_read_gb_s']:.0f} GB/s")
        if "ipc_error" in v:
            parts.append(f"IPC failed: {v['ipc_error'].strip().splitlines()[-1]}")
        if "h2d_gb_s" in v:
            why = v.get("nccl_skipped") or v.get("nccl_error")
            parts.append(f"NCCL {v['nccl_gb_s']:.1f} GB/s" if "nccl_gb_s" in v else f"NCCL: {why}")
        rows.append(f"{k}: " + ", ".join(parts))
    return "; ".join(rows) + (f" ({r['skipped']})" if "skipped" in r else "")


if __name__ == "__main__":
    if sys.argv[1] == "--ipc-child":
        raise SystemExit(ipc_child())
    raise SystemExit(nccl_child(int(sys.argv[2]), int(sys.argv[3])))
