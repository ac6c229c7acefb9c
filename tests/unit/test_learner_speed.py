"""The learner at GPU speed, what a CPU can check: log-probs a chunk of positions at a time equal the plain
full-vocabulary computation (values and gradients, float32 and bfloat16, at a temperature other than 1) and
never make a tensor of the whole vocabulary at every position; every zoo family takes the hidden-state path
(Gemma 2's soft-capping included) and a model whose logits are something else falls back to them; token-budget
micro-batches and activation checkpointing leave the step's gradient as it was; the step reports its speed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dora.hf import zoo
from dora.ids import Finish
from dora.learner.logprobs import head_logprobs, sampled_logprobs
from dora.learner.loss import LossConfig
from dora.learner.throughput import flop_params
from dora.learner.trainers.torch_trainer import TorchTrainer, TrainerConfig
from dora.samples import Batch, TrainGroup, TrainSample
from dora.store import WeightStore

pytestmark = pytest.mark.timeout(120)

V, N, H, T = 1000, 64, 16, 0.7
ROWS = 8
"""Positions a chunk in these tests (``chunk_bytes`` of float32 logits): N / ROWS = 8 chunks."""
CHUNK = ROWS * V * 4


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: one thread is faster than several, by far on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Made(TorchDispatchMode):
    """Records every tensor an operation makes (forward and backward alike): its shape and dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.made.append((tuple(t.shape), t.dtype))
        return out

    def widest(self, vocab: int, dtype: torch.dtype | None = None) -> int:
        """The most elements of a tensor made with a vocabulary-sized dimension (of ``dtype``, or any)."""
        return max((int(np.prod(s)) for s, d in self.made if vocab in s and dtype in (None, d)), default=0)


def plain(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float() / T, -1).gather(1, tokens[:, None]).squeeze(1)


def inputs(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.5).to(dtype).requires_grad_()
    bias = torch.randn(V, generator=g).to(dtype).requires_grad_()
    return hidden, weight, bias, torch.randint(0, V, (N,), generator=g), torch.randn(N, generator=g)


def grads(*tensors: torch.Tensor) -> list[torch.Tensor]:
    out = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_probs_from_logits_a_chunk_at_a_time_are_the_full_log_softmax_and_its_gradient(dtype):
    hidden, weight, _, tokens, upstream = inputs(torch.float32)
    logits = (hidden @ weight.t()).detach().to(dtype).requires_grad_()
    want = plain(logits, tokens)
    (want * upstream).sum().backward()
    (want_grad,) = grads(logits)
    got = sampled_logprobs(logits, tokens, temperature=T, chunk_bytes=CHUNK - 4)  # 7 a chunk: the last one short
    (got * upstream).sum().backward()
    (got_grad,) = grads(logits)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got_grad.dtype == dtype
    torch.testing.assert_close(got_grad, want_grad, atol=1e-6, rtol=1e-5 if dtype == torch.float32 else 1.6e-2)


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "autocast"])
def test_log_probs_from_the_head_a_chunk_at_a_time_are_the_full_computation_and_its_gradient(dtype, softcap):
    """float32; bfloat16 weights and hidden states (FSDP2's mixed precision); float32 ones under bf16 autocast
    (one rank's), whose product runs in bf16. A soft-cap of 3 bends most logits (Gemma 2's is 30 on larger ones)."""
    hidden, weight, bias, tokens, upstream = inputs(torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    compute = torch.float32 if dtype == "float32" else torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "autocast"):
        z = F.linear(hidden, weight, bias).float()
    want = plain(z if softcap is None else softcap * torch.tanh(z / softcap), tokens)
    (want * upstream).sum().backward()
    want_grads = grads(hidden, weight, bias)
    got = head_logprobs(hidden, weight, tokens, bias=bias, softcap=softcap, temperature=T, dtype=compute,
                        chunk_bytes=CHUNK)  # fmt: skip
    (got * upstream).sum().backward()
    got_grads = grads(hidden, weight, bias)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for name, g, w in zip(("hidden", "weight", "bias"), got_grads, want_grads, strict=True):
        assert g.dtype == w.dtype, name
        if compute == torch.float32:
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5, msg=lambda e, n=name: f"{n}: {e}")
        else:  # a product rounded to bf16 per chunk, summed in fp32, against one product over every position
            scale = float(w.float().abs().max())
            assert float((g.float() - w.float()).abs().max()) <= 2e-2 * scale, name
            assert torch.cosine_similarity(g.float().flatten(), w.float().flatten(), dim=0) > 0.9999, name


