"""Full-weight workers decide exactly as before multi-version workers were added to the core.

Each seed draws a configuration (mode, K, batch and group sizes, fleet, watermark, elastic workers, deadline
policy, drain bound) and a run of the property machine's own moves (decode, reports, loads, exports, yields,
kills, joins, restarts, lost leases, replays, timer and load triggers, the learner's requests, publishes and
crashes), then drains it to the end. Every action the core returns is folded into one digest per seed.

``core_replay.json`` holds the digests the core made before it knew of multi-version workers (commit 67f773d):
made with ``python -m tests.unit.test_core_replay --write`` in a checkout of that commit (with this file and the
harness ``tests/unit/machine.py`` of that commit). With every worker holding one version, the core must return
the same actions, in the same order, for every seed.

One digest was made again since, for a bug that seed runs into: seed 271 (partial mode, adaptive deadlines, an
elastic worker) made ``c9dac844...`` until the core stopped moving a deadline while an elastic worker of a partial
run holds a running group, which its yield pauses through the step (``tests/unit/test_adaptive_deadlines.py``).
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import random
import re
import sys

from dora.config import CoreConfig
from dora.core.events import Action, LoadReported, Tick, WorkerJoined
from dora.ids import Mode
from dora.sim.workload import Workload
from tests.unit.machine import Harness, together

GOLDEN = pathlib.Path(__file__).with_name("core_replay.json")
SEEDS = range(400)
MOVES = 300


DIGESTED_AS = {
    "Pin": "Assign",
    "Lend": "Yield",
    "Reclaim": "Resume",
    "ExportGroup": "MigrateOut",
    "ImportGroup": "MigrateIn",
    "Revoke": "Cancel",
    "ReadyGroup": "TrainGroup",
    "ReadySample": "TrainSample",
}
"""The core's action types (and the batch's group and sample types inside them) by the names they had when the
digests were made: a digest folds in each type's name, so a renamed type is folded in under its old one."""
_RENAMED = re.compile(r"\b(" + "|".join(DIGESTED_AS) + r")\(")


def canonical(action: Action) -> str:
    """An action's kind and fields. Left out: a migration's exported state (the world's objects, not a decision)
    and fields added since the digests were made while they hold their default (a worker keeping no version)."""
    fields = {}
    for name in action.__slots__:  # type: ignore[union-attr]  (every action is a slotted dataclass)
        value = getattr(action, name)
        if name == "state" or (name == "keep" and value == ()):
            continue
        fields[name] = value
    kind = type(action).__name__
    text = f"{DIGESTED_AS.get(kind, kind)}{sorted(fields.items())!r}"
    return _RENAMED.sub(lambda m: DIGESTED_AS[m[1]] + "(", text)


class Recorder(Harness):
    def __post_init__(self) -> None:
        super().__post_init__()
        self.digest = hashlib.sha256()

    def feed(self, event):  # type: ignore[override]
        actions = super().feed(event)
        for a in actions:
            self.digest.update(canonical(a).encode())
        return actions


def trace(seed: int) -> dict[str, object]:
    rng = random.Random(seed)
    group_size = rng.randint(1, 3)
    cfg = CoreConfig(
        deadlines=rng.choice(["fixed", "adaptive"]),
        drain_load=rng.choice([0, 0, 1, 2, 4]),
        mode=rng.choice([Mode.DORA, Mode.PARTIAL, Mode.ONE_STEP, Mode.SYNC, Mode.DORA]),
        max_staleness=rng.randint(0, 3),
        train_groups=rng.randint(1, 3),
        group_size=group_size,
        total_steps=rng.randint(2, 6),
        rollout_groups=rng.choice([None, rng.randint(1, 8)]),
    )
    h = Recorder(
        cfg=cfg,
        slots=rng.randint(1, 3) * group_size,
        workload=Workload.lognormal(
            median=8,
            sigma=rng.uniform(0.2, 2.0),
            difficulty_sigma=0.7,
            cap=200,
            seed=rng.randint(0, 2**16),
            prompt_tokens=4,
        ),
    )
    world = h.world
    for _ in range(rng.randint(1, 5)):
        h.feed(world.join(h.slots, elastic=rng.random() < 0.4))
    for _ in range(MOVES):
        _move(h, rng)
    h.drain()
    h.check_end()
    return {"digest": h.digest.hexdigest(), "events": h.events, "steps": world.learner.steps}


def _move(h: Recorder, rng: random.Random) -> None:
    world, lr = h.world, h.world.learner
    alive = world.alive_workers()
    move = rng.choice(["decode", "report", "load", "export", "yield", "kill", "join", "restart", "replay",
                       "lose", "tick", "kv", "request", "publish", "crash"])  # fmt: skip
    if move in ("decode", "report"):
        live = [w for w in alive if w.requests]
        if live:
            done = world.decode(rng.choice(live).worker_id, rng.randint(1, 40))
            if move == "decode":
                h.feed_all(done)
            elif done:
                h.feed(together(done))
    elif move == "load" and (loading := [w for w in alive if w.loading is not None]):
        h.feed(world.finish_load(rng.choice(loading).worker_id))
    elif move == "export" and (exporting := [w for w in alive if w.exporting]):
        w = rng.choice(exporting)
        h.feed(world.finish_export(w.worker_id, next(iter(w.exporting))))
    elif move == "yield" and (yielding := [w for w in alive if w.yield_pending]):
        h.feed(world.finish_yield(rng.choice(yielding).worker_id))
    elif move == "kill" and alive:
        h.feed(world.kill(rng.choice(alive).worker_id))
    elif move == "join" and len(alive) < 6:
        h.feed(world.join(h.slots, elastic=rng.random() < 0.4))
    elif move == "restart" and alive:
        w = rng.choice(alive)
        w.engine.clear()
        w.exporting.clear()
        w.loaded = w.loading = None
        w.yielded = w.yield_pending = False
        w.resume_debt = 0
        h.feed(WorkerJoined(worker_id=w.worker_id, slots=w.slots, elastic=w.elastic))
    elif move == "replay" and world.sent:
        h.feed(rng.choice(world.sent))
    elif move == "lose":
        held = sorted({(w.worker_id, r.group_id, r.attempt) for w in alive for r in w.requests}
                      | {(w.worker_id, g, a) for w in alive for g, (a, _) in w.exporting.items()})  # fmt: skip
        if held:
            h.feed(world.lose_lease(*rng.choice(held)))
    elif move == "tick":
        h.feed(Tick())
    elif move == "kv" and alive:
        h.feed(LoadReported(worker_id=rng.choice(alive).worker_id, kv_use=rng.random()))
    elif move == "request" and not lr.waiting and lr.batch is None and not lr.finished:
        h.feed(world.request_batch())
    elif move == "publish" and lr.batch is not None:
        h.feed(world.publish())
    elif move == "crash" and lr.batch is not None:
        h.feed(world.crash_learner())


def test_full_weight_workers_decide_exactly_as_before_multi_version_workers_existed():
    golden = json.loads(GOLDEN.read_text())
    assert len(golden) == len(SEEDS)
    changed = [seed for seed in SEEDS if trace(seed) != golden[str(seed)]]
    assert not changed, f"the core decides differently for seeds {changed[:10]} ({len(changed)} of {len(SEEDS)})"


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    GOLDEN.write_text(json.dumps({str(s): trace(s) for s in SEEDS}, indent=0) + "\n")
