"""The processes of tests/unit/test_collective_weights.py: a learner that publishes two versions of a small state
through a ``HostSnapshot`` into a store and broadcasts each (``dora.store.collective.send``), and workers that
receive them into zero tensors of the state's shapes (``Receiver.receive``) and print what they found.

    main(["learner", DIR, WORLD, BACKEND, DEVICE])       # writes DIR/ready.json, then sends
    main(["worker", DIR, RANK, WORLD, BACKEND, DEVICE])  # waits for it, joins, writes DIR/rank<RANK>.jsonl

(or ``python -m tests.collective_peers ARGS``). The test forks them at once from a server that imported torch
(``run``); the workers learn the learner's port and the versions' digests from ``ready.json``.

Version 1 is sent as published. Version 2 is sent with one element changed after it was published (the manifest
sent is the published one), so every worker must refuse it with its model tensors untouched.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import structlog
import torch

from dora.store.collective import Receiver, WeightGroup, send
from dora.store.digest import DigestMismatch
from dora.store.publish import WeightStore
from dora.store.snapshot import HostSnapshot

SHARD_BYTES = 1 << 20
"""Small shards: the version is several files."""
BUCKET_BYTES = 256 << 10
"""Small buckets: a tensor spans several, a bucket several tensors."""
CHUNK_BYTES = 1 << 20


def state(version: int) -> dict[str, torch.Tensor]:
    """A model's tensors of mixed dtypes and sizes (about 1.2 MB in bf16), the same in every process for a version."""
    g = torch.Generator().manual_seed(version)
    return {"embed.weight": torch.randn(512, 640, generator=g),
            "layers.0.mlp.weight": torch.randn(300, 301, generator=g),
            "layers.0.norm.weight": torch.randn(301, generator=g), "layers.0.step": torch.tensor([version] * 3),
            "lm_head.weight": torch.randn(640, 257, generator=g).to(torch.bfloat16)}  # fmt: skip


def expected(version: int) -> dict[str, torch.Tensor]:
    """What a worker holds once it adopted the version: floating tensors as published (bf16)."""
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state(version).items()}


def learner(folder: pathlib.Path, world: int, backend: str, device: str) -> int:
    group = WeightGroup("127.0.0.1", 0, 0, world, backend=backend, device=device, timeout_s=30)
    store = WeightStore(folder / "store", chunk_bytes=CHUNK_BYTES, fsync=False, shard_bytes=SHARD_BYTES)
    snapshot = HostSnapshot(shard_bytes=SHARD_BYTES, pin=False)
    digests, views = [], {}
    for v in (1, 2):
        views[v] = {k: t.clone() for k, t in snapshot.take(state(v), torch.bfloat16).items()}
        digests.append(store.publish(v, views[v])[1])
    (folder / "ready.tmp").write_text(json.dumps({"port": group.port, "digests": digests}))
    (folder / "ready.tmp").rename(folder / "ready.json")
    for v in (1, 2):
        tensors = views[v]
        if v == 2:
            tensors["layers.0.mlp.weight"][7, 7] += 1  # a byte changed after the version was published
        tensors = {k: t.to(device) for k, t in tensors.items()}
        send(group, store.manifest(v), tensors, shard_bytes=SHARD_BYTES, bucket_bytes=BUCKET_BYTES)
    group.close()
    return 0


def worker(folder: pathlib.Path, rank: int, world: int, backend: str, device: str) -> int:
    deadline = time.monotonic() + 30
    while not (folder / "ready.json").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {folder / 'ready.json'} from the learner in 30 s")
        time.sleep(0.05)
    ready = json.loads((folder / "ready.json").read_text())
    port, digests = ready["port"], ready["digests"]
    group = WeightGroup("127.0.0.1", port, rank, world, backend=backend, device=device, timeout_s=30)
    receiver = Receiver(group)
    model = {k: torch.zeros_like(t, device=device) for k, t in expected(1).items()}
    rows = []
    for v, digest in zip((1, 2), digests, strict=True):
        before = {k: t.clone() for k, t in model.items()}
        row: dict[str, object] = {"rank": rank, "version": v}
        try:
            got = receiver.receive(into=model, digest=digest)
            row.update(received=got.version, bytes=got.bytes, digest=got.digest)
        except DigestMismatch as e:
            row["error"] = f"DigestMismatch: {e}"
        row["equal"] = all(torch.equal(model[k].cpu(), t) for k, t in expected(v).items())
        row["untouched"] = all(torch.equal(model[k], t) for k, t in before.items())
        rows.append(json.dumps(row))
    (folder / f"rank{rank}.jsonl").write_text("\n".join(rows) + "\n")
    group.close()
    return 0


def main(argv: list[str]) -> int:
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    folder, world = pathlib.Path(argv[1]), int(argv[3 if argv[0] == "worker" else 2])
    if argv[0] == "learner":
        return learner(folder, world, argv[3], argv[4])
    rank = int(argv[2])
    return worker(folder, rank, world, argv[4], argv[5].replace("RANK", str(rank)))


def run(argvs: list[list[str]], timeout_s: float) -> list[int | None]:
    """Each of ``argvs`` as a process forked from a server that imported torch once (the imports are most of what
    three fresh processes would cost), run to its end or killed by PID at ``timeout_s``; their exit codes."""
    import multiprocessing
    import os
    import signal

    from tests import forks

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "tests.collective_peers"])
    procs = [ctx.Process(target=_child, args=(a,)) for a in argvs]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
        return [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                os.kill(p.pid, signal.SIGKILL)
                p.join(5)
        forks.stop()


def _child(argv: list[str]) -> None:
    sys.exit(main(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
