"""Discrete-event simulation: the production core driven by the world model on a virtual clock.

The core (``dora.core.core.Core``) makes every decision; this module only advances time:

- **Rollout.** Each worker is one engine replica (``dora.sim.engine``): a decode step of ``n`` running
  sequences takes ``tpot_base_s + tpot_per_seq_s * n``; prefill (new requests, re-prefill after a
  weight swap or a migration without KV) costs ``prefill_s_per_token`` and stalls that replica's
  decoding; a version change costs ``load_s``; a migration ships ``kv_bytes_per_token`` per token of
  context at ``transfer_bytes_per_s`` (or nothing, then the target re-prefills).
- **Trainer.** A batch of ``T`` tokens trains for ``step_fixed_s + T * gpu_s_per_token / trainer_gpus``;
  or, with ``trainer.data_parallel`` other than fluid, in ``updates_per_step`` updates, each as long as its
  busiest data-parallel replica (a barrier per update: the fewer sequences a replica gets, the more a long one
  makes the others wait, a cost that grows with the fleet). Then it writes the version (``trainer.write_s``:
  ``publish_s``, or ``weights_gb x write_s_per_gb``) and publishes it. With ``trainer.overlap_publish`` the step
  ends once the version is copied aside (``snapshot_s``): the learner asks for the next batch at once and a
  ``WriteDone`` publishes the version ``write_s`` later. One write is in flight at most: a step that ends before
  it waits for it, then copies. The core decides when the early batch may go (K = 0: not before the publish, as
  its groups need the new version; with elastic workers: held until the publish).
- **Tools.** An agentic episode that ends a turn waits ``tools_s`` seconds of wall clock on its tool
  call (also while a colocated fleet trains: tools run on CPUs), holding its lease but no decode slot;
  then its observation tokens are prefilled (its whole context too without a KV cache) and its next
  turn queues on whichever worker holds it by then. The trainer trains observation tokens as context.
- **Placement.** Rollout workers are standalone (always roll out) or elastic (roll out while the trainer
  waits for a batch, yield their accelerators for each train step). The core decides the yields
  (``dora.core.core``): elastic workers hand running groups to standalone peers of their version, the
  rest pause, and the batch starts training once all have yielded; after the publish they come back.
  ``colocated``: every accelerator is an elastic worker. ``disaggregated``: ``rollout_gpus`` are
  standalone workers and the rest train. ``elastic``: ``elastic_gpus`` of the rollout workers are
  elastic, the others standalone; the trainer has the elastic accelerators plus any not rolling out.
- **LoRA** (``lora.rank`` > 0; ``dora.sim.lora`` derives every cost): a version is an adapter. A worker takes a
  new one in ``adapter_bytes / transfer_bytes_per_s + lora.load_fixed_s`` and, holding ``K + 1`` versions (every
  mode but partial and drop_stale), keeps decoding the versions it keeps meanwhile; the trainer's per-token time is
  multiplied by the training cost factor and its publish scaled to the adapter's bytes.
- **Role switches** (``cluster.host_link_bytes_per_s``; free when 0). A yield offloads the replica's
  weights (``engine.weight_bytes``) and the KV of what it holds (or drops it, ``engine.yield_kv``) to
  host memory; coming back costs ``engine.wake_s`` plus loading them back (resume, same version) or
  ``load_s`` (assigned the newest). A trainer that shares its accelerators loads its state
  (``trainer.state_bytes``, split over its accelerators) before each step and offloads it after.

Between two events a replica's batch is constant, so its progress is exact (no time stepping).
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import fields

from dora.config import ConfigError
from dora.config.sim import Placement, SimConfig
from dora.core.core import Core
from dora.core.events import (
    Action,
    DeliverBatch,
    Event,
    ExportGroup,
    ImportGroup,
    Lease,
    Lend,
    Pin,
    ReadySample,
    Reclaim,
    Revoke,
    Tick,
)
from dora.ids import Mode, WorkerId
from dora.sim import lora
from dora.sim.agenda import (
    Agenda,
    DecodeDue,
    ExportDone,
    Kill,
    LoadDone,
    Restart,
    TickDue,
    Timer,
    ToolDone,
    TrainDone,
    WriteDone,
    YieldDone,
)
from dora.sim.bounds import kv_token_steps
from dora.sim.engine import Request, decode_step_s
from dora.sim.outcome import Counts, Occupancy, Outcome, StepRecord, Timeline, Totals
from dora.sim.trainer import batch_train_s, replicas
from dora.sim.workload import Workload
from dora.sim.world import World


def split(
    cfg: SimConfig, placement: Placement, rollout_gpus: int | None, elastic_gpus: int | None
) -> tuple[int, int, int]:
    """The placement's split of the cluster: (rollout workers, the elastic ones among them, the trainer's
    accelerators); ``rollout_gpus`` and ``elastic_gpus`` override the config's. A split that leaves either side
    nothing raises ``ConfigError``."""
    cl = cfg.cluster
    g = cl.gpus_per_worker
    if placement == "colocated":
        n_workers = n_elastic = cl.total_gpus // g
    elif placement == "elastic":
        n_workers = (rollout_gpus or cl.rollout_gpus or cl.total_gpus) // g
        eg = elastic_gpus or cl.elastic_gpus or n_workers * g // 2
        n_elastic = min(n_workers, eg // g)
    else:
        rg = rollout_gpus or cl.rollout_gpus or cl.total_gpus // 2
        n_workers, n_elastic = max(1, rg // g), 0
    trainer_gpus = cl.total_gpus - (n_workers - n_elastic) * g
    if trainer_gpus < 1 or n_workers < 1:
        raise ConfigError(f"no accelerator left to train or to roll out: {n_workers} workers of {g} GPUs, "
                          f"{n_elastic} elastic, of {cl.total_gpus}")  # fmt: skip
    if replicas(cfg.trainer, trainer_gpus) < 1:
        raise ConfigError(f"the trainer's {trainer_gpus} accelerators make no data-parallel replica of "
                          f"trainer.model_parallel_gpus = {cfg.trainer.model_parallel_gpus}")  # fmt: skip
    return n_workers, n_elastic, trainer_gpus


class Simulation:
    """One run of one mode on one configuration."""

    def __init__(
        self,
        cfg: SimConfig,
        mode: Mode,
        *,
        rollout_gpus: int | None = None,
        elastic_gpus: int | None = None,
        deaths: tuple[tuple[float, int], ...] | None = None,
        strict: bool = False,
        timeline: bool = False,
    ) -> None:
        self.cfg = lora.priced(cfg.for_mode(mode))
        self.costs = lora.costs(self.cfg)
        self.mode = mode
        self.placement = cfg.cluster.placement_of(mode)
        self.n_workers, self.n_elastic, self.trainer_gpus = split(cfg, self.placement, rollout_gpus, elastic_gpus)
        self._price_role_switches(cfg)
        self.eng = cfg.engine
        self.core = Core(self.cfg.core, strict=strict)
        self.world = self._make_world(cfg)
        self.now = 0.0
        self._agenda = Agenda()
        self._inbox: deque[Event] = deque()
        """Events the core is yet to handle at ``now``."""
        self._touched: set[WorkerId] = set()
        """Workers to reschedule once the inbox is empty."""
        self._feeding = False
        self._last: dict[WorkerId, float] = {}
        """When each worker was last brought up to ``now``."""
        self._debt_s: dict[WorkerId, float] = {}
        """Seconds of prefill each worker pays before it decodes again."""
        self._epoch: dict[WorkerId, int] = {}
        """Each worker's reschedulings: a ``DecodeDue`` of an earlier one is stale."""
        self._offloaded: dict[WorkerId, float] = {}
        """Bytes a yielded worker put in host memory (weights, held KV), loaded back when it resumes."""
        self.occupancy = Occupancy()
        self.counts = Counts()
        self._training = False
        self._write_until: float | None = None
        """When the version being written in the background is durable (None: no write in flight)."""
        self._acct_t = 0.0
        self.totals = Totals()
        self.totals_at_step: list[Totals] = []
        self.steps: list[StepRecord] = []
        self._trained_samples: list[list[ReadySample]] = []
        self.timeline = Timeline() if timeline else None
        self._faults_at_step = self._plan_faults(cfg, deaths)

    def _price_role_switches(self, cfg: SimConfig) -> None:
        link = cfg.cluster.host_link_bytes_per_s
        self.worker_link = link * cfg.cluster.gpus_per_worker
        """Host-memory bytes/s of one replica (0: role switches are free)."""
        state = self.cfg.trainer.state_bytes
        self.switch_s = 2 * state / (self.trainer_gpus * link) if link and self.n_elastic else 0.0
        """The trainer's state onto its shared accelerators before a step and off them after it."""

    def _make_world(self, cfg: SimConfig) -> World:
        world = World(
            group_size=self.cfg.core.group_size, train_groups=self.cfg.core.train_groups,
            max_staleness=self.cfg.core.staleness, workload=Workload(cfg.workload, cfg.run.seed),
            mixed_versions_allowed=self.cfg.core.in_flight_swap, max_running=self.eng.max_slots,
            kv_budget_tokens=self.eng.kv_budget_tokens, kv_transfer=self.eng.kv_transfer, keep_kv=self.eng.keep_kv,
            yield_kv=self.eng.yield_kv,
        )  # fmt: skip
        world.before_change = self._advance
        world.on_turn_end = self._tool_call
        return world

    def _plan_faults(
        self, cfg: SimConfig, deaths: tuple[tuple[float, int], ...] | None
    ) -> dict[int, list[tuple[float, int]]]:
        """Kills at the times given (``deaths``), or else ``run.faults`` kills after train steps (returned)."""
        for t, idx in deaths or ():
            self._agenda.at(t, Kill(idx))
        return self.fault_schedule(cfg) if deaths is None else {}

    @staticmethod
    def fault_schedule(cfg: SimConfig) -> dict[int, list[tuple[float, int]]]:
        """``run.faults`` kills, the same for every mode: {step: [(seconds after that step's batch, victim)]}."""
        rng = random.Random(cfg.run.seed)
        plan: dict[int, list[tuple[float, int]]] = {}
        for _ in range(cfg.run.faults):
            plan.setdefault(rng.randrange(cfg.run.steps), []).append((rng.uniform(0, 60), rng.randrange(1 << 30)))
        return plan

    # ------------------------------------------------------------------ plumbing

    def _feed(self, event: Event | None) -> None:
        """Hand an event to the core; events it causes at the same instant are queued, not nested."""
        if event is not None:
            self._inbox.append(event)
        if self._feeding:
            return
        self._feeding = True
        try:
            while self._inbox or self._touched:
                while self._inbox:
                    started = time.perf_counter()
                    actions = self.core.handle(self.now, self._inbox.popleft())
                    self.counts.decision_s += time.perf_counter() - started
                    self.world.apply(actions)
                    self._react(actions)
                    self.counts.max_live_versions = max(self.counts.max_live_versions, len(self.core.view.alive()))
                touched, self._touched = self._touched, set()
                for w in sorted(touched):
                    self._reschedule(w)
        finally:
            self._feeding = False

    def _react(self, actions: list[Action]) -> None:
        for a in actions:
            match a:
                case Lease() | ImportGroup() | Revoke():
                    self._touched.add(a.worker_id)
                case Pin():
                    c = self.counts
                    c.loads += 1
                    c.load_s += self.costs.load_s
                    c.load_bytes += self.costs.load_bytes
                    c.keeping_assigns += bool(a.keep)
                    c.max_versions_held = max(c.max_versions_held, len(set(a.keep) | {a.version}))
                    done = self.now + self._woken(a.worker_id) + self.costs.load_s
                    self._agenda.at(done, LoadDone(a.worker_id, a.version))
                    self._touched.add(a.worker_id)
                case Lend():
                    self.counts.yields += 1
                    w = self.world.workers[a.worker_id]
                    held = w.engine.kv_used() + w.engine.parked_kv if self.eng.yield_kv == "offload" else 0.0
                    self._offloaded[a.worker_id] = self.eng.weight_bytes + held * self.eng.kv_bytes_per_token
                    self._agenda.at(self.now + self._over_link(self._offloaded[a.worker_id]), YieldDone(a.worker_id))
                    self._touched.add(a.worker_id)
                case Reclaim():
                    back = self._woken(a.worker_id) + self._over_link(self._offloaded.pop(a.worker_id, 0.0))
                    self._agenda.at(self.now + back, LoadDone(a.worker_id, a.version))
                    self._touched.add(a.worker_id)
                case ExportGroup():
                    w = self.world.workers[a.worker_id]
                    reqs = w.exporting.get(a.group_id, (0, []))[1]
                    tokens = sum(r.context for r in reqs if r.has_kv or r.turn == 0)  # no cache, nothing to ship
                    ship = (
                        tokens * self.eng.kv_bytes_per_token / self.eng.transfer_bytes_per_s
                        if self.eng.kv_transfer
                        else 0.0
                    )
                    self._agenda.at(self.now + ship, ExportDone(a.worker_id, a.group_id))
                    self._touched.add(a.worker_id)
                case DeliverBatch(redelivery=False):
                    self._start_training(a)

    def _over_link(self, nbytes: float) -> float:
        return nbytes / self.worker_link if self.worker_link else 0.0

    def _woken(self, worker: WorkerId) -> float:
        """The wake-up a worker coming back from a yield pays before its load (0 for any other load)."""
        w = self.world.workers[worker]
        if not w.woken:
            return 0.0
        w.woken = False
        return self.eng.wake_s

    def _start_training(self, batch: DeliverBatch) -> None:
        lengths = [sum(n for _, n in s.segments) for g in batch.groups for s in g.samples]
        sequences = [self.world.workload.prompt_len(g.group_id) + sum(n for _, n in s.segments)
                     for g in batch.groups for s in g.samples]  # fmt: skip
        turns = 0
        if self.world.workload.multi_turn:  # tool results are trained as context (loss-masked)
            i = 0
            for g in batch.groups:
                for s in g.samples:
                    n, obs = self.world.episodes.pop((g.group_id, s.payload, s.index))
                    turns += n
                    sequences[i] += obs
                    i += 1
        longest = max(lengths, default=0)
        budget, prompt = self.eng.kv_budget_tokens, self.world.workload.prompt_len
        kv = sum(kv_token_steps(sum(n for _, n in s.segments), prompt(g.group_id), budget)
                 for g in batch.groups for s in g.samples)  # fmt: skip
        rec = StepRecord(step=batch.step, delivered_s=self.now, tokens=sum(sequences),
                         response_tokens=sum(lengths), episodes=len(lengths), turns=turns,
                         bubble=(longest - sum(lengths) / len(lengths)) / longest if longest else 0.0,
                         train_s=batch_train_s(self.cfg.trainer, sequences, self.trainer_gpus,
                                               self.cfg.core.group_size),
                         kv_token_steps=kv)  # fmt: skip
        self.steps.append(rec)
        for delay, victim in self._faults_at_step.get(batch.step, ()):
            self._agenda.at(self.now + delay, Kill(victim))
        self._account()
        self._training = True
        self._agenda.at(self._step_ends_at(rec.train_s), TrainDone())

    def _step_ends_at(self, train_s: float) -> float:
        """When a step that computes ``train_s`` from now ends: with its write in line, or, overlapped, with its
        copy aside, after the previous version's write if that is still running (one write in flight)."""
        tr = self.cfg.trainer
        trained = self.now + train_s + self.switch_s
        if not tr.overlap_publish:
            return trained + tr.write_s
        return max(trained, self._write_until or 0.0) + tr.snapshot_s

    def _account(self) -> None:
        dt = self.now - self._acct_t
        if dt > 0:
            t = self.totals
            t.t += dt
            n = self.occupancy
            active = n.n_busy > 0
            t.rollout_active_s += dt * active
            t.rollout_only_s += dt * (active and not self._training)
            t.trainer_busy_s += dt * self._training
            t.slot_s += dt * n.n_running
            t.tool_wait_s += dt * n.n_parked
            t.busy_worker_s += dt * n.n_busy
            t.capacity_s += dt * n.n_serving * self.eng.max_slots
        self._acct_t = self.now

    def _decoding(self, worker: WorkerId) -> bool:
        return self.world.workers[worker].decoding

    def _advance(self, worker: WorkerId) -> None:
        """Bring one worker up to ``now``: pay prefill debt, then decode; finished samples go to the inbox."""
        last = self._last.get(worker, self.now)
        self._last[worker] = self.now
        w = self.world.workers[worker]
        if w.prefill_debt:
            self._debt_s[worker] = self._debt_s.get(worker, 0.0) + w.prefill_debt * self.eng.prefill_s_per_token
            w.prefill_debt = 0
        if not self._decoding(worker):
            return
        dt = max(0.0, self.now - last)
        debt = self._debt_s.get(worker, 0.0)
        pay = min(debt, dt)
        self._debt_s[worker] = debt - pay if debt - pay > 1e-9 else 0.0
        if self._debt_s[worker]:
            return
        steps = (dt - pay) / decode_step_s(self.eng, len(w.engine.running))
        if w.loading is not None:
            self.counts.tokens_decoded_while_loading += steps * len(w.engine.running)
        done = self.world.decode(worker, steps + 1e-9)  # the epsilon also settles a request due right now
        if done or steps > 0:
            self._inbox.extend(done)
            self._touched.add(worker)

    def _reschedule(self, worker: WorkerId) -> None:
        self._advance(worker)
        self._account()
        self._refresh(worker)
        self._epoch[worker] = self._epoch.get(worker, 0) + 1
        if not self._decoding(worker):
            return
        w = self.world.workers[worker]
        steps = w.engine.steps_to_next()
        if steps is None:
            return
        t = self.now + self._debt_s.get(worker, 0.0) + steps * decode_step_s(self.eng, len(w.engine.running))
        self._agenda.at(t, DecodeDue(worker, self._epoch[worker]))

    def _refresh(self, worker: WorkerId) -> None:
        """Keep the fleet-wide counts (and the timeline) in step with one worker's state."""
        w = self.world.workers[worker]
        running = len(w.engine.running) if self._decoding(worker) else 0
        self.occupancy.update(worker, running, len(w.engine.parked), w.alive and not w.yielded)
        if self.timeline is not None:
            kind = ("dead" if not w.alive else "train" if w.yielded else "load" if w.loading is not None
                    else "busy" if len(w.engine) else "idle")  # fmt: skip
            version = w.loading if w.loading is not None else (w.loaded if w.loaded is not None else -1)
            self.timeline.note(worker, self.now, version, kind)

    def _tool_call(self, worker: WorkerId, r: Request) -> None:
        """An episode ended a turn on ``worker``: its tool answers after the call's seconds of wall clock."""
        self._agenda.at(self.now + r.tools_s[r.turn - 1], ToolDone(r))
        self._touched.add(worker)

    # ------------------------------------------------------------------ run

    def run(self, max_events: int = 50_000_000) -> Outcome:
        for i in range(self.n_workers):  # standalone workers first (join order breaks the core's ties)
            self._feed(self.world.join(self.eng.credit, elastic=i >= self.n_workers - self.n_elastic,
                                       holds=self.costs.holds))  # fmt: skip
        self._feed(self.world.request_batch())
        self._agenda.at(self.cfg.run.tick_s, TickDue())
        for _ in range(max_events):
            if self.world.learner.finished or not self._agenda or not self._agenda.pending:
                break
            self.now, timer = self._agenda.pop()
            self._account()
            self._fire(timer)
        if not self.world.learner.finished:
            raise RuntimeError(f"simulation of {self.mode.value} stopped at step {self.core.step}: deadlock")
        self._account()
        if self.timeline is not None:
            for w in self.world.workers:
                self._refresh(w)
                self.timeline.close(w, self.now)
        return self._outcome()

    def _outcome(self) -> Outcome:
        lr = self.world.learner
        view = self.core.view
        totals, filtered = view.totals(), view.filtered()
        c = self.counts
        trained_lengths = [sum(n for _, n in s.segments) for b in self._trained_samples for s in b]
        return Outcome(
            mode=self.mode, staleness_bound=self.cfg.core.staleness, placement=self.placement,
            rollout_workers=self.n_workers, trainer_gpus=self.trainer_gpus, elastic_workers=self.n_elastic,
            wall_s=self.now, steps=self.steps,
            totals_at_step=self.totals_at_step, staleness=lr.staleness, c1_violations=lr.c1_violations,
            mixed_version_trajectories=lr.mixed_version_trajectories, trained=list(lr.trained),
            dropped_lengths=[sum(n for _, n in s.segments) for g in view.dropped() for s in g.samples],
            trained_lengths=trained_lengths, groups_dispatched=totals.dispatched,
            groups_in_flight=totals.in_flight + totals.finished_waiting, groups_filtered=len(filtered),
            filtered_tokens=sum(self.world.workload.length(g, i, self.world.attempts[g]) for g in filtered
                                for i in range(self.cfg.core.group_size)),
            migrated_groups=totals.migrated_groups, migrated_requests=totals.migrated_requests,
            reprefill_tokens=self.world.reprefill_tokens, requeued=totals.requeued,
            rebalances=self.core.rebalances, worker_moves=c.loads,
            preemptions=sum(w.engine.preemptions for w in self.world.workers.values()),
            timeline=self.timeline.spans if self.timeline else {},
            resume_prefill_tokens=sum(w.engine.resume_prefill for w in self.world.workers.values()),
            kv_evictions=sum(w.engine.evictions for w in self.world.workers.values()),
            **{f.name: getattr(c, f.name) for f in fields(Counts)},
        )  # fmt: skip

    def _fire(self, timer: Timer) -> None:
        match timer:
            case DecodeDue(worker, epoch):
                if self._epoch.get(worker) == epoch:
                    self._touched.add(worker)  # rescheduling catches its clock up first
                    self._feed(None)
            case LoadDone(worker, version):
                w = self.world.workers[worker]
                if w.alive and w.loading == version:
                    self._advance(worker)
                    self._feed(self.world.finish_load(worker))
                    self._touched.add(worker)
                    self._feed(None)
            case YieldDone(worker):
                w = self.world.workers[worker]
                if w.alive and w.yield_pending:
                    self._advance(worker)
                    self._feed(self.world.finish_yield(worker))
            case ExportDone(worker, group):
                w = self.world.workers[worker]
                if w.alive and group in w.exporting:
                    self._feed(self.world.finish_export(worker, group))
            case ToolDone(request):
                holder = self.world.tool_returned(request)
                if holder is not None:
                    self._touched.add(holder)
                    self._feed(None)
            case TrainDone():
                self._finish_training()
            case WriteDone():
                self._write_until = None
                self._publish()
            case TickDue():
                for w in self.world.alive_workers():
                    self._touched.add(w.worker_id)
                self._feed(Tick())
                self._agenda.at(self.now + self.cfg.run.tick_s, TickDue())
            case Kill(victim):
                self._kill(victim)
            case Restart(elastic):  # a restarted worker, in the role it had
                self._feed(self.world.join(self.eng.credit, elastic=elastic, holds=self.costs.holds))

    def _kill(self, victim: int) -> None:
        live = self.world.alive_workers()
        if live:
            w = live[victim % len(live)]
            self._advance(w.worker_id)
            self._feed(self.world.kill(w.worker_id))
            self._touched.add(w.worker_id)
            self._agenda.at(self.now + self.cfg.run.restart_s, Restart(w.elastic))
            self._feed(None)

    def _finish_training(self) -> None:
        """The step is over: its version is published, or, overlapped, its write starts and the learner asks for
        the next batch before the version is out (``World.finish_training``)."""
        batch = self.world.learner.batch
        assert batch is not None
        self._trained_samples.append([s for g in batch.groups for s in g.samples])
        self._training = False
        if not self.cfg.trainer.overlap_publish:
            self._publish()
            return
        self.world.finish_training()
        self._write_until = self.now + self.cfg.trainer.write_s
        self._agenda.at(self._write_until, WriteDone())
        self._feed(self.world.request_batch())
        self._feed(None)

    def _publish(self) -> None:
        """The version is durable: it is published (a step boundary of the measured window), and a learner that
        neither waits for a batch nor trains one (overlapped, the next may be in training already) asks for one."""
        lr = self.world.learner
        done = lr.writing or lr.batch
        assert done is not None
        next(r for r in reversed(self.steps) if r.step == done.step).published_s = self.now
        self.totals_at_step.append(Totals(*(getattr(self.totals, f) for f in Totals.__slots__)))
        self._feed(self.world.publish())
        if not lr.finished and not lr.waiting and lr.batch is None:
            self._feed(self.world.request_batch())
        self._feed(None)
