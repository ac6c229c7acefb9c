"""The broker journal: replay after a crash, and a core rebuilt from it."""

from __future__ import annotations

import pytest

from dora.broker.journal import RESERVE_BLOCK, Journal, JournalError, replay
from dora.config import CoreConfig
from dora.core import events as ev
from dora.core.core import Core
from dora.ids import Finish, WorkerId
from tests.unit.machine import finished

STEP1 = '{"kind":"step","version":1,"uri":"u","sha256":"s","groups":[1]}'
SHAPE = {"mode": "dora", "max_staleness": 1, "train_groups": 2, "group_size": 2}


def test_a_missing_journal_is_a_fresh_run(tmp_path):
    r = replay(tmp_path / "none.jsonl")
    assert (r.newest, r.weights, r.trained, r.reserved, r.owed) == (0, None, set(), 0, [])


def test_replay_gives_the_newest_weights_the_trained_groups_and_what_is_owed(tmp_path):
    j = Journal(tmp_path / "j.jsonl")
    j.start(7, SHAPE, 0)
    j.reserve_through(3)  # ids below 3 are about to leave: a block is reserved at once
    assert j.reserved == 3 + RESERVE_BLOCK
    j.reserve_through(10)  # still inside the block: no record
    j.step(1, "file:///s/v1", "a" * 64, [2, 0])
    j.step(2, "file:///s/v2", "b" * 64, [5, 1])
    j.close()
    r = replay(tmp_path / "j.jsonl")
    assert r.newest == 2 and r.weights == ("file:///s/v2", "b" * 64) and r.epochs == [7] and r.shape == SHAPE
    assert r.trained == {0, 1, 2, 5} and r.reserved == 3 + RESERVE_BLOCK
    assert r.owed[:4] == [3, 4, 6, 7] and len(r.owed) == r.reserved - 4


def test_a_torn_last_line_is_ignored_and_a_bad_line_before_it_is_an_error(tmp_path):
    path = tmp_path / "j.jsonl"
    j = Journal(path)
    j.start(1, SHAPE, 0)
    j.step(1, "u", "s", [0, 1])
    j.close()
    with open(path, "ab") as f:
        f.write(b'{"kind":"step","version":2,"ur')  # the crash came mid-write
    assert replay(path).newest == 1
    path.write_bytes(b'{"kind":"start","epoch":1}\nnot json\n{"kind":"reserve","cursor":4}\n')
    with pytest.raises(JournalError, match=":2: unreadable"):
        replay(path)


@pytest.mark.parametrize(
    ("lines", "words"),
    [
        (['{"kind":"step","version":2,"uri":"u","sha256":"s","groups":[1]}'], "version 2 follows 0"),
        ([STEP1, STEP1.replace('"version":1', '"version":2')], "trained twice"),
        (['{"kind":"launch"}'], "unknown record kind"),
    ],
)
def test_an_impossible_journal_is_refused(tmp_path, lines, words):
    path = tmp_path / "j.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(JournalError, match=words):
        replay(path)


def test_a_rebuilt_core_hands_out_what_it_owes_first_then_fresh_groups():
    cfg = CoreConfig(mode="dora", max_staleness=1, train_groups=2, group_size=2, total_steps=5)
    core = Core(cfg, initial_version=3, start_cursor=10, strict=True)  # strict: every invariant after every event
    core.restore([4, 7, 9])
    w = WorkerId("w")
    out = core.handle(0.0, ev.WorkerJoined(worker_id=w, slots=64))
    out += core.handle(0.1, ev.VersionLoaded(worker_id=w, version=3))
    leased = [a for a in out if isinstance(a, ev.Lease)]
    # the owed groups first, on the newest version; fresh ids (from the cursor on) only after them
    assert [(a.group_id, a.version) for a in leased][:3] == [(4, 3), (7, 3), (9, 3)]
    assert [a.group_id for a in leased[3:]] == list(range(10, 10 + len(leased) - 3))
    for a in leased:
        for i in range(2):
            core.handle(1.0, finished(worker_id=w, group_id=a.group_id, attempt=a.attempt, index=i,
                                               segments=((3, 3),), finish=Finish.STOP))  # fmt: skip
    [batch] = [a for a in core.handle(2.0, ev.BatchRequested(step=3)) if isinstance(a, ev.DeliverBatch)]
    assert batch.step == 3 and len(batch.groups) == 2
    out = core.handle(3.0, ev.VersionPublished(version=4))
    assert core.ledger.newest == 4 and not any(isinstance(a, ev.Refused) for a in out)


