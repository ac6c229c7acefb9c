"""`dora audit RUN_DIR`: the invariant report of a run, from what its processes wrote down.

Two records, written by different processes, are checked against each other:
- the broker journal (``journal.jsonl``): every step the broker recorded (version, weights, the groups
  it trained), fsync'd before the learner was told; and every broker start (with the Slurm job and
  attempt, when there is one);
- the learner's audit (``audit.jsonl``): every step the learner committed, with each group's dispatch
  version, the staleness of its samples and any mixed-version trajectory; and every step a restarted learner
  took from the weight store instead (``adopted``: it resumed from an older checkpoint, behind the broker).

Checks (each a line of the report; the exit status is 1 if one fails):
- steps: the learner committed steps 0, 1, 2, ... each once, in order (a step adopted from the store fills its
  place: its groups are the journal's, trained by the learner that published it), and the journal's versions
  follow on;
- C2: no group trained twice; learner and broker agree on what was trained (a learner killed between the
  broker's record and its own may leave the journal one step ahead: reported, not a failure); a group filtered
  (every reward equal, ``learner.filter_uniform_groups = "replace"``) is counted once, never trained; once the run
  is finished, every group dispatched was trained or filtered (group ids are handed out in order, so the groups
  consumed must be exactly 0 .. steps x train_groups + filtered - 1: dispatched = trained + filtered);
- C3: no trajectory trained more than K versions after it was dispatched;
- C1: no trajectory mixes policy versions (``partial`` breaks this on purpose; it is reported for it); an
  episode's turns were each checked by the learner against the group's version, and are counted.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from dora.broker.journal import JournalError, Replay, replay
from dora.config import ConfigError, CoreConfig, load
from dora.config.run import RunConfig
from dora.ids import Mode
from dora.ops.plot import read_jsonl


@dataclass(slots=True)
class Report:
    mode: str
    k: int
    train_groups: int
    total_steps: int | None
    steps_committed: int
    """Steps the learner holds: committed after training, or adopted from the store after a restart."""
    journal_version: int
    groups_trained: int
    staleness: dict[int, int]
    """Samples trained at each staleness."""
    mixed_version_trajectories: int
    turns: int
    """Assistant turns of multi-turn episodes, each checked by the learner against its group's version (C1)."""
    broker_starts: list[dict[str, Any]]
    checkpoints: list[int]
    finished: bool
    owed: int
    """Groups handed out (or reserved) and neither trained nor filtered (at the end of a finished run: lost)."""
    groups_filtered: int = 0
    """Groups consumed without training: their rewards were all equal (counted once each, C2)."""
    steps_adopted: int = 0
    """Of those, steps a restarted learner took from the store without having committed them itself."""
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def audit_run(journal_path: pathlib.Path, audit_path: pathlib.Path, *, total_steps: int | None = None,
              checkpoint_dir: pathlib.Path | None = None) -> Report:  # fmt: skip
    """Check a run's journal against its learner audit (see the module docstring)."""
    journal = replay(journal_path)
    if not journal.epochs:
        raise ConfigError(f"{journal_path}: no broker journal there (set broker.journal)")
    shape = journal.shape
    core = CoreConfig(mode=Mode(shape["mode"]), max_staleness=int(shape["max_staleness"]),
                      train_groups=int(shape["train_groups"]), group_size=int(shape["group_size"]))  # fmt: skip
    everything = _read_audit(audit_path)
    rows = [r for r in everything if not r.get("adopted")]
    held, adopted, in_order, seen = _steps(everything)
    report = Report(
        mode=core.mode.value, k=core.staleness, train_groups=core.train_groups, total_steps=total_steps,
        steps_committed=held, steps_adopted=len(adopted), journal_version=journal.newest,
        groups_trained=len(journal.trained), groups_filtered=len(journal.filtered), staleness={},
        mixed_version_trajectories=sum(r.get("mixed", 0) for r in rows), turns=sum(r.get("turns", 0) for r in rows),
        broker_starts=[_start_info(s) for s in journal.starts], checkpoints=_checkpoints(checkpoint_dir),
        finished=total_steps is not None and journal.newest >= total_steps, owed=len(journal.owed),
    )  # fmt: skip
    problems, notes = report.problems, report.notes
    if not in_order:
        problems.append(f"steps: the learner's committed steps are not 0, 1, 2, ... once each: {seen[:20]}")
    if held > journal.newest:
        problems.append(f"steps: the learner committed {held} steps, the broker recorded {journal.newest}")
    elif held < journal.newest:
        notes.append(f"the journal holds {journal.newest - held} step(s) past the learner's audit "
                     "(a learner stopped between the broker's record and its own)")  # fmt: skip
    if adopted:
        notes.append(
            f"{len(adopted)} step(s) taken from the weight store by a restarted learner, not committed "
            f"by it: {sorted(adopted)[:10]} (a learner killed after the broker's record and before its own)"
        )
    problems += _group_problems(rows, journal, core, finished=report.finished)
    for r in rows:
        for lag, n in r["staleness"].items():
            report.staleness[int(lag)] = report.staleness.get(int(lag), 0) + n
    report.staleness = dict(sorted(report.staleness.items()))
    worst = max(report.staleness, default=0)
    if worst > core.staleness or min(report.staleness, default=0) < 0:
        problems.append(f"C3: staleness {worst} trained, K = {core.staleness}")
    if report.mixed_version_trajectories and not core.in_flight_swap:
        problems.append(f"C1: {report.mixed_version_trajectories} trajectories mix policy versions")
    elif report.mixed_version_trajectories:
        notes.append(f"C1 not kept by mode {core.mode.value}, as it says: "
                     f"{report.mixed_version_trajectories} mixed-version trajectories")  # fmt: skip
    return report


