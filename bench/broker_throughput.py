"""How many trajectories a live `dora broker` routes per second, beside a bare pyzmq echo.

    python bench/broker_throughput.py [--seconds 10] [--workers 3] [--tokens 1024]

The broker is the real `dora broker` process (dora mode, K = 2). Rollout workers are zero-latency
fakes in their own processes: every leased group comes straight back as G finished samples of
``--tokens`` tokens with log-probs. A fake learner publishes a version the moment a batch arrives.
So the broker's own work is what limits the rate: decode, the core's decision for every sample,
acks, leases and batch delivery.

Workers stream what finished together as one message (here a whole group: G samples); the broker
answers each with one ack message. A fake worker reads what has come without a poll per message and
re-encodes only the headers of an answer made once per size. In the same run:

- a bare pyzmq ROUTER echoes the same frames to the same number of DEALERs (one message in, a short one
  out, the clients sending pre-made frames with 256 in flight): the local limit of this machine;
- the routing floor: a Python ROUTER that moves what the broker moves for the same fake workers and the
  learner (per result message an ack and a new Generate, each made once; every B messages their frames
  forwarded to the learner unread) and decides nothing. What it reaches is the most any broker written
  in Python could reach with these workers on this machine; the broker's rate over the floor's is the
  share its decisions leave.

Printed: trajectories/s, MB/s of samples routed, broker CPU µs per trajectory and per message (from
/proc), the floor's rate and CPU per message, and the ratios broker / echo, floor / echo and broker /
floor. Targets: broker >= 50% of the echo rate and >= 10,000 trajectories/s at 1,024 tokens.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import msgspec
import numpy as np
import zmq

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dora.broker import translate  # noqa: E402
from dora.ids import Finish  # noqa: E402
from dora.samples import FinishedSample  # noqa: E402
from dora.wire import codec, packed  # noqa: E402
from dora.wire import messages as m  # noqa: E402

G, B, K = 8, 64, 2


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sample(gen: m.Generate, index: int, epoch: int, ids: np.ndarray, lps: np.ndarray) -> FinishedSample:
    return FinishedSample(group_id=gen.group_id, attempt=gen.attempt, index=index,
                          segments=np.array([[gen.version, len(ids)]], dtype=np.int32), token_ids=ids,
                          logprobs=lps, reward=1.0, finish=Finish.STOP, broker_epoch=epoch)  # fmt: skip


def finished(gen: m.Generate, epoch: int, ids: np.ndarray, lps: np.ndarray) -> m.SamplesFinished:
    """The whole group finished at once: one message of ``gen.n_samples`` samples, as a real worker coalesces.
    Every sample has the same tokens, so the packed arrays and their checksum are made once per shape and only
    the headers are new: a fake worker costs as little as the echo's clients (``pack_cost_us`` measures what a
    real worker pays to pack)."""
    token_ids, logprobs, check = _packed(gen.n_samples, ids.tobytes(), lps.tobytes())
    n = len(ids)
    headers = tuple(
        m.SampleHeader(group_id=gen.group_id, attempt=gen.attempt, index=i, segments=((gen.version, n),), reward=1.0,
                       finish=Finish.STOP, offset=i * n, tokens=n, checksum=check, broker_epoch=epoch)
        for i in range(gen.n_samples)
    )  # fmt: skip
    return m.SamplesFinished(samples=headers, token_ids=token_ids, logprobs=logprobs)


@functools.cache
def _packed(n_samples: int, ids: bytes, lps: bytes) -> tuple[np.ndarray, np.ndarray, int]:
    one = np.frombuffer(ids, np.int32), np.frombuffer(lps, np.float32)
    return np.tile(one[0], n_samples), np.tile(one[1], n_samples), packed.checksum(*one, None)


def pack_cost_us(tokens: int, n_samples: int = G, repeat: int = 200) -> float:
    """What a real worker pays per trajectory to pack a message of ``n_samples`` finished samples."""
    gen = m.Generate(group_id=1, attempt=1, version=0, prompt_ids=np.zeros(1, np.int32), n_samples=n_samples,
                     max_tokens=tokens)  # fmt: skip
    ids, lps = (np.arange(tokens) % 50_000).astype(np.int32), np.full(tokens, -0.7, np.float32)
    samples = [sample(gen, i, 0, ids, lps) for i in range(n_samples)]
    started = time.perf_counter()
    for _ in range(repeat):
        packed.pack_samples(samples)
    return 1e6 * (time.perf_counter() - started) / repeat / n_samples


class Replies:
    """A fake worker's answers to Generates of one size, encoded once: each answer re-encodes only the headers'
    plain data (the group, attempt, version and epoch changed) beside the same array frames. The bytes are those
    of ``codec.encode(finished(...))`` (``tests/unit/test_bench_broker.py`` compares them)."""

    def __init__(self, n_samples: int, ids: np.ndarray, lps: np.ndarray) -> None:
        gen = m.Generate(group_id=0, attempt=0, version=0, prompt_ids=np.zeros(1, np.int32), n_samples=n_samples,
                         max_tokens=len(ids))  # fmt: skip
        frames = codec.encode(finished(gen, 0, ids, lps))
        self.head, self.arrays = frames[:3], frames[4:]
        self.body = msgspec.msgpack.decode(bytes(frames[3]))
        self.tokens = len(ids)

    def frames(self, gen: m.Generate, epoch: int) -> list:
        for x in self.body["samples"]:
            x["group_id"], x["attempt"], x["broker_epoch"] = gen.group_id, gen.attempt, epoch
            x["segments"] = [[gen.version, self.tokens]]
        return [*self.head, _plain.encode(self.body), *self.arrays]


_plain = msgspec.msgpack.Encoder()


def fake_worker(endpoint: str, name: str, slots: int, tokens: int, until: float) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, f"rollout/{name}/0".encode())
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    ids = (np.arange(tokens) % 50_000).astype(np.int32)
    lps = np.full(tokens, -0.7, np.float32)
    s.send_multipart(codec.encode(m.Hello(wire_version=m.WIRE_VERSION, role=m.Role.ROLLOUT, peer_id=name,
                                          pid=os.getpid(), host="bench", slots=slots, engine="zero")))  # fmt: skip
    epoch, replies = 0, {}
    while time.time() < until:
        if not s.poll(100):
            continue
        for _ in range(256):  # what has come, without a poll per message (as the echo's clients)
            try:
                frames = s.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            msg = codec.decode(frames)
            match msg:
                case m.Welcome():
                    epoch = msg.broker_epoch
                case m.Assign():
                    s.send_multipart(codec.encode(m.WeightsLoaded(version=msg.version)))
                case m.Generate():
                    if (r := replies.get(msg.n_samples)) is None:
                        r = replies[msg.n_samples] = Replies(msg.n_samples, ids, lps)
                    s.send_multipart(r.frames(msg, epoch), copy=False)
                case m.MigrateOut():  # its groups are already done: nothing left to hand over
                    s.send_multipart(codec.encode(m.MigrationExported(group_id=msg.group_id, attempt=msg.attempt,
                                                                      requests=())))  # fmt: skip
                case m.Goodbye():
                    ctx.destroy(linger=0)
                    return
    ctx.destroy(linger=0)


def fake_learner(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """A learner's DEALER that has said hello and asked for the first batch; the caller trains by publishing."""
    learner = ctx.socket(zmq.DEALER)
    learner.setsockopt(zmq.IDENTITY, b"learner/bench/0")
    learner.setsockopt(zmq.LINGER, 0)
    learner.connect(endpoint)
    learner.send_multipart(codec.encode(m.Hello(wire_version=m.WIRE_VERSION, role=m.Role.LEARNER,
                                                peer_id="learner-0", pid=os.getpid(), host="bench")))  # fmt: skip
    learner.send_multipart(codec.encode(m.RequestBatch(step=0)))
    return learner