def test_a_rebuilt_core_owes_no_reserved_id_past_its_budget_and_trains_exactly_the_ids_below_it():
    """A journal reserves ids in blocks, past those it handed out: replayed, every reserved id not trained is owed.
    Owed ids at or past the run's budget (total_steps x train_groups) are left out, or the restarted run would
    dispatch groups it never trains and end with a lower id untrained. Here 3 steps of 2 (ids 0-5), the first
    (groups 1 and 3) trained before the crash, ids reserved through 9 (a block), the groups finishing in reverse
    order of their ids."""
    cfg = CoreConfig(mode="dora", max_staleness=1, train_groups=2, group_size=1, total_steps=3)
    core = Core(cfg, initial_version=1, start_cursor=10, strict=True)
    assert core.restore([0, 2, *range(4, 10)]) == 4
    w = WorkerId("w")
    out = core.handle(0.0, ev.WorkerJoined(worker_id=w, slots=64))
    out += core.handle(0.1, ev.VersionLoaded(worker_id=w, version=1))
    trained, leased = [], []
    for now in range(1, 20):
        if any(isinstance(a, ev.RunFinished) for a in out):
            break
        leased += [a.group_id for a in out if isinstance(a, ev.Lease)]
        todo = sorted((a for a in out if isinstance(a, ev.Lease)), key=lambda a: -a.group_id)
        loads = [a for a in out if isinstance(a, ev.Pin)]
        out = []
        for a in loads:
            out += core.handle(now, ev.VersionLoaded(worker_id=w, version=a.version))
        for a in todo:
            out += core.handle(now, finished(worker_id=w, group_id=a.group_id, attempt=a.attempt, index=0,
                                                      segments=((a.version, 3),), finish=Finish.STOP))  # fmt: skip
        out += core.handle(now, ev.BatchRequested(step=core.step))
        for batch in [a for a in out if isinstance(a, ev.DeliverBatch)]:
            trained += [g.group_id for g in batch.groups]
            out += core.handle(now, ev.VersionPublished(version=batch.step + 1))
    leased += [a.group_id for a in out if isinstance(a, ev.Lease)]
    assert max(leased) < 6, f"a group past the budget was handed out: {leased}"
    assert sorted(trained) == [0, 2, 4, 5] and not core.scheduler.flights


@pytest.mark.parametrize("owed", [[10], [3, 3]])
def test_only_distinct_groups_below_the_cursor_can_be_owed(owed):
    core = Core(CoreConfig(mode="dora", max_staleness=1, train_groups=2, group_size=2), start_cursor=10)
    with pytest.raises(ValueError, match="distinct and below the cursor"):
        core.restore(owed)


def test_a_broker_resumed_from_its_journal_retires_the_store_versions_its_ledger_no_longer_holds(tmp_path):
    """The rebuilt ledger holds only the journal's newest version (the older versions' groups are re-run on it);
    the older versions left in the store are deleted at once, or nothing would ever retire them."""
    import torch

    from dora.broker.main import open_journal
    from dora.config import load
    from dora.config.run import RunConfig
    from dora.store import WeightStore

    store = WeightStore(tmp_path / "store")
    j = Journal(tmp_path / "j.jsonl")
    for v in (1, 2, 3):
        uri, digest, _ = store.publish(v, {"w": torch.full((2,), float(v))})
        j.step(v, uri, digest, [v])
    j.close()
    store.publish(4, {"w": torch.zeros(2)})  # published by the learner, never journalled: the learner redoes it
    cfg = load(RunConfig, overrides=[f"broker.journal={tmp_path / 'j.jsonl'}"])
    core, journal, weights = open_journal(cfg, epoch=2)
    journal.close()
    assert core.ledger.alive() == [3] and weights == {3: (uri, digest)}
    assert store.versions() == [3, 4]


