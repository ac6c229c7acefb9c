"""dora on one GPU, in one script of at most 5 minutes (H100 / H200): decode, learner step, weight path, `dora run`.

    python3 bench/gpu.py [--out FILE.json] [--only engine learner weights transfer run static] [--peak-flops 989e12]
    python3 bench/gpu.py --quick --device cpu     # tiny shapes, a few tokens: the smoke run (CPU, 1-3 min)

On a GPU machine without network: fetch the wheels dora needs beyond the image's packages here first
(``bench/gpu_wheels.sh`` writes them to .whl/; its header lists them), carry .whl/ over, and run ``python3 -m pip
install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export
PYTHONPATH=/tmp/site:$PWD && python3 bench/gpu.py --out $OUT/gpu.json``. dora is imported from this checkout (no
install); `dora sft` and `dora run` start as ``python3 -m dora``. Writes JSON (default
bench/out_gpu/gpu_<device>_<date>.json) after each part, and prints one line per part.

The model is Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab 151936,
tied embeddings) with random weights, saved (bf16) and loaded back through ``from_pretrained``. The parts, in the
order they run, each guarded (one that fails records its error and the next runs):

1. **engine**: decode tokens/s, bf16, at batch 64 and 256 (128-token prompts, 8 samples each, 256 new tokens,
   EOS never ends a sample, prefill included) of dora's torch engine (submit, step until empty; on CUDA with its
   decode steps as CUDA graphs, then without: ``dora_eager``) and of HF ``generate`` with its dynamic cache on the
   same prompts (sampling over the whole vocabulary); dora / HF. Each engine first runs a few steps of each batch
   size, sized as the timed run (its cache grown, its graphs captured: ``dora_first_s``, as HF static's first call).
2. **learner**: one ``TorchTrainer`` step (bf16, micro-batch 16) on 16 groups x 8 samples x (256 prompt + 512
   completion) tokens, and a plain loop on the same tokens (bf16 autocast forward of prompt + completion,
   log-softmax gather of the completion's tokens, a group-normalised policy gradient, AdamW), each timed after a
   warm-up step: seconds, tokens/s, MFU = 6 x params x tokens / s / ``--peak-flops`` (``tokens``: the batch's,
   the same for both; the trainer runs each group's prompt once: ``tokens_computed``, ``mfu_computed``), and
   ``torch.cuda.max_memory_allocated`` of each.
3. **weights**: ``TorchTrainer.publish`` twice (bf16 where the trainer has ``publish_dtype``), then
   ``TorchEngine.load_weights`` of the published version without and with its digest: seconds, and seconds per
   GB of the version's safetensors.
4. **transfer**: the GPU weight paths (``bench/gpu_paths.py``) for a bf16 state of 1 and 4 GB (``--transfer-gb``):
   pinned host -> device copy GB/s, device -> pinned host (``HostSnapshot.take``, the learner's copy of a version)
   GB/s, ``dora.store.ipc.open_shared`` of the state in another process on the GPU (CUDA IPC: seconds to open,
   GB/s to read), and ``dora.store.collective``'s NCCL broadcast GB/s with 2 GPUs or more (with one it says why
   not). Without CUDA: the snapshot's copy only, the rest ``skipped`` with the reason.
5. **run**: ``dora sft`` then ``dora run --config examples/arithmetic.toml`` with the workers and the learner on
   the device and 40 steps, as subprocesses with timeouts; the held-out accuracy before -> after.
6. **static**: HF ``generate`` with ``cache_implementation="static"`` (on CUDA, transformers compiles its decode
   step) per batch, in a child process given the time left of ``--budget-s`` (compiling may be long); the first
   call (compiling) and a second timed one; dora / it (``dora_over_hf_static``, dora's rate from **engine**).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

PARTS = ("engine", "learner", "weights", "transfer", "run", "static")
"""In the order they run: the static-cache child last, in the time left (its compilation may take long)."""
CHILD_MARK = "hf_static "


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    hidden: int = 896
    layers: int = 24
    heads: int = 14
    kv_heads: int = 2
    intermediate: int = 4864
    vocab: int = 151_936
    tied: bool = True


QWEN25_05B = Shape()
TINY = Shape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512)


@dataclass(frozen=True, slots=True, kw_only=True)
class Sizes:
    batches: tuple[int, ...] = (64, 256)
    group: int = 8
    prompt: int = 128
    new_tokens: int = 256
    train_groups: int = 16
    train_prompt: int = 256
    completion: int = 512
    micro_batch: int = 16
    sft_epochs: int | None = None
    """None: the config's."""
    run_steps: int = 40
    eval_limit: int | None = None
    cpu_threads: int | None = None
    """sft.threads and run.threads, and this process's on a CPU; None: the config's (all cores)."""
    dataset_rows: int | None = None
    """The first rows of the config's task.dataset only (sft and RL); None: all."""
    workers: int | None = None
    """run.workers; None: the config's."""


