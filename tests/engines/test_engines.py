"""The engine suite every step-driven engine passes: torch always, vllm when its extra is installed.

Log-probs are checked against a plain transformers forward pass of the same weights: bit-for-bit
rounding aside for torch (1e-4), and within 2e-3 for vLLM, whose CPU kernels differ.
"""

from __future__ import annotations

import hashlib
import importlib.util

import numpy as np
import pytest
import torch

from dora.ids import Finish
from dora.rollout.engines.base import EngineError
from dora.rollout.engines.torch.engine import TorchEngine
from dora.samples import TrainSample
from dora.store import sha256_file

pytestmark = pytest.mark.timeout(300)
PROMPT = [17, 300, 45, 9, 88, 12]
KINDS = [
    "torch",
    pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                                      reason="the vllm extra is not installed")]),
]  # fmt: skip
TOLERANCE = {"torch": 1e-4, "vllm": 2e-3}


@pytest.fixture(scope="session")
def vllm_engine(tiny_model):
    from dora.rollout.engines.vllm_engine import VllmEngine

    # sleep level 0 (its scheduler paused) runs on CPU; level 1 (memory released) is tests/unit/test_gpu.py's
    return VllmEngine(tiny_model, max_slots=16, kv_cache_bytes=64 << 20, max_model_len=1024, version=0, sleep_level=0)


@pytest.fixture(params=KINDS)
def new_engine(request, tiny_model):
    """A factory: a fresh torch engine per call; vLLM's one engine per session (it must be idle)."""
    if request.param == "torch":
        return lambda: TorchEngine(tiny_model, max_slots=16, version=0)
    shared = request.getfixturevalue("vllm_engine")

    def reuse():
        assert not len(shared), "a previous test left requests in the shared engine"
        return shared

    return reuse


@pytest.fixture(scope="session")
def reference(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model)).eval()


def run(engine, limit: int = 10_000) -> dict:
    done = {}
    for _ in range(limit):
        for s in engine.step():
            done[s.key] = s
        if not len(engine):
            return done
    raise AssertionError("the engine did not finish")


def logprobs_of(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, -1)
    return logp[torch.arange(len(tokens)), torch.tensor(tokens)]


def test_behaviour_log_probs_are_those_of_the_weights_at_the_sampled_tokens(new_engine, reference):
    e = new_engine()
    e.submit(group_id=1, attempt=1, prompt=PROMPT, n=3, max_tokens=24, temperature=0.8, seed=5)
    done = run(e)
    assert sorted(done) == [(1, 1, 0), (1, 1, 1), (1, 1, 2)]
    for s in done.values():
        assert 1 <= len(s.tokens) <= 24 and len(s.logprobs) == len(s.tokens)
        assert s.finish in (Finish.STOP, Finish.LENGTH) and (s.finish is Finish.STOP) == (len(s.tokens) < 24)
        ref = logprobs_of(reference, PROMPT, s.tokens, 0.8)
        assert torch.allclose(torch.tensor(s.logprobs), ref, atol=TOLERANCE[e.name]), (s.logprobs[:3], ref[:3])


def test_the_learner_scores_an_engines_top_p_samples_over_the_same_nucleus(new_engine, tiny_model, tmp_path):
    """At the weights that sampled them, the learner's log-probs of an engine's tokens drawn at temperature 0.8 and
    top_p 0.6 are the engine's within 1e-4 in float32, vLLM's too: the learner cuts the same nucleus. Over the
    whole vocabulary they are not (by about log 0.6)."""
    from dora.learner.loss import LossConfig
    from dora.learner.trainers.torch_trainer import TorchTrainer, TrainerConfig
    from dora.store import WeightStore

    e = new_engine()
    e.submit(group_id=2, attempt=1, prompt=PROMPT, n=4, max_tokens=24, temperature=0.8, top_p=0.6, seed=9)
    done = sorted(run(e).values(), key=lambda s: s.index)
    samples = [TrainSample(index=s.index, token_ids=np.array(s.tokens, np.int32),
                           logprobs=np.array(s.logprobs, np.float32), reward=0.0, finish=s.finish)
               for s in done]  # fmt: skip
    rows = [(PROMPT, s, 0) for s in samples]
    trainer = TorchTrainer(tiny_model, WeightStore(tmp_path), LossConfig(),
                           TrainerConfig(temperature=0.8, top_p=0.6))  # fmt: skip
    with torch.no_grad():
        stats, behaviour, mask = trainer._score(rows)
    live = mask > 0
    gap = (stats.logp - behaviour)[live].abs().max()
    whole = (stats.full - behaviour)[live].abs().max()
    assert gap <= 1e-4, (float(gap), e.name)
    assert whole > 0.1, "the nucleus never cut anything: the test proves nothing"


