"""The torch engine's counter-based sampler and its slot cache: draws that are a pure function of (seed, token
index), whatever the batch, the worker or the slot; sequences joining and leaving without touching the others'
caches."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

from dora.rollout.engines.base import EngineError
from dora.rollout.engines.torch.engine import TorchEngine, hash_seed
from dora.rollout.engines.torch.sampling import sample, seed_halves, uniform, uniform_host, uniform_tensor
from dora.rollout.engines.torch.slots import SlotCache
from tests.engines.test_engines import PROMPT, logprobs_of, run

pytestmark = pytest.mark.timeout(180)


def draws(seeds: list[int], indices: list[int]) -> torch.Tensor:
    """``uniform`` as a CPU computes it (numpy), checked against the int64 torch ops a GPU runs."""
    lo, hi = zip(*(seed_halves(s) for s in seeds), strict=True)
    args = torch.tensor(lo), torch.tensor(hi), torch.tensor(indices)
    got = uniform(*args)
    assert torch.equal(got, uniform_tensor(*args))
    return got


def test_a_draw_is_a_pure_function_of_the_seed_and_the_token_index():
    rng = random.Random(0)
    seeds = [rng.getrandbits(63) for _ in range(64)] + [0, 1, (1 << 63) - 1]
    pairs = [(s, i) for s in seeds for i in [*range(40), 1 << 31, (1 << 32) - 1]]
    got = draws([s for s, _ in pairs], [i for _, i in pairs])
    assert torch.equal(got, torch.tensor([uniform_host(s, i) for s, i in pairs], dtype=torch.float64))
    shuffled = list(range(len(pairs)))
    rng.shuffle(shuffled)  # another batch order, other neighbours: the same number for each (seed, index)
    again = draws([pairs[k][0] for k in shuffled], [pairs[k][1] for k in shuffled])
    assert torch.equal(again, got[torch.tensor(shuffled)])
    assert float(got.min()) >= 0.0 and float(got.max()) < 1.0
    counts = torch.histc(got, bins=10, min=0.0, max=1.0)
    expected = len(pairs) / 10
    assert float(((counts - expected) ** 2 / expected).sum()) < 30  # chi-square, 9 degrees of freedom
    grid = got[: 64 * 42].view(64, 42)[:, :40]
    for a, b in ((grid[:, :-1], grid[:, 1:]), (grid[:-1], grid[1:])):  # next index, next seed
        assert abs(float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])) < 0.06
    with pytest.raises(ValueError, match="63 bits"):
        seed_halves(1 << 63)


def test_a_rows_token_does_not_depend_on_the_rows_beside_it():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn((12, 50), generator=g) * 3
    temp = torch.tensor([1.0, 0.7, 0.0, 1.3] * 3)
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.5] * 3)
    seeds = [hash_seed(5, i) for i in range(12)]
    lo, hi = (torch.tensor(x) for x in zip(*map(seed_halves, seeds), strict=True))
    index = torch.arange(12) * 3
    tokens, logps = sample(logits, temp, top_p, lo, hi, index)
    for order in (torch.arange(12).flip(0), torch.tensor([3, 7, 1])):
        t, lp = sample(logits[order], temp[order], top_p[order], lo[order], hi[order], index[order])
        assert torch.equal(t, tokens[order]) and torch.allclose(lp, logps[order])
    alone = [sample(logits[r : r + 1], temp[r : r + 1], None, lo[r : r + 1], hi[r : r + 1], index[r : r + 1])
             for r in range(12) if top_p[r] == 1.0]  # fmt: skip
    full = top_p == 1.0  # beside rows with a nucleus or not, the same token, the same log-prob bit for bit
    assert torch.equal(torch.cat([t for t, _ in alone]), tokens[full])
    assert torch.equal(torch.cat([lp for _, lp in alone]), logps[full])
    assert torch.equal(tokens[2::4], logits[2::4].argmax(-1))  # temperature 0: greedy


def test_the_slot_cache_keeps_each_slots_columns_through_writes_moves_and_growth():
    cache = SlotCache(4, torch.device("cpu"))
    cache.reserve(5)
    assert cache.capacity == 16 and not cache.allocated
    g = torch.Generator().manual_seed(1)
    own = [[(torch.randn((2, n, 3), generator=g), torch.randn((1, n, 5), generator=g)) for _ in range(2)]
           for n in (4, 7, 2)]  # fmt: skip
    with torch.inference_mode():
        for slot, kv in enumerate(own):
            cache.write(slot, kv)
        assert cache.keys[0].shape == (4, 2, 16, 3) and cache.values[1].shape == (4, 1, 16, 5)
        cache.reserve(17)
        assert cache.capacity == 32
        cache.share(1, slice(3, 4), 7)
        cache.move([3], [0], 7)
        for slot, kv in ((0, own[1]), (1, own[1]), (2, own[2]), (3, own[1])):
            for (k, v), (rk, rv) in zip(cache.read(slot, kv[0][0].shape[1]), kv, strict=True):
                assert torch.equal(k, rk) and torch.equal(v, rv)
        cache.free()
    assert not cache.allocated and cache.capacity == 0


def test_a_sequence_that_others_join_and_leave_around_computes_what_it_computes_alone(tiny_model):
    alone = TorchEngine(tiny_model, version=0)
    alone.stops = frozenset()
    alone.submit(group_id=1, attempt=1, prompt=PROMPT, n=1, max_tokens=60, seed=4)
    (expected,) = run(alone).values()

    e = TorchEngine(tiny_model, max_slots=4, version=0)
    e.stops = frozenset()  # every other sample runs to its own length: they leave at steps of their own
    e.submit(group_id=99, attempt=1, prompt=[7, 8, 9], n=2, max_tokens=4, seed=3)  # in the slots below it
    (watched,) = e.submit(group_id=1, attempt=1, prompt=PROMPT, n=1, max_tokens=60, seed=4)
    slots, cache_rows = set(), []
    for step in range(1, 60):
        if step % 7 == 0:  # short samples of prompts of other lengths join while it runs
            e.submit(group_id=100 + step, attempt=1, prompt=[5 + step, 9, 3][: 1 + step % 3] * 2, n=2,
                     max_tokens=3 + step % 5, seed=step)  # fmt: skip
        e.step()
        slot = next((i for i, s in enumerate(e.running) if s is watched), None)
        if slot is not None:
            slots.add(slot)
            cache_rows.append(e.batch.cache.read(slot, watched.positions)[0][0])
        if watched.finish is not None:
            break
    assert len(slots) > 1, "it moved to another slot when one below it was freed"
    assert watched.tokens == expected.tokens
    torch.testing.assert_close(torch.tensor(watched.logprobs), torch.tensor(expected.logprobs), atol=1e-4, rtol=0)
    for before, after in itertools.pairwise(cache_rows):  # its columns were never rewritten
        assert torch.equal(after[:, : before.shape[1]], before)


def test_an_export_mid_generation_draws_the_same_numbers_in_a_crowded_engine(tiny_model):
    ref = TorchEngine(tiny_model, version=0)
    ref.submit(group_id=3, attempt=1, prompt=PROMPT, n=2, max_tokens=40, top_p=0.9, seed=8)
    expected = run(ref)

    src = TorchEngine(tiny_model, version=0)
    seqs = src.submit(group_id=3, attempt=1, prompt=PROMPT, n=2, max_tokens=40, top_p=0.9, seed=8)
    for _ in range(9):
        src.step()
    state = src.export(3, 1)
    assert [st.rng_state for st in state] == [s.seed.to_bytes(8, "little") for s in seqs]
    assert [s.seed for s in seqs] == [hash_seed(8, i) for i in range(2)]
    dst = TorchEngine(tiny_model, max_slots=5, version=0)
    dst.submit(group_id=9, attempt=1, prompt=[40, 41, 42, 43, 44, 45, 46, 47], n=3, max_tokens=50, seed=2)
    for _ in range(4):
        dst.step()  # three others run: the imported samples take slots 3 and 4, beside them
    dst.import_(group_id=3, attempt=1, prompt=PROMPT, requests=state, max_tokens=40, top_p=0.9)
    got = run(dst)
    for key, s in expected.items():
        assert got[key].tokens == s.tokens
        torch.testing.assert_close(torch.tensor(got[key].logprobs), torch.tensor(s.logprobs), atol=1e-4, rtol=0)
    with pytest.raises(EngineError, match="8-byte seed"):  # a torch.Generator's state, as an older dora exported it
        dst.import_(group_id=4, attempt=1, prompt=PROMPT, max_tokens=40,
                    requests=[dataclasses.replace(state[0], rng_state=bytes(5056))])  # fmt: skip


def test_group_samples_of_different_lengths_step_under_their_own_masks(tiny_model):
    """Prompts of three lengths (rows at different positions in every step), top-p on some: each sample's log-probs
    are a full forward's; the greedy one is HF generate's."""
    e = TorchEngine(tiny_model, max_slots=6, version=0)
    e.submit(group_id=0, attempt=1, prompt=PROMPT[:2], n=2, max_tokens=30, temperature=0.9, top_p=0.8, seed=1)
    e.submit(group_id=1, attempt=1, prompt=PROMPT * 2, n=2, max_tokens=30, temperature=1.0, seed=2)
    e.submit(group_id=2, attempt=1, prompt=PROMPT, n=1, max_tokens=20, temperature=0.0)
    done = run(e)
    prompts = {0: PROMPT[:2], 1: PROMPT * 2, 2: PROMPT}
    for (g, _, _), s in done.items():
        if s.temperature > 0 and s.top_p == 1.0:
            ref = logprobs_of(e.model, prompts[g], s.tokens, s.temperature)
            torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=1e-4, rtol=0)
    with torch.no_grad():
        greedy = e.model.generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False,
                                  eos_token_id=sorted(e.stops), pad_token_id=0)[0, len(PROMPT) :]  # fmt: skip
    assert done[(2, 1, 0)].tokens == greedy.tolist()[: len(done[(2, 1, 0)].tokens)]
