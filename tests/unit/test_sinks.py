"""The broker's metrics sinks: scalar names, TensorBoard event files read back by TensorBoard's own reader, a
wandb offline run read back from its ``.wandb`` file, a live broker feeding them from its train steps, a sink
that fails at run time (dropped, the broker goes on) and one whose library is missing (one line at start)."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import struct
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import numpy as np
import pytest
from structlog.testing import capture_logs

from dora.broker.sinks import Sinks, TensorBoardSink, flatten, open_sinks, step_scalars
from dora.config import ConfigError, load
from dora.config.run import MetricsSection, RunConfig
from dora.launch.run import prepare
from dora.launch.slurm import job_config
from dora.wire import messages as m
from tests.unit.test_broker_actor import Fake, running_broker
from tests.unit.test_broker_metrics import G, fake_worker

pytestmark = pytest.mark.timeout(60)
STEPS = 3


def scalars_of(logdir: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of every scalar in ``logdir``, read by TensorBoard's EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def f32(x: float) -> float:
    """``x`` as TensorBoard stores it (simple_value is a float32)."""
    return float(np.float32(x))


# ---------------------------------------------------------------------- names


def test_step_scalars_name_every_number_of_a_metrics_line():
    line = {"step": 4, "version": 5, "step_s": 1.5, "publish_s": 0.25, "staleness": {"0": 30, "1": 2},
            "live_versions": [4, 5], "workers": 3, "max_staleness": 1, "reward_mean": 0.5, "loss": -0.1,
            "tokens": 1200, "note": "text", "flag": True, "gone": None, "elapsed_s": 9.0, "t": 1.7e9,
            "reward_failed": 1, "reward_components": {"format": 0.5, "answer": 0.25}, "new_key": 2}  # fmt: skip
    got = step_scalars(line, learner={"reward_mean", "loss", "tokens", "note", "flag"})
    assert got == {
        "broker/version": 5.0, "time/step_s": 1.5, "time/publish_s": 0.25, "staleness/0": 30.0, "staleness/1": 2.0,
        "broker/live_versions": 2.0, "broker/workers": 3.0, "broker/max_staleness": 1.0, "train/reward_mean": 0.5,
        "train/loss": -0.1, "train/tokens": 1200.0, "time/elapsed_s": 9.0, "train/reward_failed": 1.0,
        "train/reward/format": 0.5, "train/reward/answer": 0.25, "broker/new_key": 2.0,
    }  # fmt: skip
    assert all(type(v) is float for v in got.values())


def test_flatten_joins_nested_keys_and_leaves_out_what_is_not_a_number():
    values = {"reward_mean": 0.75, "per_task": {"gsm8k": {"acc": 0.5}, "name": "x"}, "n": 3, "ok": False, "ids": [1]}
    assert flatten(values, "eval") == {"eval/reward_mean": 0.75, "eval/per_task/gsm8k/acc": 0.5, "eval/n": 3.0}
    assert flatten({"a": 1}) == {"a": 1.0}


# ---------------------------------------------------------------------- TensorBoard


def test_tensorboard_sink_writes_event_files_tensorboard_reads_back(tmp_path):
    pytest.importorskip("tensorboard")
    points = {step: {"train/loss": -0.1 * step, "time/step_s": 1.0 + step, "staleness/1": float(step * 7)}
              for step in range(4)}  # fmt: skip
    first = TensorBoardSink(str(tmp_path / "tb"))
    for step in (0, 1):
        first.log(step, points[step])
    first.close()
    second = TensorBoardSink(str(tmp_path / "tb"))  # a restarted broker: a new file in the same directory
    for step in (2, 3):
        second.log(step, points[step])
    second.close()
    second.close()  # twice is harmless
    assert first.path != second.path and len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 2
    got = scalars_of(tmp_path / "tb")
    assert set(got) == {"train/loss", "time/step_s", "staleness/1"}
    for tag, series in got.items():
        assert series == [(step, f32(points[step][tag])) for step in range(4)], tag


def test_sinks_and_the_tensorboard_sink_load_no_torch_tensorflow_or_transformers(tmp_path):
    pytest.importorskip("tensorboard")
    tb = tmp_path / "tb"
    code = f"""
