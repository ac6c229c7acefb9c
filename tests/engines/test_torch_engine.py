"""The torch engine: continuous batching, exact behaviour log-probs, seeds, weights, KV migration."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from dora.ids import Finish
from dora.rollout.engines.base import EngineError
from dora.rollout.engines.torch.engine import TorchEngine
from dora.store import sha256_file
from tests.engines.test_engines import PROMPT, run

pytestmark = pytest.mark.timeout(120)


def engine(model, **kw) -> TorchEngine:
    return TorchEngine(model, version=0, **kw)


def test_log_probs_are_those_of_a_full_forward_pass_at_the_sampled_tokens(tiny_model):
    e = engine(tiny_model)
    e.submit(group_id=1, attempt=1, prompt=PROMPT, n=3, max_tokens=24, temperature=0.8, seed=5)
    done = run(e)
    assert len(done) == 3
    for s in done.values():
        assert 1 <= len(s.tokens) <= 24 and len(s.logprobs) == len(s.tokens)
        with torch.no_grad():
            logits = e.model(input_ids=torch.tensor([PROMPT + s.tokens])).logits[0].float()
        ref = torch.log_softmax(logits[len(PROMPT) - 1 : -1] / 0.8, -1)
        ref = ref[torch.arange(len(s.tokens)), torch.tensor(s.tokens)]
        assert torch.allclose(torch.tensor(s.logprobs), ref, atol=1e-4), (s.logprobs[:4], ref[:4])


def test_greedy_matches_hf_generate(tiny_model):
    e = engine(tiny_model)
    e.submit(group_id=1, attempt=1, prompt=PROMPT, n=1, max_tokens=16, temperature=0.0)
    (s,) = run(e).values()
    with torch.no_grad():
        ref = e.model.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False,
                               eos_token_id=sorted(e.stops), pad_token_id=0)[0, len(PROMPT):]  # fmt: skip
    assert s.tokens == ref.tolist()[: len(s.tokens)]


def test_a_sample_does_not_depend_on_what_else_runs_beside_it(tiny_model):
    alone = engine(tiny_model)
    alone.submit(group_id=1, attempt=1, prompt=PROMPT, n=2, max_tokens=32, seed=9)
    a = run(alone)
    crowded = engine(tiny_model, max_slots=3)
    crowded.submit(group_id=7, attempt=1, prompt=[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], n=4, max_tokens=40, seed=1)
    crowded.submit(group_id=1, attempt=1, prompt=PROMPT, n=2, max_tokens=32, seed=9)
    b = run(crowded)
    together = engine(tiny_model)  # both prompts prefilled in one right-padded pass, of different lengths
    together.submit(group_id=7, attempt=1, prompt=[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], n=4, max_tokens=40)
    together.submit(group_id=1, attempt=1, prompt=PROMPT, n=2, max_tokens=32, seed=9)
    assert len(together.step()) == 0 and len(together.running) == 6
    c = run(together)
    for key, s in a.items():
        for other in (b, c):
            assert other[key].tokens == s.tokens
            assert torch.allclose(torch.tensor(other[key].logprobs), torch.tensor(s.logprobs), atol=1e-4)


def test_continuous_batching_never_exceeds_its_slots_and_finishes_everything(tiny_model):
    e = engine(tiny_model, max_slots=3)
    for g in range(4):
        e.submit(group_id=g, attempt=1, prompt=PROMPT[: 2 + g], n=2, max_tokens=10 + 5 * g, seed=g)
    done, seen = {}, 0
    while len(e):
        for s in e.step():
            done[s.key] = s
        seen = max(seen, len(e.running))
        assert len(e.running) <= 3
    assert seen == 3 and len(done) == 8
    assert all(s.finish in (Finish.STOP, Finish.LENGTH) for s in done.values())
    assert all(len(s.tokens) == s.max_tokens for s in done.values() if s.finish is Finish.LENGTH)


@pytest.mark.parametrize("with_kv", [True, False], ids=["kv-transfer", "re-prefill"])
def test_a_request_migrated_mid_generation_continues_exactly(tiny_model, with_kv):
    ref = engine(tiny_model)
    ref.submit(group_id=3, attempt=2, prompt=PROMPT, n=2, max_tokens=40, temperature=1.0, seed=11)
    expected = run(ref)

    src, dst = engine(tiny_model), engine(tiny_model)
    src.submit(group_id=3, attempt=2, prompt=PROMPT, n=2, max_tokens=40, temperature=1.0, seed=11)
    for _ in range(12):
        src.step()
    made = len(src.running[0].tokens)  # the first step prefills and decodes: 13 tokens after 12 steps
    assert len(src.running) == 2 and all(len(s.tokens) == made for s in src.running)
    assert all(made < len(s.tokens) for s in expected.values()), "both samples mid-generation"
    state = src.export(3, 2, with_kv=with_kv)
    assert not len(src) and len(state) == 2 and all(len(st.token_ids) == made for st in state)
    assert bool(state[0].kv) is with_kv
    dst.import_(group_id=3, attempt=2, prompt=PROMPT, requests=state, max_tokens=40, temperature=1.0)
    got = run(dst)
    for key, s in expected.items():
        assert got[key].tokens == s.tokens
        if with_kv:  # the same arithmetic on the same cache: bit for bit
            assert got[key].logprobs == s.logprobs
        else:  # the prefix is recomputed in one pass: equal to float rounding
            assert torch.allclose(torch.tensor(got[key].logprobs), torch.tensor(s.logprobs), atol=1e-4)


def test_a_sleep_drops_every_cache_and_after_the_wake_each_sample_goes_on_exactly(tiny_model, tmp_path):
    ref = engine(tiny_model)
    ref.submit(group_id=3, attempt=2, prompt=PROMPT, n=2, max_tokens=40, temperature=1.0, seed=11)
    ref.submit(group_id=4, attempt=1, prompt=PROMPT[:3], n=2, max_tokens=30, temperature=1.0, seed=12)
    expected = run(ref)

    e = engine(tiny_model, max_slots=3, sleep_on_yield=True)  # one sample of group 4 waits for a slot
    e.submit(group_id=3, attempt=2, prompt=PROMPT, n=2, max_tokens=40, temperature=1.0, seed=11)
    e.submit(group_id=4, attempt=1, prompt=PROMPT[:3], n=2, max_tokens=30, temperature=1.0, seed=12)
    for _ in range(10):
        e.step()
    assert len(e.running) == 3 and len(e.waiting) == 1 and e.batch.cache.allocated
    e.sleep()
    assert e.asleep and len(e) == 4 and not e.running and not e.batch.cache.allocated
    assert all(s.kv is None for s in e.waiting) and e.step() == []
    assert e.groups() == {(3, 2), (4, 1)}
    e.wake()
    got = run(e)
    assert sorted(got) == sorted(expected)
    for key, s in expected.items():  # each re-prefilled from its prefix, its generator where it was
        assert got[key].tokens == s.tokens
        assert torch.allclose(torch.tensor(got[key].logprobs), torch.tensor(s.logprobs), atol=1e-4)
    e.sleep()  # a load that ends after the yield is made awake, and the engine sleeps on
    e.load_weights(0, tiny_model / "model.safetensors", sha256_file(tiny_model / "model.safetensors"))
    assert e.asleep
    e.wake()
    e.submit(group_id=3, attempt=3, prompt=PROMPT, n=1, max_tokens=40, temperature=1.0, seed=11)
    assert next(iter(run(e).values())).tokens == expected[(3, 2, 0)].tokens


def test_without_sleep_on_yield_a_sleep_changes_nothing(tiny_model):
    e = engine(tiny_model)
    e.submit(group_id=1, attempt=1, prompt=PROMPT, n=2, max_tokens=20, temperature=1.0, seed=3)
    e.step()
    e.sleep()
    assert not e.asleep and len(e.running) == 2 and e.batch.cache.allocated  # the slot cache is kept


def test_weights_load_in_place_are_verified_and_change_the_output(tiny_model, tmp_path):
    from safetensors.torch import save_file

    e = engine(tiny_model)
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in e.model.state_dict().items()}
    path = tmp_path / "v1.safetensors"
    save_file({k: v.contiguous() for k, v in new.items()}, str(path))
    good = sha256_file(path)
    e.submit(group_id=1, attempt=1, prompt=PROMPT, n=1, max_tokens=12, temperature=0.0)
    with pytest.raises(EngineError, match="running"):
        e.load_weights(1, path, good)
    (before,) = run(e).values()
    with pytest.raises(EngineError, match="sha256"):
        e.load_weights(1, path, hashlib.sha256(b"other").hexdigest())
    assert e.version == 0
    e.load_weights(1, path, good)
    assert e.version == 1
    e.submit(group_id=1, attempt=1, prompt=PROMPT, n=1, max_tokens=12, temperature=0.0)
    (after,) = run(e).values()
    assert after.tokens != before.tokens


def test_weights_retired_before_the_load_are_refused_and_during_it_load_as_checked(tiny_model, tmp_path, monkeypatch):
    """The broker may retire a version it told a worker to load once a newer order replaced that one. A file gone
    before the engine opens it is refused (EngineError: the worker stays on its version), not a crash; once opened,
    the file checked is the file loaded, so one deleted between the check and the load still loads whole."""
    import dora.store.load

    e = engine(tiny_model)
    path = tmp_path / "v1.safetensors"
    path.write_bytes((tiny_model / "model.safetensors").read_bytes())
    good = sha256_file(path)
    with pytest.raises(EngineError, match=r"v2: cannot read .*v2\.safetensors"):
        e.load_weights(2, tmp_path / "v2.safetensors", good)
    checked = dora.store.load.verify

    def check_then_retire(*args, **kwargs):  # the file is deleted between its check and the read of its tensors
        found = checked(*args, **kwargs)
        path.unlink()
        return found

    monkeypatch.setattr(dora.store.load, "verify", check_then_retire)
    e.load_weights(1, path, good)
    assert e.version == 1 and not path.exists()


def test_top_p_samples_only_from_the_nucleus(tiny_model):
    e = engine(tiny_model)
    e.submit(group_id=1, attempt=1, prompt=PROMPT, n=4, max_tokens=12, temperature=1.0, top_p=0.3, seed=2)
    for s in run(e).values():
        with torch.no_grad():
            logits = e.model(input_ids=torch.tensor([PROMPT + s.tokens])).logits[0].float()
        for pos, token in enumerate(s.tokens):
            p = torch.softmax(logits[len(PROMPT) - 1 + pos], -1)
            sorted_p, order = torch.sort(p, descending=True)
            nucleus = order[torch.cumsum(sorted_p, 0) - sorted_p < 0.3].tolist()
            assert token in nucleus


def _flip_a_bit_near_the_end(file) -> None:
    """One bit of the file's last chunk flipped in place (the manifest still names the original bytes)."""
    data = bytearray(file.read_bytes())
    data[-3] ^= 0x10
    file.write_bytes(bytes(data))