FULL = Sizes()
QUICK = Sizes(batches=(8, 16), group=4, prompt=16, new_tokens=8, train_groups=4, train_prompt=16, completion=24,
              micro_batch=8, sft_epochs=1, run_steps=4, eval_limit=16, cpu_threads=1, dataset_rows=200,
              workers=1)  # fmt: skip
"""One thread a process: OpenMP threads on a shared or small CPU spin against each other (10x slower)."""


def build_model(out: pathlib.Path, shape: Shape, *, dtype: str = "bfloat16", seed: int = 0) -> pathlib.Path:
    """A Qwen2 causal LM of ``shape`` with random weights, saved as an HF folder at ``out``."""
    import transformers
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                      num_key_value_heads=shape.kv_heads, max_position_embeddings=32_768,
                      tie_word_embeddings=shape.tied, bos_token_id=0, eos_token_id=1, pad_token_id=1)  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(out)
    return out


def built(path: pathlib.Path) -> dict[str, Any]:
    from safetensors import safe_open

    params = 0
    for f in path.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            params += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())  # noqa: SIM118
    return {"path": str(path), "params": params, "bytes": sum(f.stat().st_size for f in path.iterdir())}


def timed(device: torch.device, fn: Callable[[], Any]) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n, length), generator=g).tolist()


# ---------------------------------------------------------------------- 1. engine decode


