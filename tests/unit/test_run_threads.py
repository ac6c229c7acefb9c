"""`dora run`'s CPU threads per process: what runs at once fits the cores, elastic workers and the learner taking
turns on the same ones."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dora.launch.run import Threads, thread_shares


def test_elastic_workers_share_the_learners_cores():
    assert thread_shares(2, workers=2, elastic=0, ranks=1) == Threads(1, 1, 1)  # oversubscribed: one each
    assert thread_shares(2, workers=2, elastic=2, ranks=1) == Threads(1, 2, 1)  # colocated: the learner gets both
    assert thread_shares(16, workers=4, elastic=0, ranks=2) == Threads(2, 2, 2)
    assert thread_shares(16, workers=4, elastic=2, ranks=2) == Threads(4, 4, 4)
    assert thread_shares(10, workers=7, elastic=6, ranks=1) == Threads(1, 6, 1)


@given(cpus=st.integers(1, 256), workers=st.integers(1, 64), ranks=st.integers(1, 16), data=st.data())
def test_what_runs_at_once_fits_the_cores_whenever_one_thread_each_does(cpus, workers, ranks, data):
    elastic = data.draw(st.integers(0, workers))
    t = thread_shares(cpus, workers=workers, elastic=elastic, ranks=ranks)
    assert min(t.standalone, t.learner_rank, t.elastic) >= 1
    at_once = t.standalone * (workers - elastic) + max(t.learner_rank * ranks, t.elastic * elastic)
    if cpus >= workers - elastic + max(ranks, elastic):
        assert at_once <= cpus
        assert at_once > cpus - (workers - elastic + max(ranks, elastic))  # no more than a share's rounding idle
    assert t.learner_rank >= t.standalone  # the learner never gets less than a worker
