"""The weight path per GB, for synthetic versions of 0.5, 2 and 8 GB: the learner's wait, the publish, the verify
and the load, each beside the machine's own bound measured in the same run. One table.

    .venv/bin/python bench/weights.py                  # 0.5, 2 and 8 GB (~10 min on a 2-core machine)
    .venv/bin/python bench/weights.py --sizes 0.5      # a quick run
    .venv/bin/python bench/weights.py --sizes 2 --algo sha256 --dir /mnt/shared/scratch

A version is bf16 tensors of a Llama-like shape (embeddings 32000 x 2048; per layer q, o 2048 x 2048, k, v
256 x 2048, gate, up 5632 x 2048, down 2048 x 5632, two norms; layers until the size is reached), random bits.
For each size, in the same run:

- **critical path**: ``HostSnapshot.take`` of the state (what the learner waits for: one copy into a reused,
  prefaulted buffer laid out as the files), in s/GB: the first take (the buffer made and touched) and the later
  ones (reused), beside ``memcpy`` between two prefaulted buffers. Target: <= 0.05 s/GB.
- **total publish**: ``WeightStore.publish`` of the snapshot's views (write, hash, fsync, rename), beside
  ``dd if=/dev/zero bs=1M count=N conv=fsync`` to the same filesystem. The disk is shared and its speed swings,
  so the two alternate, ``--reps`` times each (``os.sync()`` before each); the ratio is the median of each
  publish against the ``dd`` just before it. Target: >= 0.8 x dd. ``publish via save_file`` (sizes up to
  2 GB, once) is the previous path: ``safetensors.torch.save_file`` (a bytes copy of every tensor, then the
  write), the file read back to hash it, fsync.
- **verify / load** (the page cache warm: the version was just written): ``load_verified`` (the files mapped,
  every chunk hashed in place, the tensors views of the mapping) and ``load_into`` (as a torch engine loads: each
  piece hashed, then copied into the model's tensors), beside ``memcpy`` and a single-thread sha256 of memory.

The ``copies`` column counts the CPU copies each byte takes on each path (read from the code, not measured):
the snapshot 1 (the state into the buffer, cast in the same pass); the publish 1 (the buffer into the page
cache; the hash reads the buffer, the disk reads the page cache by DMA); ``dd`` 1; save_file 2 (into bytes, into
the page cache) and a read back; ``load_verified`` 0 (the tensors are the mapping; the hash reads it once);
``load_into`` 1 (the page cache into the model; the hash reads the same piece while it is in cache).

Rows from ``bench/weights_transfer.py`` (direct transfer to workers), when that module exists, are printed in the
same table: its ``transfer_rows(sizes, scratch)`` returns rows of the keys ``ROW_KEYS``.

Writes bench/out/weights.json (every measurement, and the rows).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.util
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dora.store import WeightStore, load_into, load_verified  # noqa: E402
from dora.store.digest import digest_file  # noqa: E402
from dora.store.snapshot import HostSnapshot  # noqa: E402

CRITICAL_S_PER_GB = 0.05
PUBLISH_OVER_DD = 0.8
ROW_KEYS = ("size_gb", "stage", "seconds", "rate", "beside", "beside_rate", "ratio", "copies", "target", "met")
"""A row of the table: ``rate`` and ``beside_rate`` are GB/s (s/GB where ``stage`` says so), ``ratio`` is rate over
beside_rate, ``target`` a text, ``met`` True/False/None."""
HIDDEN, FFN, KV, VOCAB = 2048, 5632, 256, 32000


def synthetic(size_gb: float) -> dict[str, torch.Tensor]:
    """bf16 tensors of a Llama-like model's shapes, about ``size_gb`` GB, random bits."""
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    layer = {"self_attn.q_proj.weight": (HIDDEN, HIDDEN), "self_attn.k_proj.weight": (KV, HIDDEN),
             "self_attn.v_proj.weight": (KV, HIDDEN), "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
             "mlp.gate_proj.weight": (FFN, HIDDEN), "mlp.up_proj.weight": (FFN, HIDDEN),
             "mlp.down_proj.weight": (HIDDEN, FFN), "input_layernorm.weight": (HIDDEN,),
             "post_attention_layernorm.weight": (HIDDEN,)}  # fmt: skip
    per_layer = sum(math.prod(s) for s in layer.values()) * 2
    layers = max(1, round((size_gb * 1e9 - VOCAB * HIDDEN * 2) / per_layer))
    for i in range(layers):
        shapes.update({f"model.layers.{i}.{k}": s for k, s in layer.items()})
    g = torch.Generator().manual_seed(0)
    return {k: torch.empty(s, dtype=torch.bfloat16).view(torch.int16).random_(generator=g).view(torch.bfloat16)
            for k, s in shapes.items()}  # fmt: skip


def timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def dd(path: pathlib.Path, nbytes: int) -> float:
    """Seconds for ``dd`` to write ``nbytes`` (in MiB blocks) and fsync them; the file is removed after."""
    os.sync()
    started = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={-(-nbytes // (1 << 20))}",
                    "conv=fsync"], check=True, capture_output=True)  # fmt: skip
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def save_file_publish(folder: pathlib.Path, state: dict[str, torch.Tensor], algo: str) -> float:
    """The previous publish's work for one file: ``save_file``, the file read back to hash it, fsync."""
    from safetensors.torch import save_file

    os.sync()
    started = time.perf_counter()
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    digest_file(folder / "model.safetensors", algo)
    fd = os.open(folder / "model.safetensors", os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    seconds = time.perf_counter() - started
    (folder / "model.safetensors").unlink()
    folder.rmdir()
    return seconds


def memcpy_s(buf: torch.Tensor, nbytes: int, reps: int) -> float:
    """Best seconds to copy ``nbytes`` between two halves of a prefaulted buffer (at most 2 GB a copy), per byte
    scaled to ``nbytes``."""
    n = min(nbytes, buf.numel() // 2, 2 << 30)
    return min(timed(lambda: buf[n : 2 * n].copy_(buf[:n])) for _ in range(reps)) * nbytes / n


def sha256_s(buf: torch.Tensor, nbytes: int) -> float:
    """Seconds for one thread's sha256 of ``nbytes`` in memory (at most 512 MB hashed, scaled)."""
    n = min(nbytes, buf.numel(), 512 << 20)
    view = memoryview(buf[:n].numpy())
    return timed(lambda: hashlib.sha256(view).digest()) * nbytes / n


def available() -> int:
    """Bytes of memory available to a new allocation (``MemAvailable``), or 0 where /proc/meminfo is not."""
    try:
        lines = pathlib.Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return 0
    found = [int(line.split()[1]) << 10 for line in lines if line.startswith("MemAvailable:")]
    return found[0] if found else 0


def one_size(size_gb: float, scratch: pathlib.Path, reps: int, algo: str) -> dict[str, Any]:
    """Every measurement for one synthetic version (a dict of lists of seconds, and the bytes). At most two copies
    of the version are in memory at once: the state and the snapshot while it is taken, then the snapshot alone
    (the loads copy into it, as an engine into its model)."""
    state = synthetic(size_gb)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    snap = HostSnapshot()
    takes = []
    for _ in range(reps + 1):
        views = snap.take(state, torch.bfloat16)
        takes.append((snap.seconds, snap.alloc_s))
    del state
    gc.collect()
    store = WeightStore(scratch / f"store-{size_gb}", algo=algo)
    runs: dict[str, Any] = {"bytes": nbytes, "tensors": len(views), "take_first_s": takes[0][0],
                            "alloc_s": takes[0][1], "take_s": [t for t, _ in takes[1:]], "dd_s": [], "publish_s": [],
                            "publish_stages_s": []}  # fmt: skip
    beside = {"config.json": json.dumps({"architectures": ["LlamaForCausalLM"], "dtype": "bfloat16"}).encode()}
    for v in range(1, reps + 1):
        runs["dd_s"].append(dd(scratch / "dd.bin", nbytes))
        os.sync()
        _, digest, seconds = store.publish(v, views, beside=beside)
        runs["publish_s"].append(seconds)
        runs["publish_stages_s"].append(store.manifest(v).timings_s)
        if v > 1:
            store.retire(v - 1)
    if size_gb <= 2:
        runs["dd_before_save_file_s"] = dd(scratch / "dd.bin", nbytes)
        runs["save_file_s"] = save_file_publish(scratch / "save_file", dict(views), algo)
    folder = store.path(reps)
    got = load_verified(folder, digest, name="v")
    same = all(torch.equal(got[k].view(torch.int16), v.view(torch.int16)) for k, v in views.items())  # NaN bits too
    assert same, "the version loaded is the one taken"
    del got
    runs["load_verified_s"] = [timed(lambda: load_verified(folder, digest, name="v")) for _ in range(reps)]
    runs["load_into_s"] = [timed(lambda: load_into(folder, digest, name="v", into=views, undo=lambda: None))
                           for _ in range(reps)]  # fmt: skip
    runs["memcpy_s"] = memcpy_s(snap.buffer, nbytes, reps) if snap.buffer is not None else float("nan")
    runs["sha256_s"] = sha256_s(snap.buffer, nbytes) if snap.buffer is not None else float("nan")
    store.retire(reps)
    return runs


def rows_of(size_gb: float, r: dict[str, Any]) -> list[dict[str, Any]]:
    """The table's rows for one size."""
    gb = r["bytes"] / 1e9
    med = statistics.median
    take, memcpy = med(r["take_s"]) / gb, r["memcpy_s"] / gb
    pairs = [(gb / p) / (gb / d) for p, d in zip(r["publish_s"], r["dd_s"], strict=True)]
    publish, disk = gb / med(r["publish_s"]), gb / med(r["dd_s"])

    def row(stage: str, seconds: float, rate: float, beside: str, beside_rate: float, ratio: float, copies: str,
            target: str = "", met: bool | None = None) -> dict[str, Any]:  # fmt: skip
        return dict(zip(ROW_KEYS, (size_gb, stage, seconds, rate, beside, beside_rate, ratio, copies, target, met),
                        strict=True))  # fmt: skip

    out = [row("critical path: HostSnapshot.take (s/GB)", med(r["take_s"]), take, "memcpy (s/GB)", memcpy,
               take / memcpy, "1", f"<= {CRITICAL_S_PER_GB} s/GB", take <= CRITICAL_S_PER_GB),
           row("  first take: buffer made and touched (s/GB)", r["take_first_s"], r["take_first_s"] / gb,
               "of which alloc (s/GB)", r["alloc_s"] / gb, float("nan"), "1"),
           row("total publish (GB/s)", med(r["publish_s"]), publish, "dd conv=fsync (GB/s)", disk, med(pairs),
               "1 + hash read", f">= {PUBLISH_OVER_DD} x dd", med(pairs) >= PUBLISH_OVER_DD)]  # fmt: skip
    spread = " ".join(f"{x:.2f}" for x in pairs)
    out.append(row("  publish / dd, each pair", float("nan"), float("nan"), spread, float("nan"), float("nan"), ""))
    stages = r["publish_stages_s"]
    for k in stages[0]:
        s = med(x[k] for x in stages)
        out.append(row(f"  publish: {k} (GB/s)", s, gb / s if s else float("inf"), "", float("nan"), float("nan"), ""))
    if "save_file_s" in r:
        d = gb / r["dd_before_save_file_s"]
        out.append(row("publish via save_file, previous (GB/s)", r["save_file_s"], gb / r["save_file_s"],
                       "dd conv=fsync (GB/s)", d, gb / r["save_file_s"] / d, "2 + read back"))  # fmt: skip
    sha = gb / r["sha256_s"]
    for name, key, copies in (("load_verified", "load_verified_s", "0 + hash read"),
                              ("load_into (engine)", "load_into_s", "1 + hash read")):  # fmt: skip
        s = min(r[key])
        copy = gb / r["memcpy_s"]
        out.append(row(f"{name}, best (GB/s)", s, gb / s, "memcpy (GB/s)", copy, (gb / s) / copy, copies))
    out.append(row("sha256, one thread, memory (GB/s)", r["sha256_s"], sha, "", float("nan"), float("nan"), "0 + read"))
    return out


def transfer_rows(sizes: list[float], scratch: pathlib.Path) -> list[dict[str, Any]]:
    """The direct-transfer rows (``bench/weights_transfer.py``: to 1, 4 and 16 workers beside memcpy) when that
    module exists, as rows of this table; none otherwise."""
    if importlib.util.find_spec("bench.weights_transfer") is None:
        return []
    from bench import weights_transfer

    found = list(weights_transfer.transfer_rows(sizes, scratch))
    return [r if set(ROW_KEYS) <= set(r) else _as_row(r, found) for r in found]


def _as_row(r: dict[str, Any], every: list[dict[str, Any]]) -> dict[str, Any]:
    """A transfer row (``kind``: memcpy or transfer; ``fetchers``, ``fanout``, ``gb_s_per_worker``,
    ``learner_sends``) in this table's keys, with the transfer's two targets."""
    size = r.get("size_gb", float("nan"))
    if r.get("kind") != "transfer":
        return dict(zip(ROW_KEYS, (size, f"transfer: {r.get('kind', '?')} (GB/s)", float("nan"), r.get("gb_s"), "",
                                   float("nan"), float("nan"), "", "", None), strict=True))  # fmt: skip
    n, fanout = r.get("fetchers", 0), r.get("fanout", 0)
    memcpy = next((m["gb_s"] for m in every if m.get("kind") == "memcpy" and m.get("size_gb") == size), float("nan"))
    rate, sends = r.get("gb_s_per_worker", float("nan")), r.get("learner_sends", float("nan"))
    target, met = "", None
    if n == 1:
        target, met = ">= 1 GB/s", rate >= 1
    elif n == 4 and fanout:
        target, met = "sends <= 2", sends <= 2
    stage = f"transfer to {n}, {'relayed' if fanout else 'direct'} (GB/s a worker)"
    if "skipped" in r:
        return dict(zip(ROW_KEYS, (size, stage, float("nan"), float("nan"), r["skipped"], float("nan"), float("nan"),
                                   "", target, None), strict=True))  # fmt: skip
    return dict(zip(ROW_KEYS, (size, stage, r.get("seconds"), rate, "memcpy (GB/s)", memcpy, rate / memcpy,
                               f"learner sends {sends}", target, met), strict=True))  # fmt: skip


def show(rows: list[dict[str, Any]]) -> None:
    def num(x: Any) -> str:
        return f"{x:8.3f}" if isinstance(x, float | int) and x == x else f"{'-':>8s}"  # NaN: nothing to show

    print(f"{'GB':>5s} {'stage':46s} {'s':>8s} {'rate':>8s} {'beside':30s} {'rate':>8s} {'ratio':>8s} "
          f"{'copies':15s} {'target':15s} met")  # fmt: skip
    for r in rows:
        met = "" if r["met"] is None else ("met" if r["met"] else "NOT MET")
        print(f"{r['size_gb']:5.1f} {r['stage']:46s} {num(r['seconds'])} {num(r['rate'])} {r['beside']:30s} "
              f"{num(r['beside_rate'])} {num(r['ratio'])} {r['copies']:15s} {r['target']:15s} {met}")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=float, nargs="+", default=[0.5, 2.0, 8.0], help="version sizes, GB")
    p.add_argument("--reps", type=int, default=3, help="publishes (each after a dd), takes and loads per size")
    p.add_argument("--algo", default="xxh3_128", help="the store's digest: xxh3_128 or sha256")
    p.add_argument("--dir", help="scratch directory on the filesystem to measure (default: a temp dir)")
    p.add_argument("--no-transfer", action="store_true", help="leave out bench/weights_transfer.py's rows")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "weights.json"))
    args = p.parse_args()
    runs, rows = {}, []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="dora-weights-") as tmp:
        scratch = pathlib.Path(tmp)
        for size in args.sizes:
            if available() and 2 * size * 1e9 > 0.9 * available():
                print(f"{size} GB skipped: the state and its snapshot need {2 * size:.0f} GB, "
                      f"{available() / 1e9:.1f} GB available", file=sys.stderr)  # fmt: skip
                rows.append(dict(zip(ROW_KEYS, (size, "skipped: not enough memory", *[float("nan")] * 2,
                                                f"needs {2 * size:.0f} GB, {available() / 1e9:.1f} available",
                                                *[float("nan")] * 2, "", "", None), strict=True)))  # fmt: skip
                continue
            runs[str(size)] = one_size(size, scratch, args.reps, args.algo)
            gc.collect()  # the version's state and snapshot go before the next size's are made
            rows += rows_of(size, runs[str(size)])
            print(f"{size} GB measured", file=sys.stderr, flush=True)
        if not args.no_transfer:
            rows += transfer_rows(args.sizes, scratch)
    print(f"weight path ({os.cpu_count()} cores; {args.algo}; medians of {args.reps} unless a best is named; "
          f"copies: CPU copies per byte, from the code)")  # fmt: skip
    show(rows)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"sizes_gb": args.sizes, "algo": args.algo, "reps": args.reps, "rows": rows,
                               "runs": runs}, indent=1, default=str) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
