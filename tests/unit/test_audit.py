"""`dora audit`: the invariant report, on journals written by the broker's Journal and learner audit lines."""

from __future__ import annotations

import json
import pathlib

import pytest

from dora.broker.journal import Journal
from dora.ops.audit import audit_run, main, render

B = 2  # groups per step


def write_run(root: pathlib.Path, steps: list[list[tuple[int, int]]], *, mode: str = "dora", k: int = 1,
              journal_steps: int | None = None, mixed: int = 0, restarts: int = 0, turns: int = 0,
              filtered: dict[int, list[int]] | None = None) -> None:  # fmt: skip
    """A run whose step ``s`` trained ``steps[s]``: (group id, dispatch version) pairs, 4 samples each; and
    filtered ``filtered[s]`` (the broker's record only)."""
    shape = {"mode": mode, "max_staleness": k, "train_groups": B, "group_size": 4}
    journal = Journal(root / "journal.jsonl")
    for attempt in range(restarts + 1):
        journal.start(100 + attempt, shape, 0, {"slurm_job_id": "7", "slurm_restart": attempt})
    journal.reserve_through(sum(len(s) for s in steps))
    recorded: set[int] = set()
    for s, groups in enumerate(steps[: len(steps) if journal_steps is None else journal_steps]):
        fresh = [g for g, _ in groups if g not in recorded]  # the broker records a group once; a learner may not
        recorded.update(fresh)
        journal.step(s + 1, f"file:///w/v{s + 1}", "0" * 64, fresh, (filtered or {}).get(s))
    journal.close()
    with open(root / "audit.jsonl", "w") as f:
        for s, groups in enumerate(steps):
            staleness: dict[int, int] = {}
            for _, v in groups:
                staleness[s - v] = staleness.get(s - v, 0) + 4
            f.write(
                json.dumps(
                    {
                        "step": s,
                        "groups": sorted(g for g, _ in groups),
                        "staleness": staleness,
                        "versions": sorted({v for _, v in groups}),
                        "mixed": mixed if s == 0 else 0,
                        "turns": turns,
                    }
                )
                + "\n"
            )


GOOD = [[(0, 0), (1, 0)], [(2, 0), (3, 1)], [(4, 1), (5, 2)]]


def test_a_clean_finished_run_passes_every_check(tmp_path: pathlib.Path) -> None:
    write_run(tmp_path, GOOD, restarts=1)
    r = audit_run(tmp_path / "journal.jsonl", tmp_path / "audit.jsonl", total_steps=3)
    assert r.ok, r.problems
    assert (r.steps_committed, r.journal_version, r.groups_trained, r.finished) == (3, 3, 6, True)
    assert r.staleness == {0: 16, 1: 8}  # step - dispatch version, 4 samples a group
    assert [s["slurm_restart"] for s in r.broker_starts] == [0, 1]


@pytest.mark.parametrize(
    ("steps", "kwargs", "total", "problem"),
    [
        ([[(0, 0), (1, 0)], [(1, 0), (3, 1)]], {}, None, "C2: groups trained twice: [1]"),
        ([[(0, 0), (1, 0)], [(3, 1), (4, 1)]], {}, 2, "did not train exactly groups 0..3: missing [2]"),
        ([[(0, 0), (1, 0)], [(2, 0), (3, 1)], [(4, 0), (5, 2)]], {}, None, "C3: staleness 2 trained, K = 1"),
        (GOOD, {"mixed": 3}, None, "C1: 3 trajectories mix policy versions"),
        ([[(0, 0)], [(1, 0), (2, 1)]], {}, None, "a batch without exactly 2 groups"),
        (GOOD, {"journal_steps": 1}, None, "the learner committed 3 steps, the broker recorded 1"),
    ],
)
def test_each_broken_invariant_is_reported(tmp_path: pathlib.Path, steps, kwargs, total, problem) -> None:
    write_run(tmp_path, steps, **kwargs)
    r = audit_run(tmp_path / "journal.jsonl", tmp_path / "audit.jsonl", total_steps=total)
    assert not r.ok
    assert any(problem in p for p in r.problems), r.problems


def test_partial_mode_reports_its_mixed_trajectories_without_failing(tmp_path: pathlib.Path) -> None:
    write_run(tmp_path, GOOD, mode="partial", mixed=5)
    r = audit_run(tmp_path / "journal.jsonl", tmp_path / "audit.jsonl")
    assert r.ok and any("5 mixed-version trajectories" in n for n in r.notes)


def test_episode_turns_are_counted_and_reported(tmp_path: pathlib.Path) -> None:
    write_run(tmp_path, GOOD, turns=5)
    r = audit_run(tmp_path / "journal.jsonl", tmp_path / "audit.jsonl", total_steps=3)
    assert r.ok and r.turns == 15
    text = render(r)
    assert "episode turns checked one by one: 15" in text and "one policy version per trajectory and per turn" in text
    plain = tmp_path / "plain"
    plain.mkdir()
    write_run(plain, GOOD)  # single-turn runs say nothing of turns
    assert "turn" not in render(audit_run(plain / "journal.jsonl", plain / "audit.jsonl", total_steps=3))


