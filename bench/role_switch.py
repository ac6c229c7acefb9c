"""A role switch on a GPU, measured: what an elastic torch worker's sleep and wake and the learner's offload and
onload between steps cost on a real architecture, beside the host link's own rate measured in the same run and the
rate the simulator's paper configs assume (``cluster.host_link_bytes_per_s``, 25 GB/s). Needs CUDA.

    python bench/role_switch.py                                   # Qwen2-shaped, ~0.9 B parameters (~1 min)
    python bench/role_switch.py --hidden 1024 --layers 8          # smaller
    python bench/role_switch.py --out bench/out/role_switch.json

Stages, each timed with the device synchronised, median of ``--reps`` (the first sleep and offload are also given
alone, and the time to reserve the pinned buffer, which each makes in the background at startup):

- **link**: one 2 GiB tensor copied device -> host and back, into pinned host memory and into pageable memory
  (what a plain ``.to("cpu")`` gets).
- **engine sleep / wake**: ``TorchEngine.sleep`` (``rollout.sleep_on_yield``: every sequence's cache dropped, the
  model parked in one pinned host buffer by ``dora.hostmem``, the allocator's cache emptied) with sequences
  mid-generation, then ``wake`` (the model back). Rates are the engine's weight bytes over the time.
- **learner offload / onload**: ``TorchTrainer.offload`` and the onload that starts the next step
  (``learner.offload_between_steps``): fp32 weights and both AdamW moments. The moments are made by one optimizer
  step on zero gradients (AdamW with no weight decay leaves the weights as they are), as a first train step would
  make them.
- **plain .to**: the move ``dora.hostmem`` replaced (``.to`` tensor by tensor, pageable memory), on the same
  tensors, for both.

The paper configs' yield cost is ``weight_bytes / (gpus_per_worker x host_link_bytes_per_s)`` each way; the last
lines print it at the assumed and at the measured rates.

Writes the figures as JSON (``--out``) and prints them as the last line.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.weights import build_model  # noqa: E402
from dora.learner.loss import LossConfig  # noqa: E402
from dora.learner.trainers.torch_trainer import TorchTrainer, TrainerConfig  # noqa: E402
from dora.rollout.engines.torch.engine import TorchEngine  # noqa: E402
from dora.store import WeightStore  # noqa: E402

ASSUMED = 2.5e10
"""cluster.host_link_bytes_per_s of examples/sim/paper-{64,128}gpu.toml."""
PAPER_WEIGHT_BYTES, PAPER_GPUS_PER_WORKER = 65.5e9, 4


def synced(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def link(nbytes: int, reps: int) -> dict[str, float]:
    """GB/s of one large copy each way, into pinned and into pageable host memory."""
    gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1)
    out = {}
    for kind, host in (("pinned", torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)),
                       ("pageable", torch.empty(nbytes, dtype=torch.uint8))):  # fmt: skip
        host.fill_(2)  # pages touched before timing
        d2h = statistics.median(synced(lambda h=host, g=gpu: h.copy_(g, non_blocking=True)) for _ in range(reps))
        h2d = statistics.median(synced(lambda h=host, g=gpu: g.copy_(h, non_blocking=True)) for _ in range(reps))
        out[f"{kind}_d2h_GBps"], out[f"{kind}_h2d_GBps"] = nbytes / d2h / 1e9, nbytes / h2d / 1e9
    gpu = host = None
    torch.cuda.empty_cache()
    return out


def engine(model_dir: pathlib.Path, reps: int, sequences: int, prompt: int) -> dict[str, float]:
    e = TorchEngine(model_dir, device="cuda", dtype="bfloat16", max_slots=sequences, version=0, sleep_on_yield=True)
    weights = sum(p.numel() * p.element_size() for p in e.model.parameters())
    ids = torch.randint(0, e.model.config.vocab_size, (prompt,), generator=torch.Generator().manual_seed(0))
    e.submit(group_id=1, attempt=1, prompt=ids.tolist(), n=sequences, max_tokens=10_000, temperature=1.0, seed=1)
    sleep, wake, freed = [], [], []
    for _ in range(reps):
        for _ in range(4):
            e.step()  # sequences mid-generation, caches live
        held = torch.cuda.memory_allocated()
        sleep.append(synced(e.sleep))
        freed.append(held - torch.cuda.memory_allocated())
        wake.append(synced(e.wake))
    s, w = statistics.median(sleep), statistics.median(wake)
    out, back = plain(lambda d: [e.model.to(d)], reps)
    return {"engine_weight_GB": weights / 1e9, "engine_freed_GB": statistics.median(freed) / 1e9,
            "engine_reserve_s": e.parking.reserve_s, "engine_first_sleep_s": sleep[0], "engine_sleep_s": s,
            "engine_wake_s": w, "engine_sleep_GBps": weights / s / 1e9,
            "engine_wake_GBps": weights / w / 1e9, "engine_plain_to_out_GBps": weights / out / 1e9,
            "engine_plain_to_back_GBps": weights / back / 1e9}  # fmt: skip


def plain(move, reps: int) -> tuple[float, float]:
    """Seconds out and back of the move before dora.hostmem: ``.to`` tensor by tensor into pageable memory."""
    out, back = [], []
    for _ in range(reps):
        out.append(synced(lambda: (move("cpu"), torch.cuda.empty_cache())))
        back.append(synced(lambda: move("cuda")))
    return statistics.median(out), statistics.median(back)


def learner(model_dir: pathlib.Path, reps: int, scratch: pathlib.Path) -> dict[str, float]:
    t = TorchTrainer(model_dir, WeightStore(scratch / "store"), LossConfig(),
                     TrainerConfig(offload_between_steps=True), device="cuda")  # fmt: skip
    for p in t.model.parameters():
        p.grad = torch.zeros_like(p)
    t.parking.ready()  # reserved in the background since the trainer was made (a learner waits for its first batch)
    t.opt.step()  # the AdamW moments, as after a first step (zero gradients, no weight decay: weights unchanged)
    t.opt.zero_grad(set_to_none=True)
    state = [v for s in t.opt.state.values() for k, v in s.items() if torch.is_tensor(v) and k != "step"]
    moved = sum(x.numel() * x.element_size() for x in [*t.model.parameters(), *state])
    off, on = [], []
    for _ in range(reps):
        off.append(synced(t.offload))
        on.append(synced(t._onload))
    o, n = statistics.median(off), statistics.median(on)

    def to(device: str) -> None:
        t.model.to(device)
        for s in t.opt.state.values():
            for k, v in s.items():
                if torch.is_tensor(v) and k != "step":
                    s[k] = v.to(device)

    out, back = plain(to, max(1, reps // 2))
    return {"learner_state_GB": moved / 1e9, "learner_reserve_s": t.parking.reserve_s,
            "learner_first_offload_s": off[0], "learner_offload_s": o,
            "learner_onload_s": n,
            "learner_offload_GBps": moved / o / 1e9, "learner_onload_GBps": moved / n / 1e9,
            "learner_plain_to_out_GBps": moved / out / 1e9,
            "learner_plain_to_back_GBps": moved / back / 1e9}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32_000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--sequences", type=int, default=64, help="sequences mid-generation when the engine sleeps")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens of each")
    p.add_argument("--link-gib", type=float, default=2.0)
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "bench/out/role_switch.json")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/role_switch.py: needs a CUDA GPU (it times moves between the device and host memory)",
              file=sys.stderr)  # fmt: skip
        return 2
    print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    res: dict[str, float | str] = {"gpu": torch.cuda.get_device_name(0)}
    res.update(link(int(a.link_gib * 2**30), a.reps))
    print("link  " + "  ".join(f"{k} {v:.1f}" for k, v in res.items() if k != "gpu"), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        scratch = pathlib.Path(tmp)
        build_model(scratch / "model", hidden=a.hidden, layers=a.layers, vocab=a.vocab, dtype="bfloat16")
        res.update(engine(scratch / "model", a.reps, a.sequences, a.prompt))
        torch.cuda.empty_cache()
        res.update(learner(scratch / "model", a.reps, scratch))
    for k in ("engine", "learner"):
        shown = [f"{x.removeprefix(k + '_')} {'-' if v is None else f'{v:.3g}'}"
                 for x, v in res.items() if x.startswith(k)]  # fmt: skip
        print(f"{k:7} " + "  ".join(shown))
    per_gpu = PAPER_WEIGHT_BYTES / PAPER_GPUS_PER_WORKER
    res["paper_yield_s_assumed"] = per_gpu / ASSUMED
    res["paper_offload_s_measured"] = per_gpu / (float(res["engine_sleep_GBps"]) * 1e9)
    res["paper_reload_s_measured"] = per_gpu / (float(res["engine_wake_GBps"]) * 1e9)
    print(f"paper configs' engine weights ({PAPER_WEIGHT_BYTES / 1e9:.1f} GB over {PAPER_GPUS_PER_WORKER} GPUs): "
          f"{res['paper_yield_s_assumed']:.2f} s each way at the assumed {ASSUMED / 1e9:.0f} GB/s; at this run's "
          f"sleep and wake rates {res['paper_offload_s_measured']:.2f} s out, {res['paper_reload_s_measured']:.2f} s "
          f"back")  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