def test_neither_chunked_path_makes_a_tensor_of_the_vocabulary_at_every_position():
    """The counter sees the plain computation's [N, V] float32 tensors; the chunked paths make none bigger than
    a chunk of positions (or the [V, H] weight gradient, H < N), forward and backward."""
    hidden, weight, bias, tokens, upstream = inputs(torch.float32)
    bound = max(ROWS, H) * V
    with Made() as made:
        (plain(F.linear(hidden, weight, bias), tokens) * upstream).sum().backward()
    assert made.widest(V, torch.float32) >= N * V > bound
    with Made() as made:
        (head_logprobs(hidden, weight, tokens, bias=bias, temperature=T, chunk_bytes=CHUNK) * upstream).sum().backward()
    assert 0 < made.widest(V) <= bound
    logits = (hidden @ weight.t()).detach().bfloat16().requires_grad_()
    with Made() as made:
        (sampled_logprobs(logits, tokens, temperature=T, chunk_bytes=CHUNK) * upstream).sum().backward()
    assert 0 < made.widest(V, torch.float32) <= ROWS * V  # the only [N, V] made is the gradient, in bf16


def batch(groups: int = 6, samples: int = 4, longest: int = 24, seed: int = 0) -> Batch:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        drawn = []
        for i in range(samples):
            n = int(rng.integers(2, longest + 1))
            drawn.append(TrainSample(index=i, token_ids=rng.integers(5, 900, n).astype(np.int32),
                                     logprobs=(-7 + rng.normal(0, 0.1, n)).astype(np.float32),
                                     reward=float(rng.random()), finish=Finish.STOP))  # fmt: skip
        prompt = rng.integers(5, 900, int(rng.integers(2, 9))).astype(np.int32)
        out.append(TrainGroup(group_id=g, version=0, prompt_ids=prompt, samples=tuple(drawn)))
    return Batch(step=0, groups=tuple(out))


def rows_of(b: Batch) -> list:
    return [(g.prompt_ids.tolist(), s, gi) for gi, g in enumerate(b.groups) for s in g.samples]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_training_step_makes_no_tensor_of_the_vocabulary_at_every_position(tiny_model, tmp_path, dtype):
    """The whole step (both passes of every micro-batch, the backward, AdamW) on a batch of 24 trajectories
    (about 300 scored positions, more than the hidden size): no tensor with a vocabulary-sized dimension is bigger
    than a chunk of positions or a weight. Forced down the logits path the same counter sees the model's logits
    over every position."""
    cfg = TrainerConfig(lr=1e-2, micro_batch=64, dtype=dtype, logprob_chunk_bytes=8 * 4 * 1024)
    trainer = TorchTrainer(tiny_model, WeightStore(tmp_path / "a"), LossConfig(), cfg)
    vocab, hidden = trainer.model.config.vocab_size, trainer.model.config.hidden_size
    b = batch()
    positions = sum(len(s.token_ids) for g in b.groups for s in g.samples)
    assert trainer.scorer.path == "head" and positions > hidden
    with Made() as made:
        trainer.train(b)
    assert 0 < made.widest(vocab) <= hidden * vocab < positions * vocab
    trainer.scorer.gap = "forced, for the test"
    with Made() as made:
        trainer.train(b)
    assert made.widest(vocab) >= positions * vocab // 2


def test_every_zoo_family_scores_from_its_hidden_states_and_other_logits_fall_back(tmp_path):
    """Each family's log-probs at temperature 0.7, against its own full logits one sample at a time: through the
    head (Gemma 2's soft-capping included). A model whose logits are transformed after its head (here doubled)
    is found out by the probe and scored from its logits, still right."""
    b = batch(groups=3, samples=3, longest=10)
    for family in zoo.FAMILIES:
        trainer = TorchTrainer(zoo.build(family, tmp_path / family), WeightStore(tmp_path / f"s-{family}"),
                               LossConfig(), TrainerConfig(temperature=T))  # fmt: skip
        assert trainer.scorer.path == "head", (family, trainer.scorer.gap)
        assert (trainer.scorer.softcap is not None) == (family == "gemma"), family
        assert_scored_as_alone(trainer, b, family)
    doubled = TorchTrainer(zoo.build("qwen2", tmp_path / "doubled"), WeightStore(tmp_path / "s-doubled"),
                           LossConfig(), TrainerConfig(temperature=T))  # fmt: skip
    doubled.model.register_forward_hook(lambda _m, _a, out: out.__setitem__("logits", out.logits * 2) or out)
    doubled.scorer = type(doubled.scorer)(doubled.model, temperature=T)
    assert doubled.scorer.path == "logits" and "not its last hidden state" in doubled.scorer.gap
    assert_scored_as_alone(doubled, b, "doubled")


