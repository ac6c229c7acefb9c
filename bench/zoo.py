"""Every family of the model zoo through the commands a user runs, one table: `dora sft`, `dora run` with torch
workers and a 2-rank FSDP2 learner, `dora run` with vLLM workers, `dora eval` of a published version's folder, and
a learner killed and resumed.

    .venv/bin/python bench/zoo.py [--families qwen2 gpt2 ...] [--steps 3] [--out bench/out/zoo.json]

Each family's model is built by ``dora.hf.zoo`` (tiny, random weights, the family's real quirks). Per family:
1. **sft**: `dora sft` for one epoch on the first 256 rows of ``examples/data/arithmetic`` (with the family's chat
   template where it has one; GPT-2 has none).
2. **run torch**: `dora run` from the sft folder, torch workers, the torch learner on 2 FSDP2 ranks
   (``learner.ranks = 2``), ``--steps`` steps, held-out before and after on 32 rows: the run's exit status and its
   "held-out accuracy X -> Y" line.
3. **run vllm**: the same with vLLM workers and one learner rank; a family dora refuses on vLLM prints its one
   line and exit 2 (the reason is in the table).
4. **eval**: `dora eval --model <the run's newest version folder>`: a published version opens as a model folder.
5. **resume**: ``tests/zoo/test_run_families.py`` for the family (a learner killed with -9, a new one resumes).
Writes the table as markdown (printed) and JSON (``--out``). Minutes per family on 2 CPU cores, vLLM's start most
of it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dora.hf import zoo  # noqa: E402

DATA = ROOT / "examples" / "data" / "arithmetic"
HELD = re.compile(r"held-out accuracy ([\d.]+) -> ([\d.]+)")


def dora(args: list[str], timeout_s: float, cwd: pathlib.Path) -> tuple[int | str, float, str]:
    started = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, "-m", "dora", *args], capture_output=True, text=True, timeout=timeout_s,
                           cwd=cwd)  # fmt: skip
        return r.returncode, time.perf_counter() - started, r.stderr
    except subprocess.TimeoutExpired as e:
        return "timeout", time.perf_counter() - started, (e.stderr or b"").decode(errors="replace")


def last_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.startswith("dora")]
    return (lines or text.strip().splitlines() or [""])[-1][:200]


def family_row(family: str, scratch: pathlib.Path, steps: int) -> dict:
    fam = zoo.ZOO[family]
    model = zoo.build(family, scratch / "model")
    rows = scratch / "train.jsonl"
    rows.write_text("".join((DATA / "train.jsonl").read_text().splitlines(keepends=True)[:256]))
    task = [f"task.dataset={rows}", "task.prompt_field=question", "task.answer_field=answer", "task.reward=numeric",
            f"task.chat_template={str(fam.template is not None).lower()}"]  # fmt: skip
    common = [*task, f"eval.dataset={DATA / 'test.jsonl'}", "eval.limit=32", "eval.every_steps=0",
              "run.max_tokens=24", f"core.total_steps={steps}", "core.train_groups=4", "core.group_size=4",
              "run.workers=2", "rollout.max_slots=16", "rollout.credit_slots=16", "broker.liveness=40",
              f"run.dir={scratch / 'runs'}"]  # fmt: skip
    out: dict = {"family": family, "tied": fam.tied, "model_type": fam.model_type}
    sets = lambda xs: [a for x in xs for a in ("--set", x)]  # noqa: E731
    code, secs, err = dora(["sft", *sets([*task, f"sft.model={model}", f"sft.out={scratch / 'sft'}", "sft.epochs=1",
                                          "sft.batch_size=32"])], 300, scratch)  # fmt: skip
    out["sft"] = {"rc": code, "s": round(secs, 1), "line": last_line(err)}
    start = scratch / "sft" if code == 0 else model
    for engine, ranks in (("torch", 2), ("vllm", 1)):
        args = sets([*common, f"rollout.model={start}", f"run.engine={engine}", "run.trainer=torch",
                     f"learner.ranks={ranks}"])  # fmt: skip
        code, secs, err = dora(["run", *args], 900, scratch)
        held = HELD.search(err)
        runs = sorted((scratch / "runs").glob("*"))
        out[f"run_{engine}"] = {"rc": code, "s": round(secs, 1), "line": last_line(err) if code else "",
                                "held_out": [float(held[1]), float(held[2])] if held else None,
                                "dir": str(runs[-1]) if runs else None}  # fmt: skip
    newest = max((scratch / "runs").glob(f"*/weights/v{steps}"), default=None)
    if newest is not None:
        code, secs, err = dora(["eval", "--model", str(newest), *sets([*task, f"eval.dataset={DATA / 'test.jsonl'}",
                                                                       "eval.limit=32", "run.max_tokens=24"])], 300,
                               scratch)  # fmt: skip
        out["eval"] = {"rc": code, "s": round(secs, 1), "line": last_line(err)}
    else:
        out["eval"] = {"rc": "no version", "s": 0.0, "line": "no run published a version"}
    started = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        f"tests/zoo/test_run_families.py::test_a_family_trains_publishes_model_folders_and_resumes_after"
                        f"_its_learner_is_killed[{family}]"], capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    out["resume"] = {"rc": r.returncode, "s": round(time.perf_counter() - started, 1),
                     "line": (r.stdout.strip().splitlines() or [""])[-1][:200]}  # fmt: skip
    return out


def cell(r: dict, key: str) -> str:
    x = r.get(key)
    if x is None:
        return "-"
    if x["rc"] == 0:
        held = x.get("held_out")
        return f"ok{f' {held[0]:.2f}->{held[1]:.2f}' if held else ''} ({x['s']:.0f} s)"
    return f"**{x['rc']}**: {x['line']}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", default=list(zoo.FAMILIES), choices=zoo.FAMILIES)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "zoo.json"))
    args = p.parse_args()
    rows = []
    for family in args.families:
        with tempfile.TemporaryDirectory(prefix=f"dora-zoo-{family}-") as tmp:
            started = time.perf_counter()
            rows.append(family_row(family, pathlib.Path(tmp), args.steps))
            print(f"bench/zoo.py: {family} done in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    keys = [("sft", "sft"), ("run_torch", "run, torch workers + 2-rank FSDP2 (held-out)"), ("run_vllm", "run, vLLM"),
            ("eval", "eval of a version folder"), ("resume", "learner kill -9 + resume")]  # fmt: skip
    print("| family | tied | " + " | ".join(k[1] for k in keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for r in rows:
        print(f"| {r['family']} | {'yes' if r['tied'] else 'no'} | " + " | ".join(cell(r, k[0]) for k in keys) + " |")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(r[k]["rc"] == 0 for r in rows for k, _ in keys if k != "run_vllm") else 1


if __name__ == "__main__":
    raise SystemExit(main())
