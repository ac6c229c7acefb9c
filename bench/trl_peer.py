"""The peer in the convergence benchmark: TRL's GRPOTrainer on a dora run config's model, rows, reward and batch.

    python bench/trl_peer.py --config examples/arithmetic.toml [--set rollout.model=DIR ...] --steps 150 \\
                             --seed 0 [--eval-every 10] [--eval-limit 200] [--threads N] --out trl.json

Read from the same resolved config `dora run` reads (``--config`` and ``--set``, same precedence):
- **Model.** ``rollout.model``: the same model folder, in float32, no gradient checkpointing.
- **Rows.** Step ``s`` trains groups ``s*B .. s*B+B-1`` (``B = core.train_groups``), and group ``g``'s prompt is
  ``dora.tasks.prompts.TaskRun.item(g)``: the row dora's broker sends for that group id (epochs permuted by
  ``task.seed``), rendered with the same chat template. TRL's shuffling is off. The tokenizer is the model
  folder's ``tokenizer.json`` as ``PreTrainedTokenizerFast`` (``AutoTokenizer`` picks a class by model type,
  e.g. ``Qwen2Tokenizer``, whose pre-tokenizer can split digits otherwise), and the ids TRL encodes for every
  prompt are checked against the broker's (``TaskRun.prompt_ids``) before training.
- **Reward.** ``TaskRun.score(g, completion_ids)``'s ``.reward``: the configured reward (its ``"reward"``
  component when it returns several), on the completion's tokens decoded as dora decodes them.
- **Batch and loss.** ``core.group_size`` samples per prompt, ``core.train_groups`` prompts per step,
  ``run.max_tokens`` tokens, ``run.temperature``; AdamW at ``learner.lr`` with betas (0.9, 0.99), no weight
  decay, constant lr; ``learner.max_grad_norm``; clip ``learner.clip_low``/``clip_high``; micro-batches of
  ``learner.micro_batch`` accumulated into one update per generated batch (``num_iterations`` 1, so the
  ratio's denominator is the policy that sampled); KL off (``beta`` 0); group-std advantages
  (``scale_rewards="group"``, or ``"none"`` with ``learner.advantage = "dr_grpo"``); sequence-level loss
  (``loss_type="grpo"``; ``"dapo"`` with ``learner.token_level``).
- **Threads.** ``torch.set_num_threads(--threads)``, default ``os.cpu_count()``: every core of the machine,
  which is what `dora run`'s processes share among themselves.

Not the same as dora (TRL's own choices, left as they are): the advantage's epsilon is 1e-4 (dora: 1e-6);
TRL recomputes the sampling policy's log-probs in the trainer instead of taking the sampler's; generation is
``transformers.generate`` on the training process, one batch at a time (the synchronous baseline users run
on a machine without GPUs), with TRL's own random stream.

Held-out accuracy: at step 0, every ``--eval-every`` steps and at the last step, the trained weights are
copied into a dora ``TorchEngine`` and scored by dora's evaluator (``dora.rollout.evaluate.evaluate``, [eval]'s
samples, temperature and max tokens) on the first ``--eval-limit`` held-out rows (0: all); after the last
step also on every row (``final``). **The clock stops during each evaluation**: ``elapsed_s`` is training
time only, from ``on_train_begin`` (model loading left out).

Writes one JSON object: ``steps`` (per step: reward mean, completion tokens, elapsed s), ``evals`` (per
evaluation: step, elapsed s, accuracy, rows), ``final`` (the last step on every row), ``wall_s``, ``batch``,
``threads``, ``eval_s``. Needs ``trl`` (``pip install -e '.[peers]'``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dora.config import ConfigError, load  # noqa: E402
from dora.config.run import RunConfig  # noqa: E402


def trl_args(cfg: RunConfig, *, steps: int, seed: int, out_dir: pathlib.Path) -> dict[str, Any]:
    """GRPOConfig's arguments for the run config's batch, sampling, optimizer and loss."""
    lr = cfg.learner
    if lr.filter_uniform_groups or lr.loss or lr.dtype != "float32":
        raise ConfigError("trl_peer: learner.filter_uniform_groups, learner.loss and a non-float32 learner.dtype "
                          "have no TRL counterpart here")  # fmt: skip
    batch = cfg.core.train_groups * cfg.core.group_size
    micro = min(batch, lr.micro_batch)
    if batch % micro:
        raise ConfigError(f"trl_peer: the batch ({batch}) must be a multiple of learner.micro_batch ({micro})")
    return dict(
        output_dir=str(out_dir), use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, seed=seed, max_steps=steps,
        per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
        steps_per_generation=batch // micro, num_generations=cfg.core.group_size, shuffle_dataset=False,
        max_completion_length=cfg.run.max_tokens, temperature=cfg.run.temperature, top_p=cfg.run.top_p, top_k=0,
        learning_rate=lr.lr, lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.99,
        weight_decay=0.0, max_grad_norm=lr.max_grad_norm, beta=0.0, epsilon=lr.clip_low, epsilon_high=lr.clip_high,
        num_iterations=1, loss_type="dapo" if lr.token_level else "grpo",
        scale_rewards="group" if lr.advantage == "grpo" else "none", disable_dropout=True,
    )  # fmt: skip


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, metavar="FILE.toml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=0, help="TRL's seed (pass run.seed and task.seed with --set too)")
    p.add_argument("--eval-every", type=int, default=10, help="steps between held-out evaluations (0: first/last)")
    p.add_argument("--eval-limit", type=int, default=200, help="held-out rows per evaluation (0: all)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: all cores)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    try:
        import torch
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        print(f"trl_peer: {e}; install the peer with `pip install -e '.[peers]'`", file=sys.stderr)
        return 2
    from dora.ops.evaluate import eval_engine, evaluate_on
    from dora.tasks.prompts import TaskRun, eval_task

    try:
        cfg = load(RunConfig, path=args.config, overrides=args.set)
        model_dir = cfg.rollout.model
        if not model_dir or not (pathlib.Path(model_dir) / "config.json").is_file():
            raise ConfigError(f"trl_peer: rollout.model {model_dir!r} is not a model folder")
        tok_dir = cfg.task.tokenizer or model_dir
        task, held = TaskRun(cfg.task, tok_dir), eval_task(cfg, tok_dir)
        out = pathlib.Path(args.out)
        grpo = GRPOConfig(**trl_args(cfg, steps=args.steps, seed=args.seed, out_dir=out.parent / f"{out.stem}-tmp"))
    except ConfigError as e:
        print(f"trl_peer: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    groups = list(range(args.steps * cfg.core.train_groups))
    data = Dataset.from_dict({"prompt": [task.item(g).prompt for g in groups], "group": groups})
    tok = PreTrainedTokenizerFast.from_pretrained(tok_dir, padding_side="left")  # tokenizer.json, as dora reads it
    for g in groups:  # TRL encodes a text prompt with tok(text=...); the broker sends TaskRun.prompt_ids(g)
        if tok(text=[data[g]["prompt"]])["input_ids"][0] != task.prompt_ids(g).tolist():
            print(f"trl_peer: group {g}: TRL's prompt tokens differ from dora's", file=sys.stderr)
            return 1

    def reward(completions: list[str], completion_ids: list[list[int]], group: list[int], **_: Any) -> list[float]:
        return [task.score(g, ids).reward for g, ids in zip(group, completion_ids, strict=True)]

    limit, batch = args.eval_limit or None, grpo.generation_batch_size
    engine = eval_engine(cfg, model_dir)  # the one `dora eval` and dora run's before/after evaluations use
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows: list[dict[str, float]] = []
    evals: list[dict[str, float]] = []
    final: dict[str, Any] = {}

    class Clock(TrainerCallback):
        """Training time since on_train_begin, less the held-out evaluations; evaluates on schedule."""

        started, paused = 0.0, 0.0

        def elapsed(self) -> float:
            return time.perf_counter() - self.started - self.paused

        def held_out(self, step: int, model: Any, rows_limit: int | None) -> dict[str, Any]:
            t = time.perf_counter()
            engine.model.load_state_dict(model.state_dict())
            engine.relabel(step)
            was_training = model.training
            got = evaluate_on(engine, held, cfg, limit=rows_limit)
            model.train(was_training)
            self.paused += time.perf_counter() - t
            return got

        def record(self, step: int, model: Any) -> None:
            got = self.held_out(step, model, limit)
            evals.append({"step": step, "elapsed_s": self.elapsed(), "accuracy": got["accuracy"],
                          "rows": got["rows"], "seconds": got["seconds"]})  # fmt: skip
            print(f"trl_peer: step {step}: held-out accuracy {got['accuracy']:.3f} on {int(got['rows'])} rows",
                  file=sys.stderr, flush=True)  # fmt: skip

        def on_train_begin(self, _args: Any, state: Any, _control: Any, model: Any = None, **k: Any) -> None:
            self.started = time.perf_counter()
            self.record(0, model)

        def on_step_end(self, _args: Any, state: Any, _control: Any, model: Any = None, **k: Any) -> None:
            step = state.global_step
            if step == args.steps or (args.eval_every and step % args.eval_every == 0):
                self.record(step, model)
            if step == args.steps:
                got = self.held_out(step, model, None)
                final.update(step=step, elapsed_s=self.elapsed(), **got)

        def on_log(self, _args: Any, state: Any, _control: Any, logs: dict | None = None, **k: Any) -> None:
            if logs and "reward" in logs:
                rows.append({"step": len(rows), "reward_mean": float(logs["reward"]),
                             "tokens": float(logs.get("completions/mean_length", 0.0)) * batch,
                             "elapsed_s": self.elapsed()})  # fmt: skip

    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=grpo, train_dataset=data, processing_class=tok,
                          callbacks=[clock])  # fmt: skip
    trainer.train()
    shutil.rmtree(grpo.output_dir, ignore_errors=True)  # nothing is saved there (save_strategy "no")
    result = {"wall_s": rows[-1]["elapsed_s"] if rows else 0.0, "eval_s": clock.paused, "batch": batch,
              "threads": torch.get_num_threads(), "steps": rows, "evals": evals, "final": final}  # fmt: skip
    out.write_text(json.dumps(result))
    print(f"trl_peer: {len(rows)} steps in {result['wall_s']:.1f} s of training ({clock.paused:.1f} s of held-out "
          f"evaluation left out); final held-out accuracy {final.get('accuracy', float('nan')):.3f}",
          file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