def test_a_version_refused_for_a_flipped_byte_leaves_every_weight_as_it_was(tiny_model, tmp_path):
    """The digest is checked before the model is touched: a refused version (here one bit in the store's last
    chunk) names the chunk and leaves the engine on its previous weights, bit for bit."""
    from dora.store import WeightStore

    e = engine(tiny_model)
    before = {k: v.clone() for k, v in e.model.state_dict().items()}
    store = WeightStore(tmp_path, chunk_bytes=1 << 20)
    _, digest, _ = store.publish(1, {k: v + 1.0 for k, v in before.items() if "rotary" not in k})
    _flip_a_bit_near_the_end(store.path(1) / "model.safetensors")
    with pytest.raises(EngineError, match=r"v1 at .*: 1 of \d+ chunks differ from the manifest, the first at bytes"):
        e.load_weights(1, store.path(1), digest)
    assert e.version == 0
    assert all(torch.equal(v, before[k]) for k, v in e.model.state_dict().items())


def _published(store, version: int, state: dict) -> tuple:
    _, digest, _ = store.publish(version, {k: v for k, v in state.items() if "rotary" not in k})
    return store.path(version), digest


@pytest.mark.parametrize("piece", [4099, 1 << 20])
def test_a_version_checked_as_it_is_copied_loads_what_the_whole_file_check_loads(tiny_model, tmp_path, monkeypatch,
                                                                                  piece):  # fmt: skip
    """Once an engine holds a version loaded from a file, the next one is checked chunk by chunk as it is copied
    in (pieces that cross tensors and chunks here): the weights are those a fresh engine loads after checking the
    whole file. A plain sha256 digest has no chunks to check one by one: it loads the whole-file way."""
    import dora.rollout.engines.torch.engine as te
    import dora.store.load
    from dora.store import WeightStore

    monkeypatch.setattr(dora.store.load, "IN_PLACE_PIECE_BYTES", piece)
    took = []

    def spy(file, *args, **kwargs):  # the loads done in place
        found = dora.store.load_into(file, *args, **kwargs)
        took.append(file)
        return found

    monkeypatch.setattr(te, "load_into", spy)
    store = WeightStore(tmp_path, chunk_bytes=1 << 20)
    base = {k: v.clone() for k, v in engine(tiny_model).model.state_dict().items()}
    v1, d1 = _published(store, 1, {k: v * 0.5 for k, v in base.items()})
    v2, d2 = _published(store, 2, {k: v + torch.arange(v.numel()).view(v.shape) % 7 for k, v in base.items()})
    assert (v2 / "model.safetensors").stat().st_size > 2 << 20, "the file spans several chunks"
    e, fresh = engine(tiny_model), engine(tiny_model)
    e.load_weights(1, v1, d1)
    assert took == [], "nothing kept yet: the first load checks the whole file"
    e.load_weights(2, v2, d2)
    fresh.load_weights(2, v2, d2)
    assert took == [v2] and e.version == 2
    assert all(torch.equal(v, fresh.model.state_dict()[k]) for k, v in e.model.state_dict().items())
    assert not all(torch.equal(v, base[k]) for k, v in e.model.state_dict().items() if "rotary" not in k)
    e.load_weights(3, v1 / "model.safetensors", sha256_file(v1 / "model.safetensors"))
    assert took == [v2] and e.version == 3
    assert all(torch.equal(v, (base[k] * 0.5)) for k, v in e.model.state_dict().items() if "rotary" not in k)


