"""The broker's Prometheus endpoint and record files: a real BrokerActor over inproc with fake peers runs a few
train steps; `/metrics` is scraped over HTTP and parsed, and its numbers are checked against what the peers saw,
the `dora status` snapshot, and the metrics and timeline files."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections import Counter
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from dora.broker.metrics import failure_reason, serve_http
from dora.config import ConfigError, load
from dora.config.run import RunConfig
from dora.ops.status import health, render
from dora.samples import FinishedSample
from dora.wire import messages as m
from dora.wire import packed
from tests.unit.test_broker_actor import B, Fake, G, finished, running_broker

pytestmark = pytest.mark.timeout(30)
STEPS = 3
HEALTH = {"entropy": 0.8123, "kl_ref": 0.0031, "mismatch_abs": 0.000321, "clip_low_fraction": 0.012,
          "clip_high_fraction": 0.034, "length_mean": 123.4, "length_p95": 456.0, "truncated_share": 0.02,
          "uniform_share": 0.125, "lr": 1e-6}  # fmt: skip
"""A step's health numbers, as the torch learner reports them."""


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


async def scrape(url: str) -> dict[str, list[Any]]:
    """name -> samples (name, labels, value) of every family, read by a real HTTP client off the loop."""
    status, text = await asyncio.to_thread(get, url)
    assert status == 200, text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(families: dict[str, list[Any]], family: str, sample: str | None = None, **labels: str) -> float:
    found = [s.value for s in families[family] if s.name == (sample or family) and s.labels == labels]
    assert len(found) == 1, (family, sample, labels, families[family])
    return found[0]


async def fake_worker(w: Fake, slots: int, seen: Counter[str]) -> None:
    """Load what it is assigned (and say so twice, as a lossy link may) and finish every group at once."""
    await w.hello(m.Role.ROLLOUT, slots)
    while True:
        msg = await w.recv(timeout_s=60)
        match msg:
            case m.Assign():
                for _ in range(2):
                    await w.send(m.WeightsLoaded(version=msg.version, load_s=0.0))
            case m.Generate():
                seen["generate"] += 1
                await w.send(packed.pack_samples([finished(msg, i, epoch=7) for i in range(G)]))