def engine_rate(engine: Any, batch: int, sz: Sizes, vocab: int, new_tokens: int) -> float:
    """Tokens/s of dora's torch engine: batch // group prompts, group samples each, new_tokens each (the tokens
    counted are those it made)."""
    for g, p in enumerate(prompts(batch // sz.group, sz.prompt, vocab, seed=batch)):
        engine.submit(group_id=g, attempt=1, prompt=p, n=sz.group, max_tokens=new_tokens, seed=g)
    done: list[Any] = []
    s = timed(engine.device, lambda: [done.extend(engine.step()) for _ in iter(lambda: len(engine), 0)])
    made = sum(len(x.tokens) for x in done)
    assert made == batch * new_tokens, f"the engine made {made} tokens, not {batch} x {new_tokens}"
    return made / s


def engine_warm(engine: Any, batch: int, sz: Sizes, vocab: int) -> float:
    """Seconds of a few steps of ``batch`` samples sized as the timed run's (its cache capacity, its CUDA graphs:
    what a first call pays, as HF's static cache compiles on its first call), then cancelled."""
    groups = prompts(batch // sz.group, sz.prompt, vocab, seed=batch)
    for g, p in enumerate(groups):
        engine.submit(group_id=g, attempt=1, prompt=p, n=sz.group, max_tokens=sz.new_tokens, seed=g)

    def steps() -> None:
        for _ in range(3):
            engine.step()
        for g in range(len(groups)):
            engine.cancel(g, 1)

    return timed(engine.device, steps)


def hf_rate(model: Any, batch: int, sz: Sizes, new_tokens: int, **kw: Any) -> float:
    """Tokens/s of HF generate on the same prompts (each repeated group times), sampling from the whole vocabulary."""
    distinct = prompts(batch // sz.group, sz.prompt, model.config.vocab_size, seed=batch)
    ids = torch.tensor([p for p in distinct for _ in range(sz.group)], device=model.device)

    def run() -> None:
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                           pad_token_id=1, **kw)  # fmt: skip

    return batch * new_tokens / timed(model.device, run)


def part_engine(model_dir: pathlib.Path, device: torch.device, sz: Sizes) -> dict[str, Any]:
    """dora's torch engine (CUDA graphs where the device has them, then without) and HF ``generate`` (a dynamic
    cache: plain) at each batch size; HF with a static cache is ``part_static``'s."""
    from transformers import AutoModelForCausalLM

    from dora.rollout.engines.torch.engine import TorchEngine

    out: dict[str, Any] = {"prompt": sz.prompt, "group": sz.group, "new_tokens": sz.new_tokens, "dtype": "bfloat16"}
    modes = {"dora": None, "dora_eager": False} if device.type == "cuda" else {"dora": None}
    rates: dict[str, dict[int, float]] = {}
    for mode, graphs in modes.items():
        engine = TorchEngine(model_dir, max_slots=max(sz.batches), device=str(device), dtype="bfloat16", version=0,
                             cuda_graphs=graphs)  # fmt: skip
        engine.stops = frozenset()  # no stop token: every sample makes exactly new_tokens, as HF with min_new_tokens
        vocab = engine.model.config.vocab_size
        first = {b: engine_warm(engine, b, sz, vocab) for b in sz.batches}  # captures, cache sized: a first call
        rates[mode] = {b: engine_rate(engine, b, sz, vocab, sz.new_tokens) for b in sz.batches}
        made = engine.batch.graphs
        out[f"{mode}_cuda_graphs"] = (None if made is None else
                                      {"captured": len(made.graphs), "broken": made.broken})  # fmt: skip
        out[f"{mode}_first_s"] = first
        out[f"{mode}_max_memory_allocated_gb"] = peak_gb(device)
        engine = made = None
        free(device)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).to(device).eval()
    hf_rate(model, sz.batches[0], sz, 4)
    hf = {b: hf_rate(model, b, sz, sz.new_tokens) for b in sz.batches}
    model = None
    free(device)
    for b in sz.batches:
        row = {f"{mode}_tok_s": rates[mode][b] for mode in modes}
        out[f"batch_{b}"] = {**row, "hf_tok_s": hf[b], "dora_over_hf": rates["dora"][b] / hf[b]}
    return out


def part_static(model_dir: pathlib.Path, device: torch.device, sz: Sizes, timeout_s: float,
                engine: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """HF generate with a static cache (compiled decode on CUDA), in the time left; dora's ratio to it."""
    got, error = hf_static(model_dir, device, sz, timeout_s)
    out: dict[str, Any] = {"timeout_s": timeout_s}
    for b, row in got.items():
        dora = engine.get(f"batch_{b}", {}).get("dora_tok_s")
        out[f"batch_{b}"] = {**row, **({"dora_over_hf_static": dora / row["tok_s"]} if dora else {})}
    if error:
        out["error" if not got else "partial"] = error
    return out


def hf_static(model_dir: pathlib.Path, device: torch.device, sz: Sizes,
              timeout_s: float) -> tuple[dict[int, dict[str, float]], str | None]:  # fmt: skip
    """HF generate with a static cache, per batch, in a child process killed at ``timeout_s`` (compiling may be
    long): what it measured by then, and an error text if it did not finish."""
    if timeout_s <= 5:
        return {}, "skipped: no time left in the budget"
    args = json.dumps({"model": str(model_dir), "device": str(device), "sizes": asdict(sz)})
    me = str(pathlib.Path(__file__).resolve())
    proc = subprocess.Popen([sys.executable, me, "--hf-static-child", args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    error = None
    try:
        text, _ = proc.communicate(timeout=timeout_s)
        if proc.returncode != 0:
            error = f"exit {proc.returncode}: " + tail(text)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the child's own group: it and its compile workers
        text, _ = proc.communicate()
        error = f"timed out after {timeout_s:.0f} s: " + tail(text)
    got = {}
    for line in text.splitlines():
        if line.startswith(CHILD_MARK):
            row = json.loads(line[len(CHILD_MARK) :])
            got[row.pop("batch")] = row
    return got, error


def hf_static_child(spec: str) -> int:
    a = json.loads(spec)
    from transformers import AutoModelForCausalLM

    sz, device = Sizes(**{**a["sizes"], "batches": tuple(a["sizes"]["batches"])}), torch.device(a["device"])
    if sz.cpu_threads and device.type == "cpu":
        torch.set_num_threads(sz.cpu_threads)
    model = AutoModelForCausalLM.from_pretrained(a["model"], dtype=torch.bfloat16).to(device).eval()
    for b in sz.batches:
        started = time.perf_counter()
        hf_rate(model, b, sz, sz.new_tokens, cache_implementation="static")  # compiles for this shape on CUDA
        first = time.perf_counter() - started
        rate = hf_rate(model, b, sz, sz.new_tokens, cache_implementation="static")
        print(CHILD_MARK + json.dumps({"batch": b, "tok_s": rate, "first_s": first}), flush=True)
    return 0


# ---------------------------------------------------------------------- 2. learner step


def train_batch(sz: Sizes, vocab: int, seed: int = 0) -> Any:
    from dora.ids import Finish
    from dora.samples import Batch, TrainGroup, TrainSample

    rng = np.random.default_rng(seed)
    groups = []
    for g in range(sz.train_groups):
        samples = tuple(TrainSample(index=i, token_ids=rng.integers(2, vocab, sz.completion).astype(np.int32),
                                    logprobs=rng.normal(-math.log(vocab), 0.1, sz.completion).astype(np.float32),
                                    reward=float(rng.random()), finish=Finish.LENGTH)
                        for i in range(sz.group))  # fmt: skip
        prompt = rng.integers(2, vocab, sz.train_prompt).astype(np.int32)
        groups.append(TrainGroup(group_id=g, version=0, prompt_ids=prompt, samples=samples))
    return Batch(step=0, groups=tuple(groups))


def plain_step(model: Any, opt: torch.optim.Optimizer, batch: Any, micro: int, device: torch.device) -> None:
    """The textbook step: prompt + completion through the model, completion tokens' log-probs, REINFORCE with
    group-normalised rewards, one AdamW step."""
    rows = [(g.prompt_ids, s) for g in batch.groups for s in g.samples]
    rewards = torch.tensor([[s.reward for s in g.samples] for g in batch.groups])
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).flatten().to(device)
    opt.zero_grad(set_to_none=True)
    for start in range(0, len(rows), micro):
        part = rows[start : start + micro]
        ids = torch.from_numpy(np.stack([np.concatenate([p, s.token_ids]) for p, s in part]).astype(np.int64))
        ids, n = ids.to(device), len(part[0][1].token_ids)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(input_ids=ids, logits_to_keep=n + 1).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(2, ids[:, -n:, None]).squeeze(2)
        loss = -(adv[start : start + len(part), None] * logp).mean() * len(part) / len(rows)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def part_learner(model_dir: pathlib.Path, device: torch.device, sz: Sizes, peak_flops: float,
                 scratch: pathlib.Path) -> dict[str, Any]:  # fmt: skip
    from transformers import AutoModelForCausalLM

    from dora.learner.loss import LossConfig
    from dora.learner.trainers.torch_trainer import TorchTrainer, TrainerConfig
    from dora.store import WeightStore

    rows = sz.train_groups * sz.group
    tokens = rows * (sz.train_prompt + sz.completion)
    out: dict[str, Any] = {"groups": sz.train_groups, "samples": sz.group, "prompt": sz.train_prompt,
                           "completion": sz.completion, "micro_batch": sz.micro_batch, "tokens": tokens,
                           "peak_flops": peak_flops}  # fmt: skip

    def figures(seconds: float, computed: int, params: int) -> dict[str, Any]:
        return {"s": seconds, "tok_s": tokens / seconds, "mfu": 6 * params * tokens / seconds / peak_flops,
                "tokens_computed": computed, "mfu_computed": 6 * params * computed / seconds / peak_flops,
                "max_memory_allocated_gb": peak_gb(device)}  # fmt: skip

    free(device)
    cfg = TrainerConfig(dtype="bfloat16", micro_batch=sz.micro_batch, lr=1e-6)
    trainer = TorchTrainer(model_dir, WeightStore(scratch / "learner-store"), LossConfig(), cfg, device=str(device))
    params = sum(p.numel() for p in trainer.model.parameters())  # tied embeddings counted once
    out["params"] = params
    batch = train_batch(sz, trainer.model.config.vocab_size)
    step = trainer.train
    step(batch)  # warm-up
    # what _score runs: each micro-batch's distinct prompts (rows in group order: all the same length), then every
    # sample's tokens but the last on its prompt's cache
    prompts_run = sum(len({i // sz.group for i in range(s, min(s + sz.micro_batch, rows))})
                      for s in range(0, rows, sz.micro_batch))  # fmt: skip
    computed = prompts_run * sz.train_prompt + rows * (sz.completion - 1)
    out["trainer"] = figures(timed(device, lambda: step(batch)), computed, params)
    trainer = step = None
    free(device)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.99), weight_decay=0.0)

    def plain() -> None:
        plain_step(model, opt, batch, sz.micro_batch, device)

    plain()  # warm-up
    out["plain"] = figures(timed(device, plain), tokens, params)
    out["trainer_speedup"] = out["plain"]["s"] / out["trainer"]["s"]
    model = opt = None
    free(device)
    return out


# ---------------------------------------------------------------------- 3. publish / verify / load


def part_weights(model_dir: pathlib.Path, device: torch.device, scratch: pathlib.Path) -> dict[str, Any]:
    from dora.learner.loss import LossConfig
    from dora.learner.trainers.torch_trainer import TorchTrainer, TrainerConfig
    from dora.rollout.engines.torch.engine import TorchEngine
    from dora.store import WeightStore

    free(device)
    cfg = TrainerConfig(dtype="bfloat16")
    if "publish_dtype" in TrainerConfig.__dataclass_fields__:  # versions in the engines' dtype
        cfg = replace(cfg, publish_dtype="bfloat16")
    trainer = TorchTrainer(model_dir, WeightStore(scratch / "store"), LossConfig(), cfg, device=str(device))
    published = {}
    for v in (1, 2):
        wall = time.perf_counter()
        uri, digest, seconds = trainer.publish(v)
        wall = time.perf_counter() - wall
        path = pathlib.Path(uri.removeprefix("file://"))
        files = [f for f in (path if path.is_dir() else path.parent).rglob("*") if f.is_file()]
        published[v] = {"path": path, "digest": digest, "s": seconds, "wall_s": wall,
                        "bytes": sum(f.stat().st_size for f in files),
                        "weight_bytes": sum(f.stat().st_size for f in files if f.suffix == ".safetensors")}  # fmt: skip
    trainer = None
    free(device)
    engine = TorchEngine(model_dir, device=str(device), dtype="bfloat16", version=0)
    one, two = published[1], published[2]
    load = engine.load_weights
    load(1, one["path"], None)  # warm-up (and, on a CPU, the mapping the next loads start from)
    plain = timed(device, lambda: load(2, two["path"], None))
    verified = timed(device, lambda: load(1, one["path"], one["digest"]))
    gb = two["weight_bytes"] / 1e9
    return {"bytes": two["bytes"], "weight_bytes": two["weight_bytes"], "engine_dtype": "bfloat16",
            "publish_dtype": getattr(cfg, "publish_dtype", "float32"), "publish_first_s": one["s"],
            "publish_s": two["s"], "publish_wall_s": two["wall_s"], "publish_s_per_gb": two["s"] / gb,
            "load_s": plain, "load_s_per_gb": plain / gb, "verified_load_s": verified,
            "verified_load_s_per_gb": verified / gb, "verify_over_load": (verified - plain) / plain}  # fmt: skip


# ---------------------------------------------------------------------- 4. the GPU weight paths


def part_transfer(device: torch.device, sizes_gb: list[float], deadline: float) -> dict[str, Any]:
    from bench import gpu_paths

    return gpu_paths.part_transfer(device, sizes_gb, deadline)


# ---------------------------------------------------------------------- 5. dora sft + dora run


def dora(argv: list[str], log: pathlib.Path, timeout_s: float) -> tuple[int | str, float, str]:
    """``python -m dora ARGV`` from this checkout; on timeout it is interrupted (dora run then stops its
    processes) and killed 30 s later. (exit code or "timeout", seconds, its output)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "dora", *argv], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=env)  # fmt: skip
        try:
            rc: int | str = proc.wait(timeout=max(timeout_s, 1))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            rc = "timeout"
    return rc, time.perf_counter() - started, log.read_text(errors="replace")


def part_run(device: torch.device, sz: Sizes, scratch: pathlib.Path, config: str, deadline: float,
             sft_timeout_s: float, run_timeout_s: float) -> dict[str, Any]:  # fmt: skip
    dev = "cuda" if device.type == "cuda" else str(device)
    from dora.hf.tiny import build_model

    if not (scratch / "tiny-model" / "config.json").exists():  # a folder of its own: the device's home may be read-only
        build_model(scratch / "tiny-model")
    sets = [f"sft.model={scratch / 'tiny-model'}", f"sft.out={scratch / 'sft'}", f"rollout.model={scratch / 'sft'}",
            f"run.dir={scratch / 'runs'}", f"rollout.device={dev}", f"learner.device={dev}",
            f"core.total_steps={sz.run_steps}", "run.share_gpus=true"]  # fmt: skip
    sets += [f"sft.epochs={sz.sft_epochs}"] if sz.sft_epochs else []
    sets += [f"eval.limit={sz.eval_limit}"] if sz.eval_limit else []
    sets += [f"sft.threads={sz.cpu_threads}", f"run.threads={sz.cpu_threads}"] if sz.cpu_threads else []
    sets += [f"run.workers={sz.workers}"] if sz.workers else []
    if sz.dataset_rows:
        with open(ROOT / config, "rb") as f:
            rows = (ROOT / tomllib.load(f)["task"]["dataset"]).read_text().splitlines()[: sz.dataset_rows]
        (scratch / "train.jsonl").write_text("\n".join(rows) + "\n")
        sets.append(f"task.dataset={scratch / 'train.jsonl'}")
    flags = [x for s in sets for x in ("--set", s)]
    out: dict[str, Any] = {"config": config, "sets": sets}
    for name, limit in (("sft", sft_timeout_s), ("run", run_timeout_s)):
        left = deadline - time.monotonic()
        if left < 20:
            raise TimeoutError(f"dora {name}: not started, {left:.0f} s left in the budget")
        rc, seconds, text = dora([name, "--config", config, *flags], scratch / f"{name}.log", min(limit, left))
        out[f"{name}_s"], out[f"{name}_rc"] = seconds, rc
        if rc != 0:
            out["error"] = f"dora {name} exit {rc}: {tail(text)}"
            return out
    found = re.search(r"held-out accuracy ([\d.]+) -> ([\d.]+)", text)
    if found is None:
        out["error"] = f"no held-out accuracy line: {tail(text)}"
        return out
    out["accuracy_before"], out["accuracy_after"] = float(found[1]), float(found[2])
    rundirs = [p for p in (scratch / "runs").iterdir() if p.is_dir() and p.name[0].isdigit()]
    if rundirs and (rundirs[0] / "metrics.jsonl").exists():
        out["steps_done"] = len((rundirs[0] / "metrics.jsonl").read_text().splitlines())
    return out


# ---------------------------------------------------------------------- main


def tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def git_commit(given: str | None) -> str:
    if given:
        return given
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({e})"
    return (r.stdout.strip() + (" (modified)" if dirty else "")) if r.returncode == 0 else "unknown (no git)"


def meta(device: torch.device, commit: str | None) -> dict[str, Any]:
    import platform

    import transformers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"device": str(device), "device_name": name, "torch": torch.__version__,
            "cuda": torch.version.cuda, "transformers": transformers.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "git_commit": git_commit(commit),
            "cpu_count": os.cpu_count()}  # fmt: skip


def summary(name: str, r: dict[str, Any]) -> str:
    if "error" in r:
        return "FAILED: " + r["error"].strip().splitlines()[-1]
    if name == "build":
        return f"{r['params'] / 1e6:,.1f} M parameters, {r['bytes'] / 1e9:.2f} GB saved"
    if name in ("engine", "static"):
        rows = []
        for k, v in r.items():
            if k.startswith("batch_") and name == "engine":
                ratio = v["dora_over_hf"]
                eager = f", without graphs {v['dora_eager_tok_s']:,.0f}" if "dora_eager_tok_s" in v else ""
                rows.append(f"{k}: dora {v['dora_tok_s']:,.0f} tok/s{eager}, HF {v['hf_tok_s']:,.0f} ({ratio:.2f}x)")
            elif k.startswith("batch_"):
                ratio = f" (dora {v['dora_over_hf_static']:.2f}x)" if "dora_over_hf_static" in v else ""
                rows.append(f"{k}: HF static {v['tok_s']:,.0f} tok/s{ratio}, first call {v['first_s']:.0f} s")
        return "; ".join(rows) + (f" ({r['partial'].splitlines()[0]})" if "partial" in r else "")
    if name == "learner":
        t, p = r["trainer"], r["plain"]
        return (f"trainer {t['s']:.2f} s ({t['tok_s']:,.0f} tok/s, MFU {t['mfu']:.1%}), plain {p['s']:.2f} s "
                f"({p['tok_s']:,.0f} tok/s, MFU {p['mfu']:.1%}); peak GB {t['max_memory_allocated_gb']} / "
                f"{p['max_memory_allocated_gb']}")  # fmt: skip
    if name == "transfer":
        from bench import gpu_paths

        return gpu_paths.summary(r)
    if name == "weights":
        return (f"{r['weight_bytes'] / 1e9:.3f} GB: publish {r['publish_s']:.2f} s ({r['publish_s_per_gb']:.2f} s/GB), "
                f"load {r['load_s_per_gb']:.3f} s/GB, verified {r['verified_load_s_per_gb']:.3f} s/GB")  # fmt: skip
    return (f"sft {r['sft_s']:.0f} s, run {r['run_s']:.0f} s, held-out {r['accuracy_before']:.3f} -> "
            f"{r['accuracy_after']:.3f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny model and shapes, a few tokens (a smoke run)")
    p.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--out", type=pathlib.Path, help="default bench/out_gpu/gpu_<device>_<date>.json")
    p.add_argument("--peak-flops", type=float, default=989e12, help="bf16 dense FLOP/s (H100 SXM: 989e12)")
    p.add_argument("--budget-s", type=float, default=280, help="dora run and the static-cache child end by then")
    p.add_argument("--static-timeout-s", type=float, default=120)
    p.add_argument("--sft-timeout-s", type=float, default=120)
    p.add_argument("--run-timeout-s", type=float, default=150)
    p.add_argument("--run-steps", type=int, help="dora run's core.total_steps (default 40; quick 4)")
    p.add_argument("--sft-epochs", type=int, help="dora sft's sft.epochs (default the config's; quick 1)")
    p.add_argument("--transfer-gb", type=float, nargs="+", help="transfer's state sizes (default 1 4; quick 0.016)")
    p.add_argument("--config", default="examples/arithmetic.toml")
    p.add_argument("--commit", help="the commit to record where this copy has no .git (default: git rev-parse)")
    p.add_argument("--hf-static-child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.hf_static_child:
        return hf_static_child(a.hf_static_child)
    threads = torch.get_num_threads()
    if a.quick and a.device == "cpu":
        torch.set_num_threads(QUICK.cpu_threads or threads)
    try:
        return run(a)
    finally:
        torch.set_num_threads(threads)


def run(a: argparse.Namespace) -> int:
    started = time.monotonic()
    deadline = started + a.budget_s
    device = torch.device(a.device)
    shape, sz = (TINY, QUICK) if a.quick else (QWEN25_05B, FULL)
    sz = replace(sz, run_steps=a.run_steps or sz.run_steps, sft_epochs=a.sft_epochs or sz.sft_epochs)
    res: dict[str, Any] = {"meta": meta(device, a.commit), "quick": a.quick}
    res.update(model=asdict(shape), sizes=asdict(sz), peak_flops=a.peak_flops)
    slug = re.sub(r"[^a-z0-9]+", "-", res["meta"]["device_name"].lower()).strip("-") or device.type
    out = a.out or ROOT / "bench/out_gpu" / f"gpu_{slug}_{datetime.date.today().isoformat()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"bench/gpu.py on {res['meta']['device_name']} ({device}), torch {torch.__version__}, transformers "
          f"{res['meta']['transformers']}, parts {' '.join(a.only)}", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="dora-gpu-") as tmp:
        scratch = pathlib.Path(tmp)
        model_dir = scratch / "model"

        def guarded(name: str, fn: Callable[[], dict[str, Any]]) -> None:
            t = time.monotonic()
            try:
                res[name] = fn()
            except Exception:  # a part's failure is a result: recorded, and the next part runs
                res[name] = {"error": tail(traceback.format_exc(), 20)}
                try:
                    free(device)
                except RuntimeError as e:  # a CUDA error can outlive the part that met it
                    res[name]["error"] += f"\nthen, freeing memory: {e}"
            res[name]["elapsed_s"] = time.monotonic() - t
            res["total_s"] = time.monotonic() - started
            out.write_text(json.dumps(res, indent=1, default=str))  # after each part: a killed run keeps its figures
            print(f"[{res['total_s']:6.1f} s] {name}: {summary(name, res[name])}", flush=True)

        if set(a.only) & {"engine", "learner", "weights", "static"}:
            guarded("build", lambda: built(build_model(model_dir, shape)))
        steps = {"engine": lambda: part_engine(model_dir, device, sz),
                 "learner": lambda: part_learner(model_dir, device, sz, a.peak_flops, scratch),
                 "weights": lambda: part_weights(model_dir, device, scratch),
                 "transfer": lambda: part_transfer(device, a.transfer_gb or ([0.016] if a.quick else [1.0, 4.0]),
                                                   deadline),
                 "run": lambda: part_run(device, sz, scratch, a.config, deadline, a.sft_timeout_s,
                                         a.run_timeout_s),
                 "static": lambda: part_static(model_dir, device, sz,
                                               min(a.static_timeout_s, deadline - time.monotonic()),
                                               res.get("engine", {}))}  # fmt: skip
        for name in PARTS:
            if name in a.only:
                guarded(name, steps[name])
    res["total_s"] = time.monotonic() - started
    out.write_text(json.dumps(res, indent=1, default=str))
    print(f"[{res['total_s']:6.1f} s] wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
