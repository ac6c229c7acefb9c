"""The decision core alone, driven by a fleet of zero-latency workers: what each event costs the broker's core.

    python bench/core_fleet.py [--workers 1024] [--seconds 20] [--no-gc]

``bench/many_workers.py`` without sockets, peers or a broker process: the same training loop (dora mode, K = 2,
G = 8, B = 128, each worker one group of slots) fed straight to ``Core.handle``. A lease is answered at once with
its group's finished samples (the answers of each round arrive shuffled, as from many peers), an ``Assign`` with
``WeightsLoaded``, and a delivered batch with the next version's publish and the learner's next request. Nothing
but the core runs, so the times are its decisions: at a publish, re-pinning the idle fleet to the new version is
most of the work (an ``Assign`` each).

The broker's GC settings apply (``dora.broker.main.GC_THRESHOLDS``); ``--no-gc`` turns the collector off to time
the decisions alone. Prints, per event kind: count, mean, p99 and max in ms, and the total; the workers re-pinned
per publish. Run it alternately against another checkout to compare (``--tree``).
"""

from __future__ import annotations

import argparse
import collections
import gc
import pathlib
import random
import sys
import time

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--workers", type=int, default=1024)
p.add_argument("--group-size", type=int, default=8)
p.add_argument("--train-groups", type=int, default=128)
p.add_argument("--max-staleness", type=int, default=2)
p.add_argument("--seconds", type=float, default=20.0, help="wall-clock budget (the run also stops at --steps)")
p.add_argument("--steps", type=int, default=400)
p.add_argument("--no-gc", action="store_true", help="turn the cyclic collector off (decisions alone)")
p.add_argument("--tree", default=str(pathlib.Path(__file__).resolve().parents[1]),
               help="the checkout whose dora is measured (default: this one)")  # fmt: skip
args = p.parse_args()
sys.path.insert(0, args.tree)

from dora.broker.main import GC_THRESHOLDS  # noqa: E402
from dora.config import CoreConfig  # noqa: E402
from dora.core import events as ev  # noqa: E402
from dora.core.core import Core  # noqa: E402
from dora.ids import Mode  # noqa: E402


def main() -> int:
    g = args.group_size
    core = Core(CoreConfig(mode=Mode.DORA, max_staleness=args.max_staleness, train_groups=args.train_groups,
                           group_size=g, rollout_groups=args.train_groups), strict=False)  # fmt: skip
    queue: collections.deque = collections.deque(
        ev.WorkerJoined(worker_id=f"w{i:05d}", slots=g) for i in range(args.workers)
    )
    queue.append(ev.BatchRequested(step=0))
    answers: list = []
    rng = random.Random(0)
    times: dict[str, list[float]] = collections.defaultdict(list)
    repinned: list[int] = []
    steps = 0
    gc.freeze()
    if args.no_gc:
        gc.disable()
    else:
        gc.set_threshold(*GC_THRESHOLDS)
    stop = time.perf_counter() + args.seconds
    while steps < args.steps and time.perf_counter() < stop:
        if not queue:
            if not answers:
                print("the loop stalled: no event left to feed", file=sys.stderr)
                return 1
            rng.shuffle(answers)
            queue.extend(answers)
            answers.clear()
        event = queue.popleft()
        started = time.perf_counter()
        actions = core.handle(0.0, event)
        times[type(event).__name__].append(time.perf_counter() - started)
        if type(event) is ev.VersionPublished:
            repinned.append(sum(1 for a in actions if type(a) is ev.Pin))
        for a in actions:
            if type(a) is ev.Pin:
                queue.append(ev.VersionLoaded(worker_id=a.worker_id, version=a.version))
            elif type(a) is ev.Lease:
                answers.append(ev.ResultsReported(worker_id=a.worker_id, payloads=(None,) * a.n_samples, samples=tuple(
                    ev.SampleResult(group_id=a.group_id, attempt=a.attempt, index=i, segments=((a.version, 32),))
                    for i in range(a.n_samples))))  # fmt: skip
            elif type(a) is ev.DeliverBatch:
                steps += 1
                queue.extend([ev.VersionPublished(version=a.step + 1), ev.BatchRequested(step=a.step + 1)])
    print(
        f"core alone: {args.workers} workers, {steps} steps, GC {'off' if args.no_gc else 'on'}; "
        f"workers re-pinned per publish: mean {sum(repinned) / max(1, len(repinned)):.0f}"
    )
    print(f"{'event':18s} {'count':>8s} {'mean ms':>8s} {'p99 ms':>8s} {'max ms':>8s} {'total s':>8s}")
    for kind, ts in sorted(times.items()):
        ts.sort()
        print(f"{kind:18s} {len(ts):8d} {1e3 * sum(ts) / len(ts):8.3f} {1e3 * ts[int(0.99 * (len(ts) - 1))]:8.3f} "
              f"{1e3 * ts[-1]:8.3f} {sum(ts):8.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