def test_many_requests_of_different_lengths_all_finish(new_engine):
    e = new_engine()
    for g in range(5):
        e.submit(group_id=g, attempt=1, prompt=PROMPT[: 2 + g], n=4, max_tokens=6 + 4 * g, seed=g)
    done = run(e)
    assert len(done) == 20
    assert all(len(s.tokens) <= s.max_tokens for s in done.values())


def test_a_migrated_request_continues_on_the_same_weights(new_engine, reference):
    src = new_engine()
    src.submit(group_id=3, attempt=2, prompt=PROMPT, n=2, max_tokens=30, temperature=1.0, seed=11)
    for _ in range(8):
        src.step()
    state = src.export(3, 2)
    assert not len(src) and len(state) == 2 and all(len(st.token_ids) >= 1 for st in state)
    prefixes = {st.index: list(st.token_ids) for st in state}
    dst = new_engine()
    dst.import_(group_id=3, attempt=2, prompt=PROMPT, requests=state, max_tokens=30, temperature=1.0)
    done = run(dst)
    for (_, _, index), s in done.items():
        assert s.tokens[: len(prefixes[index])] == prefixes[index] and len(s.tokens) <= 30
        ref = logprobs_of(reference, PROMPT, s.tokens, 1.0)
        assert torch.allclose(torch.tensor(s.logprobs), ref, atol=TOLERANCE[dst.name])


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the vllm extra is not installed")
def test_requests_held_while_vllm_sleeps_go_on_from_their_prefixes_on_the_same_weights(vllm_engine, reference,
                                                                                       tmp_path):  # fmt: skip
    from types import SimpleNamespace

    from dora.rollout.engines.stepped import StepWorkerEngine

    e = vllm_engine
    worker = StepWorkerEngine(e, SimpleNamespace())  # the yield goes through the worker's engine, as the actor's
    e.submit(group_id=4, attempt=1, prompt=PROMPT, n=2, max_tokens=30, temperature=1.0, seed=21)
    e.submit(group_id=5, attempt=1, prompt=PROMPT[:3], n=1, max_tokens=30, temperature=1.0, seed=22)
    for _ in range(6):
        e.step()
    before = {r.key: (list(r.tokens), list(r.logprobs)) for r in e.requests.values()}
    assert len(before) == 3 and all(len(tokens) >= 1 for tokens, _ in before.values())
    worker.paused = True
    assert e.llm.llm_engine.is_sleeping() and not e.requests  # out of vLLM, held by the engine
    assert len(e) == 3 and e.groups() == {(4, 1), (5, 1)} and e.load()[0] == 3
    worker.advance(0.0)
    assert e.step() == [] and worker.take_finished() == []
    with pytest.raises(EngineError, match="3 requests are running"):
        e.load_weights(1, "unused.safetensors", None)
    moved = e.export(5, 1)  # a group can still leave a sleeping engine (a migration to a peer of its version)
    assert [list(st.token_ids) for st in moved] == [before[(5, 1, 0)][0]] and e.groups() == {(4, 1)}
    worker.paused = False
    assert not e.llm.llm_engine.is_sleeping() and len(e.requests) == 2
    done = run(e)
    assert sorted(done) == [(4, 1, 0), (4, 1, 1)]
    for key, s in done.items():
        tokens, logprobs = before[key]
        assert s.tokens[: len(tokens)] == tokens and s.logprobs[: len(tokens)] == logprobs
        assert len(s.tokens) > len(tokens) and len(s.tokens) <= 30
        ref = logprobs_of(reference, PROMPT, s.tokens, 1.0)
        assert torch.allclose(torch.tensor(s.logprobs), ref, atol=TOLERANCE["vllm"])
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(tmp_path / "v0.safetensors"))
    worker.paused = True  # a load that ends after the yield: done awake, and the engine sleeps on
    e.load_weights(0, tmp_path / "v0.safetensors", sha256_file(tmp_path / "v0.safetensors"))
    assert e.llm.llm_engine.is_sleeping() and e.held == []
    worker.paused = False
    e.submit(group_id=6, attempt=1, prompt=PROMPT, n=1, max_tokens=12, temperature=1.0, seed=23)
    s = next(iter(run(e).values()))
    assert torch.allclose(torch.tensor(s.logprobs), logprobs_of(reference, PROMPT, s.tokens, 1.0), atol=2e-3)


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the vllm extra is not installed")
def test_sleep_on_yield_where_vllm_cannot_sleep_is_one_clear_error(tiny_model, capsys):
    """`dora rollout`'s main in this process, which has imported vLLM already (a process of its own would spend
    seconds importing it again)."""
    from dora.rollout.engines.vllm_engine import sleep_mode_available
    from dora.rollout.main import main

    if sleep_mode_available():
        pytest.skip("vLLM can sleep on this platform")
    argv = ["--broker", "tcp://127.0.0.1:9", "--engine", "vllm", "--model", str(tiny_model), "--elastic",
            "--set", "task.name=arithmetic", "--set", "rollout.sleep_on_yield=true"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "sleep mode needs CUDA" in err and "Traceback" not in err and err.count("\n") == 1, err


def test_weights_reload_in_place_verified_and_outputs_follow_them(new_engine, reference, tmp_path):
    from safetensors.torch import save_file

    e = new_engine()
    original = {k: v.clone().contiguous() for k, v in reference.state_dict().items()}
    torch.manual_seed(0)
    changed = {k: (v + 0.05 * torch.randn_like(v)).contiguous() for k, v in original.items()}
    (tmp_path / "v0.safetensors").write_bytes(b"")
    save_file(original, str(tmp_path / "v0.safetensors"))
    save_file(changed, str(tmp_path / "v1.safetensors"))
    good = sha256_file(tmp_path / "v1.safetensors")

    def greedy() -> list[int]:
        e.submit(group_id=9, attempt=1, prompt=PROMPT, n=1, max_tokens=12, temperature=0.0)
        return next(iter(run(e).values())).tokens

    before = greedy()
    e.submit(group_id=9, attempt=1, prompt=PROMPT, n=1, max_tokens=12, temperature=0.0)
    with pytest.raises(EngineError, match="running"):
        e.load_weights(1, tmp_path / "v1.safetensors", good)
    run(e)
    with pytest.raises(EngineError, match="sha256"):
        e.load_weights(1, tmp_path / "v1.safetensors", hashlib.sha256(b"other").hexdigest())
    assert e.version == 0 and greedy() == before
    try:
        e.load_weights(1, tmp_path / "v1.safetensors", good)
        assert e.version == 1
        after = greedy()
        assert after != before
        reference.load_state_dict(changed)
        with torch.no_grad():
            want = reference.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False,
                                      eos_token_id=-1, pad_token_id=0)[0, len(PROMPT):].tolist()  # fmt: skip
        assert after == want[: len(after)]
    finally:
        reference.load_state_dict(original)
        e.load_weights(0, tmp_path / "v0.safetensors", None)  # the shared engine goes back to version 0


