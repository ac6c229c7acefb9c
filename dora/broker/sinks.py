"""Where the broker's numbers go besides ``metrics.jsonl``: TensorBoard event files and Weights & Biases.

The ``[metrics]`` section turns them on (both off by default). ``open_sinks`` builds them at broker start:
a sink whose library is missing, or that cannot start, is a ``ConfigError`` naming the key and the extra to
install, before the broker announces itself. At run time a sink is a side channel: one that fails (disk
full, a wandb error) is logged once as a warning, counted (``dora_metrics_sink_failures``) and dropped,
and the broker goes on.

Scalar names, one point per train step at x = ``step`` (the ``step`` of metrics.jsonl, version - 1):

- ``train/<name>``: the learner's own metrics (``train/reward_mean``, ``train/loss``, ``train/tokens``, ...),
  and the broker's numbers of the batch: ``train/reward/<component>`` (the mean of each reward component)
  and ``train/reward_failed`` (samples whose reward failed);
- ``time/<name>``: seconds: ``time/step_s`` (between two publishes), ``time/publish_s``, ``time/elapsed_s``
  (since the broker started);
- ``staleness/<k>``: trajectories taken into train batches so far at staleness k (the cumulative histogram);
- ``worker/<name>``: the rollout workers' own counters summed over the run so far (``worker/reward_service_calls``,
  ``worker/agent_failed``; docs/metrics.md#worker-counters), when they report any;
- ``broker/<name>``: the broker's other numbers: ``broker/version``, ``broker/workers``,
  ``broker/live_versions`` (how many), ``broker/max_staleness``, and any key the step row gains later;
- ``<prefix>/<name>``: another stream logged through ``BrokerMetrics.scalars(step, prefix, values)``, such
  as a held-out evaluation's ``eval/reward_mean``.

A nested dict is flattened with ``/`` (``{"staleness": {"1": 8}}`` is ``staleness/1``); strings, lists,
None and booleans are not scalars and are left out; ``t`` (the wall clock) is each point's own time.

TensorBoard files are written with the ``tensorboard`` package's record writer and protos alone: neither
torch nor tensorflow is imported (TensorBoard's own ``EventFileWriter`` would import tensorflow when it is
installed). wandb is imported only when ``metrics.wandb_project`` is set.
"""

from __future__ import annotations

import collections
import importlib
import itertools
import os
import socket
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, Literal, Protocol

import structlog

from dora.config import ConfigError, to_data
from dora.config.run import RunConfig

log = structlog.get_logger()

STEP_NAMES = {
    "step_s": "time/step_s",
    "publish_s": "time/publish_s",
    "elapsed_s": "time/elapsed_s",
    "staleness": "staleness",
    "reward_components": "train/reward",
    "reward_failed": "train/reward_failed",
    "worker_counters": "worker",
}
"""Keys of the step row not named ``broker/<key>`` (the learner's are ``train/<key>``)."""
NOT_SCALARS = frozenset({"step", "t"})
"""The x axis and the wall clock: every point has both already."""


class Sink(Protocol):
    """One destination of scalars."""

    name: str

    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of ``values`` named ``prefix/key`` (nested dicts: ``prefix/key/sub``); the rest left out."""
    out: dict[str, float] = {}
    for key, value in values.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flatten(value, name))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def step_scalars(line: Mapping[str, Any], learner: Collection[str]) -> dict[str, float]:
    """The scalars of one metrics.jsonl line; ``learner`` names its keys that are the learner's metrics."""
    out: dict[str, float] = {}
    for key, value in line.items():
        if key in NOT_SCALARS:
            continue
        if key == "live_versions" and isinstance(value, list | tuple):
            value = len(value)
        name = f"train/{key}" if key in learner else STEP_NAMES.get(key, f"broker/{key}")
        out.update(flatten({name: value}))
    return out


class TensorBoardSink:
    """Scalars in a new TensorBoard event file in ``logdir``; each point is written and flushed at once."""

    name = "tensorboard"

    def __init__(self, logdir: str, *, wall: Callable[[], float] = time.time) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event, self._summary, self._wall = event_pb2.Event, summary_pb2.Summary, wall
        os.makedirs(logdir, exist_ok=True)
        stem = os.path.join(logdir, f"events.out.tfevents.{int(wall()):010d}.{socket.gethostname()}.{os.getpid()}")
        for n in itertools.count():  # a new file each time, even for two sinks started in the same second
            try:
                self.path = f"{stem}.{n}"
                file = open(self.path, "xb")  # noqa: SIM115 (closed by close())
                break
            except FileExistsError:
                continue
        self._writer = RecordWriter(file)
        self._write(self._event(wall_time=wall(), file_version="brain.Event:2"))

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        values = [self._summary.Value(tag=tag, simple_value=v) for tag, v in scalars.items()]
        self._write(self._event(wall_time=self._wall(), step=step, summary=self._summary(value=values)))

    def close(self) -> None:
        if not self._writer.closed:
            self._writer.close()

    def _write(self, event: Any) -> None:
        self._writer.write(event.SerializeToString())
        self._writer.flush()


