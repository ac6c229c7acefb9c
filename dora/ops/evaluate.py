"""`dora eval --model DIR|HUB_ID [--dataset FILE] [--store DIR --version N]`: a model's held-out accuracy, alone.

The model folder (any model folder: a published version's folder is one, ``runs/<time>/weights/v<N>``) gives
the architecture, tokenizer and chat template, and its weights; with ``--store`` and ``--version`` the
weights are that published version's, checked against its manifest's digest, as a rollout worker loads them.
The rows, their fields, the template and the reward are the run config's ([task], [eval]); ``--dataset`` and
the other flags override [eval]. Prints one summary line on stderr and the metrics as one JSON object on
stdout (``--json`` also writes them to a file).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from typing import TYPE_CHECKING, Any

from dora.config import ConfigError, load
from dora.config.run import RunConfig
from dora.rollout.engines.base import EngineError, StepEngine

if TYPE_CHECKING:
    from dora.rollout.engines.torch.engine import TorchEngine


def evaluate_model(cfg: RunConfig, model: str, store: str | None = None, version: int | None = None,
                   task: Any = None) -> dict[str, Any]:  # fmt: skip
    """Evaluate a model folder (or a store version in it) on [eval]; the metrics, with the version."""
    from dora.store import WeightStore
    from dora.tasks.prompts import eval_task

    if not (pathlib.Path(model) / "config.json").is_file():
        raise ConfigError(f"--model {model}: not a model folder (no config.json)")
    task = task or eval_task(cfg, cfg.task.tokenizer or model)
    e = cfg.eval
    rows = min(len(task.rows), e.limit or len(task.rows))
    print(f"dora eval: {rows} rows x {e.samples} sample(s), up to {e.max_tokens or cfg.run.max_tokens} tokens each "
          "(eval.max_tokens, else run.max_tokens)", file=sys.stderr)  # fmt: skip
    engine = eval_engine(cfg, model)
    if store is not None and version is not None:
        ws = WeightStore(store)
        if version not in ws.versions():
            raise ConfigError(f"--store {store}: no version {version} (versions: {ws.versions()})")
        engine.load_weights(version, ws.path(version), ws.digest(version))
    return {"version": version or 0, **evaluate_on(engine, task, cfg, limit=e.limit)}


def eval_engine(cfg: RunConfig, model: str) -> TorchEngine:
    """The engine evaluations run on: a torch engine on ``model``'s folder, sized and placed as [rollout] says."""
    from dora.rollout.engines.torch.engine import TorchEngine

    r = cfg.rollout
    return TorchEngine(model, max_slots=r.max_slots, device=r.device,
                       dtype=r.engine_dtype(r.device == "cuda" or r.device.startswith("cuda:")), version=0,
                       lora=cfg.learner.lora)  # fmt: skip


def evaluate_on(engine: StepEngine[Any], task: Any, cfg: RunConfig, *, limit: int | None) -> dict[str, Any]:
    """``task``'s first ``limit`` held-out rows (None: all) on ``engine``'s weights, sampled as [eval] says."""
    from dora.rollout.evaluate import evaluate

    e = cfg.eval
    return evaluate(engine, task, samples=e.samples, temperature=e.temperature, limit=limit,
                    max_tokens=e.max_tokens or cfg.run.max_tokens, seed=cfg.run.seed)  # fmt: skip


def line(metrics: dict[str, Any]) -> str:
    """One human line of eval metrics."""
    right = round(metrics["accuracy"] * metrics["rows"] * metrics["samples"])
    extra = "".join(f", {k} {v:.3f}" for k, v in metrics.items() if k.startswith("pass@") and k != "pass@1")
    return (f"accuracy {metrics['accuracy']:.3f} ({right}/{int(metrics['rows'] * metrics['samples'])}){extra}, "
            f"mean reward {metrics['mean_reward']:.3f}, mean length {metrics['mean_tokens']:.1f} tokens, "
            f"{metrics['seconds']:.1f} s")  # fmt: skip


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dora eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    about = ("the model folder (architecture, tokenizer, chat template; a published version's folder is one), a hub id "
             "or dora:tiny")
    p.add_argument("--model", required=True, help=about)
    p.add_argument("--dataset", help="held-out rows (overrides eval.dataset)")
    p.add_argument("--store", help="a weight store: evaluate --version from it")
    p.add_argument("--version", type=int, help="the store version to evaluate")
    p.add_argument("--config", metavar="FILE.toml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--json", metavar="OUT", help="also write the metrics to OUT")
    args = p.parse_args(argv)
    sets = [*args.set, *([f"eval.dataset={args.dataset}"] if args.dataset else [])]
    try:
        if (args.store is None) != (args.version is None):
            raise ConfigError("--store and --version go together")
        cfg = load(RunConfig, path=args.config, env=os.environ, env_prefix="DORA_", overrides=sets)
        from dora.hf.preflight import model_folder

        model = str(model_folder(args.model, key="--model"))  # a folder (a published version is one) or a hub id
        metrics = evaluate_model(cfg, model, args.store, args.version)
    except (ConfigError, ValueError, EngineError) as e:
        print(f"dora eval: {e}", file=sys.stderr)
        return 2
    where = f"{args.model}" + (f" version {args.version}" if args.version is not None else "")
    print(f"dora eval: {where} on {cfg.eval.dataset}: {line(metrics)}", file=sys.stderr)
    print(json.dumps(metrics))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(metrics) + "\n")
    return 0
