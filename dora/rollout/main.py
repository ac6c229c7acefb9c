"""`dora rollout --broker ADDR|broker.json --engine sim [--name NAME] [--config run.toml] [--set k=v ...]`"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog
import uvloop
import zmq.asyncio

from dora.actor.cluster import ClusterInfo
from dora.actor.discovery import resolve_endpoint, run_finished, wait_for_endpoint
from dora.actor.security import check_keys
from dora.actor.signals import ignore_sigterm_while_exiting
from dora.config import ConfigError, load
from dora.config.run import RunConfig
from dora.hf.checks import check_model
from dora.hf.preflight import check_run_model, model_folder
from dora.logging import configure_logging
from dora.rollout.actor import RolloutActor
from dora.rollout.engines.base import WorkerEngine
from dora.rollout.engines.sim import SimEngine
from dora.sim.workload import Workload
from dora.store.fetch import relay_server

if TYPE_CHECKING:
    from dora.rollout.engines.torch.engine import TorchEngine
    from dora.rollout.engines.vllm_engine import VllmEngine


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dora rollout", description="A rollout worker: one inference-engine replica.")
    p.add_argument("--broker", required=True, help="tcp://host:port, ipc://path, or a broker.json discovery file")
    p.add_argument("--engine", choices=["sim", "torch", "vllm"], default="sim")
    p.add_argument("--model", help="torch/vllm engines: a model folder, hub id or dora:tiny (overrides rollout.model)")
    p.add_argument("--name", default=f"{socket.gethostname()}-{os.getpid()}")
    p.add_argument("--config", metavar="FILE.toml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--time-scale", type=float, help="real seconds per simulated second (overrides run.time_scale)")
    p.add_argument("--elastic", action="store_true", help="share the accelerators with the learner (rollout.elastic)")
    args = p.parse_args(argv)
    overrides = [*args.set, *([f"run.time_scale={args.time_scale}"] if args.time_scale else [])]
    overrides += [f"rollout.model={args.model}"] if args.model else []
    overrides += ["rollout.elastic=true"] if args.elastic else []
    try:
        cfg = load(RunConfig, path=args.config, env=os.environ, env_prefix="DORA_", overrides=overrides)
        cluster = ClusterInfo.from_env(os.environ)
        if args.engine != "sim":
            if not cfg.rollout.model:
                raise ConfigError(f"--engine {args.engine} needs --model (a model folder, a hub id or dora:tiny)")
            folder = model_folder(cfg.rollout.model, key="rollout.model")
            check_model(folder, key="rollout.model", engine=args.engine, chat_template=cfg.task.chat_template)
            cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, model=str(folder)))
            if cfg.task.name == "synthetic":
                raise ConfigError(f"--engine {args.engine} needs a real task: set task.dataset, or task.name "
                                  "(arithmetic, countdown)")  # fmt: skip
        if cfg.task.env is not None and args.engine == "sim":
            raise ConfigError("task.env: multi-turn episodes run on --engine torch or vllm, not sim")
        if cfg.task.agent is not None and args.engine == "sim":
            raise ConfigError("task.agent: agent episodes run on --engine torch or vllm, not sim")
        if args.engine == "vllm":
            try:
                import vllm  # noqa: F401
            except ImportError:
                raise ConfigError("--engine vllm needs the vllm extra: pip install -e '.[vllm]'") from None
        check_engine(args.engine, cfg)
        if cfg.rollout.sleep_on_yield:
            check_sleep(args.engine, cfg.rollout.device)
        task = load_task(cfg) if args.engine != "sim" else None
        if task is not None:
            check_run_model(cfg, folder, args.engine, task[0].about)
        check_keys(cfg)
        # a bad address is a usage error now (a file not written yet is waited for); every session re-reads it
        wait_for_endpoint(args.broker, cfg.broker.discovery_wait_s, cluster)
    except (ConfigError, ValueError) as e:
        print(f"dora rollout: {e}", file=sys.stderr)
        return 2
    configure_logging(cfg.log, process="rollout", worker_id=args.name, **cluster.log_fields())
    endpoint = lambda: resolve_endpoint(args.broker, cluster)  # noqa: E731
    finished = lambda epoch: run_finished(args.broker, epoch)  # noqa: E731
    return uvloop.run(serve(cfg, endpoint, args.name, args.engine, cluster, task, finished))


def on_cuda(device: str) -> bool:
    """Whether the torch device string ``device`` (rollout.device) is a CUDA GPU."""
    return device == "cuda" or device.startswith("cuda:")


def check_engine(engine: str, cfg: RunConfig) -> None:
    """What the engine cannot run: tensor parallelism is vLLM's; vLLM serves adapters up to a rank."""
    from dora.hf.lora import VLLM_RANKS

    if engine == "vllm" and cfg.learner.lora is not None and cfg.learner.lora.rank > VLLM_RANKS[-1]:
        raise ConfigError(f"learner.lora.rank = {cfg.learner.lora.rank}: vLLM workers serve adapters of rank "
                          f"{VLLM_RANKS[-1]} at most")  # fmt: skip
    if engine != "vllm" and cfg.rollout.tensor_parallel_size > 1:
        raise ConfigError(f"rollout.tensor_parallel_size = {cfg.rollout.tensor_parallel_size}: only the vllm engine "
                          f"shards a model over several devices; the {engine} engine runs on one")  # fmt: skip


