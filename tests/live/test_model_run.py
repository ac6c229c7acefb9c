"""A live multi-version run on a real model: broker + 2 `dora rollout --engine torch|vllm` + the sim learner."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from dora.learner.schedule import LrSchedule
from tests.live.cluster import cluster

pytestmark = pytest.mark.timeout(240)


def torch_run(tmp_path: pathlib.Path, tiny_model: pathlib.Path, steps: int, *, min_workers: int, max_tokens: int,
              **sections: dict) -> dict:  # fmt: skip
    """Overrides for a run of torch workers and the torch learner on the tiny model (4 groups of 4 a step, K = 1);
    ``sections`` add to (or replace keys of) each section."""
    overrides = {
        "core": {"total_steps": steps, "max_staleness": 1, "train_groups": 4, "group_size": 4,
                 "min_workers": min_workers},
        "run": {"max_tokens": max_tokens},
        "task": {"name": "arithmetic", "tokenizer": str(tiny_model), "reward": "dora.tasks.rewards:digits_shaped"},
        "broker": {"heartbeat_interval_s": 0.5, "liveness": 20},
        "rollout": {"max_slots": 16, "credit_slots": 16},
        "learner": {"model": str(tiny_model), "store": str(tmp_path / "store"), "lr": 1e-3},
    }  # fmt: skip
    for section, values in sections.items():
        overrides.setdefault(section, {}).update(values)
    return overrides


@contextmanager
def store_sampled(root: pathlib.Path, every_s: float = 0.002) -> Iterator[list[set[int]]]:
    """Every few ms while the body runs, the set of versions with anything on disk in a store: published
    (``v<N>``), being written (``.v<N>.….tmp``) or being deleted (renamed aside, ``.v<N>.….tmp``)."""
    seen: list[set[int]] = []
    stop = threading.Event()
    name = re.compile(r"\.?v(\d+)(?:\..*\.tmp)?")

    def sample() -> None:
        while not stop.wait(every_s):
            try:
                names = os.listdir(root)
            except FileNotFoundError:
                continue
            found = {int(m[1]) for n in names if (m := name.fullmatch(n))}
            if not seen or found != seen[-1]:
                seen.append(found)

    thread = threading.Thread(target=sample, name="store-sampler", daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join(5)


def wait_steps(c, n: int, learner: str, timeout_s: float = 150) -> None:
    """Until the broker has recorded ``n`` train steps (the learner must not exit meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while len(c.events("broker", "train_step")) < n:
        assert time.monotonic() < deadline and c.procs[learner].poll() is None, c.log(learner)[-3000:]
        time.sleep(0.1)


@pytest.mark.vllm
# slow: by default a vLLM worker serves a live run of several versions, every group trained once, in
# test_every_learner_option_on_trains_from_torch_and_vllm_workers, and logs no error in test_episodes_run.py's
# test_lora_workers_keep_the_version_of_episodes_open_across_a_publish_and_train_one_version_per_turn; several
# versions served at once, steps on data one version old and rewards in [0, 1] are checked on torch workers in
# test_a_torch_learner_trains_and_standalone_and_elastic_workers_load_every_published_version
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the vllm extra is not installed")
def test_vllm_workers_serve_a_multi_version_run_with_real_tokens_and_rewards(tmp_path, tiny_model):
    """The torch engine's counterpart runs beside the torch learner (next test)."""
    steps, k, b, g, engine = 6, 1, 4, 2, "vllm"
    overrides = {
        "core": {"total_steps": steps, "max_staleness": k, "train_groups": b, "group_size": g, "min_workers": 2},
        "run": {"time_scale": 0.001, "max_tokens": 24},
        "task": {"name": "arithmetic", "tokenizer": str(tiny_model)},
        "broker": {"heartbeat_interval_s": 0.5, "liveness": 20},
        "rollout": {"max_slots": 8, "credit_slots": 8, "kv_cache_mib": 64, "max_model_len": 1024},
    }
    with cluster(tmp_path, overrides) as c:
        c.start_broker()
        for i in range(2):
            c.start_worker(f"w{i}", engine, "--model", str(tiny_model))
        c.start_learner()
        assert c.wait("learner", 200) == 0, c.log("learner")[-3000:] + c.log("w0")[-3000:]
        assert c.wait("broker", 15) == 0
        audit = c.check_exactly_once()
        served = {v for r in audit for v in r["versions"]}  # a version may go by unserved (published again first)
        assert 0 in served and len(served) >= 3, f"several versions served: {served}"
        assert any(r["staleness"].get("1") for r in audit), "no step trained on older data: not asynchronous"
        finished = c.events("broker", "train_step")
        assert len(finished) == steps and all(0.0 <= r["learner"]["reward_mean"] <= 1.0 for r in finished)
        workers = [json.loads(line) for w in ("w0", "w1") for line in c.log(w).splitlines() if line.startswith("{")]
        assert not [r for r in workers if r.get("level") == "error"], [r for r in workers if r.get("level") == "error"]


def test_a_custom_engine_from_the_example_serves_a_run(tmp_path):
    example = pathlib.Path(__file__).resolve().parents[2] / "examples" / "custom_engine.py"
    with cluster(tmp_path, {"core": {"total_steps": 6, "min_workers": 2}}) as c:
        c.start_broker()
        for i in range(2):
            with open(tmp_path / f"c{i}.log", "wb") as log:
                c.procs[f"c{i}"] = subprocess.Popen(
                    [sys.executable, str(example), "--broker", str(tmp_path / "broker.json"), "--config",
                     str(c.config), "--name", f"c{i}"], stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        c.start_learner()
        assert c.wait("learner", 60) == 0, c.log("learner")[-2000:] + c.log("c0")[-2000:]
        c.check_exactly_once()


def test_a_torch_learner_trains_and_standalone_and_elastic_workers_load_every_published_version(tmp_path, tiny_model):
    """The whole loop on a real model: GRPO steps, weights published to the store, verified and loaded by the torch
    workers, retired versions deleted from the store: sampled all along, the store never holds more than K + 2
    versions (K + 1 alive in the ledger, and the next one being written). Of the two workers, ``e`` is elastic
    and shares the learner's cores: each batch goes out only once it has paused, and it goes on after the publish.
    Several versions are served at once, and steps train on data one version old: the run is asynchronous."""
    steps = 5
    store = tmp_path / "store"
    overrides = torch_run(tmp_path, tiny_model, steps, min_workers=2, max_tokens=16)
    with cluster(tmp_path, overrides, fork=True) as c, store_sampled(store) as seen:
        c.start_broker()
        c.start_worker("w0", "torch", "--model", str(tiny_model))
        c.start_worker("e", "torch", "--model", str(tiny_model), "--elastic")
        c.spawn("learner", "learner", "--trainer", "torch", "--broker", str(tmp_path / "broker.json"))
        assert c.wait("learner", 200) == 0, c.log("learner")[-3000:]
        assert c.wait("broker", 15) == 0, c.log("broker")[-3000:]
        audit = c.check_exactly_once()
        served = {v for r in audit for v in r["versions"]}  # a version may go by unserved (published again first)
        assert 0 in served and len(served) >= 3, f"several versions served: {served}"
        assert any(r["staleness"].get("1") for r in audit), "no step trained on older data: not asynchronous"
        k = overrides["core"]["max_staleness"]
        assert seen and max(map(len, seen)) <= k + 2, f"more than K + 2 = {k + 2} versions on disk: {seen}"
        assert set().union(*seen) >= set(range(1, steps + 1)), seen  # the sampler saw every version go by
        published = c.events("broker", "train_step")
        assert [r["version"] for r in published] == list(range(1, steps + 1))
        assert all(r["learner"]["tokens"] > 0 and 0.0 <= r["learner"]["reward_mean"] <= 1.0 for r in published)
        # a step whose groups all scored alike has no advantage and moves nothing; the others do
        assert sum(r["learner"]["grad_norm"] > 0 for r in published) >= 2, [r["learner"] for r in published]
        loaded = [(r["version"], r["uri"]) for w in ("w0", "e") for r in c.events(w, "weights_loaded")]
        assert {v for v, uri in loaded if uri.startswith("file://")} >= {1, 2}, loaded
        retired = [r for r in c.events("broker", "version_retired") if r.get("deleted")]
        assert retired and all(not pathlib.Path(r["deleted"]).exists() for r in retired)
        left = sorted(p.name for p in store.iterdir())
        assert f"v{steps}" in left and len(left) <= 3, left  # only what the ledger may still need
        marks = [r["event"] for r in c.events("broker") if r["event"] in ("worker_yielded", "train_step")]
        assert marks == ["worker_yielded", "train_step"] * steps, "each step trained after the elastic worker paused"
        mine = [r["event"] for r in c.events("e") if r["event"] in ("yielded", "resumed")]
        assert mine[: 2 * (steps - 1)] == ["yielded", "resumed"] * (steps - 1), mine
        assert not [r for w in ("w0", "e") for r in c.events(w) if r.get("level") == "error"]


def test_a_learner_drained_stopped_or_killed_resumes_from_its_checkpoint_and_trains_no_group_twice(
    tmp_path, tiny_model
):
    """SIGUSR1 (Slurm's early warning): the learner finishes the step in flight, checkpoints and leaves with
    exit 0. SIGTERM to an idle learner: it checkpoints the version it holds and leaves. Each time a new
    learner resumes from exactly that checkpoint. Then kill -9 mid-run, steps after that checkpoint: a new learner
    loads the checkpoint (model, optimizer, RNG, trained group ids), takes the weights it published after it from
    the store, and finishes the run: every version published once, every group trained once."""
    from dora.ops.audit import audit_run

    steps = 24  # room to spare: the batches already out when w0 stops are trained before the SIGTERM
    ckpt = tmp_path / "ckpt"
    overrides = torch_run(
        tmp_path,
        tiny_model,
        steps,
        min_workers=1,
        max_tokens=12,
        broker={"liveness": 40, "journal": str(tmp_path / "journal.jsonl")},
        learner={"checkpoint_dir": str(ckpt), "checkpoint_every": 1000},
    )  # only signals, and the last step

    with cluster(tmp_path, overrides, fork=True) as c:
        c.start_broker()
        c.start_worker("w0", "torch", "--model", str(tiny_model))
        learner = ["learner", "--trainer", "torch", "--broker", str(tmp_path / "broker.json")]
        c.spawn("learner", *learner)
        wait_steps(c, 2, "learner")
        c.signal("learner", signal.SIGUSR1)
        assert c.wait("learner", 60) == 0, c.log("learner")[-3000:]
        [stopped] = c.events("learner", "learner_stopped")
        drained = stopped["version"]
        assert stopped["reason"] == "drained" and stopped["checkpointed"] == drained >= 2
        assert [(r["version"], r["reason"]) for r in c.events("learner", "checkpoint_saved")] == [(drained, "drained")]
        assert (ckpt / f"ckpt-v{drained}").is_dir()
        assert max(r["version"] for r in c.events("broker", "train_step")) == drained  # nothing published after

        c.spawn("learner2", *learner)
        wait_steps(c, drained + 2, "learner2")
        [resumed] = c.events("learner2", "resumed_from_checkpoint")
        assert resumed["version"] == drained and not c.events("learner2", "weights_from_store")
        c.signal("w0", signal.SIGSTOP)  # no more batches: the learner goes idle between steps
        settled, last = time.monotonic(), len(c.events("broker", "train_step"))
        while time.monotonic() - settled < 3:
            time.sleep(0.2)
            if len(c.events("broker", "train_step")) != last:
                settled, last = time.monotonic(), len(c.events("broker", "train_step"))
        assert last < steps, "the run ended before the SIGTERM: nothing left to test"
        c.signal("learner2", signal.SIGTERM)
        assert c.wait("learner2", 30) == 0, c.log("learner2")[-3000:]
        c.signal("w0", signal.SIGCONT)
        [stopped] = c.events("learner2", "learner_stopped")
        assert stopped["reason"] == "stopping" and stopped["checkpointed"] == stopped["version"] == last
        assert c.events("learner2", "checkpoint_saved")[-1]["reason"] == "stopping"

        c.spawn("learner3", *learner)
        wait_steps(c, last + 2, "learner3")
        assert c.events("learner3", "resumed_from_checkpoint")[0]["version"] == last
        c.signal("learner3", signal.SIGKILL)  # as if the crash came after publishing, with no checkpoint since
        c.procs["learner3"].wait(10)
        newest = max(r["version"] for r in c.events("broker", "train_step"))
        kept = max(int(p.name[6:]) for p in ckpt.glob("ckpt-v*"))
        assert kept == last < newest < steps, (kept, last, newest)

        c.spawn("learner4", *learner)
        assert c.wait("learner4", 200) == 0, c.log("learner4")[-3000:]
        assert c.wait("broker", 15) == 0, c.log("broker")[-3000:]
        [resumed] = c.events("learner4", "resumed_from_checkpoint")
        assert resumed["version"] == kept and resumed["groups"] == 4 * kept
        [adopted] = c.events("learner4", "weights_from_store")
        assert (adopted["version"], adopted["optimizer_state_version"]) == (newest, kept)
        assert [r["version"] for r in c.events("broker", "train_step")] == list(range(1, steps + 1))
        assert c.events("learner4", "checkpoint_saved")[-1]["version"] == steps
        c.check_exactly_once()
        report = audit_run(tmp_path / "journal.jsonl", tmp_path / "audit.jsonl", total_steps=steps)
        assert report.ok and report.finished, report.problems


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the vllm extra is not installed")
def test_every_learner_option_on_trains_from_torch_and_vllm_workers(tmp_path, tiny_model):
    """The learner's options all at once, on samples drawn at top_p 0.9 by a torch and a vLLM worker: two
    mini-batches and two epochs (four optimizer steps a batch), the decoupled correction masked and capped per
    sequence, GSPO's sequence ratio, RLOO, KL (k2) to the start model, an entropy bonus, a cosine decay after a warmup,
    weight decay. The run ends with every group trained once, and every step reports its health."""
    steps = 4
    learner = {"mini_batches": 2, "epochs": 2, "is_cap": 2.0, "is_mask": 4.0, "is_level": "sequence",
               "ratio": "sequence", "clip_low": 0.05, "clip_high": 0.05, "advantage": "rloo", "kl_coef": 0.05,
               "kl_estimator": "k2", "entropy_coef": 0.001, "lr_schedule": "cosine", "warmup_steps": 2,
               "weight_decay": 0.01}  # fmt: skip
    overrides = torch_run(tmp_path, tiny_model, steps, min_workers=2, max_tokens=12, learner=learner,
                          run={"max_tokens": 12, "top_p": 0.9, "temperature": 0.9},
                          rollout={"kv_cache_mib": 64, "max_model_len": 1024})  # fmt: skip
    with cluster(tmp_path, overrides, fork=True) as c:
        c.start_broker()
        c.start_worker("t", "torch", "--model", str(tiny_model))
        c.start_worker("v", "vllm", "--model", str(tiny_model))
        c.spawn("learner", "learner", "--trainer", "torch", "--broker", str(tmp_path / "broker.json"))
        assert c.wait("learner", 220) == 0, c.log("learner")[-3000:] + c.log("v")[-2000:]
        assert c.wait("broker", 15) == 0, c.log("broker")[-3000:]
        audit = c.check_exactly_once()
        assert {v for r in audit for v in r["versions"]} >= {0, 1}
        steps_seen = [r["learner"] for r in c.events("broker", "train_step")]
        assert len(steps_seen) == steps
        for k, row in enumerate(steps_seen):
            assert row["optimizer_steps"] == 4 and row["entropy"] > 0 and row["kl_ref"] >= 0, row
            assert 0 < row["is_weight_max"] <= 2.0 and 0 <= row["is_corrected"] <= 1, row
            assert row["length_max"] <= 12 and 0 <= row["truncated_share"] <= 1 and 0 <= row["uniform_share"] <= 1
            # the cosine after a warmup of 2, over 4 batches x 4 optimizer steps: each batch reports its last step's
            want = LrSchedule(lr=1e-3, kind="cosine", warmup_steps=2, total_steps=steps * 4).at(4 * k + 3)
            assert row["lr"] == pytest.approx(want, rel=1e-3, abs=1e-9), (k, row["lr"], want)
        gaps = [row["mismatch_abs"] for row in steps_seen if "mismatch_abs" in row]
        assert gaps and max(gaps) < 0.01, gaps  # staleness-0 tokens: the same nucleus, the same weights
        served = {c.events(w, "weights_loaded")[-1]["version"] for w in ("t", "v") if c.events(w, "weights_loaded")}
        assert served, "neither worker loaded a published version"
