"""C2 over a dataset's epochs, with real processes: the broker is killed -9 in the middle of an epoch and a new
one resumes from the journal; every row of every epoch is trained exactly once, in the permutation the
first broker began, and a broker started on other rows refuses the journal."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections import Counter

import pytest

from dora.broker.journal import replay
from dora.tasks.datasets import Epochs
from tests.live.cluster import cluster
from tests.live.test_faults import wait_until

pytestmark = pytest.mark.timeout(180)

ROWS, B, EPOCHS = 12, 4, 3


def write_dataset(path, rows: int) -> None:
    path.write_text("".join(json.dumps({"prompt": f"{i} + {i} =", "answer": str(2 * i)}) + "\n" for i in range(rows)))


def test_a_broker_killed_mid_epoch_resumes_the_same_permutation_and_trains_every_row_once(tmp_path, tiny_model):
    data = tmp_path / "rows.jsonl"
    write_dataset(data, ROWS)
    journal = tmp_path / "journal.jsonl"
    steps = EPOCHS * ROWS // B
    overrides = {
        "core": {"total_steps": steps, "train_groups": B, "min_workers": 2},
        "broker": {"journal": str(journal)},
        "rollout": {"reconnect_max_s": 1.0},
        "task": {"dataset": str(data), "tokenizer": str(tiny_model), "seed": 7,
                 "reward": "dora.tasks.rewards:exact_match"},
    }  # fmt: skip
    with cluster(tmp_path, overrides) as c:
        c.start(workers=2)  # sim workers and trainer: the broker's prompts are the dataset's
        wait_until(lambda: len(c.events("broker", "train_step")) >= ROWS // B + 1, 60, "a step into epoch 1")
        c.signal("broker", signal.SIGKILL)
        c.wait("broker", 10)
        c.start_broker(name="broker2")
        assert c.wait("learner", 120) == 0, c.log("learner")[-3000:] + c.log("broker2")[-3000:]
        assert c.wait("broker2", 15) == 0, c.log("broker2")[-3000:]
        [loaded] = c.events("broker2", "task_loaded")
        assert loaded["rows"] == loaded["kept"] == ROWS and loaded["filtered"] == 0
        steps_done = c.check_exactly_once()
    starts = replay(journal).starts
    assert len(starts) == 2 and starts[0]["shape"]["dataset"] == starts[1]["shape"]["dataset"]
    assert starts[0]["shape"]["dataset"]["rows"] == ROWS
    trained = sorted(g for r in steps_done for g in r["groups"])
    assert trained == list(range(EPOCHS * ROWS))
    order = Epochs(list(range(ROWS)), seed=7)
    for epoch in range(EPOCHS):
        rows = Counter(order.row(g) for g in range(epoch * ROWS, (epoch + 1) * ROWS))
        assert rows == Counter(range(ROWS)), (epoch, rows)
    assert [order.row(g) for g in range(ROWS)] != list(range(ROWS))  # a permutation, not the file's order

    write_dataset(data, ROWS + 1)  # other rows: the journal's cursor would name other rows
    cfg = tmp_path / "other.toml"
    cfg.write_text(c.config.read_text())
    r = subprocess.run([sys.executable, "-m", "dora", "broker", "--config", str(cfg)], capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and "was written by a run with" in r.stderr and "Traceback" not in r.stderr, r.stderr
