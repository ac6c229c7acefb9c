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
placement, with the trainer as configured or perfectly balanced (``fluid``). Only the balanced trainer gives a
strict bound: the configured one waits at each update for its busiest replica, and which sequences share a
replica depends on the order a schedule hands the batch over (``completion_order``), so with it the figure is
an estimate, given for batches in completion order and in dispatch order.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from statistics import fmean
from typing import Literal

from dora.config.sim import SimConfig, SimEngineSection, TrainerSection
from dora.sim.trainer import batch_train_s, publish_cost_s, replicas
from dora.sim.workload import Workload

Order = Literal["completion", "dispatch"]


@dataclass(frozen=True, slots=True)
class StepWork:
    """What one train step's batch asks of the fleet, as a mean over sampled batches."""

    samples: int
    response_tokens: float
    kv_token_steps: float
    """Q: the sum over samples of the KV context held at each of their decode steps."""
    batches: tuple[tuple[int, ...], ...]
    """Each sampled batch's sequences (prompt + response tokens), what the trainer trains, in completion order
    (``completion_order``): how a batch of one deadline's groups reaches the trainer."""
    dispatched: tuple[tuple[int, ...], ...]
    """The same batches in dispatch order (group by group, as the groups were drawn)."""
    group_size: int = 1
    """Sequences of a group, side by side in either order (the trainer keeps a group together where it can)."""

    def ordered(self, order: Order) -> tuple[tuple[int, ...], ...]:
        return self.batches if order == "completion" else self.dispatched


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


def decode_replica_s(engine: SimEngineSection, tokens: float, kv_steps: float) -> float:
    """D: replica-seconds that decoding ``tokens`` tokens with ``kv_steps`` KV token-steps takes at the least."""
    steps = max(tokens / engine.max_slots, kv_steps / engine.kv_budget_tokens)
    return engine.tpot_scale * (engine.tpot_base_s * steps + engine.tpot_per_seq_s * tokens)


def step_work(cfg: SimConfig, batches: int = 16) -> StepWork:
    """The mean batch of ``cfg``'s workload over ``batches`` batches of consecutive groups. An episode counts as
    one sample of all its turns' tokens; the tool results it trains on count for the trainer, not in its KV
    (they only add context, so Q stays a lower bound), and its tool calls take no accelerator time."""
    if batches < 1:
        raise ValueError("batches must be >= 1")
    wl = Workload(cfg.workload, cfg.run.seed)
    b, g = cfg.core.train_groups, cfg.core.group_size
    tokens = kv = 0.0
    seqs: list[tuple[int, ...]] = []
    dispatched: list[tuple[int, ...]] = []
    for k in range(batches):
        groups: list[tuple[int, list[int]]] = []
        for group in range(k * b, (k + 1) * b):
            p, longest, members = wl.prompt_len(group), 0, []
            for i in range(g):
                ep = wl.episode(group, i, 1)
                n = ep.length
                tokens += n
                kv += kv_token_steps(n, p, cfg.engine.kv_budget_tokens)
                members.append(p + n + sum(ep.observations))
                longest = max(longest, n)
            groups.append((longest, members))
        seqs.append(completion_order(groups))
        dispatched.append(tuple(x for _, members in groups for x in members))
    return StepWork(samples=b * g, response_tokens=tokens / batches, kv_token_steps=kv / batches,
                    batches=tuple(seqs), dispatched=tuple(dispatched), group_size=g)  # fmt: skip


def completion_order(groups: list[tuple[int, list[int]]]) -> tuple[int, ...]:
    """A batch's sequences in completion order, a group's samples together: the order in which the core hands
    one deadline's groups to the trainer (``dora.core.transfer``: by deadline, then completion). Groups dispatched
    together complete roughly in the order of their longest responses, so that is the order taken: ``groups``
    are (longest response, the group's sequences).

    The order prices a trainer that splits an update's sequences over its replicas by count: groups of like
    lengths side by side balance the replicas, groups in dispatch order do not. A batch of several deadlines
    (K > 0) is one such run per deadline, so a run's trainer falls between the two orders; the balanced
    trainer (``fluid``) is the bound no order beats."""
    return tuple(x for _, members in sorted(groups, key=lambda g: g[0]) for x in members)


def train_step_s(trainer: TrainerSection, work: StepWork, gpus: int, order: Order = "completion") -> float:
    """The mean train step (and what its publish adds, ``dora.sim.trainer.publish_cost_s``) over the sampled
    batches, in ``order``, on ``gpus`` accelerators."""
    train = fmean(batch_train_s(trainer, list(s), gpus, work.group_size) for s in work.ordered(order))
    return train + publish_cost_s(trainer, train)


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
            if gpus < 1 or replicas(t, gpus) < 1:
                continue
            placement = "disaggregated" if e == 0 else "colocated" if e == w == most else "elastic"
            yield placement, w, e


def fleet_bounds(cfg: SimConfig, work: StepWork, *, balanced: bool = False, order: Order = "completion"
                 ) -> dict[str, Bound]:  # fmt: skip
    """The lowest bound per placement (disaggregated, elastic, colocated) and over all of them (``best``), with
    the trainer pricing the sampled batches in ``order``. ``balanced``: the trainer splits every batch perfectly
    over its accelerators (``data_parallel = fluid``; then the order does not matter)."""
    trainer = replace(cfg.trainer, data_parallel="fluid") if balanced else cfg.trainer
    d = decode_replica_s(cfg.engine, work.response_tokens, work.kv_token_steps)
    g = cfg.cluster.gpus_per_worker
    train: dict[int, float] = {}
    best: dict[str, Bound] = {}
    for placement, w, e in splits(cfg):
        gpus = cfg.cluster.total_gpus - (w - e) * g
        if gpus not in train:
            train[gpus] = train_step_s(trainer, work, gpus, order)
        b = Bound(placement=placement, rollout_gpus=w * g, elastic_gpus=e * g, trainer_gpus=gpus, decode_s=d / w,
                  train_s=train[gpus], step_s=step_bound(d, w, e, train[gpus]))  # fmt: skip
        for key in (placement, "best"):
            if key not in best or b.step_s < best[key].step_s:
                best[key] = b
    return best
