"""Engines run each request under the version it names (C1). A LoRA torch engine holds several adapter versions,
rows of each in one batch, each sampled under its own; a full-weight engine holds one; the worker's results name the
version each request ran under."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dora.rollout.engines.base import EngineError, SampleState
from dora.rollout.engines.torch.engine import TorchEngine
from dora.tasks.rewards import Scored
from dora.wire import messages as m
from tests.unit.test_fsdp import batch
from tests.unit.test_lora_learner import LORA, trainer

PROMPT = [11, 12, 13, 400, 401, 402]


@pytest.fixture(scope="module")
def versions(tiny_model, tmp_path_factory):
    """A store with adapter versions 1, 2 and 3, each a training step past the one before."""
    t = trainer(tiny_model, tmp_path_factory.mktemp("lora"))
    for v in (1, 2, 3):
        t.train(batch())
        t.publish(v)
    return t.store


def lora_engine(model, store, *loaded: int, max_versions: int = 2) -> TorchEngine:
    e = TorchEngine(model, version=0, lora=LORA.lora, max_versions=max_versions)
    for v in loaded:
        e.load_weights(v, store.path(v), store.digest(v))
    return e


def finish(e: TorchEngine, seen: list[set[int | None]] | None = None) -> None:
    for _ in range(200):
        if not len(e):
            return
        e.step()
        if seen is not None:
            seen.append({s.version for s in e.running})
    raise AssertionError("the engine did not finish")


def full_forward(e: TorchEngine, tokens: list[int]) -> torch.Tensor:
    """The log-probs of ``tokens`` after PROMPT under ``e``'s current version, from one forward of the whole text."""
    with torch.no_grad():
        logits = e.model(input_ids=torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]
    return torch.log_softmax(logits.float(), -1)[torch.arange(len(tokens)), torch.tensor(tokens)]


def test_a_lora_torch_engine_runs_two_versions_in_one_batch_each_row_under_its_own(tiny_model, versions):
    """Version 1's group starts; version 2 is loaded while it runs; a group naming 2 and one naming 1 (the older,
    still held) join. All three decode in the same batches, and each group's tokens and behaviour log-probs are
    those a single-version engine holding only its version makes, not the other version's."""
    e = lora_engine(tiny_model, versions, 1)
    assert e.max_versions == 2 and e.held_versions() == {1}
    first = e.submit(group_id=1, attempt=1, prompt=PROMPT, n=2, max_tokens=12, seed=1)
    e.step()
    assert all(s.tokens and s.finish is None for s in first)
    e.load_weights(2, versions.path(2), versions.digest(2))
    assert e.version == 2 and e.held_versions() == {1, 2}
    second = e.submit(group_id=2, attempt=1, prompt=PROMPT, n=2, max_tokens=12, seed=2, version=2)
    third = e.submit(group_id=3, attempt=1, prompt=PROMPT, n=2, max_tokens=12, seed=3, version=1)
    seen: list[set[int | None]] = []
    finish(e, seen)
    assert {1, 2} in seen, seen  # rows of both versions in one decode batch
    assert [s.version for s in first + second + third] == [1, 1, 2, 2, 1, 1]

    alone = {v: lora_engine(tiny_model, versions, v, max_versions=1) for v in (1, 2)}
    for group, v, seed in ((first, 1, 1), (second, 2, 2), (third, 1, 3)):
        ref = alone[v].submit(group_id=9, attempt=1, prompt=PROMPT, n=2, max_tokens=12, seed=seed)
        finish(alone[v])
        for s, r in zip(group, ref, strict=True):
            assert s.tokens == r.tokens
            got = torch.tensor(s.logprobs)
            assert torch.allclose(got, torch.tensor(r.logprobs), atol=1e-5), (v, got, r.logprobs)
            assert torch.allclose(got, full_forward(alone[v], s.tokens), atol=1e-4)
            assert not torch.allclose(got, full_forward(alone[3 - v], s.tokens), atol=1e-4), "the versions agree"


def test_a_request_for_a_version_not_held_is_refused(tiny_model, versions):
    e = lora_engine(tiny_model, versions, 1, 2)  # version 1 left when 2 came: nothing ran on it
    assert e.held_versions() == {2}
    with pytest.raises(EngineError, match=r"a request for v1: this engine holds v2"):
        e.submit(group_id=1, attempt=1, prompt=PROMPT, n=1, max_tokens=4, version=1)
    with pytest.raises(EngineError, match=r"a request for v0: this engine holds v2"):
        e.import_(group_id=1, attempt=1, prompt=PROMPT, max_tokens=4, version=0,
                  requests=[SampleState(index=0, token_ids=np.array([5]), logprobs=np.array([-1.0]),
                                        rng_state=bytes(8))])  # fmt: skip
    assert not len(e)


