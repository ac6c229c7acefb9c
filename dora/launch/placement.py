"""Which GPUs each process of `dora run` gets: placement is explicit
(docs/gpus.md#placement-which-process-runs-on-which-gpu).

``plan(cfg, visible)`` is a pure function of the run's config and the GPUs this machine shows. It gives every
process its GPUs, or refuses the layout with one line (a ConfigError: `dora run` exits 2) before any process starts:

- the learner, when it trains on a GPU (run.trainer = torch, learner.device auto or cuda), gets learner.gpus, else
  the first learner.ranks GPUs of run.gpus: one rank per GPU; torchrun's ranks all see the learner's GPUs and each
  takes ``cuda:<LOCAL_RANK>`` of them, NCCL between them;
- elastic workers share the learner's GPUs: the k-th takes the k-th run of rollout.gpus_per_worker of them (they
  cycle when there are more elastic workers than runs: all of them yield for every train step);
- standalone workers (and elastic ones when the learner has no GPU) get runs of the GPUs left, disjoint from the
  learner's and from each other's; too few is refused, unless run.share_gpus lets them share (the free GPUs first,
  then the learner's);
- a process that runs on no GPU (the broker, the sim engine and trainer, a torch engine or trainer on the CPU)
  gets none.

Each process learns its GPUs from CUDA_VISIBLE_DEVICES (``Placement.envs``): within it ``cuda`` (``cuda:0``) is its
first GPU, and a vLLM engine with tensor_parallel_size N starts its N shards on ``cuda:0`` .. ``cuda:N-1``. With no
GPU visible the plan is empty and no process's environment changes; `dora run` does not even look for GPUs when no
process runs on one and the config names none (``wants_gpus``).
"""

from __future__ import annotations

import glob
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from dora.config import ConfigError
from dora.config.run import RunConfig

VISIBLE = "CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True, slots=True)
class Placement:
    """The GPUs (their CUDA_VISIBLE_DEVICES ids) of each process of one `dora run`."""

    gpus: tuple[str, ...] = ()
    """What run.gpus lets this run use; empty on a machine without GPUs (then nothing is placed)."""
    learner: tuple[str, ...] = ()
    """The learner's GPUs, one per rank; empty: it runs on the CPU."""
    workers: tuple[tuple[str, ...], ...] = ()
    """Each rollout worker's GPUs (w0 first); empty: it runs on the CPU."""
    elastic: int = 0
    """How many of the workers (the first ones) are elastic."""
    envs: dict[str, dict[str, str]] = field(default_factory=dict)
    """What each process (broker, learner, w0, w1, ...) gets in its environment."""

    @property
    def idle(self) -> tuple[str, ...]:
        used = {g for ids in (self.learner, *self.workers) for g in ids}
        return tuple(g for g in self.gpus if g not in used)

    def describe(self) -> str:
        """One line: who runs on which GPUs."""
        parts = [f"learner {','.join(self.learner)} ({len(self.learner)} rank{'s' * (len(self.learner) > 1)})"
                 if self.learner else "learner on the CPU"]  # fmt: skip
        for i, ids in enumerate(self.workers):
            role = " (elastic)" if i < self.elastic else ""
            parts.append(f"w{i} {','.join(ids)}{role}" if ids else f"w{i} on the CPU")
        parts += [f"idle {','.join(self.idle)}"] if self.idle else []
        return f"GPUs {','.join(self.gpus)}: " + "; ".join(parts)


def cuda_count(devices: Sequence[str] = ("/proc/driver/nvidia/version", "/dev/nvidia*", "/dev/kfd")) -> int:
    """GPUs torch counts here (it honours CUDA_VISIBLE_DEVICES); 0 where torch has no CUDA. Where no GPU driver shows
    (none of ``devices``: NVIDIA's /proc entry or device nodes, ROCm's /dev/kfd), it is 0 without importing torch,
    which takes seconds of CPU."""
    if not any(glob.glob(pattern) for pattern in devices):
        return 0
    import torch

    return torch.cuda.device_count()


def visible_gpus(environ: Mapping[str, str], count: Callable[[], int] | None = None) -> tuple[str, ...]:
    """The GPUs this process sees, by the ids CUDA_VISIBLE_DEVICES gives them (else 0, 1, ...), as many as
    ``count()`` (default: torch's count) finds; CUDA stops reading that variable at its first empty or negative
    entry."""
    n = (count or cuda_count)()
    listed = environ.get(VISIBLE)
    if listed is None:
        return tuple(str(i) for i in range(n))
    ids: list[str] = []
    for entry in (x.strip() for x in listed.split(",")):
        if not entry or entry.startswith("-"):
            break
        ids.append(entry)
    return tuple(ids[:n])


def learner_on_gpu(cfg: RunConfig) -> bool:
    d = cfg.learner.device
    return cfg.run.trainer == "torch" and (d in ("auto", "cuda") or d.startswith("cuda:"))


def workers_on_gpu(cfg: RunConfig) -> bool:
    d = cfg.rollout.device
    return cfg.run.engine == "vllm" or (cfg.run.engine == "torch" and (d == "cuda" or d.startswith("cuda:")))


def wants_gpus(cfg: RunConfig) -> bool:
    """Whether `dora run` must look for GPUs: a process runs on one, or the config names some."""
    return learner_on_gpu(cfg) or workers_on_gpu(cfg) or cfg.run.gpus != "auto" or bool(cfg.learner.gpus)