async def test_scrape_agrees_with_the_peers_the_snapshot_and_the_record_files(tmp_path):
    metrics_file, timeline_file = tmp_path / "metrics.jsonl", tmp_path / "timeline.jsonl"
    files = f"broker.metrics_file={metrics_file}", f"broker.timeline_file={timeline_file}"
    async with running_broker(*files, "broker.exit_when_done=false", f"core.total_steps={STEPS}") as (actor, ep, ctx):
        server, url = await serve_http(actor.metrics.registry, "127.0.0.1:0")
        try:
            seen = Counter[str]()
            workers = [Fake(ctx, ep, f"rollout/{n}/1") for n in "ab"]
            tasks = [asyncio.create_task(fake_worker(w, 2 * G, seen)) for w in workers]
            learner = Fake(ctx, ep, "learner/x")
            await learner.hello(m.Role.LEARNER)
            trained: list[m.TrainBatch] = []
            for step in range(STEPS):
                await learner.send(m.RequestBatch(step=step))
                batch = await learner.recv(m.TrainBatch)
                trained.append(batch)
                if step == 1:  # a batch in training is consumed, not trained yet
                    mid = await scrape(url)
                    assert value(mid, "dora_batch_in_training") == 1
                    assert value(mid, "dora_consumed_groups", "dora_consumed_groups_total") == 2 * B
                    assert value(mid, "dora_trained_groups", "dora_trained_groups_total") == B
                    assert value(mid, "dora_filtered_groups", "dora_filtered_groups_total") == 0  # not filtering
                numbers = {"reward_mean": 0.25 * (step + 1), "loss": -1.0, **HEALTH}
                await learner.send(m.WeightsPublished(version=step + 1, uri="sim://v", sha256="0" * 8, metrics=numbers))
                await learner.recv(m.PublishAck)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await workers[0].send(m.Goodbye(reason="done"))
            await workers[1].sock.send_multipart([b"\x00garbage"])
            await asyncio.sleep(0.2)  # nothing is sent any more: the broker's state stands still

            got = await scrape(url)
            snap = actor.snapshot()
        finally:
            server.close()

    # what the peers saw
    samples = sum(len(g.samples) for b in trained for g in b.groups)
    tokens = sum(s.tokens for b in trained for g in b.groups for s in g.samples)
    assert value(got, "dora_train_steps", "dora_train_steps_total") == STEPS
    assert value(got, "dora_trained_groups", "dora_trained_groups_total") == STEPS * B
    assert value(got, "dora_trained_tokens", "dora_trained_tokens_total") == tokens == snap["trained_tokens"]
    assert value(got, "dora_groups_leased", "dora_groups_leased_total") == seen["generate"]
    assert value(got, "dora_newest_version") == STEPS == snap["newest_version"]
    assert value(got, "dora_learner_step_metric", name="reward_mean") == 0.25 * STEPS
    assert value(got, "dora_malformed_frames", "dora_malformed_frames_total", reason="decode") == 1
    assert value(got, "dora_peers_lost", "dora_peers_lost_total", role="rollout", reason="goodbye") == 1
    # every finished group had a lease latency observed; the finished ones are those trained or waiting
    finished_groups = STEPS * B + snap["finished_waiting"] + value(got, "dora_batch_in_training") * B
    assert value(got, "dora_lease_latency_seconds", "dora_lease_latency_seconds_count") == finished_groups
    # the staleness histogram is the snapshot's, and counts every consumed trajectory
    hist = {int(k): n for k, n in snap["staleness"].items()}
    assert value(got, "dora_consumed_staleness_versions", "dora_consumed_staleness_versions_count") == sum(
        hist.values()) == value(got, "dora_consumed_samples", "dora_consumed_samples_total")  # fmt: skip
    assert sum(hist.values()) >= samples
    for le in range(2):  # K = 1
        below = sum(n for lag, n in hist.items() if lag <= le)
        assert value(got, "dora_consumed_staleness_versions", "dora_consumed_staleness_versions_bucket",
                     le=f"{le}.0") == below  # fmt: skip
    # per-version gauges are the snapshot's table
    for v, row in snap["versions"].items():
        assert value(got, "dora_version_workers", version=v) == row["workers"]
        assert value(got, "dora_version_running_groups", version=v) == row["running"]
        assert value(got, "dora_version_queued_groups", version=v) == row["queued"]
    assert {s.labels["version"] for s in got["dora_version_workers"]} == set(snap["versions"])
    assert sum(s.value for s in got["dora_workers"]) == len(snap["workers"]) == 1
    # the learner's latest step is in the snapshot, and `dora status` shows its health
    assert snap["learner"] == {"reward_mean": 0.75, "loss": -1.0, **HEALTH}
    assert value(got, "dora_learner_step_metric", name="lr") == 1e-6
    shown = io.StringIO()
    render(snap, Console(file=shown, width=200))
    policy, written = [line for line in shown.getvalue().splitlines() if line.startswith(("policy:", "samples:"))]
    assert policy == ("policy: reward 0.75  entropy 0.8123  kl_ref 0.0031  mismatch_abs 0.000321  "
                      "clipped low/high 1.2%/3.4%  lr 1e-06")  # fmt: skip
    assert written == "samples: length mean 123.4 p95 456  truncated 2.0%  uniform groups 12.5%"
    assert value(got, "dora_event_loop_lag_seconds", "dora_event_loop_lag_seconds_count") > 0

    # metrics.jsonl: one line per step, with the learner's numbers and the histogram at that step
    rows = [json.loads(x) for x in metrics_file.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS)) and [r["version"] for r in rows] == [1, 2, 3]
    assert [r["reward_mean"] for r in rows] == [0.25, 0.5, 0.75] and all(r["max_staleness"] == 1 for r in rows)
    assert all(r["lr"] == 1e-6 and r["mismatch_abs"] == 0.000321 for r in rows)  # small numbers keep their digits
    assert sum(rows[-1]["staleness"].values()) == samples
    assert all(r["elapsed_s"] >= 0 and r["t"] > 1e9 and r["live_versions"] for r in rows)
    # timeline.jsonl: both workers joined, were assigned and loaded; publishes; the one that left is lost
    events = [json.loads(x) for x in timeline_file.read_text().splitlines()]
    assert events[0]["event"] == "started" and events[0]["max_staleness"] == 1
    assert [e["version"] for e in events if e["event"] == "published"] == [1, 2, 3]
    for w in ("rollout/a/1", "rollout/b/1"):
        mine = [e["event"] for e in events if e.get("worker") == w]
        assert mine[:3] == ["joined", "assigned", "ready"], mine
        assigned = [e["version"] for e in events if e.get("worker") == w and e["event"] == "assigned"]
        ready = [e["version"] for e in events if e.get("worker") == w and e["event"] == "ready"]
        assert ready == assigned[: len(ready)] and len(ready) >= len(assigned) - 1, (assigned, ready)
    assert [e["worker"] for e in events if e["event"] == "lost"] == ["rollout/a/1"]
    assert [e["t"] for e in events] == sorted(e["t"] for e in events)


