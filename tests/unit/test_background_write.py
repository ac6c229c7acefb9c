"""A version written in the background (dora.learner.writing) by a process that is killed mid-write leaves no version:
the store lists none, and the next publisher removes the dead one's temporary folder. A write that fails is the
learner's error, never a version."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from dora.learner.trainers import PendingVersion
from dora.learner.writing import BackgroundWrite, WriteFailed
from dora.samples import Batch
from dora.store import WeightStore

WRITER = r"""
import sys, time, torch
from dora.learner.writing import BackgroundWrite
from dora.learner.trainers import PendingVersion
from dora.samples import Batch
from dora.store import WeightStore
from dora.store.snapshot import HostSnapshot

store = WeightStore(sys.argv[1], chunk_bytes=1 << 20)
state = {f"layer{i}.weight": torch.full((1024, 1024), float(i)) for i in range(32)}  # 128 MiB of fp32
views = HostSnapshot(shard_bytes=store.shard_bytes).take(state, torch.bfloat16)
write = BackgroundWrite(PendingVersion(version=1, write=lambda: store.publish(1, views), snapshot_s=0.0),
                        Batch(step=0, groups=()), {}, {}).start()
print("writing", flush=True)
write.done.result()
print("written", flush=True)
"""


def test_a_learner_killed_while_its_version_is_written_leaves_no_version(tmp_path):
    root = tmp_path / "store"
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "writing"
        deadline = time.monotonic() + 30
        while not list(root.glob(".v1.*.tmp/*.safetensors")):  # the write has begun: its first file is there
            assert time.monotonic() < deadline and child.poll() is None, "the write never began"
            time.sleep(0.001)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
    if (root / "v1").exists():
        pytest.skip("the write ended before the kill landed (a very fast disk): nothing to check")
    store = WeightStore(root, stale_temp_s=3600.0)  # opening a store removes what dead publishers left
    assert store.versions() == []
    assert not list(root.iterdir()), f"left behind: {sorted(p.name for p in root.iterdir())}"


def test_a_write_that_fails_is_an_error_of_the_learner_not_a_version(tmp_path):
    store = WeightStore(tmp_path / "store")

    def full_disk() -> tuple[str, str, float]:
        raise OSError(28, "No space left on device")

    write = BackgroundWrite(PendingVersion(version=3, write=full_disk, snapshot_s=0.0), Batch(step=2, groups=()),
                            {}, {}).start()  # fmt: skip
    with pytest.raises(OSError):
        write.done.result(timeout=10)
    with pytest.raises(WriteFailed, match="v3: OSError"):
        write.result()
    assert store.versions() == []
    ok = BackgroundWrite(PendingVersion(version=1, write=lambda: store.publish(1, {"w": torch.ones(4)}),
                                        snapshot_s=0.0), Batch(step=0, groups=()), {}, {}).start()  # fmt: skip
    ok.done.result(timeout=30)
    uri, digest, _ = ok.result()
    assert uri.endswith("/v1") and store.digest(1) == digest and store.versions() == [1]
