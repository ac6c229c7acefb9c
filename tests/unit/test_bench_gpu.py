"""bench/gpu.py's quick mode on the CPU: the parts that run without a GPU (decode rates, the learner step, the
weight path, the snapshot's copy of the transfer part, whose GPU paths are skipped with their reason) each measure
something, and a part that fails is recorded while the others still run."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import pytest

PATH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "gpu.py"
spec = importlib.util.spec_from_file_location("bench_gpu", PATH)
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench  # its dataclasses look their module up
spec.loader.exec_module(bench)

pytestmark = pytest.mark.timeout(120)


def test_quick_mode_measures_decode_the_learner_step_and_the_weight_path(tmp_path):
    out = tmp_path / "gpu.json"
    parts = ["engine", "learner", "weights", "transfer"]
    assert bench.main(["--quick", "--device", "cpu", "--only", *parts, "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["meta"]["device"] == "cpu" and res["meta"]["torch"] and res["meta"]["transformers"]
    assert set(res) >= {"build", *parts} and "run" not in res and "static" not in res
    assert not [k for k in ("build", *parts) if "error" in res[k]], res
    assert res["build"]["params"] > 0 and res["model"]["tied"] is True
    for b in bench.QUICK.batches:
        row = res["engine"][f"batch_{b}"]
        assert row["dora_tok_s"] > 0 and row["hf_tok_s"] > 0
        assert row["dora_over_hf"] == pytest.approx(row["dora_tok_s"] / row["hf_tok_s"])
    learner = res["learner"]
    assert learner["tokens"] == bench.QUICK.train_groups * bench.QUICK.group * (
        bench.QUICK.train_prompt + bench.QUICK.completion
    )
    for kind in ("trainer", "plain"):
        assert learner[kind]["s"] > 0 and learner[kind]["tok_s"] > 0 and learner[kind]["mfu"] > 0
    assert 0 < learner["trainer"]["tokens_computed"] < learner["plain"]["tokens_computed"] == learner["tokens"]
    w = res["weights"]
    assert w["bytes"] > w["weight_bytes"] > 0  # the safetensors and what a version holds beside them
    assert all(w[k] > 0 for k in ("publish_s", "publish_s_per_gb", "load_s", "load_s_per_gb", "verified_load_s"))
    t = res["transfer"]  # on a CPU: the snapshot's copy measured, the GPU paths skipped with the reason
    assert t["sizes_gb"] == [0.016] and "no CUDA device" in t["skipped"]
    row = t["gb_0.016"]
    assert row["bytes"] == 16_000_000 and row["snapshot_gb_s"] > 0 and "h2d_gb_s" not in row


def test_a_failing_part_is_recorded_and_the_script_goes_on(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no engine today")

    monkeypatch.setattr(bench, "part_engine", broken)
    out = tmp_path / "gpu.json"
    assert bench.main(["--quick", "--device", "cpu", "--only", "engine", "weights", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert "RuntimeError: no engine today" in res["engine"]["error"]
    assert "error" not in res["weights"] and res["weights"]["load_s"] > 0