def run_broker(seconds: float, workers: int, tokens: int, profile: str | None = None) -> dict:
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="dora-bench-"))
    (tmp / "run.toml").write_text(
        f'[core]\nmode = "dora"\nmax_staleness = {K}\ntrain_groups = {B}\ngroup_size = {G}\n'
        f'[broker]\nbind = "ipc://{tmp}/broker.sock"\ndiscovery_file = "{tmp}/broker.json"\n'
        "heartbeat_interval_s = 1.0\nliveness = 60\ntick_s = 1.0\nexit_when_done = false\n"
        '[log]\nformat = "json"\nlevel = "warning"\n'
    )
    prof = ["-m", "cProfile", "-o", profile] if profile else []
    with open(tmp / "broker.log", "wb") as err:
        broker = subprocess.Popen([sys.executable, *prof, "-m", "dora", "broker", "--config", str(tmp / "run.toml")],
                                  stdout=subprocess.PIPE, stderr=err)  # fmt: skip
    try:
        ready = json.loads(broker.stdout.readline())
        endpoint = ready["endpoint"]
        until = time.time() + seconds + 3
        procs = [mp.Process(target=fake_worker, args=(endpoint, f"z{i}", 2 * B * G // workers, tokens, until))
                 for i in range(workers)]  # fmt: skip
        for p in procs:
            p.start()
        ctx = zmq.Context()
        learner = fake_learner(ctx, endpoint)
        steps, trajectories, nbytes = 0, 0, 0
        t0 = c0 = None
        warm = time.time() + 2.0  # workers connect and the first versions flow before the clock starts
        end = warm + seconds
        while time.time() < end:
            if not learner.poll(100):
                continue
            msg = codec.decode(learner.recv_multipart(copy=False))
            if not isinstance(msg, m.TrainBatch):
                continue
            if t0 is None and time.time() >= warm:
                t0, c0, first = time.time(), cpu_s(broker.pid), msg.step
                w0, l0 = sum(cpu_s(p.pid) for p in procs), time.process_time()
            elif t0 is not None:
                steps += 1
                trajectories += sum(len(g.samples) for g in msg.groups)
                nbytes += 8 * sum(s.tokens for g in msg.groups for s in g.samples)  # int32 ids + float32 log-probs
            learner.send_multipart(codec.encode(m.WeightsPublished(version=msg.step + 1, uri="bench", sha256="0" * 64)))
            learner.send_multipart(codec.encode(m.RequestBatch(step=msg.step + 1)))
        wall = time.time() - t0
        cpu = cpu_s(broker.pid) - c0
        cores = {"broker": cpu / wall, "workers": (sum(cpu_s(p.pid) for p in procs) - w0) / wall,
                 "learner": (time.process_time() - l0) / wall}  # fmt: skip
        ctx.destroy(linger=0)
        for p in procs:
            p.join(timeout=10)
        return {"steps": steps, "first_step": first, "trajectories": trajectories, "wall_s": wall, "cpu_s": cpu,
                "trajectories_per_s": trajectories / wall, "mb_per_s": nbytes / wall / 1e6,
                "cpu_us_per_trajectory": 1e6 * cpu / max(trajectories, 1), "cores_busy": cores}  # fmt: skip
    finally:
        broker.terminate()  # graceful: a profile gets written
        try:
            broker.wait(timeout=15)
        except subprocess.TimeoutExpired:
            broker.kill()
            broker.wait()


def echo_server(endpoint: str, until: float, out: mp.Queue) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 0)
    s.bind(endpoint)
    n, c0 = 0, None
    while time.time() < until:
        if s.poll(100):
            if c0 is None:
                c0 = time.process_time()
            for _ in range(1000):
                try:
                    frames = s.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                s.send_multipart([frames[0], b"ack"], copy=False)  # a small answer, as an ack is
                n += 1
    out.put(1e6 * (time.process_time() - (c0 or 0.0)) / max(n, 1))
    ctx.destroy(linger=0)


def echo_client(endpoint: str, tokens: int, seconds: float, window: int, out: mp.Queue) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    gen = m.Generate(group_id=1, attempt=1, version=0, prompt_ids=np.zeros(1, np.int32), n_samples=G, max_tokens=1)
    ids, lps = (np.arange(tokens) % 50_000).astype(np.int32), np.full(tokens, -0.7, np.float32)
    frames = codec.encode(finished(gen, 0, ids, lps))
    time.sleep(0.5)
    sent = got = 0
    end = time.time() + seconds
    while time.time() < end:
        while sent - got < window:
            s.send_multipart(frames, copy=False)
            sent += 1
        s.recv_multipart()
        got += 1
    out.put(got / seconds)
    ctx.destroy(linger=0)


def run_echo(seconds: float, clients: int, tokens: int) -> dict:
    tmp = tempfile.mkdtemp(prefix="dora-echo-")
    endpoint = f"ipc://{tmp}/echo.sock"
    q: mp.Queue = mp.Queue()
    cpu: mp.Queue = mp.Queue()
    server = mp.Process(target=echo_server, args=(endpoint, time.time() + seconds + 2, cpu))
    server.start()
    procs = [mp.Process(target=echo_client, args=(endpoint, tokens, seconds, 256, q)) for _ in range(clients)]
    for p in procs:
        p.start()
    rate = sum(q.get(timeout=seconds + 30) for _ in procs)
    for p in procs:
        p.join()
    cpu_us = cpu.get(timeout=30)  # the server's CPU per message, from its first to its end (the clients' tail idle)
    server.join(timeout=10)
    return {"messages_per_s": rate, "cpu_us_per_message": cpu_us}


def floor_server(endpoint: str, tokens: int, warm_s: float, seconds: float, out: mp.Queue) -> None:
    """The routing floor: a Python ROUTER that moves what the broker moves for the same workers and decides nothing.
    Each worker gets a Welcome and its slots' worth of Generates; each message that comes back is answered with
    an ack (encoded once: G accepted samples) and one new Generate (encoded once); every B result messages, their
    frames go to the learner as one message, unread and uncopied, as a TrainBatch forwards its sources. No header
    is decoded, no sample checked, no lease kept: whatever the broker does beyond this is its decisions."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 0)
    s.bind(endpoint)
    welcome = codec.encode(m.Welcome(broker_epoch=1, heartbeat_interval_s=1.0, liveness=60, newest_version=0))
    prompt = np.zeros(32, np.int32)
    generate = codec.encode(m.Generate(group_id=1, attempt=1, version=0, prompt_ids=prompt, n_samples=G,
                                       max_tokens=tokens, broker_epoch=1))  # fmt: skip
    headers = [m.SampleHeader(group_id=1, attempt=1, index=i, segments=((0, tokens),), reward=1.0,
                              finish=Finish.STOP, offset=i * tokens, tokens=tokens, checksum=0, broker_epoch=1)
               for i in range(G)]  # fmt: skip
    ack = translate.all_accepted(headers)
    result_kind, hello_kind = m.SamplesFinished.KIND.encode(), m.Hello.KIND.encode()
    learner, batch, results, t0, c0 = None, [], 0, None, 0.0
    start = time.time()
    warm, end = start + warm_s, start + warm_s + seconds
    while time.time() < end:
        if not s.poll(100):
            continue
        for _ in range(1000):
            try:
                frames = s.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            who, kind = frames[0], frames[3].bytes
            if kind == result_kind:
                s.send_multipart([who, *ack], copy=False)
                s.send_multipart([who, *generate], copy=False)
                batch.extend(frames[4:])
                if t0 is not None:
                    results += 1
                if len(batch) >= B * (len(frames) - 4) and learner is not None:
                    s.send_multipart([learner, b"batch", *batch], copy=False)
                    batch = []
            elif kind == hello_kind:
                hello = codec.decode(frames[1:])
                if hello.role is m.Role.LEARNER:
                    learner = frames[0].bytes
                    continue
                s.send_multipart([who, *welcome], copy=False)
                for _ in range(hello.slots // G):
                    s.send_multipart([who, *generate], copy=False)
        if t0 is None and time.time() >= warm:
            t0, c0 = time.time(), time.process_time()
    wall = time.time() - t0
    cpu = time.process_time() - c0  # the process's threads: zmq's I/O thread too, as the broker's /proc figure
    out.put({"messages_per_s": results / wall, "cpu_us_per_message": 1e6 * cpu / max(results, 1)})
    ctx.destroy(linger=0)


def floor_learner(endpoint: str, until: float) -> None:
    """The broker run's learner, taking the floor's batches (its request for one is ignored there)."""
    ctx = zmq.Context()
    s = fake_learner(ctx, endpoint)
    while time.time() < until:
        if s.poll(100):
            s.recv_multipart(copy=False)
    ctx.destroy(linger=0)


def run_floor(seconds: float, workers: int, tokens: int) -> dict:
    """The routing floor beside the same fake workers and a learner that takes the batches."""
    tmp = tempfile.mkdtemp(prefix="dora-floor-")
    endpoint = f"ipc://{tmp}/floor.sock"
    q: mp.Queue = mp.Queue()
    server = mp.Process(target=floor_server, args=(endpoint, tokens, 2.0, seconds, q))
    server.start()
    time.sleep(0.3)
    until = time.time() + seconds + 3
    procs = [mp.Process(target=fake_worker, args=(endpoint, f"z{i}", 2 * B * G // workers, tokens, until))
             for i in range(workers)]  # fmt: skip
    procs.append(mp.Process(target=floor_learner, args=(endpoint, until)))
    for p in procs:
        p.start()
    got = q.get(timeout=seconds + 30)
    server.join(timeout=10)
    for p in procs:
        p.join(timeout=10)
    return got


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--profile", metavar="OUT.prof", help="run the broker under cProfile (slower) and write the profile")
    args = p.parse_args()
    echo = run_echo(args.seconds, args.workers, args.tokens)
    floor = run_floor(args.seconds, args.workers, args.tokens)
    b = run_broker(args.seconds, args.workers, args.tokens, args.profile)
    b["messages_per_s"] = b["trajectories_per_s"] / G
    ratio = b["messages_per_s"] / echo["messages_per_s"]
    print(f"bare pyzmq ROUTER/DEALER echo ({args.workers} clients; one message = {G} samples of {args.tokens} "
          f"tokens, answered by a short ack): {echo['messages_per_s']:,.0f} msg/s "
          f"= {G * echo['messages_per_s']:,.0f} samples/s; the server's CPU {echo['cpu_us_per_message']:.0f} µs "
          "per message")  # fmt: skip
    print(
        f"dora broker ({args.workers} zero-latency workers, G={G}, B={B}, K={K}): "
        f"{b['messages_per_s']:,.0f} result msg/s = {b['trajectories_per_s']:,.0f} trajectories/s, "
        f"{b['mb_per_s']:,.1f} MB/s of samples, {b['cpu_us_per_trajectory']:.0f} µs broker CPU per trajectory, "
        f"{b['steps']} steps in {b['wall_s']:.1f} s"
    )
    print(f"routing floor (a Python ROUTER moving the broker's messages for the same workers, deciding nothing): "
          f"{floor['messages_per_s']:,.0f} result msg/s, {floor['cpu_us_per_message']:.0f} µs CPU per message; "
          f"floor / bare echo = {floor['messages_per_s'] / echo['messages_per_s']:.2f}")  # fmt: skip
    print(f"dora broker: {1e6 * b['cpu_s'] / max(b['trajectories'] / G, 1):.0f} µs CPU per message; "
          f"broker / floor = {b['messages_per_s'] / floor['messages_per_s']:.2f}")  # fmt: skip
    busy = b["cores_busy"]
    print(f"cores busy meanwhile (of {os.cpu_count()}): broker {busy['broker']:.2f}, workers {busy['workers']:.2f}, "
          f"learner {busy['learner']:.2f}")  # fmt: skip
    print(
        f"broker / bare echo = {ratio:.2f} (target >= 0.50); trajectories/s target >= 10,000: "
        f"{'met' if b['trajectories_per_s'] >= 10_000 else 'not met'}"
    )
    pack_us = pack_cost_us(args.tokens)
    print(f"a worker's own cost to pack its finished samples (pack_samples, checksums included): "
          f"{pack_us:.1f} µs per trajectory of {args.tokens} tokens")  # fmt: skip
    print(json.dumps({"echo": echo, "floor": floor, "broker": b, "ratio": ratio,
                      "worker_pack_us_per_trajectory": pack_us}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