def test_a_version_refused_after_its_copy_began_puts_the_held_version_back_bit_for_bit(tiny_model, tmp_path):
    """A flipped byte in the last chunk of a version checked as it is copied: the chunks before it are already in
    the model when the mismatch is found; the engine puts back the version it held, from that version's file, and
    stays on it, bit for bit, naming the chunk."""
    from dora.store import WeightStore

    store = WeightStore(tmp_path, chunk_bytes=1 << 20)
    e = engine(tiny_model)
    base = {k: v.clone() for k, v in e.model.state_dict().items()}
    v1, d1 = _published(store, 1, {k: v - 1.0 for k, v in base.items()})
    v2, d2 = _published(store, 2, {k: v + 1.0 for k, v in base.items()})
    e.load_weights(1, v1, d1)
    held = {k: v.clone() for k, v in e.model.state_dict().items()}
    _flip_a_bit_near_the_end(v2 / "model.safetensors")
    with pytest.raises(EngineError, match=r"v2 at .*: 1 of \d+ chunks differ from the manifest, the first at bytes"):
        e.load_weights(2, v2, d2)
    assert e.version == 1
    assert all(torch.equal(v, held[k]) for k, v in e.model.state_dict().items())
    assert not all(torch.equal(v, base[k]) for k, v in held.items() if "rotary" not in k)


def test_a_bf16_sequence_migrates_with_its_kv_cache_exactly(tiny_model):
    """numpy has no bfloat16: the cache travels as float32 and comes back bit for bit, and the sample goes on as it
    would have where it started."""
    alone = TorchEngine(tiny_model, version=0, dtype="bfloat16")
    alone.submit(group_id=1, attempt=1, prompt=[5, 6, 7], n=1, max_tokens=12, seed=3)
    want = []
    while len(alone):
        want += alone.step()
    src = TorchEngine(tiny_model, version=0, dtype="bfloat16")
    src.submit(group_id=1, attempt=1, prompt=[5, 6, 7], n=1, max_tokens=12, seed=3)
    for _ in range(5):
        src.step()
    [state] = src.export(1, 1, with_kv=True)
    assert state.kv and all(a.dtype == np.float32 for a in state.kv)
    dst = TorchEngine(tiny_model, version=0, dtype="bfloat16")
    [seq] = dst.import_(group_id=1, attempt=1, prompt=[5, 6, 7], requests=[state], max_tokens=12)
    assert all(k.dtype == torch.bfloat16 for pair in seq.kv for k in pair)
    got = []
    while len(dst):
        got += dst.step()
    assert got[0].tokens == want[0].tokens