def test_status_leaves_out_the_health_numbers_a_step_did_not_report():
    assert health({"reward_mean": 0.5, "loss": 1.0}, {}) == ["policy: reward 0.5"]  # the sim trainer's step
    assert health({"entropy": 1.5, "clip_high_fraction": 0.5, "length_mean": 7.0}, {"accuracy": 0.625}) == [
        "policy: entropy 1.5  clipped high 50.0%  held-out accuracy 0.625", "samples: length mean 7.0"]  # fmt: skip
    assert health({}, {}) == []


async def test_the_endpoint_answers_only_get_metrics():
    async with running_broker() as (actor, _ep, _ctx):
        server, url = await serve_http(actor.metrics.registry, "127.0.0.1:0")
        try:
            assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
            status, body = await asyncio.to_thread(get, url.removesuffix("/metrics") + "/nothing")
            assert status == 404 and "/metrics" in body
            request = urllib.request.Request(url, data=b"x", method="POST")
            with pytest.raises(urllib.error.HTTPError) as e:
                await asyncio.to_thread(urllib.request.urlopen, request, timeout=5)
            assert e.value.code == 405
            host, port = url.removeprefix("http://").split("/")[0].split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"\r\n")  # no request line at all
            assert (await reader.read()).startswith(b"HTTP/1.0 400")
            writer.close()
            got = await scrape(url)  # and it still serves
            assert value(got, "dora_newest_version") == 0
        finally:
            server.close()


@pytest.mark.parametrize("bind", ["8000", "localhost", "host:port", ":9000", "127.0.0.1:70000"])
def test_a_bad_metrics_bind_is_a_config_error(bind):
    with pytest.raises(ConfigError, match="metrics_bind"):
        load(RunConfig, overrides=[f"broker.metrics_bind={bind}"])


def test_a_good_metrics_bind_is_taken():
    assert load(RunConfig, overrides=["broker.metrics_bind=[::1]:0"]).broker.metrics_bind == "[::1]:0"