def assert_scored_as_alone(trainer: TorchTrainer, b: Batch, name: str) -> None:
    rows = rows_of(b)
    with torch.no_grad():
        logp = trainer._score(rows)[0].logp
        for i, (prompt, s, _) in enumerate(rows):
            ids = torch.tensor([prompt + s.token_ids.tolist()[:-1]])
            logits = trainer.model(input_ids=ids).logits[0, len(prompt) - 1 :]
            want = plain(logits, torch.from_numpy(s.token_ids.astype(np.int64)))
            torch.testing.assert_close(logp[i, : len(want)], want, atol=2e-5, rtol=1e-5, msg=lambda e: f"{name}: {e}")


def steps_alike(a: TorchTrainer, b: TorchTrainer) -> None:
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-7, rtol=1e-4, msg=lambda e, w=name: f"{w}: {e}")


@pytest.mark.parametrize(("budget", "cuts"), [(1, "one each"), (60, "some"), (10**9, "one")])
def test_token_budget_micro_batches_give_the_whole_batch_gradient(tiny_model, tmp_path, budget, cuts):
    b = batch()
    whole = TorchTrainer(tiny_model, WeightStore(tmp_path / "a"), LossConfig(), TrainerConfig(lr=1e-2, micro_batch=64))
    cut = TorchTrainer(tiny_model, WeightStore(tmp_path / "b"), LossConfig(),
                       TrainerConfig(lr=1e-2, micro_batch=1, micro_batch_tokens=budget))  # fmt: skip
    a, got = whole.train(b), cut.train(b)
    assert a["micro_batches"] == 1
    n = sum(len(g.samples) for g in b.groups)
    assert got["micro_batches"] == {"one each": n, "one": 1}.get(cuts, got["micro_batches"])
    assert cuts != "some" or 1 < got["micro_batches"] < n
    assert got["loss"] == pytest.approx(a["loss"], abs=1e-6) and got["grad_norm"] == pytest.approx(
        a["grad_norm"], rel=1e-4
    )
    steps_alike(whole, cut)


def test_activation_checkpointing_recomputes_the_blocks_and_leaves_the_gradient(tiny_model, tmp_path):
    b = batch()
    plain_ = TorchTrainer(tiny_model, WeightStore(tmp_path / "a"), LossConfig(), TrainerConfig(lr=1e-2, micro_batch=8))
    ac = TorchTrainer(tiny_model, WeightStore(tmp_path / "b"), LossConfig(),
                      TrainerConfig(lr=1e-2, micro_batch=8, activation_checkpointing=True))  # fmt: skip
    calls = {"plain": 0, "ac": 0}
    for name, trainer in (("plain", plain_), ("ac", ac)):
        trainer.model.model.layers[0].register_forward_pre_hook(lambda *_, n=name: calls.__setitem__(n, calls[n] + 1))
    a, got = plain_.train(b), ac.train(b)
    micro = a["micro_batches"]
    assert calls == {"plain": 2 * micro, "ac": 2 * micro}  # two passes a micro-batch; one whole-row pass, replayed
    assert got["loss"] == pytest.approx(a["loss"], abs=1e-6)
    steps_alike(plain_, ac)
    assert not ac.model.model.layers[0].mlp.training  # the blocks checkpoint; their dropout stays off


def test_a_step_reports_its_tokens_per_second_and_its_mfu_against_a_given_peak(tiny_model, tmp_path):
    b = batch()
    rows = rows_of(b)
    prompts = sum(len(p) for p in {tuple(p) for p, _, _ in rows})
    longest = max(len(s.token_ids) for _, s, _ in rows)
    fed = prompts + sum(min(len(s.token_ids), longest - 1) for _, s, _ in rows)  # one micro-batch: both passes
    quiet = TorchTrainer(tiny_model, WeightStore(tmp_path / "a"), LossConfig(), TrainerConfig(micro_batch=64))
    metrics = quiet.train(b)
    assert "mfu" not in metrics  # a CPU has no peak in the table
    assert metrics["tokens_per_s"] == pytest.approx(fed / metrics["train_s"])
    rated = TorchTrainer(tiny_model, WeightStore(tmp_path / "b"), LossConfig(),
                         TrainerConfig(micro_batch=64, peak_tflops=0.5))  # fmt: skip
    metrics = rated.train(b)
    model = rated.model
    assert rated.flop_params == sum(p.numel() for p in model.parameters()) - model.model.embed_tokens.weight.numel()
    assert metrics["mfu"] == pytest.approx(6 * rated.flop_params * fed / metrics["train_s"] / 0.5e12)
    assert metrics["rank_imbalance"] == 1.0


def test_the_flop_count_takes_a_tied_head_once_and_leaves_out_looked_up_tables(tmp_path):
    from transformers import AutoModelForCausalLM

    gpt2 = AutoModelForCausalLM.from_pretrained(zoo.build("gpt2", tmp_path / "gpt2"))
    every = sum(p.numel() for p in gpt2.parameters())  # the tied wte/lm_head once
    assert flop_params(gpt2) == every - gpt2.transformer.wpe.weight.numel()  # learned positions: a lookup
