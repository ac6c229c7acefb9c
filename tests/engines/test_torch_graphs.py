"""The torch engine's decode step as a CUDA graph records it: a bucket of slot rows (the running ones, then rows a
sequence left or none used), every cache column read under the rows' masks. On a CPU the same step runs without
capture (the computation a graph replays); on a GPU (marked ``gpu``) graphs are captured, replayed, and make what
eager steps make."""

from __future__ import annotations

import pytest
import torch

from dora.rollout.engines.torch.engine import TorchEngine
from dora.rollout.engines.torch.graphs import DecodeGraphs
from tests.engines.test_engines import PROMPT, logprobs_of, run

pytestmark = pytest.mark.timeout(300)
CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


class Uncaptured(DecodeGraphs):
    """Replays run the recorded step's computation itself (bucket rows, full width), with no CUDA graph."""

    def _capture(self, rows: int, width: int, nucleus: bool):
        run = self.run

        class Step:
            def replay(self) -> None:
                run(rows, width, nucleus)

        return Step()


def crowd(e: TorchEngine) -> dict:
    """Three samples, then three more join (top-p on two, a greedy one): buckets of 4 and 8 rows, both kinds."""
    e.submit(group_id=0, attempt=1, prompt=PROMPT, n=3, max_tokens=30, seed=1)
    for _ in range(4):
        e.step()
    e.submit(group_id=1, attempt=1, prompt=PROMPT[:3], n=2, max_tokens=20, top_p=0.9, seed=2)
    e.submit(group_id=2, attempt=1, prompt=[5] * 9, n=1, max_tokens=25, temperature=0.0)
    return run(e)


def prompt_of(group: int) -> list[int]:
    return {0: PROMPT, 1: PROMPT[:3], 2: [5] * 9}[group]


def test_the_step_a_graph_records_makes_what_the_eager_step_makes(tiny_model):
    eager = crowd(TorchEngine(tiny_model, max_slots=8, version=0))
    e = TorchEngine(tiny_model, max_slots=8, version=0)
    e.batch.graphs = Uncaptured(e.batch._decode_rows, e.device, 8)
    recorded = crowd(e)
    assert {k[0] for k in e.batch.graphs.graphs} == {4, 8} and {k[2] for k in e.batch.graphs.graphs} == {False, True}
    for key, s in eager.items():
        assert recorded[key].tokens == s.tokens
        torch.testing.assert_close(torch.tensor(recorded[key].logprobs), torch.tensor(s.logprobs), atol=1e-4, rtol=0)


def test_a_graph_whose_first_replay_differs_from_the_eager_step_is_never_used(tiny_model):
    """A replay that makes other tokens and writes other keys (here scrambled after the step): the eager step that
    follows a new graph's first replay rewrites both, and graphs are off from then on."""
    eager = crowd(TorchEngine(tiny_model, max_slots=8, version=0))
    e = TorchEngine(tiny_model, max_slots=8, version=0)
    batch = e.batch

    class Scrambled(Uncaptured):
        def _capture(self, rows, width, nucleus):
            step = super()._capture(rows, width, nucleus)

            class Replay:
                def replay(self) -> None:
                    step.replay()
                    batch.out[0, :rows] += 1
                    at = batch.ints[:rows, 1]  # the column each row's key went to
                    for keys in batch.cache.keys:
                        keys[torch.arange(rows), :, at] += 100.0

            return Replay()

    batch.graphs = Scrambled(batch._decode_rows, e.device, 8)
    got = crowd(e)
    assert batch.graphs.broken == "a graph's first replay differed from the eager step" and not batch.graphs.graphs
    for key, s in eager.items():
        assert got[key].tokens == s.tokens
        torch.testing.assert_close(torch.tensor(got[key].logprobs), torch.tensor(s.logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_are_captured_and_make_what_eager_steps_make(tiny_model, dtype):
    got = {}
    for graphs in (False, True):
        e = TorchEngine(tiny_model, device="cuda", dtype=dtype, max_slots=8, version=0, cuda_graphs=graphs)
        got[graphs] = crowd(e)
    made = e.batch.graphs
    assert made.broken is None and len(made.graphs) >= 3, (made.broken, list(made.graphs))
    gaps = []
    for key, s in got[False].items():
        g = got[True][key]
        ref = logprobs_of(e.model, prompt_of(key[0]), g.tokens, 1.0).cpu()
        if dtype == "float32":  # the same numbers to float rounding: the same tokens
            assert g.tokens == s.tokens
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(s.logprobs), atol=1e-4, rtol=0)
            if key[0] == 0:
                torch.testing.assert_close(torch.tensor(g.logprobs), ref, atol=1e-3, rtol=0)
        elif key[0] == 0:
            gaps.append((torch.tensor(g.logprobs) - ref).abs())
    if gaps:  # bf16: the batched decode and one full forward round differently
        gap = torch.cat(gaps)
        assert float(gap.mean()) < 0.05 and float(gap.max()) < 0.5, gap


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_sleep_drops_the_graphs_and_the_cache_and_the_wake_goes_on_exactly(tiny_model):
    ref = crowd(TorchEngine(tiny_model, device="cuda", max_slots=8, version=0))
    e = TorchEngine(tiny_model, device="cuda", max_slots=8, version=0, sleep_on_yield=True)
    e.submit(group_id=0, attempt=1, prompt=PROMPT, n=3, max_tokens=30, seed=1)
    for _ in range(4):
        e.step()
    assert e.batch.graphs.graphs
    e.sleep()
    assert not e.batch.graphs.graphs and not e.batch.cache.allocated
    e.wake()
    e.submit(group_id=1, attempt=1, prompt=PROMPT[:3], n=2, max_tokens=20, top_p=0.9, seed=2)
    e.submit(group_id=2, attempt=1, prompt=[5] * 9, n=1, max_tokens=25, temperature=0.0)
    got = run(e)
    assert e.batch.graphs.broken is None and e.batch.graphs.graphs
    for key, s in ref.items():
        assert got[key].tokens == s.tokens
        torch.testing.assert_close(torch.tensor(got[key].logprobs), torch.tensor(s.logprobs), atol=1e-4, rtol=0)
