"""The broker journal: what a restarted broker needs so that nothing is lost and nothing is trained twice.

An append-only file of JSON lines, each written and fsync'd before the broker acts on it:

- ``start``: a broker incarnation began (its ``broker_epoch``, the batch shape it runs with and, under
  Slurm, the job and attempt it belongs to);
- ``reserve``: group ids below ``cursor`` may have been handed out. Written ahead of use in blocks, so
  one fsync covers many dispatches;
- ``step``: the learner published ``version`` (weights ``uri`` + ``sha256``) after training ``groups``;
  ``filtered`` (present when not empty): the groups consumed without training in that step (every reward equal,
  ``learner.filter_uniform_groups = "replace"``). It is written before the publish takes effect and before the
  learner is told it is committed.

Replay gives the newest version and its weights, every group trained and every group filtered so far, and the
reserved cursor. Every reserved group neither trained nor filtered yet is owed again: it is re-run whole on the
newest version (the groups that were running, or finished but not yet consumed, at the crash). So across broker
restarts generation may repeat, and consumption of a group (trained, or filtered) happens exactly once.

Why a JSON-lines file and not SQLite: the broker writes about one record per train step plus one per
block of dispatches, never updates or queries one, and reads the whole file once at start. An append
plus fsync is the least machinery that gives that. A torn last line (a crash mid-write) is ignored; a
bad line before it is corruption and stops the broker with the line number.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

RESERVE_BLOCK = 256
"""Group ids reserved per ``reserve`` record."""


class JournalError(RuntimeError):
    pass


@dataclass(slots=True)
class Replay:
    """The state a journal leaves behind."""

    newest: int = 0
    weights: tuple[str, str] | None = None
    """(uri, sha256) of the newest version; None while only version 0 exists."""
    trained: set[int] = field(default_factory=set)
    filtered: set[int] = field(default_factory=set)
    """Groups consumed without training (their rewards all equal)."""
    reserved: int = 0
    epochs: list[int] = field(default_factory=list)
    starts: list[dict[str, Any]] = field(default_factory=list)
    """Every ``start`` record, oldest first: one per broker incarnation."""
    shape: dict[str, Any] = field(default_factory=dict)

    @property
    def owed(self) -> list[int]:
        """Groups handed out (or about to be) and neither trained nor filtered: each is re-run whole."""
        return [g for g in range(self.reserved) if g not in self.trained and g not in self.filtered]


def replay(path: str | pathlib.Path) -> Replay:
    """Read a journal (missing or empty: a fresh run)."""
    state = Replay()
    path = pathlib.Path(path)
    if not path.exists():
        return state
    lines = path.read_bytes().split(b"\n")
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
            kind = rec["kind"]
        except (ValueError, KeyError, TypeError) as e:
            if n == len(lines) or all(not x.strip() for x in lines[n:]):
                break  # the last line, torn by a crash mid-write: it never took effect
            raise JournalError(f"{path}:{n}: unreadable journal record ({e})") from None
        if kind == "start":
            state.epochs.append(int(rec["epoch"]))
            state.starts.append(rec)
            state.shape = rec.get("shape", {})
        elif kind == "reserve":
            state.reserved = max(state.reserved, int(rec["cursor"]))
        elif kind == "step":
            if int(rec["version"]) != state.newest + 1:
                raise JournalError(f"{path}:{n}: version {rec['version']} follows {state.newest}")
            state.newest = int(rec["version"])
            state.weights = (rec["uri"], rec["sha256"])
            trained, filtered = [int(g) for g in rec["groups"]], [int(g) for g in rec.get("filtered", ())]
            again = state.trained.intersection(trained)
            if again:
                raise JournalError(f"{path}:{n}: groups trained twice: {sorted(again)[:8]}")
            again = state.trained.intersection(filtered) | state.filtered.intersection(trained + filtered)
            again |= set(trained).intersection(filtered)
            if again or len(set(filtered)) < len(filtered):
                raise JournalError(f"{path}:{n}: groups filtered and consumed again: {sorted(again)[:8]}")
            state.trained.update(trained)
            state.filtered.update(filtered)
        else:
            raise JournalError(f"{path}:{n}: unknown record kind {kind!r}")
    return state


class Journal:
    """Appends records, each fsync'd before ``append`` returns."""

    def __init__(self, path: str | pathlib.Path) -> None:
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.reserved = 0
        self.records = 0

    def append(self, record: dict[str, Any]) -> None:
        data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        os.write(self._fd, data)
        os.fsync(self._fd)
        self.records += 1

    def start(self, epoch: int, shape: dict[str, Any], reserved: int, about: dict[str, Any] | None = None) -> None:
        """Record a broker start; ``about``: where it runs (e.g. the Slurm job and attempt)."""
        self.reserved = reserved
        self.append({"kind": "start", "epoch": epoch, "shape": shape, **(about or {})})

    def reserve_through(self, cursor: int) -> None:
        """Make sure ids below ``cursor`` are reserved (one record per block)."""
        if cursor > self.reserved:
            self.reserved = cursor + RESERVE_BLOCK
            self.append({"kind": "reserve", "cursor": self.reserved})

    def step(
        self, version: int, uri: str, sha256: str, groups: Sequence[int], filtered: Sequence[int] | None = None
    ) -> None:
        record = {"kind": "step", "version": version, "uri": uri, "sha256": sha256, "groups": sorted(groups)}
        if filtered:
            record["filtered"] = sorted(filtered)
        self.append(record)

    def close(self) -> None:
        os.close(self._fd)
