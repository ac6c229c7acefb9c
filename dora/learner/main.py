"""`dora learner --trainer sim --broker ADDR|broker.json [--config run.toml] [--set k=v ...]`"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import structlog
import uvloop
import zmq.asyncio

from dora.actor.cluster import ClusterInfo
from dora.actor.discovery import resolve_endpoint, wait_for_endpoint
from dora.actor.security import check_keys
from dora.actor.signals import ignore_sigterm_while_exiting
from dora.config import ConfigError, load
from dora.config.run import RunConfig
from dora.hf.checks import check_model
from dora.hf.preflight import model_folder
from dora.learner.actor import LearnerActor
from dora.learner.trainers import Trainer
from dora.learner.trainers.sim import SimTrainer
from dora.logging import configure_logging
from dora.store.plane import ChunkServer

if TYPE_CHECKING:
    from dora.learner.loss import LossFn

log = structlog.get_logger()


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg, cluster, endpoint, loss_fn = _prepare(args)
    except (ConfigError, ValueError) as e:
        print(f"dora learner: {e}", file=sys.stderr)
        return 2
    rank, world, device = 0, 1, "cpu"
    if args.trainer == "torch":
        from dora.learner.ranks import init_from_env, learner_device

        placed = learner_device(cfg.learner.device, cluster)
        rank, world = init_from_env(cluster, placed)
        device = str(placed)
    configure_logging(cfg.log, process="learner", rank=rank, **cluster.log_fields())
    if rank > 0:  # the other ranks train in step with rank 0, which alone talks to the broker
        _follow(cfg, loss_fn, device)
    discover = lambda: resolve_endpoint(args.broker, cluster)  # noqa: E731
    try:
        return uvloop.run(serve(cfg, endpoint, args.trainer, world, discover=discover, cluster=cluster,
                                device=device, loss_fn=loss_fn))  # fmt: skip
    finally:
        if world > 1:
            from dora.learner.ranks import leave

            leave()


def _parser() -> argparse.ArgumentParser:
    about = "The learner: GRPO/DAPO with FSDP2 over torchrun/srun ranks (torch), or a timing stand-in (sim)."
    p = argparse.ArgumentParser(prog="dora learner", description=about)
    p.add_argument("--broker", required=True, help="tcp://host:port, ipc://path, or a broker.json discovery file")
    p.add_argument(
        "--trainer",
        choices=["sim", "torch"],
        required=True,
        help="sim: a stand-in that checks and times batches; torch: GRPO on a transformers model",
    )
    about = "torch trainer: the model to start from, a folder, a hub id or dora:tiny (overrides learner.model)"
    p.add_argument("--model", help=about)
    p.add_argument("--config", metavar="FILE.toml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    return p


def _prepare(args: argparse.Namespace) -> tuple[RunConfig, ClusterInfo, str, LossFn | None]:
    """The config (the torch trainer's model folder resolved and checked), the cluster, the broker's endpoint and
    the resolved ``learner.loss``; a mistake is a ConfigError or ValueError, one line before any rank starts."""
    overrides = [*args.set, *([f"learner.model={args.model}"] if args.model else [])]
    cfg = load(RunConfig, path=args.config, env=os.environ, env_prefix="DORA_", overrides=overrides)
    cluster = ClusterInfo.from_env(os.environ)
    if args.trainer == "torch":
        if not cfg.learner.model:
            raise ConfigError("--trainer torch needs --model (learner.model: a model folder, hub id or dora:tiny)")
        folder = model_folder(cfg.learner.model, key="learner.model")
        check_model(folder, key="learner.model", chat_template=False)
        cfg = dataclasses.replace(cfg, learner=dataclasses.replace(cfg.learner, model=str(folder)))
    check_keys(cfg, "learner")
    endpoint = wait_for_endpoint(args.broker, cfg.broker.discovery_wait_s, cluster)
    loss_fn = None
    if args.trainer == "torch":
        from dora.learner.loss import resolve_loss

        loss_fn = resolve_loss(cfg.learner.loss)  # once, before any rank starts: a bad spec is one line
        if cfg.learner.checkpoint_dir:
            from dora.learner.checkpoint import check_resumable

            check_resumable(cfg.learner.checkpoint_dir, adapters_only=cfg.learner.lora is not None)
    return cfg, cluster, endpoint, loss_fn


def _follow(cfg: RunConfig, loss_fn: LossFn | None, device: str) -> NoReturn:
    """A rank after the first: train in step with rank 0 until it says stop, then leave the process at once."""
    from dora.learner.ranks import follow, leave

    for sig in (signal.SIGTERM, signal.SIGUSR1):  # rank 0 decides when to stop, and tells them
        signal.signal(sig, signal.SIG_IGN)
    trainer, _ = make_trainer(cfg, loss_fn, device)
    code = 1
    try:
        code = follow(trainer)
    except BaseException:  # reported here: the exit below skips the interpreter's own report
        import traceback

        traceback.print_exc()
    finally:
        leave()
        # a follower holds nothing to save (rank 0 checkpoints): leave now, before exit-time destructors,
        # where gloo's threads can still abort a clean rank ("terminate called without an active exception")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def make_trainer(cfg: RunConfig, loss_fn: LossFn | None = None,
                 device: str = "cpu") -> tuple[Any, dict[str, Any] | None]:  # fmt: skip
    """The torch trainer, restored from the newest checkpoint if there is one (on every rank), and its meta.
    ``loss_fn``: the resolved ``learner.loss`` (resolved here when not given)."""
    from dora.learner.loss import LossConfig, resolve_loss
    from dora.learner.trainers.torch_trainer import TorchTrainer, TrainerConfig
    from dora.store import WeightStore

    lc = cfg.learner
    assert lc.model, "learner.model is a resolved model folder here (main checks it)"
    loss = LossConfig(clip_low=lc.clip_low, clip_high=lc.clip_high, token_level=lc.token_level,
                      advantage=lc.advantage, filter_uniform_groups=bool(lc.filter_uniform_groups), ratio=lc.ratio,
                      is_cap=lc.is_cap or None, is_mask=lc.is_mask or None, is_level=lc.is_level,
                      kl_coef=lc.kl_coef, kl_estimator=lc.kl_estimator, entropy_coef=lc.entropy_coef)  # fmt: skip
    tc = TrainerConfig(lr=lc.lr, micro_batch=lc.micro_batch, temperature=cfg.run.temperature, top_p=cfg.run.top_p,
                       mini_batches=lc.mini_batches, epochs=lc.epochs, weight_decay=lc.weight_decay,
                       lr_schedule=lc.lr_schedule, warmup_steps=lc.warmup_steps, min_lr_ratio=lc.min_lr_ratio,
                       total_steps=cfg.core.total_steps,
                       max_grad_norm=lc.max_grad_norm, seed=cfg.run.seed, dtype=lc.dtype,
                       checkpoint_dir=lc.checkpoint_dir, keep_checkpoints=lc.keep_checkpoints,
                       offload_between_steps=lc.offload_between_steps,
                       micro_batch_tokens=lc.micro_batch_tokens or None, balance=lc.balance,
                       activation_checkpointing=lc.activation_checkpointing, peak_tflops=lc.peak_tflops or None,
                       publish_dtype=publish_dtype(cfg, device), lora=lc.lora)  # fmt: skip
    store = WeightStore(lc.store, shard_bytes=lc.publish_shard_mib << 20)
    trainer = TorchTrainer(lc.model, store, loss, tc, loss_fn=loss_fn or resolve_loss(lc.loss),
                           device=device)  # fmt: skip
    log.info("trainer_ready", device=str(trainer.device), offload_between_steps=trainer.offloads,
             scoring=trainer.scorer.path, scoring_why=trainer.scorer.gap)  # fmt: skip
    resumed = trainer.restore()
    if resumed is not None:
        log.info("resumed_from_checkpoint", version=resumed["version"], groups=len(resumed["trained_groups"]),
                 dir=lc.checkpoint_dir)  # fmt: skip
    return trainer, resumed


def publish_dtype(cfg: RunConfig, device: str) -> str:
    """learner.publish_dtype, auto resolved: rollout.dtype, whose own auto is bfloat16 when the learner's ``device``
    is a GPU (the engines beside it are on GPUs too), else float32."""
    if cfg.learner.publish_dtype != "auto":
        return cfg.learner.publish_dtype
    return cfg.rollout.engine_dtype(device.startswith("cuda"))


async def serve(cfg: RunConfig, endpoint: str, kind: str = "sim", world: int = 1,
                discover: Callable[[], str] | None = None, cluster: ClusterInfo | None = None,
                device: str = "cpu", loss_fn: LossFn | None = None) -> int:  # fmt: skip
    stop, drain = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def drain_requested() -> None:
        log.warning("drain_requested", signal="SIGUSR1")
        drain.set()

    loop.add_signal_handler(signal.SIGUSR1, drain_requested)
    ctx = zmq.asyncio.Context()
    with contextlib.ExitStack() as stack:
        audit = stack.enter_context(open(cfg.learner.audit_file, "a")) if cfg.learner.audit_file else None
        trainer: Trainer = SimTrainer(cfg)
        resumed, leader = None, None
        if kind == "torch":
            try:
                trainer, resumed = make_trainer(cfg, loss_fn, device)
            except ConfigError as e:  # found on the model itself (learner.lora.target_modules matching nothing)
                print(f"dora learner: {e}", file=sys.stderr)
                return 2
            if world > 1:
                from dora.learner.ranks import Leader

                trainer = leader = Leader(trainer)
        server = ChunkServer(cfg.learner.store, cfg.learner.weights_bind)  # the weights' data plane
        try:
            sources = (server.start(),)
            learner = LearnerActor(cfg, ctx, endpoint, audit=audit, clock=loop.time, trainer=trainer, resumed=resumed,
                                   discover=discover, cluster=cluster, sources=sources)  # fmt: skip
            return await learner.run(stop, drain)
        finally:
            server.stop()
            if leader is not None:
                leader.stop()  # release the other ranks
            ignore_sigterm_while_exiting()  # first: a SIGTERM would cut short the wait for a Goodbye to leave
            ctx.destroy(linger=0)