def _group_problems(rows: list[dict[str, Any]], journal: Replay, core: CoreConfig, *, finished: bool) -> list[str]:
    """C2: every group the learner trained, once, recorded by the broker and never filtered, in batches of exactly
    ``train_groups``; a finished run trained or filtered exactly the groups it handed out."""
    problems = []
    counts = Counter(g for r in rows for g in r["groups"])
    twice = sorted(g for g, n in counts.items() if n > 1)
    if twice:
        problems.append(f"C2: groups trained twice: {twice[:10]}")
    if not set(counts) <= journal.trained:
        problems.append(f"C2: groups the learner trained that the broker never recorded: "
                        f"{sorted(set(counts) - journal.trained)[:10]}")  # fmt: skip
    if set(counts) & journal.filtered:
        problems.append(f"C2: groups the broker filtered that the learner trained: "
                        f"{sorted(set(counts) & journal.filtered)[:10]}")  # fmt: skip
    if any(len(r["groups"]) != core.train_groups for r in rows):
        problems.append(f"C2: a batch without exactly {core.train_groups} groups")
    if finished and core.mode is not Mode.DROP_STALE:
        expected = set(range(journal.newest * core.train_groups + len(journal.filtered)))
        consumed = journal.trained | journal.filtered
        if consumed != expected:
            lost, extra = sorted(expected - consumed), sorted(consumed - expected)
            what = "train or filter" if journal.filtered else "train"
            problems.append(f"C2: the finished run did not {what} exactly groups 0..{len(expected) - 1}: "
                            f"missing {lost[:10]}, unexpected {extra[:10]}")  # fmt: skip
    return problems


def _steps(lines: list[dict[str, Any]]) -> tuple[int, list[int], bool, list[int | str]]:
    """(steps held, steps adopted, whether in order, the steps as seen) of the learner's audit lines in file order:
    a committed step is the next one; an adopted one may re-cover held steps."""
    held, adopted, in_order = 0, [], True
    seen: list[int | str] = []
    for r in lines:
        step = int(r["step"])
        if r.get("adopted"):
            seen.append(f"{step} adopted")
            in_order &= step <= held
            if step == held:
                adopted.append(step)
        else:
            seen.append(step)
            in_order &= step == held
        held = max(held, step + 1)
    return held, adopted, in_order, seen


def _read_audit(path: pathlib.Path) -> list[dict[str, Any]]:
    if not path.exists():
        raise ConfigError(f"{path}: no learner audit there (set learner.audit_file)")
    return read_jsonl(path)  # a last line torn by a kill: the learner never counted that step


def _start_info(start: dict[str, Any]) -> dict[str, Any]:
    return {k: start[k] for k in ("epoch", "slurm_job_id", "slurm_restart") if k in start}