def chosen(setting: int | str | tuple[int, ...], visible: Sequence[str]) -> tuple[str, ...]:
    """run.gpus over the visible GPUs."""
    shown = f"{len(visible)} visible" + (f" ({','.join(visible)})" if visible else "")
    if setting == "auto":
        return tuple(visible)
    if isinstance(setting, int):
        if setting > len(visible):
            raise ConfigError(f"run.gpus = {setting}, but this machine shows {shown}")
        return tuple(visible[:setting])
    ids = tuple(str(g) for g in setting)
    missing = [g for g in ids if g not in visible]
    if missing:
        raise ConfigError(f"run.gpus = {list(setting)}: GPU {', '.join(missing)} not among the {shown}")
    return ids


def runs(gpus: Sequence[str], each: int) -> list[tuple[str, ...]]:
    """``gpus`` cut into consecutive runs of ``each`` (a shorter tail left out)."""
    return [tuple(gpus[i : i + each]) for i in range(0, len(gpus) - each + 1, each)]


def plan(cfg: RunConfig, visible: Sequence[str]) -> Placement:
    """Every process's GPUs for a `dora run` of ``cfg`` on a machine showing ``visible`` GPUs (their ids)."""
    r, n = cfg.rollout, cfg.run.workers
    elastic = n if r.elastic else cfg.run.elastic_workers
    gpus = chosen(cfg.run.gpus, visible)
    if not gpus:
        if cfg.learner.gpus:
            raise ConfigError(f"learner.gpus = {list(cfg.learner.gpus)}, but this machine shows no GPU")
        return Placement(workers=((),) * n, elastic=elastic)
    learner = learner_gpus(cfg, gpus)
    workers: list[tuple[str, ...]] = [()] * n
    if workers_on_gpu(cfg):
        each = r.gpus_each
        if r.device.startswith("cuda:") and not (r.device[5:].isdigit() and int(r.device[5:]) < each):
            raise ConfigError(f"rollout.device = {r.device!r}: under dora run each worker sees only its own "
                              f"{each} GPU(s) (rollout.gpus_per_worker), from cuda:0; set it to 'cuda'")  # fmt: skip
        standalone = list(range(n))
        if learner and elastic:
            shared = runs(learner, each)
            if not shared:
                raise ConfigError(f"each rollout worker takes {each} GPUs (rollout.gpus_per_worker, else "
                                  f"tensor_parallel_size) but the learner, whose GPUs the elastic workers share, has "
                                  f"{len(learner)} (learner.gpus)")  # fmt: skip
            for k in range(elastic):
                workers[k] = shared[k % len(shared)]
            standalone = standalone[elastic:]
        own = runs([g for g in gpus if g not in learner], each)
        if len(standalone) > len(own):
            left = len(gpus) - len(learner)
            why = (f"{len(standalone)} standalone rollout workers need {each * len(standalone)} GPUs of their own "
                   f"({each} each: rollout.gpus_per_worker, else tensor_parallel_size), but run.gpus leaves {left} "
                   f"beside the learner's {len(learner)}")  # fmt: skip
            pool = own + runs(learner, each)
            if not cfg.run.share_gpus or not pool:
                raise ConfigError(why + ": start fewer workers, make some elastic (run.elastic_workers: they share the "
                                  "learner's GPUs), or set run.share_gpus = true to let them share")  # fmt: skip
            own = [pool[k % len(pool)] for k in range(len(standalone))]
        for k, w in enumerate(standalone):
            workers[w] = own[k]
        if cfg.run.engine == "vllm":
            check_memory(cfg, workers)
    envs = {"broker": {VISIBLE: ""}, "learner": {VISIBLE: ",".join(learner)}}
    envs.update({f"w{i}": {VISIBLE: ",".join(ids)} for i, ids in enumerate(workers)})
    return Placement(gpus=gpus, learner=learner, workers=tuple(workers), elastic=elastic, envs=envs)


def learner_gpus(cfg: RunConfig, gpus: tuple[str, ...]) -> tuple[str, ...]:
    lc = cfg.learner
    if not learner_on_gpu(cfg):
        if lc.gpus:
            raise ConfigError(f"learner.gpus = {list(lc.gpus)}, but the learner runs on no GPU (run.trainer = "
                              f"{cfg.run.trainer!r}, learner.device = {lc.device!r})")  # fmt: skip
        return ()
    if lc.device.startswith("cuda:"):
        raise ConfigError(f"learner.device = {lc.device!r}: under dora run on GPUs each rank takes its own of "
                          f"learner.gpus; set it to 'auto' or 'cuda'")  # fmt: skip
    if lc.gpus:
        ids = tuple(str(g) for g in lc.gpus)
        missing = [g for g in ids if g not in gpus]
        if missing:
            raise ConfigError(f"learner.gpus = {list(lc.gpus)}: GPU {', '.join(missing)} not among run.gpus "
                              f"({','.join(gpus)})")  # fmt: skip
        return ids
    if lc.ranks > len(gpus):
        raise ConfigError(f"learner.ranks = {lc.ranks} needs {lc.ranks} GPUs, one per rank, but run.gpus gives "
                          f"{len(gpus)} ({','.join(gpus)})")  # fmt: skip
    return gpus[: lc.ranks]


def check_memory(cfg: RunConfig, workers: Sequence[tuple[str, ...]]) -> None:
    """vLLM workers sharing a GPU: each checks at start that rollout.gpu_memory_utilization of it is free."""
    share = cfg.rollout.gpu_memory_utilization
    for gpu in sorted({g for ids in workers for g in ids}):
        on = [f"w{i}" for i, ids in enumerate(workers) if gpu in ids]
        if len(on) * share > 1 + 1e-9:
            raise ConfigError(f"{', '.join(on)} share GPU {gpu} and each vLLM engine takes "
                              f"rollout.gpu_memory_utilization = {share:g} of it (checked free at its start): set it "
                              f"to at most {1 / len(on):.2f}")  # fmt: skip
