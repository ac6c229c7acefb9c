"""Invariant report of simulated runs: what each paradigm costs and which constraints it keeps."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

PROMISES: dict[str, frozenset[str]] = {
    "sync": frozenset({"C1", "C2", "C3"}),
    "one_step": frozenset({"C1", "C2", "C3"}),
    "partial": frozenset({"C2", "C3"}),  # C3 on the start version only; C1 is broken by design
    "dora": frozenset({"C1", "C2", "C3"}),
    "drop_stale": frozenset({"C3"}),  # bounds staleness by dropping: C2 (and C1) broken by design
}


def kept(m: dict[str, Any]) -> set[str]:
    out = set()
    if m["c1_violations"] == 0:
        out.add("C1")
    consumed = m["groups_trained"] + m.get("groups_filtered", 0)  # a filtered group is consumed, counted, not lost
    if m["dropped_groups"] == 0 and m["groups_dispatched"] == consumed + m["groups_in_flight_at_end"]:
        out.add("C2")
    if m["max_staleness_consumed"] <= m["max_staleness"]:
        out.add("C3")
    return out


def broken_promises(m: dict[str, Any]) -> list[str]:
    missing = sorted(PROMISES[m["mode"]] - kept(m))
    if "C3" in PROMISES[m["mode"]] and m["mode"] != "drop_stale" and m["max_live_versions"] > m["max_staleness"] + 1:
        missing.append("K+1 live versions")
    return missing


def print_table(rows: list[dict[str, Any]], console: Console | None = None) -> None:
    console = console or Console(width=None if Console().is_terminal else 160)
    base = next((r for r in rows if r["mode"] == "sync"), None)
    table = Table(title="dora sim: paradigms on the same cluster and workload, decided by the same core")
    cols = ("mode", "K", "placement", "step", "vs sync", "tok/s", "rollout-only", "slots used", "of ideal",
            "staleness", "C1", "C2", "C3", "dropped", "migrated", "re-run")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="left" if col in ("mode", "placement", "staleness") else "right")
    for m in rows:
        k = kept(m)
        hist = " ".join(f"{s}:{n}" for s, n in m["staleness_histogram"].items())
        c1 = "yes" if "C1" in k else f"[red]no ({m['c1_violations']})[/red]"
        speed = f"{m['throughput_tokens_per_s'] / base['throughput_tokens_per_s']:.2f}x" if base else "-"
        where = m["placement"] if m["placement"] == "colocated" else f"{m['rollout_gpus']}+{m['trainer_gpus']} GPUs"
        table.add_row(
            m["mode"], str(m["max_staleness"]), where, f"{m['step_time_s']:.0f}s", speed,
            f"{m['throughput_tokens_per_s']:.0f}", f"{m['rollout_only_fraction']:.0%}", f"{m['slot_utilization']:.0%}",
            f"{m['fraction_of_ideal']:.0%}", hist, c1, "yes" if "C2" in k else "[red]no[/red]",
            "yes" if "C3" in k else "[red]no[/red]", str(m["dropped_groups"]), str(m["migrated_requests"]),
            str(m["requeued_groups"]),
        )  # fmt: skip
    console.print(table)
    console.print(
        "step: steady-state step time; tok/s: prompt+response tokens trained per second; rollout-only: share of time "
        "the trainer waits for data; of ideal: perfect-packing bound / step. C1: one version per trajectory. "
        "C2: nothing dispatched dropped (a filtered group is counted, not dropped). C3: staleness at consumption <= K. "
        "re-run: groups re-run whole after a worker died. Disaggregated modes: rollout+trainer GPUs.",
        style="dim",
    )
    if any(m.get("groups_filtered") for m in rows):
        print_filtered(rows, console)
    if any(m.get("turns_per_episode", 1.0) > 1.0 for m in rows):
        print_episodes(rows, console)


def print_filtered(rows: list[dict[str, Any]], console: Console) -> None:
    """Filtering that refills (core.filter_uniform): how many groups it filtered and what their decoding cost."""
    table = Table(title="groups filtered (every reward equal) and replaced")
    for col in ("mode", "filtered", "of consumed", "tokens decoded for them", "tok/s trained", "step"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for m in rows:
        table.add_row(
            m["mode"], str(m["groups_filtered"]), f"{m['filtered_share']:.0%}", f"{m['filtered_tokens'] / 1e6:.2f}M",
            f"{m['throughput_tokens_per_s']:.0f}", f"{m['step_time_s']:.0f}s",
        )  # fmt: skip
    console.print(table)
    console.print(
        "filtered: groups consumed without training (whole run), each replaced by one more dispatched; of consumed: "
        "their share of the groups trained or filtered. Run again without core.filter_uniform to see what the "
        "refills cost: the same lengths and rewards, the uniform groups trained instead.",
        style="dim",
    )


def print_episodes(rows: list[dict[str, Any]], console: Console) -> None:
    """Agentic runs: where the episodes spent their time, and what resuming after tool calls cost."""
    sync = next((r["throughput_tokens_per_s"] for r in rows if r["mode"] == "sync"), None)
    partial = next((r["throughput_tokens_per_s"] for r in rows if r["mode"] == "partial"), None)
    table = Table(title="multi-turn episodes (steady state)")
    cols = ("mode", "vs sync", "vs partial", "turns/episode", "running seqs", "waiting on tools", "trainer idle",
            "re-prefill after tools", "KV evictions", "C1 violations")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="left" if col == "mode" else "right")
    for m in rows:
        tps = m["throughput_tokens_per_s"]
        table.add_row(
            m["mode"], f"{tps / sync:.2f}x" if sync else "-", f"{tps / partial:.2f}x" if partial else "-",
            f"{m['turns_per_episode']:.2f}", f"{m['mean_running']:.0f}", f"{m['mean_waiting_on_tools']:.0f}",
            f"{m['trainer_idle_fraction']:.0%}", f"{m['resume_prefill_tokens'] / 1e6:.1f}M", str(m["kv_evictions"]),
            str(m["c1_violations"]),
        )  # fmt: skip
    console.print(table)
    console.print(
        "running seqs / waiting on tools: mean sequences decoding / episodes waiting on a tool call, whole fleet. "
        "re-prefill after tools: context re-prefilled by episodes that resumed without their KV cache (evicted, "
        "keep_kv = false, or a weight swap). C1 violations: episodes with a token from a version other than their "
        "dispatch version (whole run).",
        style="dim",
    )
