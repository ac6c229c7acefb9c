"""The learner's step with its version written in the background against written in line, side by side in one run.

    .venv/bin/python bench/overlap.py                     # a ~0.25 GB bf16 version, 4 steps a side (~3 min)
    .venv/bin/python bench/overlap.py --hidden 1536 --layers 12 --steps 3

One process builds a transformers Qwen2 from a config (random weights, nothing downloaded), a torch trainer on it
and one GRPO batch, then runs the learner's step loop both ways, alternating (in line, overlapped, in line, ...) so
that the shared disk's swings fall on both:

- **in line** (``learner.overlap_publish = false``): train, then ``snapshot`` and its write: the step ends when the
  version is durable;
- **overlapped** (the default): train, wait for the previous version's write if it is still running (at most one
  in flight), ``snapshot`` (the copy into the reused host buffer: the critical path), then start the write on its
  own thread (``dora.learner.writing.BackgroundWrite``, what the learner actor runs) and go on to the next step.

It prints, per mode, the median step time (what the next batch waits for), the training, the copy, the write and
the wait for the previous write, and the ratio in line / overlapped. On a 2-core CPU the background write competes
with training for the cores, so its cost does not vanish: it shows up as slower training, and the table says so.
Writes bench/out/overlap.json.
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

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dora.ids import Finish  # noqa: E402
from dora.learner.loss import LossConfig  # noqa: E402
from dora.learner.trainers.torch_trainer import TorchTrainer, TrainerConfig  # noqa: E402
from dora.learner.writing import BackgroundWrite  # noqa: E402
from dora.samples import Batch, TrainGroup, TrainSample  # noqa: E402
from dora.store import WeightStore  # noqa: E402


def build(folder: pathlib.Path, args: argparse.Namespace) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=4096, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(folder)


def batch(args: argparse.Namespace) -> Batch:
    rng = np.random.default_rng(0)
    groups = []
    for g in range(args.groups):
        prompt = rng.integers(0, args.vocab, 32).astype(np.int32)
        samples = tuple(TrainSample(index=i, token_ids=rng.integers(0, args.vocab, args.tokens).astype(np.int32),
                                    logprobs=np.full(args.tokens, -float(np.log(args.vocab)), np.float32),
                                    reward=float(i % 2), finish=Finish.LENGTH)
                        for i in range(4))  # fmt: skip
        groups.append(TrainGroup(group_id=g, version=0, prompt_ids=prompt, samples=samples))
    return Batch(step=0, groups=tuple(groups))


def steps(trainer: TorchTrainer, data: Batch, first: int, n: int, *, overlap: bool) -> list[dict[str, float]]:
    """``n`` steps from version ``first``; each row: step (the critical path), train, wait, copy, write seconds."""
    rows, writing = [], None
    for version in range(first + 1, first + n + 1):
        started = time.perf_counter()
        trainer.train(data)
        trained = time.perf_counter()
        if writing is not None:  # one write in flight at most: the copy buffer is reused
            writing.done.result()
            rows[-1]["write_s"] = writing.result()[2]
        waited = time.perf_counter()
        pending = trainer.snapshot(version)
        assert pending is not None
        writing = BackgroundWrite(pending, data, {}, {}).start()
        if not overlap:
            writing.done.result()
        row = {"train_s": trained - started, "wait_s": waited - trained, "copy_s": pending.snapshot_s}
        if not overlap:
            row["write_s"] = writing.result()[2]
            writing = None
        row["step_s"] = time.perf_counter() - started
        rows.append(row)
    if writing is not None:
        writing.done.result()
        rows[-1]["write_s"] = writing.result()[2]
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--steps", type=int, default=4, help="steps per mode and round")
    p.add_argument("--rounds", type=int, default=2, help="rounds of (in line, overlapped)")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "overlap.json"))
    args = p.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp) / "model"
        build(folder, args)
        store = WeightStore(pathlib.Path(tmp) / "store")
        trainer = TorchTrainer(str(folder), store, LossConfig(), TrainerConfig(micro_batch=8,
                                                                               publish_dtype="bfloat16"))
        data = batch(args)
        trainer.train(data)  # warm-up: the optimizer's state, the allocator, the host buffer's first touch
        trainer.publish(1)
        version, by_mode = 1, {"in line": [], "overlapped": []}
        for _ in range(args.rounds):
            for mode in by_mode:
                by_mode[mode] += steps(trainer, data, version, args.steps, overlap=mode == "overlapped")
                version += args.steps
                for v in store.versions()[:-1]:
                    store.retire(v)
        gb = store.manifest(store.versions()[-1]).bytes / 1e9
    result = {"version_gb": round(gb, 3), "steps_per_mode": args.steps * args.rounds,
              "modes": {m: {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}
                        for m, rows in by_mode.items()}}  # fmt: skip
    inline, over = result["modes"]["in line"], result["modes"]["overlapped"]
    result["step_in_line_over_overlapped"] = round(inline["step_s"] / over["step_s"], 3)
    print(f"version {gb:.3f} GB (bf16), {result['steps_per_mode']} steps per mode, medians in seconds")
    print("| mode | step (critical path) | train | wait for previous write | copy aside | write (durable) |")
    print("|---|---|---|---|---|---|")
    for mode, r in result["modes"].items():
        print(f"| {mode} | {r['step_s']:.3f} | {r['train_s']:.3f} | {r['wait_s']:.3f} | {r['copy_s']:.3f} | "
              f"{r['write_s']:.3f} |")  # fmt: skip
    print(f"step in line / overlapped: {result['step_in_line_over_overlapped']:.2f}x; "
          f"copy aside {over['copy_s'] / gb:.3f} s per GB")  # fmt: skip
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