def check_sleep(engine: str, device: str) -> None:
    """rollout.sleep_on_yield needs accelerator memory to give back: a torch engine on a GPU, or vLLM on a platform
    where it can sleep."""
    if engine == "torch" and device.startswith("cpu"):
        raise ConfigError("rollout.sleep_on_yield: a torch worker on the CPU shares cores, not accelerator memory; "
                          "set rollout.device = 'cuda' or leave it off")  # fmt: skip
    if engine == "torch":
        return
    if engine != "vllm":
        raise ConfigError(f"rollout.sleep_on_yield applies to the torch and vllm engines, not {engine}")
    try:
        from dora.rollout.engines.vllm_engine import sleep_mode_available

        available = sleep_mode_available()
    except ImportError:
        raise ConfigError("the vllm engine needs the vllm extra: pip install -e '.[vllm]'") from None
    if not available:
        raise ConfigError("rollout.sleep_on_yield: vLLM's sleep mode needs CUDA, ROCm or XPU; this platform has "
                          "none (leave it off: a yielded worker then stops decoding and keeps its memory)")  # fmt: skip


def load_task(cfg: RunConfig) -> tuple[Any, Any]:  # -> (TaskRun, TaskRun | None)
    """The task a torch or vllm worker scores with (a dataset: every row read and checked, as the broker does),
    and the held-out rows when the broker runs evaluation rounds (eval.every_steps)."""
    from dora.tasks.prompts import TaskRun, eval_task

    tokenizer = cfg.task.tokenizer or model_of(cfg)
    held_out = eval_task(cfg, tokenizer) if cfg.eval.dataset and cfg.eval.every_steps else None
    return TaskRun(cfg.task, tokenizer), held_out


def model_of(cfg: RunConfig) -> str:
    """The model of a torch or vllm worker (rollout.model)."""
    if cfg.rollout.model is None:
        raise ConfigError("rollout.model: the torch and vllm engines need a model")
    return cfg.rollout.model


def make_engine(cfg: RunConfig, kind: str, now: float, task: Any = None) -> WorkerEngine:
    if kind in ("torch", "vllm"):
        from dora.rollout.engines.stepped import StepWorkerEngine

        task, held_out = task or load_task(cfg)
        return StepWorkerEngine(torch_engine(cfg) if kind == "torch" else vllm_engine(cfg), task, held_out)
    return SimEngine(cfg.engine, Workload(cfg.workload, cfg.run.seed), max_slots=cfg.rollout.max_slots,
                     time_scale=cfg.run.time_scale, now=now)  # fmt: skip


def torch_engine(cfg: RunConfig) -> TorchEngine:
    from dora.rollout.engines.torch.engine import TorchEngine

    r = cfg.rollout
    sleeps = r.elastic and r.sleep_on_yield
    versions = 1 if cfg.learner.lora is None else cfg.core.max_staleness + 1  # as vLLM's max_loras
    return TorchEngine(model_of(cfg), max_slots=r.max_slots, device=r.device, dtype=r.engine_dtype(on_cuda(r.device)),
                       max_model_len=r.max_model_len, sleep_on_yield=sleeps, lora=cfg.learner.lora,
                       max_versions=versions)  # fmt: skip


def vllm_engine(cfg: RunConfig) -> VllmEngine:
    from dora.rollout.engines.vllm_engine import VllmEngine

    r = cfg.rollout
    kv = r.kv_cache_mib << 20 if r.kv_cache_mib is not None else None
    return VllmEngine(model_of(cfg), max_slots=r.max_slots, kv_cache_bytes=kv, dtype=r.dtype,
                      max_model_len=r.max_model_len, seed=cfg.run.seed,
                      sleep_level=1 if r.elastic and r.sleep_on_yield else None,
                      gpu_memory_utilization=r.gpu_memory_utilization, enforce_eager=r.enforce_eager,
                      tensor_parallel_size=r.tensor_parallel_size, lora=cfg.learner.lora,
                      max_loras=cfg.core.max_staleness + 1)  # fmt: skip


async def serve(cfg: RunConfig, endpoint: Callable[[], str], name: str, kind: str = "sim",
                cluster: ClusterInfo | None = None, task: Any = None,
                run_finished: Callable[[int], bool] | None = None) -> int:  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # SIGUSR1 (Slurm's early warning, if sent to every step) is the learner's cue to checkpoint; here it only
    # must not kill the process, which is its default action
    loop.add_signal_handler(signal.SIGUSR1, lambda: structlog.get_logger().info("signal_ignored", signal="SIGUSR1"))
    ctx = zmq.asyncio.Context()
    r = cfg.rollout
    server = relay_server(r.store, r.weights_bind, r.fetch_timeout_s) if r.store else None
    try:
        try:
            engine = make_engine(cfg, kind, loop.time(), task)
            relay = server.start() if server is not None else ""  # relays what this node fetched
        except (ConfigError, RuntimeError) as e:  # a model mistake (lora.target_modules matching nothing), a bind
            print(f"dora rollout: {e}", file=sys.stderr)
            return 2
        return await RolloutActor(
            cfg, ctx, endpoint, name, engine, clock=loop.time, cluster=cluster, run_finished=run_finished,
            weights_endpoint=relay,
        ).run(stop)  # fmt: skip
    finally:
        ignore_sigterm_while_exiting()  # first: a SIGTERM would cut short the wait for a Goodbye to leave
        if server is not None:
            server.stop()
        ctx.destroy(linger=0)
