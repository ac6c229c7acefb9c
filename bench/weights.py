"""The weight path per GB: publish, verify and load a real architecture's weights through the store, beside the
disk's own bandwidth measured in the same run.

    .venv/bin/python bench/weights.py                        # Qwen2-shaped, tied, 3 versions in fp32 then bf16 (~3 min)
    .venv/bin/python bench/weights.py --algo sha256 --out bench/out/weights_sha256.json   # a cryptographic digest
    .venv/bin/python bench/weights.py --dtype bfloat16 --hidden 1536 --layers 16 --versions 4

The model is a transformers Qwen2 built from a config with random weights (nothing downloaded), its embeddings
tied by default as in the families users start from. A version is published the way the learner publishes it: a
model folder (the config, generation config and tokenizer beside the weights), each tied tensor once, the weights
in the publish dtype. The run measures each of ``--publish-dtypes`` in turn (default: float32, what every version
was written in before versions followed the engine's dtype, then bfloat16, a GPU engine's dtype), each loaded by a
torch engine of that dtype, and prints them side by side: bytes per version and seconds per stage. Every stage is
timed in the same run, in GB/s of the version's safetensors file:

- **disk**: a file of the same size written in 16 MiB blocks then fsync'd, after ``os.sync()`` (write to the page
  cache, and with the fsync: the disk's own rate); read back in 16 MiB blocks *cold* (its pages dropped first:
  fsync then ``posix_fadvise(DONTNEED)``; the residency after the drop is printed, from ``mincore``) and *warm*.
- **publish**: ``WeightStore.publish`` of the learner's ``state_dict()``, whole and by parts when the manifest
  records them (serialize + write, fsync, hash, rename).
- **load / verified load**: what a torch rollout worker does for an ``Assign``: ``TorchEngine.load_weights(v,
  path, digest)``, tensors copied into a model already in memory. Without a digest (``load``) and with the
  published one (``verified``: checked chunk by chunk as it is copied, the engine holding the file it loaded
  last); ``verify = verified - load``, the time the check adds. Cold (the version's pages dropped first) and
  warm. Each version is published twice and every load reads the copy the engine does not hold (``TWIN``). The
  target is verify / load <= 0.25.
- **check pass**: the digest alone, read from the file through a small buffer (``dora.digest.digest_file`` on its
  path, what a publish runs; a verified load hashes its own mapping of the file in place instead);
  **sha256 pass**: one sequential sha256 read of the file (``sha256_file``), the check a worker ran before.

Reading it: cold, the check's one read pass is the disk read the load would have made, so it adds little or
nothing. Warm, a CPU engine's load is one memory copy from the page cache (every byte read and written). A check
that ends before the model is touched reads every byte once more; checked as it is copied (each piece hashed, then
copied from cache, the held version put back if a chunk differs), the check costs the hash's own work, not a read.

Writes bench/out/weights.json and prints it as the last line.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dora.hf.folder import companion_files, with_dtype  # noqa: E402
from dora.hf.tensors import publishable, tied_copies  # noqa: E402
from dora.rollout.engines.torch.engine import TorchEngine  # noqa: E402
from dora.store import WeightStore, sha256_file  # noqa: E402
from dora.store.digest import digest_file  # noqa: E402

BLOCK = 16 << 20
TARGET = 0.25
"""verify / load: the check may add at most a quarter of the load."""


def build_model(out: pathlib.Path, *, hidden: int, layers: int, vocab: int, dtype: str,
                tied: bool = True) -> torch.nn.Module:  # fmt: skip
    """A Qwen2 causal LM with random weights, saved as an HF folder (the run's version 0) at ``out``, with dora's
    tokenizer beside it (what makes each published version a model folder)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from dora.hf.tiny import build_tokenizer

    heads = max(2, hidden // 64)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                      max_position_embeddings=2048, tie_word_embeddings=tied)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    model.save_pretrained(out)
    build_tokenizer(1024).save_pretrained(out)
    return model


def resident(path: pathlib.Path) -> float:
    """The fraction of the file's pages in the page cache (``mincore`` on a private mapping of it)."""
    size = path.stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mm:
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
            return float("nan")
        return sum(b & 1 for b in vec) / pages


def drop(path: pathlib.Path) -> float:
    """Drop the file's pages from the page cache (written back first); returns the fraction still resident."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return resident(path)


def read_through(path: pathlib.Path) -> float:
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    started = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.readv(fd, [view]) > 0:
            pass
    finally:
        os.close(fd)
    return time.perf_counter() - started


def disk(scratch: pathlib.Path, size: int, reps: int) -> dict[str, float]:
    """Best of ``reps``: seconds to write ``size`` bytes (to the page cache, then with fsync) and to read them cold
    and warm. Whatever else is dirty is written back first, so the fsync waits for this file's bytes only."""
    path = scratch / "disk.bin"
    block = os.urandom(BLOCK)
    runs = []
    for _ in range(reps):
        os.sync()
        started = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for _ in range(size // BLOCK):
                os.write(fd, block)
            os.write(fd, block[: size % BLOCK])
            cached_s = time.perf_counter() - started
            os.fsync(fd)
            fsync_s = time.perf_counter() - started
        finally:
            os.close(fd)
        left = drop(path)
        runs.append({"write_cache_s": cached_s, "write_fsync_s": fsync_s, "resident_after_drop": left,
                     "read_cold_s": read_through(path), "read_warm_s": read_through(path)})  # fmt: skip
        path.unlink()
    return {k: (max if k == "resident_after_drop" else min)(r[k] for r in runs) for k in runs[0]}


def timed(fn, *args) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


TWIN = 1000
"""Each version is published twice (as v and TWIN + v, the same bytes): a load reads the file the engine does not
hold, since a torch engine keeps the mapping of the file it last loaded (clean pages a drop cannot evict)."""


def versions(model: torch.nn.Module, store: WeightStore, engine: TorchEngine, n: int, reps: int, *,
             folder: pathlib.Path, publish_dtype: str) -> list[dict]:  # fmt: skip
    """Publish ``n`` versions; each one loaded by the engine ``reps`` times cold and warm, without and with its
    digest (alternating which goes first), and read by a plain sha256 pass. Every load reads the copy of the
    version the engine does not hold (``TWIN``)."""
    rows = []
    held = None
    copies = tied_copies(model)
    beside = companion_files(folder)
    beside["config.json"] = with_dtype(beside["config.json"], publish_dtype)
    dtype = getattr(torch, publish_dtype)

    def publish(version: int) -> tuple[str, str, float]:  # as the learner does (TorchTrainer._publish)
        return store.publish(version, publishable(model.state_dict(), copies), beside=beside, dtype=dtype)

    for v in range(1, n + 1):
        with torch.no_grad():  # a new version: every byte differs from the last one's
            for p in model.parameters():
                p.mul_(1.0 + 1e-3)
        os.sync()  # the publish's fsync waits for its own bytes, not for what the last step left dirty
        uri, digest, publish_s = publish(v)
        file = pathlib.Path(uri.removeprefix("file://")) / "model.safetensors"
        twin_uri, twin_digest, _ = publish(TWIN + v)
        assert twin_digest == digest, "the same tensors make the same file"
        twin = pathlib.Path(twin_uri.removeprefix("file://")) / "model.safetensors"
        manifest = json.loads((file.parent / "manifest.json").read_text())
        row: dict = {"version": v, "bytes": file.stat().st_size, "folder_bytes": manifest["bytes"],
                     "publish_s": [publish_s],
                     **{f"publish_{k}_s": [s] for k, s in manifest.get("timings_s", {}).items()}}  # fmt: skip
        for rep in range(reps):
            for temp in ("cold", "warm"):
                order = [("load", None), ("verified", digest)]
                for name, check in order[:: 1 if rep % 2 == 0 else -1]:
                    path = twin if held == file else file
                    if temp == "cold":
                        row.setdefault("resident_after_drop", []).append(drop(path))
                    row.setdefault(f"{name}_{temp}_s", []).append(timed(engine.load_weights, v, path, check))
                    held = path
                path = twin if held == file else file
                for name, check in (("check_pass", lambda f: digest_file(f, store.algo, store.chunk_bytes)),
                                    ("sha256_pass", sha256_file)):  # fmt: skip
                    if temp == "cold":
                        drop(path)
                    row.setdefault(f"{name}_{temp}_s", []).append(timed(check, path))
        store.retire(v - 1)
        store.retire(TWIN + v - 1)
        rows.append(row)
    return rows


def summary(rows: list[dict], io: dict[str, float]) -> dict[str, float]:
    """Each stage's best time over every version and repetition (other work on the machine only adds time)."""
    gb = statistics.median(r["bytes"] for r in rows) / 1e9
    stages = [k for k in rows[0] if k.endswith("_s")]
    best = {k: min(x for r in rows for x in r[k]) for k in stages}
    out: dict[str, float] = {"gb": gb, **{k: round(s, 4) for k, s in best.items()}}
    out.update({f"median_{k}": round(statistics.median(x for r in rows for x in r[k]), 4) for k in stages})
    for temp in ("cold", "warm"):
        verify = best[f"verified_{temp}_s"] - best[f"load_{temp}_s"]
        out[f"verify_{temp}_s"] = round(verify, 4)
        out[f"verify_over_load_{temp}"] = round(verify / best[f"load_{temp}_s"], 3)
    out.update({f"disk_{k}": round(s, 4) for k, s in io.items()})
    return out


def report(s: dict[str, float], label: str, reps: int) -> None:
    gb = s["gb"]
    write, read = {"write": s["disk_write_fsync_s"]}, {"cold": s["disk_read_cold_s"], "warm": s["disk_read_warm_s"]}
    lines = [("disk write (to the page cache)", s["disk_write_cache_s"], None),
             ("disk write + fsync", write["write"], "write"),
             (f"disk read cold (resident after drop {s['disk_resident_after_drop']:.0%})", read["cold"], "cold"),
             ("disk read warm", read["warm"], "warm"),
             ("publish (whole)", s["publish_s"], "write")]  # fmt: skip
    lines += [(f"  publish: {k.removeprefix('publish_').removesuffix('_s')}", t, None)
              for k, t in s.items() if k.startswith("publish_") and k != "publish_s"]  # fmt: skip
    for temp in ("cold", "warm"):
        lines += [(f"load {temp} (engine, no digest)", s[f"load_{temp}_s"], temp),
                  (f"verified load {temp} (engine, digest checked)", s[f"verified_{temp}_s"], temp),
                  (f"  verify {temp} (verified - load)", s[f"verify_{temp}_s"], None),
                  (f"check pass {temp} (the digest alone, dora.digest)", s[f"check_pass_{temp}_s"], temp),
                  (f"sha256 pass {temp} (one sequential read + sha256)", s[f"sha256_pass_{temp}_s"], temp)]  # fmt: skip
    print(f"weight path, {label}: {gb:.3f} GB per version; best of {reps} per version, over the versions")
    print(f"{'stage':58s} {'s':>8s} {'GB/s':>7s} {'/ disk':>7s}")
    for name, sec, base in lines:
        rate = f"{gb / sec:7.2f}" if sec > 0 else f"{'-':>7s}"
        ratio = f"{(gb / sec) / (gb / (write | read)[base]):7.2f}" if base else ""
        print(f"{name:58s} {sec:8.3f} {rate} {ratio:>7s}")
    for temp in ("cold", "warm"):
        r = s[f"verify_over_load_{temp}"]
        note = " (the check's read pass reads the disk faster than the load's page faults)" if r < 0 else ""
        print(f"verify / load {temp}: {r:.3f} (target <= {TARGET}: {'met' if r <= TARGET else 'not met'}){note}")


def compare(results: dict[str, dict[str, float]]) -> None:
    """The publish dtypes side by side: bytes of a version and seconds (and s/GB of the float32 version's size)."""
    base = results.get("float32", next(iter(results.values())))["gb"]
    stages = [("publish", "publish_s"), ("verified load cold", "verified_cold_s"),
              ("verified load warm", "verified_warm_s"), ("load warm (no digest)", "load_warm_s"),
              ("verify warm", "verify_warm_s")]  # fmt: skip
    print(f"\nper version, by publish dtype (s per GB: of the float32 version's {base:.3f} GB, the same parameters)")
    print(f"{'':24s}" + "".join(f"{d:>22s}" for d in results))
    print(f"{'GB written':24s}" + "".join(f"{r['gb']:22.3f}" for r in results.values()))
    for name, key in stages:
        print(f"{name + ' s (s/GB)':24s}" + "".join(f"{r[key]:13.3f} ({r[key] / base:6.3f})" for r in results.values()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--untied", action="store_true", help="untied embeddings (default: tied, as Qwen2.5 / Llama-3.2)")
    p.add_argument("--publish-dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--versions", type=int, default=3)
    p.add_argument("--reps", type=int, default=3, help="loads of each kind per version (the best is kept)")
    p.add_argument("--algo", default="xxh3_128", help="the store's digest (xxh3_128 or sha256; a store of this tree)")
    p.add_argument("--dir", help="scratch directory on the disk to measure (default: a temp dir); emptied after")
    p.add_argument("--label", default="this tree", help="what this run measures, in the printed title and JSON")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "weights.json"))
    args = p.parse_args()
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    results, rows_by = {}, {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="dora-weights-") as tmp:
        scratch = pathlib.Path(tmp)
        started = time.perf_counter()
        model = build_model(scratch / "hf", hidden=args.hidden, layers=args.layers, vocab=args.vocab,
                            dtype="float32", tied=not args.untied)  # fmt: skip
        size = (scratch / "hf" / "model.safetensors").stat().st_size
        built_s = time.perf_counter() - started
        io = disk(scratch, size, args.reps)
        for dtype in args.publish_dtypes:
            engine = TorchEngine(scratch / "hf", dtype=dtype, version=0)
            engine.load_weights(0, scratch / "hf", None)  # every parameter page touched once before anything is timed
            store = WeightStore(scratch / f"store-{dtype}", algo=args.algo)
            rows = versions(model, store, engine, args.versions, args.reps, folder=scratch / "hf", publish_dtype=dtype)
            results[dtype], rows_by[dtype] = summary(rows, io), rows
            report(results[dtype], f"{args.label}, published in {dtype}", args.reps)
            del engine
    if len(results) > 1:
        compare(results)
    params = sum(p.numel() for p in model.parameters())
    shape = {"arch": "qwen2", "params": params, "tied": not args.untied, "hidden": args.hidden,
             "layers": args.layers, "vocab": args.vocab, "digest": args.algo, "build_s": round(built_s, 1)}  # fmt: skip
    result = {"label": args.label, "model": shape, "by_publish_dtype": results, "versions": rows_by,
              "target_verify_over_load": TARGET}  # fmt: skip
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "versions"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
