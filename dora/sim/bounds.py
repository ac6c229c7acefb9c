"""Lower bounds on the step time of *any* schedule of a simulated cluster, from its work and its timing model.

A replica decoding ``n`` sequences takes ``step_s(n) = scale x (tpot_base_s + tpot_per_seq_s x n)`` per decode
step, runs at most ``max_slots`` sequences, and holds every running sequence's context (prompt + tokens so far)
in ``kv_budget_tokens`` of KV cache (``dora.sim.engine``). A sample of ``L`` tokens after a prompt of ``p`` is
in ``L`` decode steps, holding ``p + j`` tokens at its ``j``-th, so a set of samples with ``N`` tokens in all and
``Q = sum(L x p + L x (L - 1) / 2)`` token-steps of KV (each step's context counted up to the budget: a
sequence longer than the cache decodes alone) needs, over the replicas that decode it, at least
``max(N / max_slots, Q / kv_budget_tokens)`` decode steps and therefore at least

    D = scale x (tpot_base_s x max(N / max_slots, Q / kv_budget_tokens) + tpot_per_seq_s x N)

replica-seconds, prefill, preemption and waiting aside. The KV term weighs each sample by its length squared:
with long-tailed lengths the cache, not ``max_slots``, limits the batch. (``metrics.ideal_step_time`` applies
the bound to a run's own batches at its own split.)

With a train step of ``train`` seconds (the trainer cannot go faster), ``W`` replicas of which ``E`` are
elastic (they yield while the trainer trains; colocated: all of them) and a step of ``tau`` seconds,
``D <= (W - E) x tau + E x (tau - train)``, so

    tau >= max(train, (D + E x train) / W)        (disaggregated: E = 0)

``fleet_bounds`` evaluates that for every split of the cluster the simulator accepts and gives the best one per
placement, with the trainer as configured (its data-parallel barrier over batches in dispatch order) and with a
perfectly balanced trainer (``fluid``, the strict bound: no split of a batch over replicas trains faster).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from statistics import fmean

from dora.config.sim import EngineSection, SimConfig, TrainerSection
from dora.sim.workload import from_section


@dataclass(frozen=True, slots=True)
class StepWork:
    """What one train step's batch asks of the fleet, as a mean over sampled batches."""

    samples: int
    response_tokens: float
    kv_token_steps: float
    """Q: the sum over samples of the KV context held at each of their decode steps."""
    batches: tuple[tuple[int, ...], ...]
    """Each sampled batch's sequences (prompt + response tokens) in dispatch order: what the trainer trains."""


@dataclass(frozen=True, slots=True)
class Bound:
    placement: str
    rollout_gpus: int
    elastic_gpus: int
    trainer_gpus: int
    decode_s: float
    """D / W: the step if rollout alone bound it."""
    train_s: float
    step_s: float


def kv_token_steps(length: int, prompt: int, budget: float = float("inf")) -> float:
    """KV tokens held over a sample's decode steps, prompt + j at its j-th (j = 0 .. length - 1), each counted
    up to ``budget``: a sequence whose context outgrows the cache decodes alone, a step of the whole budget."""
    if prompt + length - 1 <= budget:
        return length * prompt + length * (length - 1) / 2
    fits = max(0, int(budget - prompt) + 1)
    return fits * prompt + fits * (fits - 1) / 2 + (length - fits) * budget


def decode_replica_s(engine: EngineSection, tokens: float, kv_steps: float) -> float:
    """D: replica-seconds that decoding ``tokens`` tokens with ``kv_steps`` KV token-steps takes at the least."""
    steps = max(tokens / engine.max_slots, kv_steps / engine.kv_budget_tokens)
    return engine.tpot_scale * (engine.tpot_base_s * steps + engine.tpot_per_seq_s * tokens)


def step_work(cfg: SimConfig, batches: int = 16) -> StepWork:
    """The mean batch of ``cfg``'s workload over ``batches`` batches of consecutive groups. An episode counts as
    one sample of all its turns' tokens; the tool results it trains on count for the trainer, not in its KV
    (they only add context, so Q stays a lower bound), and its tool calls take no accelerator time."""
    if batches < 1:
        raise ValueError("batches must be >= 1")
    wl = from_section(cfg.workload, cfg.run.seed)
    b, g = cfg.core.train_groups, cfg.core.group_size
    tokens = kv = 0.0
    seqs: list[tuple[int, ...]] = []
    for k in range(batches):
        batch: list[int] = []
        for group in range(k * b, (k + 1) * b):
            p = wl.prompt_len(group)
            for i in range(g):
                ep = wl.episode(group, i, 1)
                n = ep.length
                tokens += n
                kv += kv_token_steps(n, p, cfg.engine.kv_budget_tokens)
                batch.append(p + n + sum(ep.observations))
        seqs.append(tuple(batch))
    return StepWork(samples=b * g, response_tokens=tokens / batches, kv_token_steps=kv / batches,
                    batches=tuple(seqs))  # fmt: skip


def train_step_s(trainer: TrainerSection, work: StepWork, gpus: int) -> float:
    """The mean train step (and its publish) over the sampled batches on ``gpus`` accelerators."""
    return fmean(trainer.batch_train_s(list(s), gpus) for s in work.batches) + trainer.publish_s


def step_bound(decode_s: float, workers: int, elastic: int, train_s: float) -> float:
    """tau >= max(train, (D + E x train) / W), with ``decode_s`` = D."""
    return max(train_s, (decode_s + elastic * train_s) / workers)


def splits(cfg: SimConfig) -> Iterable[tuple[str, int, int]]:
    """(placement, workers, elastic workers) of every split the simulator accepts."""
    cl, t = cfg.cluster, cfg.trainer
    g = cl.gpus_per_worker
    most = cl.total_gpus // g
    for w in range(1, most + 1):
        for e in range(0, w + 1):
            gpus = cl.total_gpus - (w - e) * g
            if gpus < 1 or t.replicas(gpus) < 1:
                continue
            placement = "disaggregated" if e == 0 else "colocated" if e == w == most else "elastic"
            yield placement, w, e


def fleet_bounds(cfg: SimConfig, work: StepWork, *, balanced: bool = False) -> dict[str, Bound]:
    """The lowest bound per placement (disaggregated, elastic, colocated) and over all of them (``best``).
    ``balanced``: the trainer splits every batch perfectly over its accelerators (``data_parallel = fluid``)."""
    trainer = replace(cfg.trainer, data_parallel="fluid") if balanced else cfg.trainer
    d = decode_replica_s(cfg.engine, work.response_tokens, work.kv_token_steps)
    g = cfg.cluster.gpus_per_worker
    train: dict[int, float] = {}
    best: dict[str, Bound] = {}
    for placement, w, e in splits(cfg):
        gpus = cfg.cluster.total_gpus - (w - e) * g
        if gpus not in train:
            train[gpus] = train_step_s(trainer, work, gpus)
        b = Bound(placement=placement, rollout_gpus=w * g, elastic_gpus=e * g, trainer_gpus=gpus, decode_s=d / w,
                  train_s=train[gpus], step_s=step_bound(d, w, e, train[gpus]))  # fmt: skip
        for key in (placement, "best"):
            if key not in best or b.step_s < best[key].step_s:
                best[key] = b
    return best