class WandbSink:
    """Scalars in a Weights & Biases run (one per sink); ``close`` finishes the run and ends wandb's service."""

    name = "wandb"

    def __init__(
        self, project: str, *, mode: Literal["offline", "online"], dir: str, name: str | None, config: Mapping[str, Any]
    ) -> None:
        import wandb

        self._wandb = wandb
        os.makedirs(dir, exist_ok=True)
        settings = wandb.Settings(console="off", silent=True)  # the broker's stdout carries its ready line
        self.run = wandb.init(project=project, mode=mode, dir=dir, name=name, config=dict(config), settings=settings)
        self._closed = False

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.run.finish()
        finally:
            self._wandb.teardown()  # wandb-core, the service process, would otherwise live until exit


class Sinks:
    """The sinks of a broker, fed together. One that raises is closed, warned about once, counted in
    ``failed`` and dropped: a metrics side channel never takes the broker down."""

    def __init__(self, sinks: Iterable[Sink] = ()) -> None:
        self.live: list[Sink] = list(sinks)
        self.failed = collections.Counter[str]()
        """Failures by sink name (each drops its sink)."""

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for sink in list(self.live):
            try:
                sink.log(step, scalars)
            except Exception as e:  # a third-party library's boundary: whatever it raises, the run goes on
                self._drop(sink, "log", e)

    def close(self) -> None:
        for sink in list(self.live):
            try:
                sink.close()
            except Exception as e:
                self._drop(sink, "close", e)
        self.live.clear()

    def _drop(self, sink: Sink, during: str, error: Exception) -> None:
        self.live.remove(sink)
        self.failed[sink.name] += 1
        closing = None
        if during != "close":
            try:
                sink.close()
            except Exception as e:
                closing = repr(e)
        log.warning("metrics_sink_dropped", sink=sink.name, during=during, error=repr(error), close_error=closing)


def open_sinks(cfg: RunConfig) -> Sinks:
    """The sinks ``cfg.metrics`` asks for. A ConfigError if one's library is missing or it cannot start."""
    mc = cfg.metrics
    wanted = {"tensorboard": mc.tensorboard_dir is not None, "wandb": mc.wandb_project is not None}
    for extra, module, key in (("tensorboard", "tensorboard.compat.proto.event_pb2", "tensorboard_dir"),
                               ("wandb", "wandb", "wandb_project")):  # fmt: skip
        if wanted[extra] and not _importable(module):
            raise ConfigError(f"metrics.{key} is set but {extra} is not installed: pip install 'dora-rl[{extra}]'")
    sinks = Sinks()
    try:
        if mc.tensorboard_dir is not None:
            try:
                tb = TensorBoardSink(mc.tensorboard_dir)
            except OSError as e:
                raise ConfigError(f"metrics.tensorboard_dir: cannot write event files there: {e}") from e
            sinks.live.append(tb)
            log.info("metrics_sink_opened", sink="tensorboard", file=tb.path)
        if mc.wandb_project is not None:
            where = mc.wandb_dir or os.path.dirname(os.path.abspath(cfg.broker.metrics_file or "metrics.jsonl"))
            sinks.live.append(_wandb(mc.wandb_project, mc.wandb_mode, where, mc.wandb_run_name, to_data(cfg)))
    except BaseException:
        sinks.close()
        raise
    return sinks


def _wandb(project: str, mode: str, where: str, name: str | None, config: Mapping[str, Any]) -> WandbSink:
    import wandb

    try:
        sink = WandbSink(project, mode="online" if mode == "online" else "offline", dir=where, name=name, config=config)
    except (wandb.errors.Error, OSError) as e:
        wandb.teardown()  # the service it may have started
        raise ConfigError(f"metrics.wandb_project: wandb could not start a {mode} run in {where}: {e}") from e
    log.info("metrics_sink_opened", sink="wandb", mode=mode, project=project, dir=sink.run.dir)
    return sink


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True
