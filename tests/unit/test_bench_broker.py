"""bench/broker_throughput.py: its fake workers' pre-encoded answers are the bytes the codec makes, and the broker
decodes them to the samples a worker sent."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest

from dora.wire import codec
from dora.wire import messages as m

PATH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "broker_throughput.py"
spec = importlib.util.spec_from_file_location("broker_throughput", PATH)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


@pytest.mark.parametrize("n_samples", [1, 8])
def test_replies_are_the_codecs_bytes_for_each_generate(n_samples: int) -> None:
    ids = (np.arange(64) % 50_000).astype(np.int32)
    lps = np.full(64, -0.7, np.float32)
    replies = bench.Replies(n_samples, ids, lps)
    for group, attempt, version, epoch in [(3, 1, 0, 7), (91, 2, 5, 2**61), (3, 1, 0, 7)]:
        gen = m.Generate(group_id=group, attempt=attempt, version=version, prompt_ids=np.zeros(4, np.int32),
                         n_samples=n_samples, max_tokens=64)  # fmt: skip
        got = [bytes(f) for f in replies.frames(gen, epoch)]
        want = [bytes(f) for f in codec.encode(bench.finished(gen, epoch, ids, lps))]
        assert got == want
        msg = codec.decode(got)
        assert [(x.group_id, x.attempt, x.index, x.segments, x.broker_epoch) for x in msg.samples] == [
            (group, attempt, i, ((version, 64),), epoch) for i in range(n_samples)
        ]
        assert np.array_equal(msg.token_ids, np.tile(ids, n_samples))