def test_a_broker_that_cannot_serve_its_metrics_or_write_its_files_says_so_in_one_line(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    base = ["--set", "broker.bind=tcp://127.0.0.1:0", "--set", f"broker.discovery_file={tmp_path / 'b.json'}"]
    try:
        for sets, fragment in (
            ([f"broker.metrics_bind=127.0.0.1:{taken.getsockname()[1]}"], "address already in use"),
            ([f"broker.timeline_file={tmp_path / 'no' / 'timeline.jsonl'}"], "No such file or directory"),
            (["broker.metrics_bind=nonsense"], "broker.metrics_bind must be host:port"),
        ):
            argv = [sys.executable, "-m", "dora", "broker", *base, *[x for s in sets for x in ("--set", s)]]
            r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            assert r.returncode == 2 and fragment in r.stderr and "Traceback" not in r.stderr, r.stderr
            assert not (tmp_path / "b.json").exists()  # nothing announced
    finally:
        taken.close()


def scored_sample(gen: m.Generate, index: int) -> FinishedSample:
    """A sample whose reward came as named components; the group's last sample's reward failed."""
    s = finished(gen, index, epoch=7)
    if index == G - 1:
        return dataclasses.replace(s, reward=0.0, reward_error="reward raised ValueError: no number in 'x: 1'")
    parts = {"correct": float(index % 2), "format": 0.25 * index}
    return dataclasses.replace(s, reward=sum(parts.values()), reward_components=parts)


async def scoring_worker(w: Fake, seen: Counter[str]) -> None:
    """Finish every group at once, and send each result twice (the copy is refused: it must not count again)."""
    await w.hello(m.Role.ROLLOUT, 2 * G)
    while True:
        msg = await w.recv(timeout_s=60)
        match msg:
            case m.Assign():
                await w.send(m.WeightsLoaded(version=msg.version, load_s=0.0))
            case m.Generate():
                results = packed.pack_samples([scored_sample(msg, i) for i in range(G)])
                await w.send(results)
                seen["groups"] += 1
                await w.send(results)


async def test_reward_failures_are_counted_by_reason_and_components_averaged_per_step(tmp_path):
    metrics_file = tmp_path / "metrics.jsonl"
    steps = 2
    async with running_broker(f"broker.metrics_file={metrics_file}", "broker.exit_when_done=false",
                              f"core.total_steps={steps}") as (actor, ep, ctx):  # fmt: skip
        server, url = await serve_http(actor.metrics.registry, "127.0.0.1:0")
        try:
            seen = Counter[str]()
            task = asyncio.create_task(scoring_worker(Fake(ctx, ep, "rollout/a/1"), seen))
            learner = Fake(ctx, ep, "learner/x")
            await learner.hello(m.Role.LEARNER)
            for step in range(steps):
                await learner.send(m.RequestBatch(step=step))
                batch = await learner.recv(m.TrainBatch)
                assert [s.reward for g in batch.groups for s in g.samples] == [0.0, 1.25, 0.5, 0.0] * B
                await learner.send(m.WeightsPublished(version=step + 1, uri="sim://v", sha256="0" * 8, metrics={}))
                await learner.recv(m.PublishAck)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await asyncio.sleep(0.2)  # what was sent is handled
            got = await scrape(url)
            snap = actor.snapshot()
        finally:
            server.close()

    # one failed sample per group taken, each counted once though sent twice
    assert seen["groups"] >= steps * B
    assert snap["counters"]["reward failed (raised ValueError)"] == seen["groups"]
    assert [k for k in snap["counters"] if k.startswith("reward failed")] == ["reward failed (raised ValueError)"]
    assert (
        value(got, "dora_reward_failures", "dora_reward_failures_total", reason="raised ValueError") == seen["groups"]
    )
    rows = [json.loads(x) for x in metrics_file.read_text().splitlines()]
    assert [r["reward_failed"] for r in rows] == [B] * steps
    # per group: correct 0, 1, 0 and format 0, 0.25, 0.5 over the three samples that scored
    assert [r["reward_components"] for r in rows] == [{"correct": round(1 / 3, 6), "format": 0.25}] * steps


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        ("reward raised KeyError: 'answer'", "raised KeyError"),
        ("reward timed out after 5 s", "timed out after 5 s"),
        (f"reward returned {'x' * 100}, not a finite number", "returned " + "x" * 44),
    ],
)
def test_a_reward_failure_reason_is_cut_at_the_exception_type_or_60_characters(error, reason):
    assert failure_reason(error) == reason
