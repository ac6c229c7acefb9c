"""Invariant report of simulated runs: what each paradigm costs and which constraints it keeps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from dora.ids import Mode
from dora.sim.des import Result

PROMISES: dict[Mode, frozenset[str]] = {
    Mode.SYNC: frozenset({"C1", "C2", "C3"}),
    Mode.ONE_STEP: frozenset({"C1", "C2", "C3"}),
    Mode.PARTIAL: frozenset({"C2", "C3"}),  # C3 on the start version only; C1 is broken by design
    Mode.DORA: frozenset({"C1", "C2", "C3"}),
}


@dataclass(frozen=True, slots=True)
class Verdict:
    c1: bool
    c2: bool
    c3: bool
    versions: bool

    def kept(self) -> set[str]:
        return {name for name, ok in (("C1", self.c1), ("C2", self.c2), ("C3", self.c3)) if ok}


def verdict(r: Result) -> Verdict:
    return Verdict(
        c1=r.c1_violations == 0,
        c2=r.c2_ok,
        c3=r.max_staleness <= r.staleness_bound,
        versions=r.max_live_versions <= r.staleness_bound + 1,
    )


def broken_promises(r: Result) -> list[str]:
    v = verdict(r)
    missing = sorted(PROMISES[r.mode] - v.kept())
    if not v.versions:
        missing.append("K+1 live versions")
    return missing


def as_json(results: list[Result]) -> list[dict[str, Any]]:
    base = next((r for r in results if r.mode is Mode.SYNC), None)
    rows = []
    for r in results:
        v = verdict(r)
        rows.append(
            {
                "mode": r.mode.value,
                "staleness_bound": r.staleness_bound,
                "wall_s": r.wall_s,
                "steps": r.steps,
                "mean_step_s": r.wall_s / r.steps if r.steps else 0.0,
                "throughput_tok_s": r.throughput,
                "speedup_vs_sync": (base.wall_s / r.wall_s) if base and r.wall_s else None,
                "learner_idle_frac": r.learner_idle_s / r.wall_s if r.wall_s else 0.0,
                "staleness_hist": {str(k): n for k, n in sorted(r.staleness.items())},
                "mean_staleness": r.mean_staleness,
                "c1_violations": r.c1_violations,
                "c1": v.c1,
                "c2": v.c2,
                "c3": v.c3,
                "max_live_versions": r.max_live_versions,
                "migrated_requests": r.migrated_requests,
                "requeued_groups": r.requeued,
                "broken_promises": broken_promises(r),
            }
        )
    return rows


def print_table(results: list[Result], console: Console | None = None) -> None:
    console = console or Console(width=None if Console().is_terminal else 150)
    table = Table(title="dora sim: paradigms on the same workload, same core")
    for col in ("mode", "K", "time", "vs sync", "tok/s", "learner idle", "staleness", "C1", "C2", "C3",
                "versions", "migrated", "re-run"):  # fmt: skip
        table.add_column(col, justify="right" if col not in ("mode", "staleness") else "left")
    for row in as_json(results):
        hist = " ".join(f"{k}:{n}" for k, n in row["staleness_hist"].items())
        c1 = "yes" if row["c1"] else f"[red]no ({row['c1_violations']})[/red]"
        speed = f"{row['speedup_vs_sync']:.2f}x" if row["speedup_vs_sync"] else "-"
        table.add_row(
            row["mode"], str(row["staleness_bound"]), f"{row['wall_s']:.0f}s", speed,
            f"{row['throughput_tok_s']:.0f}", f"{row['learner_idle_frac']:.0%}", hist, c1,
            "yes" if row["c2"] else "[red]no[/red]", "yes" if row["c3"] else "[red]no[/red]",
            f"{row['max_live_versions']}", str(row["migrated_requests"]), str(row["requeued_groups"]),
        )  # fmt: skip
    console.print(table)
    console.print(
        "C1: every token of a trajectory from its dispatch version.  C2: every group of the run trained exactly "
        "once, none dropped.  C3: staleness at consumption <= K.  versions: most versions alive at once (<= K+1).",
        style="dim",
    )