def test_a_load_past_max_versions_while_both_run_is_refused_and_changes_nothing(tiny_model, versions):
    e = lora_engine(tiny_model, versions, 1)
    first = e.submit(group_id=1, attempt=1, prompt=PROMPT, n=1, max_tokens=10, seed=1)
    e.step()
    e.load_weights(2, versions.path(2), versions.digest(2))
    second = e.submit(group_id=2, attempt=1, prompt=PROMPT, n=1, max_tokens=10, seed=2)
    e.step()
    with pytest.raises(EngineError, match=r"cannot load v3: .* 2 versions at most \(max_versions\) and requests "
                                          r"still run on v1, v2"):  # fmt: skip
        e.load_weights(3, versions.path(3), versions.digest(3))
    assert e.version == 2 and e.held_versions() == {1, 2}
    finish(e)
    alone = {v: lora_engine(tiny_model, versions, v, max_versions=1) for v in (1, 2)}
    for (s,), v in ((first, 1), (second, 2)):
        assert torch.allclose(torch.tensor(s.logprobs), full_forward(alone[v], s.tokens), atol=1e-4)
    # with nothing running, the next load is taken; the versions no request names leave
    e.load_weights(3, versions.path(3), versions.digest(3))
    assert e.held_versions() == {3}
    # one version at most: a load is refused while requests of the current one run, and taken once they are done
    one = lora_engine(tiny_model, versions, 1, max_versions=1)
    one.submit(group_id=1, attempt=1, prompt=PROMPT, n=1, max_tokens=4)
    with pytest.raises(EngineError, match=r"cannot load v2: .* 1 versions at most .* on v1"):
        one.load_weights(2, versions.path(2), versions.digest(2))
    finish(one)
    one.load_weights(2, versions.path(2), versions.digest(2))
    assert one.held_versions() == {2}


def test_a_full_weight_engine_holds_its_one_version_and_refuses_a_request_for_another(tiny_model):
    e = TorchEngine(tiny_model, version=3)
    assert e.max_versions == 1 and e.held_versions() == {3}
    with pytest.raises(EngineError, match=r"a request for v2: this engine holds v3"):
        e.submit(group_id=1, attempt=1, prompt=PROMPT, n=1, max_tokens=4, version=2)
    (s,) = e.submit(group_id=1, attempt=1, prompt=PROMPT, n=1, max_tokens=4, version=3)
    assert s.version == 3
    with pytest.raises(ValueError, match="an engine of full weights holds one version"):
        TorchEngine(tiny_model, version=0, max_versions=2)


class Task:
    env = None

    def score(self, group: int, tokens: list[int]) -> Scored:
        return Scored(1.0)


def test_a_worker_reports_the_version_each_request_ran_under_not_the_newest(tiny_model, versions):
    from dora.rollout.engines.stepped import StepWorkerEngine

    w = StepWorkerEngine(lora_engine(tiny_model, versions, 1), Task())
    assert w.max_versions == 2 and w.held_versions() == {1}

    def generate(group: int, version: int) -> m.Generate:
        return m.Generate(group_id=group, attempt=1, version=version, prompt_ids=np.array(PROMPT, np.int32),
                          n_samples=2, max_tokens=8, seed=group)  # fmt: skip

    w.submit(generate(1, 1), 0.0)
    w.advance(0.0)
    w.loaded(2, f"file://{versions.path(2)}", versions.digest(2))
    assert w.version == 2 and w.held_versions() == {1, 2}
    w.submit(generate(2, 2), 0.0)
    w.submit(generate(3, 1), 0.0)  # the older version, still held
    done = []
    for _ in range(100):
        if not w.busy():
            break
        w.advance(0.0)
        done += w.take_finished()
    results = {(r.group_id, r.index): r for r in (w.result(s, broker_epoch=1) for s in done)}
    assert sorted(results) == [(g, i) for g in (1, 2, 3) for i in (0, 1)]
    for (group, _), r in results.items():
        assert r.segments.tolist() == [[{1: 1, 2: 2, 3: 1}[group], len(r.token_ids)]]
    with pytest.raises(EngineError, match="a request for v0"):
        w.submit(generate(4, 0), 0.0)

    full = StepWorkerEngine(TorchEngine(tiny_model, version=5), Task())
    assert full.max_versions == 1 and full.held_versions() == {5}