def test_an_episode_turn_ends_at_a_stop_and_the_next_sees_the_environments_tokens(new_engine, reference):
    """Each engine's episode path: a turn ends at a stop token (or its budget), ``extend`` appends environment tokens
    (mask 0, log-prob 0) and the next turn is sampled on the whole context: its behaviour log-probs are the
    reference model's on prompt + every token so far, environment tokens included."""
    engine = new_engine()
    stops = frozenset(range(200, 600))  # a wide stop set: turns end after a few tokens
    seqs = engine.submit(group_id=4, attempt=1, prompt=PROMPT, n=2, max_tokens=8, temperature=1.0, seed=5,
                         stops=stops, keep_kv=True)  # fmt: skip
    obs = [33, 34, 35]
    for turn in range(3):
        ended = run(engine)
        assert sorted(k[2] for k in ended) == [0, 1]
        for s in seqs:
            assert s.finish is not None and (s.tokens[-1] in stops or len(s.tokens) - s.turn_start == 8)
            assert s.finish == (Finish.STOP if s.tokens[-1] in stops else Finish.LENGTH)
            if turn < 2:
                engine.extend(s, obs)
    for s in seqs:
        model = np.array(s.mask, bool)
        assert len(s.mask) == len(s.tokens) and (~model).sum() == 2 * len(obs)
        assert np.all(np.array(s.logprobs)[~model] == 0.0)
        ref = logprobs_of(reference, PROMPT, s.tokens, 1.0).numpy()
        np.testing.assert_allclose(np.array(s.logprobs)[model], ref[model], atol=TOLERANCE[engine.name])
