"""What an agent's completion costs through the worker's OpenAI-compatible endpoint, against the same completion asked
of the engine directly, side by side in one run.

    .venv/bin/python bench/agent_endpoint.py                    # dora's tiny model, 24 completions a side, 3 rounds
    .venv/bin/python bench/agent_endpoint.py --concurrent 8 --tokens 32

One process builds dora's tiny model and a torch engine, then alternates rounds of the two paths on the same
requests (same conversation, seeds and token budget, so the engine does the same work), batch by batch of
``--concurrent`` completions, so that the machine's load swings fall on both:

- **direct**: the conversation rendered with the chat template and encoded here, submitted to the engine, stepped
  until the turn ends; what a worker does for an environment's episode;
- **endpoint**: an agent (``task.agent``) sends the conversation with the ``openai`` client to the worker's endpoint
  (``dora.rollout.agents``), which checks and renders it, queues it for the engine, answers when the turn ends, and
  the client parses the JSON; the worker's own step loop drives the engine.

Both paths must sample the same tokens (the bench checks it: the endpoint adds no re-tokenization). It prints the
median over batches of the wall time per completion of each, the overhead per completion (endpoint - direct) and
the ratio, for ``--concurrent`` completions at once (1: one after another). Writes bench/out/agent_endpoint.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dora.config.run import TaskSection  # noqa: E402
from dora.hf.tiny import build_model  # noqa: E402
from dora.rollout.engines.stepped import StepWorkerEngine  # noqa: E402
from dora.rollout.engines.torch.engine import TorchEngine  # noqa: E402
from dora.tasks.prompts import TaskRun  # noqa: E402
from dora.wire import messages as m  # noqa: E402

TOKENS = 16
SAMPLED: dict[int, list[int]] = {}


def chat(row: dict[str, Any]) -> list[dict[str, str]]:
    return [{"role": "system", "content": "Add the numbers."}, {"role": "user", "content": row["prompt"]}]


async def agent(row: dict[str, Any], client: Any) -> float:
    """One completion; the usage says how many tokens it sampled."""
    answer = await client.chat.completions.create(model="policy", messages=chat(row), max_tokens=TOKENS)
    SAMPLED[row["index"]] = [answer.usage.completion_tokens]
    return 0.0


def direct_round(w: StepWorkerEngine, groups: list[int], concurrent: int) -> tuple[float, dict[int, list[int]]]:
    """The completions asked of the engine directly, ``concurrent`` at a time; seconds per completion and the tokens."""
    run, engine = w.task, w.engine
    out: dict[int, list[int]] = {}
    started = time.perf_counter()
    for k in range(0, len(groups), concurrent):
        seqs = []
        for g in groups[k : k + concurrent]:
            item = run.item(g)
            ids = run.encode(run.renderer.render(chat({"prompt": item.meta["source"].prompt})))
            seqs += engine.submit(group_id=g, attempt=1, index=0, prompt=ids, n=1, max_tokens=TOKENS, seed=g,
                                  stops=w.episodes.stops, keep_kv=True, version=7)  # fmt: skip
        while any(s.finish is None for s in seqs):
            engine.step()
        for s in seqs:
            out[s.group_id] = list(s.tokens)
            s.release()
    return (time.perf_counter() - started) / len(groups), out


async def endpoint_round(w: StepWorkerEngine, groups: list[int], concurrent: int) -> tuple[float, dict[int, list]]:
    """The same completions asked by agents through the endpoint, ``concurrent`` episodes at a time, the worker's step
    loop driving the engine."""
    out: dict[int, list[int]] = {}
    started = time.perf_counter()
    for k in range(0, len(groups), concurrent):
        batch = groups[k : k + concurrent]
        for g in batch:
            w.submit(m.Generate(group_id=g, attempt=1, version=7, prompt_ids=w.task.prompt_ids(g), n_samples=1,
                                max_tokens=TOKENS, seed=g), 0.0)  # fmt: skip
        done = 0
        while done < len(batch):
            w.advance(0.0)
            for ep in w.take_finished():
                out[ep.group_id] = list(ep.seq.tokens)
                done += 1
            await asyncio.sleep(w.next_event_s() or 0)
    return (time.perf_counter() - started) / len(groups), out


async def main(args: argparse.Namespace) -> dict[str, Any]:
    global TOKENS
    TOKENS = args.tokens
    folder = build_model(pathlib.Path(tempfile.mkdtemp(prefix="dora-bench-")) / "tiny")
    section = TaskSection(name="arithmetic", tokenizer=str(folder), chat_template=True, agent=f"{__name__}:agent",
                          max_episode_tokens=1024, env_timeout_s=60.0)  # fmt: skip
    w = StepWorkerEngine(TorchEngine(folder, version=7), TaskRun(section, str(folder)))
    groups = list(range(args.completions))
    await endpoint_round(w, groups[:2], 1)  # warm: the endpoint started, the client's first connection made
    direct_round(w, groups[:2], 1)
    times: dict[str, list[float]] = {"direct": [], "endpoint": []}
    d_tokens: dict[int, list[int]] = {}
    for _ in range(args.rounds):  # batch by batch, alternating: a swing of the machine's load falls on both
        for k in range(0, len(groups), args.concurrent):
            batch = groups[k : k + args.concurrent]
            d, direct_tokens = direct_round(w, batch, args.concurrent)
            e, endpoint_tokens = await endpoint_round(w, batch, args.concurrent)
            if direct_tokens != endpoint_tokens:
                raise SystemExit("the endpoint sampled other tokens than the engine did for the same request")
            d_tokens.update(direct_tokens)
            times["direct"].append(d)
            times["endpoint"].append(e)
    direct, endpoint = statistics.median(times["direct"]), statistics.median(times["endpoint"])
    tokens = statistics.mean(len(t) for t in d_tokens.values())
    result = {"completions": args.completions, "concurrent": args.concurrent, "rounds": args.rounds,
              "tokens_per_completion": tokens, "direct_ms": direct * 1e3, "endpoint_ms": endpoint * 1e3,
              "overhead_ms": (endpoint - direct) * 1e3, "ratio": endpoint / direct, "raw_s": times}  # fmt: skip
    print(f"{args.completions} completions of ≤{TOKENS} tokens (mean {tokens:.1f}), {args.concurrent} at once, "
          f"{args.rounds} rounds, median of {len(times['direct'])} batches a side, same tokens both ways")  # fmt: skip
    print(f"  direct engine call : {direct * 1e3:8.2f} ms per completion")
    print(f"  through endpoint   : {endpoint * 1e3:8.2f} ms per completion")
    print(f"  overhead           : {(endpoint - direct) * 1e3:8.2f} ms per completion (x{endpoint / direct:.2f})")
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--completions", type=int, default=24)
    p.add_argument("--concurrent", type=int, default=1)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    result = asyncio.run(main(p.parse_args()))
    suffix = "" if result["concurrent"] == 1 else f"_c{result['concurrent']}"
    out = ROOT / "bench" / "out" / f"agent_endpoint{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