def test_a_journal_one_step_ahead_of_the_learner_is_a_note(tmp_path: pathlib.Path) -> None:
    write_run(tmp_path, GOOD)
    lines = (tmp_path / "audit.jsonl").read_text().splitlines()
    (tmp_path / "audit.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])  # torn last line
    r = audit_run(tmp_path / "journal.jsonl", tmp_path / "audit.jsonl", total_steps=3)
    assert r.ok, r.problems
    assert r.steps_committed == 2 and any("1 step(s) past the learner's audit" in n for n in r.notes)


def test_the_command_reads_the_run_config_and_exits_by_the_verdict(tmp_path: pathlib.Path, capsys) -> None:
    write_run(tmp_path, GOOD)
    (tmp_path / "run.toml").write_text("[core]\ntotal_steps = 3\nmax_staleness = 1\n")
    (tmp_path / "checkpoints" / "ckpt-v3").mkdir(parents=True)
    (tmp_path / "checkpoints" / "ckpt-v3" / "meta.json").write_text(json.dumps({"version": 3}))
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "run finished" in out and "nothing dispatched left untrained" in out and "[3]" in out
    assert main([str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    (tmp_path / "twice").mkdir()
    write_run(tmp_path / "twice", [[(0, 0), (1, 0)], [(1, 0), (2, 1)]])
    assert main([str(tmp_path / "twice")]) == 1
    assert "FAILED C2" in capsys.readouterr().out


@pytest.mark.parametrize("what", ["missing", "empty"])
def test_a_directory_without_a_run_is_one_clear_line(tmp_path: pathlib.Path, capsys, what: str) -> None:
    target = tmp_path / "nope" if what == "missing" else tmp_path
    assert main([str(target)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dora audit: ") and err.count("\n") == 1


def test_steps_a_restarted_learner_adopted_from_the_store_fill_their_place(tmp_path: pathlib.Path) -> None:
    """The learner of step 1 was killed after the broker's record and before its own line; its successor resumed
    from the checkpoint of version 0 and took version 2 from the store: it writes steps 0 and 1 as adopted."""
    write_run(tmp_path, GOOD)
    lines = (tmp_path / "audit.jsonl").read_text().splitlines()
    adopted = [json.dumps({"step": s, "adopted": True, "version": s + 1}) for s in (0, 1)]
    (tmp_path / "audit.jsonl").write_text("\n".join([lines[0], *adopted, lines[2]]) + "\n")
    r = audit_run(tmp_path / "journal.jsonl", tmp_path / "audit.jsonl", total_steps=3)
    assert r.ok, r.problems
    assert (r.steps_committed, r.steps_adopted) == (3, 1)
    assert any("1 step(s) taken from the weight store" in n for n in r.notes)
    assert "learner committed 3 (1 adopted from the store), broker recorded 3 of 3" in render(r)


@pytest.mark.parametrize(
    ("rows", "problem"),
    [
        ([0, {"step": 1}, 1, 2], "once each: [0, '1 adopted', 1, 2]"),  # an adopted step trained again
        ([0, 2, {"step": 1}], "once each: [0, 2, '1 adopted']"),  # committed out of order
        ([0, 1, 2, {"step": 3}], "the learner committed 4 steps, the broker recorded 3"),  # never recorded
        ([0, {"step": 2}, 2], "once each: [0, '2 adopted', 2]"),  # a hole
    ],
)
def test_adopted_steps_cannot_hide_a_broken_order(tmp_path: pathlib.Path, rows, problem) -> None:
    write_run(tmp_path, GOOD)
    lines = (tmp_path / "audit.jsonl").read_text().splitlines()
    out = [lines[r] if isinstance(r, int) else json.dumps({**r, "adopted": True, "version": r["step"] + 1})
           for r in rows]  # fmt: skip
    (tmp_path / "audit.jsonl").write_text("\n".join(out) + "\n")
    r = audit_run(tmp_path / "journal.jsonl", tmp_path / "audit.jsonl")
    assert any(problem in p for p in r.problems), r.problems


FILTERED = [[(0, 0), (2, 0)], [(3, 0), (4, 1)], [(6, 1), (7, 2)]]
"""Groups 1 and 5 came back with every reward equal: filtered in steps 0 and 2, never trained."""


def test_a_finished_run_that_filtered_counts_its_filtered_groups_and_passes(tmp_path: pathlib.Path) -> None:
    write_run(tmp_path, FILTERED, filtered={0: [1], 2: [5]})
    r = audit_run(tmp_path / "journal.jsonl", tmp_path / "audit.jsonl", total_steps=3)
    assert r.ok, r.problems
    assert (r.groups_trained, r.groups_filtered) == (6, 2)
    text = render(r)
    assert "groups trained: 6, filtered (every reward equal, never trained): 2 (dispatched = trained + filtered)" in (
        text
    )
    assert "every group dispatched trained or filtered once" in text


@pytest.mark.parametrize(
    ("steps", "filtered", "problem"),
    [
        (FILTERED, {0: [1]}, "did not train or filter exactly groups 0..6: missing [5]"),
        (FILTERED, {0: [1], 2: [5, 9]}, "did not train or filter exactly groups 0..8: missing [8], unexpected [9]"),
        ([[(0, 0), (2, 0)], [(3, 0), (1, 1)], [(4, 1), (5, 2)]], {0: [1]}, "filtered that the learner trained: [1]"),
    ],
)
def test_a_filtered_group_lost_or_trained_anyway_is_reported(tmp_path: pathlib.Path, steps, filtered, problem) -> None:
    write_run(tmp_path, steps, filtered=filtered)
    if problem.startswith("filtered"):  # the broker would refuse to record it twice: only the learner trained it
        lines = (tmp_path / "journal.jsonl").read_text().replace('"groups":[1,3]', '"groups":[3]')
        (tmp_path / "journal.jsonl").write_text(lines)
    r = audit_run(tmp_path / "journal.jsonl", tmp_path / "audit.jsonl", total_steps=3)
    assert any(problem in p for p in r.problems), r.problems
