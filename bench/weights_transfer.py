"""The weights' data plane on one machine: a synthetic version (one bf16 safetensors file of 0.5, 2 or 8 GB) served
by one chunk server (the learner's) to 1, 4 and 16 fetchers, each a process of its own with its own store, beside a
memcpy of the same bytes.

    .venv/bin/python bench/weights_transfer.py --sizes 0.5              # 1, 4 and 16 fetchers, direct and relayed
    .venv/bin/python bench/weights_transfer.py --sizes 0.5 2 8 --fetchers 1 4 --scratch /dev/shm/dora

Each row is one transfer of the version to ``fetchers`` processes, ``fanout`` 0 (every fetcher from the learner's
server: ``direct``) or 2 (a relay tree, ``dora.store.relays``: each fetcher serves what it fetched to the ones below
it): the seconds from the start signal to the last fetcher's end, GB/s per worker (the mean of each fetcher's own
rate, and the slowest) and in total (the bytes every fetcher received over those seconds), and ``learner_sends``:
the bytes the learner's server sent per byte of the version. Targets: >= 1 GB/s to one worker; with 4 workers and
fanout 2 the learner sends each byte at most twice. Every chunk is checked (xxh3) and fsynced as in a run; the
server reads the version from the page cache (it was just written, as a learner's publish leaves it).

``transfer_rows(sizes_gb, scratch)`` is what ``bench/weights.py`` calls; run alone, the rows are printed as a table
and as JSON, the last line. A row whose stores would not fit in ``scratch`` (fetchers x size over 60 % of its free
space) is skipped with a note.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pathlib
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from dora.store.digest import CHUNK_BYTES, Digest, digest_file, folder_root
from dora.store.dirs import MANIFEST
from dora.store.manifest import FileEntry, Manifest

GB = 1e9
FETCHERS = (1, 4, 16)
FANOUTS = (0, 2)
"""0: every fetcher from the learner (direct); 2: a relay tree."""
BLOCK = 64 << 20


def synthetic_version(root: pathlib.Path, size_gb: float, version: int = 1) -> tuple[str, int]:
    """A version folder of one bf16 tensor of ``size_gb`` GB (a safetensors file: header, then the bytes) and its
    manifest; returns (digest, bytes). The bytes are a random block repeated, each copy numbered."""
    folder = root / f"v{version}"
    folder.mkdir(parents=True, exist_ok=True)
    n = int(size_gb * GB) // 2
    header = json.dumps({"w": {"dtype": "BF16", "shape": [n], "data_offsets": [0, 2 * n]}}).encode()
    header += b" " * (-len(header) % 8)
    block = np.random.default_rng(0).integers(0, 256, BLOCK, dtype=np.uint8)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        left, i = 2 * n, 0
        while left:
            block[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
            f.write(block[: min(BLOCK, left)].data)
            left -= min(BLOCK, left)
            i += 1
    d = digest_file(folder / "model.safetensors")
    files = {"model.safetensors": FileEntry(d.size, d.chunks)}
    root_hex = folder_root(d.digest.algo, CHUNK_BYTES, {k: (e.bytes, e.chunks) for k, e in files.items()})
    manifest = Manifest(version=version, digest=Digest(d.digest.algo, CHUNK_BYTES, root_hex, folder=True),
                        bytes=d.size, files=files, dtype="bfloat16")  # fmt: skip
    (folder / MANIFEST).write_text(manifest.to_json())
    return str(manifest.digest), d.size


def memcpy_gb_s(size_gb: float) -> float:
    """One copy of min(size, 1 GB) between two buffers already in memory, the best of three."""
    n = int(min(size_gb, 1.0) * GB)
    src, dst = np.ones(n, np.uint8), np.zeros(n, np.uint8)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return n / best / GB


def quiet() -> None:
    """Only warnings and errors from the store's loggers (a line per fetch would bury the table)."""
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def _fetcher(i: int, root: str, relay: bool, conn: Any) -> None:
    """One fetcher process: its own store (and with ``relay``, its chunk server), the sources it is sent, one fetch
    at the start signal, its times reported; its server stays up until the parent says every fetcher is done."""
    from dora.store.fetch import fetch, relay_server

    quiet()

    server = relay_server(root, "tcp://127.0.0.1:0", timeout_s=30.0) if relay else None
    conn.send(server.start() if server is not None else "")
    version, digest, sources = conn.recv()
    conn.recv()  # start
    started = time.time()
    got = fetch(version, digest, sources, root, timeout_s=30.0)
    conn.send({"i": i, "started": started, "ended": time.time(), "bytes": got.bytes, "served": got.served})
    conn.recv()  # every fetcher is done: a relay's children no longer need its server
    if server is not None:
        server.stop()