import sys
from dora.broker.sinks import open_sinks
from dora.config import load
from dora.config.run import RunConfig
sinks = open_sinks(load(RunConfig, overrides=["metrics.tensorboard_dir={tb}"]))
sinks.log(0, {{"train/loss": 1.0}})
sinks.close()
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "tensorflow", "transformers", "wandb")))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"  # the lines before it are the log's
    assert scalars_of(tb) == {"train/loss": [(0, 1.0)]}


# ---------------------------------------------------------------------- wandb


def wandb_records(path: pathlib.Path) -> list[Any]:
    """The records of a ``.wandb`` file: a LevelDB-style log (``:W&B`` header, 32 KiB blocks of chunks with a
    7-byte header: crc32, length, type FULL=1 FIRST=2 MIDDLE=3 LAST=4) of ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if n == 0 and kind == 0:
            break
        pending += data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def children() -> dict[int, str]:
    """pid -> command line of this process's live children (zombies left out)."""
    out = {}
    for status in pathlib.Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
            if int(fields["PPid"]) == os.getpid() and not fields["State"].startswith("Z"):
                out[int(status.parent.name)] = (status.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, KeyError, ValueError):
            continue  # gone meanwhile
    return out


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    return tmp_path


@pytest.mark.skipif(not pathlib.Path("/proc/self/status").exists(), reason="reads /proc")
def test_wandb_sink_offline_writes_the_run_and_leaves_no_process(wandb_env):
    before = children()
    cfg = load(RunConfig, overrides=["metrics.wandb_project=dora-test", f"metrics.wandb_dir={wandb_env / 'w'}",
                                     "metrics.wandb_run_name=tiny", "core.max_staleness=3"])  # fmt: skip
    sinks = open_sinks(cfg)
    service = {pid: cmd for pid, cmd in children().items() if pid not in before}
    assert any("wandb-core" in cmd for cmd in service.values()), service
    points = {step: {"train/reward_mean": 0.25 * step, "time/step_s": 2.0 + step} for step in range(3)}
    for step, scalars in points.items():
        sinks.log(step, scalars)
    sinks.close()
    deadline = time.monotonic() + 10
    while set(service) & set(children()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(service) & set(children()), "wandb's service outlived close()"
    assert sinks.failed == Counter()

    runs = list((wandb_env / "w" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    files = list(runs[0].glob("run-*.wandb"))
    assert len(files) == 1
    records = wandb_records(files[0])
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "dora-test" and run.display_name == "tiny"
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["core"]["max_staleness"] == 3 and config["metrics"]["wandb_project"] == "dora-test"
    history = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history.append((r.history.step.num, {k: v for k, v in row.items() if not k.startswith("_")}))
    assert history == list(points.items())
    assert any(r.WhichOneof("record_type") == "exit" for r in records)  # finish() ended the run


def test_wandb_goes_beside_the_metrics_file_by_default(wandb_env):
    cfg = load(RunConfig, overrides=["metrics.wandb_project=p", f"broker.metrics_file={wandb_env / 'r' / 'm.jsonl'}"])
    sinks = open_sinks(cfg)
    sinks.close()
    assert len(list((wandb_env / "r" / "wandb").glob("offline-run-*/run-*.wandb"))) == 1


# ---------------------------------------------------------------------- config and missing libraries


@pytest.mark.parametrize(
    ("sets", "fragment"),
    [
        (["metrics.wandb_mode=shared"], "metrics.wandb_mode must be offline or online; got 'shared'"),
        (["metrics.wandb_project=a/b"], "metrics.wandb_project must not contain"),
        (["metrics.wandb_dir=/tmp/x"], "metrics.wandb_dir is set but metrics.wandb_project is not"),
        (["metrics.wandb_run_name=x"], "metrics.wandb_run_name is set but metrics.wandb_project is not"),
    ],
)
def test_a_bad_metrics_section_is_a_config_error_naming_the_key(sets, fragment):
    with pytest.raises(ConfigError) as e:
        load(RunConfig, overrides=sets)
    assert fragment in str(e.value)


def test_an_empty_metrics_path_is_none_when_loaded_and_refused_when_built(tmp_path):
    (tmp_path / "run.toml").write_text('[metrics]\ntensorboard_dir = ""\n')
    assert load(RunConfig, path=str(tmp_path / "run.toml")).metrics.tensorboard_dir is None
    with pytest.raises(ConfigError, match=r"metrics\.wandb_dir must not be empty"):
        MetricsSection(wandb_project="p", wandb_dir="")


def test_the_metrics_section_defaults_to_no_sinks():
    cfg = load(RunConfig)
    assert cfg.metrics.tensorboard_dir is None and cfg.metrics.wandb_project is None
    assert cfg.metrics.wandb_mode == "offline" and open_sinks(cfg).live == []


@pytest.mark.parametrize(
    ("module", "key", "extra"),
    [("tensorboard.compat.proto.event_pb2", "metrics.tensorboard_dir", "tensorboard"),
     ("wandb", "metrics.wandb_project", "wandb")],
)  # fmt: skip
def test_a_sink_whose_library_is_missing_names_the_extra(tmp_path, monkeypatch, module, key, extra):
    monkeypatch.setitem(sys.modules, module, None)  # `import` of it raises ImportError
    sets = [f"metrics.tensorboard_dir={tmp_path / 'tb'}", "metrics.wandb_project=p"]
    with pytest.raises(ConfigError) as e:
        open_sinks(load(RunConfig, overrides=sets))
    assert str(e.value) == f"{key} is set but {extra} is not installed: pip install 'dora-rl[{extra}]'"
    assert not (tmp_path / "tb").exists()  # both are checked before either is opened


def test_a_broker_whose_sink_library_is_missing_says_so_in_one_line_and_announces_nothing(tmp_path):
    (tmp_path / "fake" / "wandb").mkdir(parents=True)
    (tmp_path / "fake" / "wandb" / "__init__.py").write_text("raise ImportError('no wandb here')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "fake"), os.getcwd()]))
    argv = [sys.executable, "-m", "dora", "broker", "--set", "broker.bind=tcp://127.0.0.1:0",
            "--set", f"broker.discovery_file={tmp_path / 'b.json'}", "--set", "metrics.wandb_project=p"]  # fmt: skip
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "dora broker: metrics.wandb_project is set but wandb is not installed: pip install 'dora-rl[wandb]'"
    )
    assert "Traceback" not in r.stderr and not (tmp_path / "b.json").exists()


def test_dora_run_and_slurm_put_relative_sink_dirs_in_the_run_directory(tmp_path):
    rundir = tmp_path / "runs" / "1"
    cfg = load(RunConfig, overrides=["metrics.tensorboard_dir=tb", "metrics.wandb_project=p", "metrics.wandb_dir=w"])
    data = prepare(cfg, rundir)
    assert data["metrics"]["tensorboard_dir"] == str(rundir / "tb")
    assert data["metrics"]["wandb_dir"] == str(rundir / "w")
    job = job_config(cfg, rundir)
    assert job["metrics"]["tensorboard_dir"] == str(rundir.resolve() / "tb")
    assert job["metrics"]["wandb_dir"] == str(rundir.resolve() / "w")
    absolute = load(RunConfig, overrides=[f"metrics.tensorboard_dir={tmp_path / 'tb'}"])
    assert prepare(absolute, rundir)["metrics"]["tensorboard_dir"] == str(tmp_path / "tb")
    assert job_config(absolute, rundir)["metrics"]["tensorboard_dir"] == str(tmp_path / "tb")
    plain = prepare(load(RunConfig), rundir)["metrics"]
    assert "tensorboard_dir" not in plain and "wandb_project" not in plain and "wandb_dir" not in plain


# ---------------------------------------------------------------------- a live broker


async def train(actor_ep_ctx: tuple[Any, str, Any], steps: int) -> None:
    """Two fake workers and a fake learner run ``steps`` train steps; reward_mean = 0.25 * (step + 1)."""
    _actor, ep, ctx = actor_ep_ctx
    seen = Counter[str]()
    workers = [Fake(ctx, ep, f"rollout/{n}/1") for n in "ab"]
    tasks = [asyncio.create_task(fake_worker(w, 2 * G, seen)) for w in workers]
    learner = Fake(ctx, ep, "learner/x")
    await learner.hello(m.Role.LEARNER)
    try:
        for step in range(steps):
            await learner.send(m.RequestBatch(step=step))
            await learner.recv(m.TrainBatch)
            numbers = {"reward_mean": 0.25 * (step + 1), "loss": -1.0 / (step + 3)}
            await learner.send(m.WeightsPublished(version=step + 1, uri="sim://v", sha256="0" * 8, metrics=numbers))
            await learner.recv(m.PublishAck)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_live_broker_writes_every_step_to_tensorboard_as_in_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboard")
    metrics_file, tb = tmp_path / "metrics.jsonl", tmp_path / "tb"
    sets = (f"broker.metrics_file={metrics_file}", f"metrics.tensorboard_dir={tb}", "broker.exit_when_done=false")
    async with running_broker(*sets) as running:
        await train(running, STEPS)
    running[0].metrics.close()
    rows = [json.loads(x) for x in metrics_file.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    got = scalars_of(tb)
    expected = {"train/reward_mean": "reward_mean", "train/loss": "loss", "time/step_s": "step_s",
                "time/publish_s": "publish_s", "time/elapsed_s": "elapsed_s", "broker/version": "version",
                "broker/workers": "workers", "broker/max_staleness": "max_staleness"}  # fmt: skip
    staleness = {f"staleness/{k}" for r in rows for k in r["staleness"]}
    assert staleness and set(expected) | staleness | {"broker/live_versions"} <= set(got)
    assert not {tag for tag in got if tag.rpartition("/")[2] in ("step", "t")}  # the x axis and the wall clock
    for tag, key in expected.items():
        assert got[tag] == [(r["step"], f32(r[key])) for r in rows], tag
    assert got["broker/live_versions"] == [(r["step"], float(len(r["live_versions"]))) for r in rows]
    for tag in staleness:
        k = tag.removeprefix("staleness/")
        assert got[tag] == [(r["step"], float(r["staleness"][k])) for r in rows if k in r["staleness"]], tag
    assert [v for _, v in got["train/reward_mean"]] == [0.25, 0.5, 0.75]


class Recording:
    name = "recording"

    def __init__(self) -> None:
        self.points: list[tuple[int, dict[str, float]]] = []
        self.closed = 0

    def log(self, step: int, scalars: Any) -> None:
        self.points.append((step, dict(scalars)))

    def close(self) -> None:
        self.closed += 1


class Broken(Recording):
    name = "broken"

    def log(self, step: int, scalars: Any) -> None:
        super().log(step, scalars)
        if step == 1:
            raise OSError(28, "No space left on device")


async def test_a_sink_that_fails_is_dropped_with_one_warning_and_the_broker_goes_on(tmp_path):
    metrics_file = tmp_path / "metrics.jsonl"
    good, broken = Recording(), Broken()
    with capture_logs() as logs:
        async with running_broker(f"broker.metrics_file={metrics_file}", "broker.exit_when_done=false") as running:
            actor = running[0]
            actor.metrics.sinks = Sinks([broken, good])
            await train(running, STEPS)
            actor.metrics.scalars(STEPS, "eval", {"reward_mean": 0.5, "by": {"task": 1}, "name": "x"})
            families = {f.name: f for f in actor.metrics.collect()}
            actor.metrics.close()
    rows = [json.loads(x) for x in metrics_file.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))  # the broker went on
    assert [s for s, _ in good.points] == [*range(STEPS), STEPS]
    assert [p["train/reward_mean"] for _, p in good.points[:STEPS]] == [r["reward_mean"] for r in rows]
    assert good.points[-1] == (STEPS, {"eval/reward_mean": 0.5, "eval/by/task": 1.0})
    assert [s for s, _ in broken.points] == [0, 1] and broken.closed == 1 and good.closed == 1
    warned = [e for e in logs if e["event"] == "metrics_sink_dropped"]
    assert len(warned) == 1 and warned[0]["sink"] == "broken" and warned[0]["log_level"] == "warning"
    assert "No space left" in warned[0]["error"]
    assert actor.metrics.sinks.failed == Counter({"broken": 1})
    [sample] = families["dora_metrics_sink_failures"].samples
    assert sample.labels == {"sink": "broken"} and sample.value == 1
