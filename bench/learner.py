"""The torch learner's step on the CPU, before and after a change, side by side in one run.

Each side is a fresh process that imports dora from its own tree (this checkout, and a git worktree of
``--before``, by default the commit before the learner scored in vocabulary chunks), builds the same model
(a Qwen2 shape with a vocabulary of ``--vocab`` tokens, random weights, so that the logits are what is big)
and the same batch (``--groups`` groups of ``--group`` samples, ``--prompt`` prompt tokens, ``--tokens``
sampled tokens each), then takes ``--steps`` GRPO steps after one warm-up step. It prints seconds per step
(the best step) and the process's peak resident memory (``ru_maxrss``: the model, AdamW's state and the
largest activations of a step). Writes ``bench/out/learner.json``.

    python bench/learner.py                      # this checkout against the commit before chunked log-probs
    python bench/learner.py --before HEAD~3 --vocab 65536
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
BEFORE = "ddc04ca~1"
"""The commit before the learner at GPU speed (chunked log-probs of the sampled tokens, token budgets, balancing)."""

CHILD = r"""
import json, resource, sys, time
import numpy as np, torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from dora.ids import Finish
from dora.learner.loss import LossConfig
from dora.learner.trainers.torch_trainer import TorchTrainer, TrainerConfig
from dora.store import WeightStore
from dora.samples import Batch, TrainGroup, TrainSample

a = json.loads(sys.argv[1])
torch.manual_seed(0)
torch.set_num_threads(a["threads"])
model_dir = a["dir"] + "/model"
cfg = Qwen2Config(vocab_size=a["vocab"], hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  tie_word_embeddings=False)
Qwen2ForCausalLM(cfg).save_pretrained(model_dir)
rng = np.random.default_rng(0)
groups = []
for g in range(a["groups"]):
    prompt = rng.integers(0, a["vocab"], a["prompt"]).astype(np.int32)
    samples = tuple(TrainSample(index=i, token_ids=rng.integers(0, a["vocab"], a["tokens"]).astype(np.int32),
                                logprobs=np.full(a["tokens"], -float(np.log(a["vocab"])), np.float32),
                                reward=float(rng.integers(0, 2)), finish=Finish.LENGTH)
                    for i in range(a["group"]))
    groups.append(TrainGroup(group_id=g, version=0, prompt_ids=prompt, samples=samples))
batch = Batch(step=0, groups=tuple(groups))
trainer = TorchTrainer(model_dir, WeightStore(a["dir"] + "/store"), LossConfig(),
                       TrainerConfig(micro_batch=a["micro_batch"]))
times = []
for step in range(a["steps"] + 1):
    start = time.perf_counter()
    trainer.train(batch)
    times.append(time.perf_counter() - start)
print(json.dumps({"step_s": min(times[1:]), "steps_s": times[1:],
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def side(tree: pathlib.Path, args: argparse.Namespace, work: pathlib.Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    spec = {k: getattr(args, k) for k in ("vocab", "groups", "group", "prompt", "tokens", "steps", "threads",
                                          "micro_batch")}  # fmt: skip
    spec["dir"] = str(work)
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], cwd=tree, capture_output=True, text=True,
                         env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})  # fmt: skip
    if out.returncode:
        sys.exit(f"the step failed in {tree}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", default=BEFORE, help=f"the commit to compare with (default {BEFORE})")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--tokens", type=int, default=192)
    p.add_argument("--micro-batch", dest="micro_batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old = pathlib.Path(tmp) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(old), args.before], check=True)
        try:
            shape = ("vocab", "groups", "group", "prompt", "tokens", "micro_batch", "threads")
            result = {"before": args.before, **{k: getattr(args, k) for k in shape}}
            result["old"] = side(old, args, pathlib.Path(tmp) / "old")
            result["new"] = side(ROOT, args, pathlib.Path(tmp) / "new")
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)
    o, n = result["old"], result["new"]
    result["speed_new_over_old"] = o["step_s"] / n["step_s"]
    result["peak_rss_new_over_old"] = n["peak_rss_mib"] / o["peak_rss_mib"]
    print(
        f"{args.groups}x{args.group} samples of {args.prompt}+{args.tokens} tokens, vocab {args.vocab}, micro-batch "
        f"{args.micro_batch}, {args.threads} threads"
    )
    print(f"| | step (best of {args.steps}) | peak RSS |")
    print("|---|---|---|")
    print(f"| before ({args.before}) | {o['step_s']:.2f} s | {o['peak_rss_mib']:.0f} MiB |")
    print(f"| after (this tree) | {n['step_s']:.2f} s | {n['peak_rss_mib']:.0f} MiB |")
    print(f"| after / before | {n['step_s'] / o['step_s']:.2f}x time | {result['peak_rss_new_over_old']:.2f}x memory |")
    out = ROOT / "bench" / "out" / "learner.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