def transfer(store: pathlib.Path, digest: str, size: int, scratch: pathlib.Path, fetchers: int,
             fanout: int) -> dict[str, Any]:  # fmt: skip
    """One transfer of version 1 in ``store`` to ``fetchers`` processes (a relay tree of ``fanout``; 0: direct)."""
    from dora.store.plane import ChunkServer
    from dora.store.relays import relay_sources

    ctx = mp.get_context("spawn")
    roots = [scratch / f"fetcher-{i}" for i in range(fetchers)]
    pipes, procs = [], []
    with ChunkServer(store, "tcp://127.0.0.1:0") as learner:
        try:
            for i, root in enumerate(roots):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_fetcher, args=(i, str(root), fanout > 0, child), daemon=True)
                p.start()
                pipes.append(parent)
                procs.append(p)
            relays = [c.recv() for c in pipes]
            tree = relay_sources(relays, [learner.endpoint], fanout) if fanout > 0 else {}
            for c, relay in zip(pipes, relays, strict=True):
                c.send((1, digest, list(tree.get(relay, (learner.endpoint,)))))
            for c in pipes:
                c.send("start")
            done = [c.recv() for c in pipes]
            for c in pipes:
                c.send("stop")
            for p in procs:
                p.join(30)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for root in roots:
                shutil.rmtree(root, ignore_errors=True)
        sent = learner.sent_bytes
    seconds = max(d["ended"] for d in done) - min(d["started"] for d in done)
    each = [d["bytes"] / (d["ended"] - d["started"]) / GB for d in done]
    return {"kind": "transfer", "size_gb": round(size / GB, 3), "fetchers": fetchers, "fanout": fanout,
            "mode": "relayed" if fanout else "direct", "seconds": round(seconds, 3),
            "gb_s_total": round(fetchers * size / seconds / GB, 3), "gb_s_per_worker": round(sum(each) / len(each), 3),
            "gb_s_slowest": round(min(each), 3), "learner_sends": round(sent / size, 3)}  # fmt: skip


def transfer_rows(sizes_gb: list[float], scratch: str | pathlib.Path, fetchers: tuple[int, ...] = FETCHERS,
                  fanouts: tuple[int, ...] = FANOUTS) -> list[dict[str, Any]]:  # fmt: skip
    """For each size: memcpy, then a transfer to each number of ``fetchers``, direct and relayed (``fanouts``; one
    fetcher only direct)."""
    scratch = pathlib.Path(scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for size_gb in sizes_gb:
        work = pathlib.Path(tempfile.mkdtemp(prefix="transfer-", dir=scratch))
        try:
            digest, size = synthetic_version(work / "learner", size_gb)
            rows.append({"kind": "memcpy", "size_gb": round(size / GB, 3), "gb_s": round(memcpy_gb_s(size_gb), 3)})
            for n in fetchers:
                for fanout in fanouts if n > 1 else (0,):
                    if n * size > 0.6 * shutil.disk_usage(work).free:
                        why = f"{n} stores of {size / GB:.1f} GB do not fit"
                        rows.append({"kind": "transfer", "size_gb": round(size / GB, 3), "fetchers": n,
                                     "fanout": fanout, "skipped": why})  # fmt: skip
                        continue
                    rows.append(transfer(work / "learner", digest, size, work, n, fanout))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return rows


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=float, nargs="+", default=[0.5, 2.0, 8.0], help="version sizes in GB")
    p.add_argument("--fetchers", type=int, nargs="+", default=list(FETCHERS))
    p.add_argument("--fanouts", type=int, nargs="+", default=list(FANOUTS))
    p.add_argument("--scratch", default=os.environ.get("TMPDIR", "/tmp"))
    args = p.parse_args(argv)
    quiet()
    rows = transfer_rows(args.sizes, args.scratch, tuple(args.fetchers), tuple(args.fanouts))
    cols = ("size_gb", "fetchers", "mode", "seconds", "gb_s_per_worker", "gb_s_slowest", "gb_s_total", "learner_sends")
    print(" ".join(f"{c:>15}" for c in cols))
    for r in rows:
        if r["kind"] == "memcpy":
            print(f"{r['size_gb']:>15} {'memcpy':>15} {r['gb_s']:>15} GB/s")
        else:
            print(" ".join(f"{r.get(c, r.get('skipped', '')) if c != 'mode' else r.get('mode', 'skipped')!s:>15}"
                           for c in cols))  # fmt: skip
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
