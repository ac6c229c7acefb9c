"""The torch engine runs an episode's turns on one sequence: a turn ends at a stop token, the cache is kept, the
environment's tokens are appended (mask 0) and prefilled on top of it, and the next turn samples exactly what a
fresh sequence with that whole prefix and the same sampler state samples."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dora.ids import Finish
from dora.rollout.engines.base import EngineError, SampleState
from dora.rollout.engines.torch.engine import TorchEngine
from tests.engines.test_engines import PROMPT

pytestmark = pytest.mark.timeout(120)

OBS = [33, 34, 35, 36, 37]


def drain(e: TorchEngine, group: int | None = None) -> list:
    """Step until the engine is empty; what ended (of ``group`` only, if given)."""
    ended = []
    while len(e):
        ended += [s for s in e.step() if group is None or s.group_id == group]
    return ended


@pytest.mark.parametrize("crowd", [False, True], ids=["alone", "beside-others"])
def test_an_episode_turn_continues_on_its_kept_cache_as_a_fresh_prefix_would(tiny_model, crowd):
    e = TorchEngine(tiny_model, version=0)
    stops = frozenset(range(100, 400))  # a wide stop set: turns end after a few tokens
    seqs = e.submit(group_id=1, attempt=1, prompt=PROMPT, n=2, max_tokens=12, seed=3, stops=stops, keep_kv=True)
    if crowd:
        e.submit(group_id=9, attempt=1, prompt=[7, 8, 9], n=3, max_tokens=30, seed=1)
    ended = drain(e, group=1)
    assert sorted(s.index for s in ended) == [0, 1]
    assert all(s.kv is not None and s.kv[0][0].shape[1] == s.positions for s in ended)
    first = [len(s.tokens) for s in seqs]
    seeds = [s.seed for s in seqs]
    answers = [OBS, OBS[:2]]  # answers of different lengths, caught up in one padded pass
    for s, obs in zip(seqs, answers, strict=True):
        e.extend(s, obs)
        assert s.mask[-len(obs) :] == [0] * len(obs) and s.logprobs[-len(obs) :] == [0.0] * len(obs)
    if crowd:
        e.submit(group_id=9, attempt=2, prompt=[5, 6], n=2, max_tokens=30, seed=2)
    drain(e)
    for s, n, seed, obs in zip(seqs, first, seeds, answers, strict=True):
        assert s.mask == [1] * n + [0] * len(obs) + [1] * (len(s.tokens) - n - len(obs))
        assert s.turn_start == n + len(obs) and len(s.tokens) > n + len(obs)
        # the reference: the whole prefix re-prefilled from scratch, the same sampler seed
        ref = TorchEngine(tiny_model, version=0)
        prefix = s.tokens[: n + len(obs)]
        ref.import_(group_id=2, attempt=1, prompt=PROMPT,
                    requests=[SampleState(index=s.index, token_ids=np.array(prefix), logprobs=np.zeros(len(prefix)),
                                          rng_state=seed.to_bytes(8, "little"))],
                    max_tokens=12)  # fmt: skip
        ref.waiting[0].stops, ref.waiting[0].turn_start = stops, len(prefix)
        (r,) = drain(ref)
        assert r.tokens == s.tokens
        torch.testing.assert_close(torch.tensor(r.logprobs[len(prefix) :]), torch.tensor(s.logprobs[len(prefix) :]),
                                   atol=1e-4, rtol=0)  # fmt: skip
        # every sampled token's log-prob is the full forward pass's, across both turns
        with torch.no_grad():
            logits = e.model(input_ids=torch.tensor([PROMPT + s.tokens])).logits[0].float()
        full = torch.log_softmax(logits[len(PROMPT) - 1 : -1], -1)[torch.arange(len(s.tokens)), torch.tensor(s.tokens)]
        sampled = torch.tensor(s.mask, dtype=torch.bool)
        torch.testing.assert_close(full[sampled], torch.tensor(s.logprobs)[sampled], atol=1e-4, rtol=0)
        assert s.finish in (Finish.STOP, Finish.LENGTH)


def test_only_an_ended_turn_can_be_extended(tiny_model):
    e = TorchEngine(tiny_model, version=0)
    (s,) = e.submit(group_id=1, attempt=1, prompt=PROMPT, n=1, max_tokens=4, keep_kv=True)
    with pytest.raises(EngineError):
        e.extend(s, OBS)
    drain(e)
    with pytest.raises(EngineError):
        e.extend(s, [])
