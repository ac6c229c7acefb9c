"""Mutation check: remove each fencing check from a copy of the package and show that tests fail.

    python -m tests.mutation            # every mutant; exit 1 if any survives
    python -m tests.mutation attempt-id # one mutant

Each mutant replaces one exact snippet of the source (the snippet must occur exactly once, so a
refactor that moves the check makes this script fail loudly instead of testing nothing). The
example-based tests and the property tests are run separately against every mutant, so the report
shows which kind of test catches it.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE_TESTS = ["tests/unit/test_core.py", "tests/unit/test_deadline.py", "tests/unit/test_ledger.py"]
PROPERTY_TESTS = ["tests/unit/test_core_properties.py", "tests/unit/test_sim_properties.py"]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    original: str
    replacement: str
    what: str


MUTANTS = [
    Mutant(
        "attempt-id",
        "dora/core/scheduler.py",
        'if flight.attempt != attempt:\n            return "stale_attempt"',
        "if False:\n            pass",
        "results are accepted whatever their attempt id",
    ),
    Mutant(
        "admission-bound",
        "dora/core/dispatch.py",
        "if deadline.admits(counts",
        "if True or deadline.admits(counts",
        "fresh groups are dispatched without the deadline admission check",
    ),
    Mutant(
        "consumption-bound",
        "dora/core/transfer.py",
        "if not deadline.keeps_invariant_after(",
        "if False and deadline.keeps_invariant_after(",
        "a batch is taken even when it leaves more groups due than later batches can hold",
    ),
    Mutant(
        "oldest-first",
        "dora/core/transfer.py",
        "for d in sorted(self._by_deadline):",
        "for d in sorted(self._by_deadline, reverse=True):",
        "batches fill newest deadline first instead of oldest first",
    ),
    Mutant(
        "retire-unserved",
        "dora/core/ledger.py",
        "v < self.newest and v not in pinned and",
        "v < self.newest and",
        "a version is retired while workers still serve it",
    ),
    Mutant(
        "retire-consumed",
        "dora/core/ledger.py",
        " and not self._unconsumed[v]]",
        "]",
        "a version is retired while its groups are still unconsumed",
    ),
]


def run_tests(tree: pathlib.Path, tests: list[str]) -> tuple[bool, list[str]]:
    env = {**os.environ, "PYTHONPATH": str(tree), "DORA_PROPERTY_EXAMPLES": "500", "DORA_SIM_EXAMPLES": "300",
           "PYTHONDONTWRITEBYTECODE": "1"}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "300", "-o",
         "addopts=", "--hypothesis-profile=mutation", *tests],
        cwd=tree, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    failed = sorted(
        {line.split(" ")[1].split("[")[0] for line in proc.stdout.splitlines() if line.startswith("FAILED")}
    )
    if proc.returncode not in (0, 1):
        failed.append(f"pytest exited {proc.returncode}: {proc.stdout[-400:]}{proc.stderr[-400:]}")
    return proc.returncode != 0, failed


def check(mutant: Mutant) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix=f"dora-mutant-{mutant.name}-") as tmp:
        tree = pathlib.Path(tmp)
        shutil.copytree(ROOT / "dora", tree / "dora")
        shutil.copytree(ROOT / "tests", tree / "tests", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
        target = tree / mutant.path
        source = target.read_text()
        if source.count(mutant.original) != 1:
            raise SystemExit(
                f"mutant {mutant.name}: snippet found {source.count(mutant.original)} times in {mutant.path}"
            )
        target.write_text(source.replace(mutant.original, mutant.replacement))
        where = subprocess.run(
            [sys.executable, "-c", "import dora; print(dora.__file__)"], cwd=tree,
            env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        if not where.startswith(str(tree)):
            raise SystemExit(f"mutant {mutant.name}: tests would import {where}, not the mutated copy")
        t0 = time.perf_counter()
        ex_killed, ex_failed = run_tests(tree, EXAMPLE_TESTS)
        pr_killed, pr_failed = run_tests(tree, PROPERTY_TESTS)
        return {
            "mutant": mutant.name, "what": mutant.what, "killed": ex_killed or pr_killed,
            "example_tests": ex_failed, "property_tests": pr_failed, "seconds": round(time.perf_counter() - t0, 1),
        }  # fmt: skip


def main(argv: list[str]) -> int:
    """Mutants run side by side, one per core (each in its own copy of the tree), and report in their order."""
    chosen = [m for m in MUTANTS if not argv or m.name in argv]
    survivors = []
    with ThreadPoolExecutor(max(1, min(len(chosen), os.cpu_count() or 1))) as pool:
        results = pool.map(check, chosen)
    for mutant, r in zip(chosen, results, strict=True):
        verdict = "killed" if r["killed"] else "SURVIVED"
        print(f"{mutant.name:18} {verdict:8} ({r['seconds']}s) {mutant.what}")
        print(f"{'':18} example tests failing:  {', '.join(r['example_tests']) or '-'}")
        print(f"{'':18} property tests failing: {', '.join(r['property_tests']) or '-'}", flush=True)
        if not r["killed"]:
            survivors.append(mutant.name)
    if survivors:
        print(f"surviving mutants: {', '.join(survivors)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