def test_groups_filtered_are_journalled_once_and_never_owed(tmp_path):
    j = Journal(tmp_path / "j.jsonl")
    j.start(7, SHAPE, 0)
    j.reserve_through(5)
    j.step(1, "u1", "a" * 64, [2, 0], filtered=[1])
    j.step(2, "u2", "b" * 64, [4, 5], filtered=[])
    j.close()
    r = replay(tmp_path / "j.jsonl")
    assert (r.trained, r.filtered, r.owed[:2]) == ({0, 2, 4, 5}, {1}, [3, 6])
    assert '"filtered"' not in (tmp_path / "j.jsonl").read_text().splitlines()[-1], "an empty list is not written"
    for extra in ('"groups":[7],"filtered":[1]', '"groups":[1],"filtered":[]', '"groups":[8],"filtered":[8]'):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(STEP1.replace('"groups":[1]', '"groups":[1],"filtered":[0]') + "\n"
                       + STEP1.replace('"version":1', '"version":2').replace('"groups":[1]', extra) + "\n")  # fmt: skip
        with pytest.raises(JournalError, match=r"twice|filtered and consumed again"):
            replay(bad)


def test_a_broker_that_filters_resumes_with_its_budget_and_consumes_exactly_the_ids_below_it(tmp_path):
    """Filtering moves the budget one id per group filtered, across a restart too: the rebuilt core counts the
    journal's filtered groups, owes every reserved id neither trained nor filtered, and the run ends having trained
    or filtered exactly ids 0 .. steps x train_groups + filtered - 1. A journal of a run that filters cannot be
    resumed by one that does not (its ids would not add up)."""
    from dora.broker.main import open_journal
    from dora.config import ConfigError, load
    from dora.config.run import RunConfig

    path = tmp_path / "j.jsonl"
    shape = {**SHAPE, "group_size": 1, "filter_uniform": True}
    j = Journal(path)
    j.start(1, shape, 0)
    j.reserve_through(9)
    j.step(1, "file:///w/v1", "0" * 64, [1, 3], filtered=[0])
    j.close()
    base = [f"broker.journal={path}", "core.train_groups=2", "core.group_size=1", "core.total_steps=3"]
    with pytest.raises(ConfigError, match="was written by a run with"):
        open_journal(load(RunConfig, overrides=base), epoch=2)
    core, journal, _ = open_journal(load(RunConfig, overrides=[*base, "learner.filter_uniform_groups=replace"]), 2)
    journal.close()
    assert core.scheduler.filtered == 1 and list(core.scheduler.owed)[:3] == [2, 4, 5]
    w = WorkerId("w")
    out = core.handle(0.0, ev.WorkerJoined(worker_id=w, slots=64))
    out += core.handle(0.1, ev.VersionLoaded(worker_id=w, version=1))
    trained = []
    for now in range(1, 30):
        if any(isinstance(a, ev.RunFinished) for a in out):
            break
        todo = [a for a in out if isinstance(a, ev.Lease)]
        loads = [a for a in out if isinstance(a, ev.Pin)]
        out = []
        for a in loads:
            out += core.handle(now, ev.VersionLoaded(worker_id=w, version=a.version))
        for a in todo:  # ids 2, 4 and 6 come with a reward (one sample: uniform), the others with none (never)
            out += core.handle(now, finished(worker_id=w, group_id=a.group_id, attempt=a.attempt, index=0,
                                                      segments=((a.version, 3),),
                                                      reward=1.0 if a.group_id in (2, 4, 6) else None))  # fmt: skip
        out += core.handle(now, ev.BatchRequested(step=core.step))
        for batch in [a for a in out if isinstance(a, ev.DeliverBatch)]:
            trained += [g.group_id for g in batch.groups]
            out += core.handle(now, ev.VersionPublished(version=batch.step + 1))
    filtered = [0, *core.transfer.filtered]
    assert sorted([*trained, 1, 3, *filtered]) == list(range(3 * 2 + len(filtered)))
    assert core.transfer.filtered == [2, 4, 6] and not core.scheduler.flights
