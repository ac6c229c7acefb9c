"""The peer in the convergence benchmark: TRL's GRPOTrainer on dora's task, model, reward and batch shape.

    python bench/trl_peer.py --model runs/tiny-model --steps 40 --seed 0 --out trl.json

Same tiny model (loaded from its folder), same prompts (``dora.tasks`` items, raw text as dora's
broker encodes them), same reward function, same group size, prompts per step, completion length,
temperature, learning rate, AdamW betas, gradient clipping and clip epsilon; KL off, one update per
generation batch, sequence-level GRPO loss with group-std advantages (dora's defaults). TRL generates
with ``transformers.generate`` on the training process, synchronously: it is the sync baseline users
run on a machine without GPUs. Writes one JSON object: per-step reward, completion tokens and elapsed
wall-clock seconds. Needs ``trl`` (``pip install -e '.[peers]'``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--groups", type=int, default=8, help="prompts per step (dora: core.train_groups)")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt (dora: core.group_size)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--task", default="arithmetic")
    p.add_argument("--reward", help="module:function (default: the task's own)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    try:
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        print(f"trl_peer: {e}; install the peer with `pip install -e '.[peers]'`", file=sys.stderr)
        return 2

    from dora.tasks import rewards, tasks

    task = tasks.get(args.task, args.seed)
    score = rewards.resolve(args.reward or rewards.DEFAULT[args.task])
    n_prompts = args.steps * args.groups
    prompts = [task.item(i).prompt for i in range(n_prompts)]
    data = Dataset.from_dict({"prompt": prompts, "item": list(range(n_prompts))})

    def reward(completions: list[str], item: list[int], **_: object) -> list[float]:
        return [float(score(c, task.item(i))) for c, i in zip(completions, item, strict=True)]

    batch = args.groups * args.group_size
    cfg = GRPOConfig(
        output_dir=str(pathlib.Path(args.out).parent / "trl-tmp"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=args.seed,
        max_steps=args.steps,
        per_device_train_batch_size=min(batch, args.micro_batch),
        gradient_accumulation_steps=max(1, batch // args.micro_batch),
        steps_per_generation=max(1, batch // args.micro_batch),
        num_generations=args.group_size,
        max_completion_length=args.max_tokens,
        temperature=args.temperature,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta2=0.99,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        num_iterations=1,
        loss_type="grpo",
        scale_rewards="group",
        disable_dropout=True,
    )
    model = AutoModelForCausalLM.from_pretrained(args.model)
    tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    rows: list[dict[str, float]] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a: object, **k: object) -> None:
            self.started = time.perf_counter()

        def on_log(self, _args: object, state: object, _control: object, logs: dict | None = None, **k: object) -> None:
            if logs and "reward" in logs:
                rows.append({"step": len(rows), "reward_mean": float(logs["reward"]),
                             "tokens": float(logs.get("completions/mean_length", 0.0)) * batch,
                             "elapsed_s": time.perf_counter() - self.started})  # fmt: skip

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok,
                          callbacks=[Clock()])  # fmt: skip
    started = time.perf_counter()
    trainer.train()
    out = {"wall_s": time.perf_counter() - started, "steps": rows, "batch": batch}
    pathlib.Path(args.out).write_text(json.dumps(out))
    print(f"trl_peer: {len(rows)} steps in {out['wall_s']:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