def _checkpoints(root: pathlib.Path | None) -> list[int]:
    if root is None or not root.is_dir():
        return []
    found = [p for p in root.glob("ckpt-v*") if p.name[6:].isdigit() and (p / "meta.json").is_file()]
    return sorted(int(json.loads((p / "meta.json").read_text())["version"]) for p in found)


def render(r: Report) -> str:
    state = "finished" if r.finished else f"in progress ({r.owed} groups handed out and not consumed yet)"
    attempts = ", ".join(
        f"job {s['slurm_job_id']} attempt {s.get('slurm_restart', 0)}" if "slurm_job_id" in s else "outside Slurm"
        for s in r.broker_starts
    )
    lines = [
        f"mode {r.mode}, K = {r.k}, {r.train_groups} groups per step; run {state}",
        f"steps: learner committed {r.steps_committed}"
        + (f" ({r.steps_adopted} adopted from the store)" if r.steps_adopted else "")
        + f", broker recorded {r.journal_version}"
        + (f" of {r.total_steps}" if r.total_steps is not None else ""),
        f"groups trained: {r.groups_trained}"
        + (
            f", filtered (every reward equal, never trained): {r.groups_filtered}"
            f" (dispatched = trained + filtered{'' if r.finished else ' + in flight'})"
            if r.groups_filtered
            else ""
        )
        + f"; broker starts: {len(r.broker_starts)} ({attempts})",
        f"staleness of trained samples: {r.staleness} (max {max(r.staleness, default=0)}, K = {r.k})",
        f"mixed-version trajectories: {r.mixed_version_trajectories}"
        + (f"; episode turns checked one by one: {r.turns}" if r.turns else ""),
        f"learner checkpoints kept: {r.checkpoints or 'none'}",
    ]
    lines += [f"note: {n}" for n in r.notes]
    lines += [f"FAILED {p}" for p in r.problems]
    if r.ok:
        lines.append("invariants hold: every step once and in order, no group trained twice, broker and learner "
                     "agree, staleness <= K, one policy version per trajectory" + (" and per turn" if r.turns else "")
                     + (", nothing dispatched left untrained" if r.finished and not r.groups_filtered else "")
                     + (", every group dispatched trained or filtered once" if r.finished and r.groups_filtered
                        else ""))  # fmt: skip
    return "\n".join(lines)


def audit_dir(run_dir: pathlib.Path, config: str | None = None, *, journal: str | None = None,
              audit: str | None = None) -> Report:  # fmt: skip
    """``audit_run`` on a run directory: its files are where its config (``run.toml`` there, unless ``config``
    names another) puts them, else at their usual names in it."""
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: not a directory")
    config = config or (str(run_dir / "run.toml") if (run_dir / "run.toml").is_file() else None)
    cfg = load(RunConfig, path=config) if config else None
    journal = journal or (cfg and cfg.broker.journal) or str(run_dir / "journal.jsonl")
    audit = audit or (cfg and cfg.learner.audit_file) or str(run_dir / "audit.jsonl")
    ckpt = (cfg and cfg.learner.checkpoint_dir) or run_dir / "checkpoints"
    return audit_run(pathlib.Path(journal), pathlib.Path(audit), checkpoint_dir=pathlib.Path(ckpt),
                     total_steps=cfg.core.total_steps if cfg else None)  # fmt: skip


def main(argv: list[str]) -> int:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="dora audit", description=__doc__, formatter_class=fmt)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (dora run's, or a Slurm job's)")
    p.add_argument("--config", metavar="FILE.toml", help="the run's config (default: RUN_DIR/run.toml if present)")
    p.add_argument("--journal", help="the broker journal (default: the config's, else RUN_DIR/journal.jsonl)")
    p.add_argument("--audit", help="the learner audit (default: the config's, else RUN_DIR/audit.jsonl)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = p.parse_args(argv)
    try:
        report = audit_dir(pathlib.Path(args.run_dir), args.config, journal=args.journal, audit=args.audit)
    except (ConfigError, JournalError) as e:
        print(f"dora audit: {e}", file=sys.stderr)
        return 2
    print(json.dumps({**asdict(report), "ok": report.ok}) if args.json else render(report))
    return 0 if report.ok else 1
