"""`dora run --config FILE.toml`: broker, rollout workers and learner on this machine, one command.

Each run gets its own directory under ``run.dir``, holding:
- the resolved config every process reads, and one log per process;
- the broker's ``metrics.jsonl`` (one line per train step) and ``timeline.jsonl`` (one line per worker
  event and published version);
- the learner's audit, the weight store, the learner's checkpoints and, at the end, the figures of
  `dora plot`: ``reward.png``, ``staleness.png``, ``health.png`` and ``timeline.png``;
- if ``[metrics]`` asks for them, TensorBoard event files and wandb's runs: a relative
  ``metrics.tensorboard_dir`` or ``metrics.wandb_dir`` is in the run directory, and wandb's default is the run
  directory itself.

The broker listens on an ipc socket in that directory and serves Prometheus metrics on a free local
port (``metrics_url`` in ``broker.json``). The progress line, read from ``metrics.jsonl``, shows step,
reward, staleness and throughput. Ctrl-C (or SIGTERM) stops every process by its PID: SIGTERM first,
then SIGKILL after the grace period.

On a machine with GPUs each process gets its own (``dora.launch.placement``: run.gpus, learner.gpus,
rollout.gpus_per_worker) through CUDA_VISIBLE_DEVICES, printed in one line at the start; a layout that does not fit
is refused before any process starts. On a machine without GPUs nothing is placed.

With task.reward_model or task.reward_judge (and no task.reward_server), `dora reward` starts first; once it serves,
its URL is written into the run's config as task.reward_server for the broker and the workers, and it is stopped with
the other processes at the end (its log: ``reward.log``). The run's own held-out evaluations (eval.dataset) then run
while it serves, so it scores both: the starting weights' once it serves, before the broker starts, and the final
version's once the other processes ended, before it stops.

A rollout worker that exits is reported at once, one line with its last error (from its log). The run goes on
without it once every worker has joined the broker; it stops (every process, by PID) and exits 1 when no worker
is left, when a worker exits before the whole fleet has joined, or when the fleet has not joined within
``run.worker_start_timeout_s``. The exit status is 0 only if the run finished and every process but such
reported workers exited 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

from dora.config import ConfigError, load, to_data
from dora.config.run import RunConfig
from dora.hf.checks import check_model
from dora.hf.preflight import check_run_model, model_folder
from dora.launch.local import LocalRun
from dora.launch.placement import Placement, plan, visible_gpus, wants_gpus
from dora.launch.watch import RunStuck, WorkerWatch, new_lines
from dora.ops.plot import EVAL, METRICS, TIMELINE, PlotError, render


def run_model(cfg: RunConfig) -> pathlib.Path | None:
    """The model folder every process of a run of ``cfg`` loads (rollout.model, else learner.model), found and
    checked as a model folder; None for a run with neither a model engine nor a model trainer. A name that does not
    resolve is a ConfigError, before the run's directory is made."""
    if cfg.run.engine == "sim" and cfg.run.trainer == "sim":
        return None
    name, key = (cfg.rollout.model, "rollout.model") if cfg.rollout.model else (cfg.learner.model, "learner.model")
    if not name:
        raise ConfigError("run.engine/run.trainer torch|vllm need rollout.model (a model folder, a hub id, or "
                          '"dora:tiny")')  # fmt: skip
    model = model_folder(name, key=key)
    check_model(model, key=key, chat_template=cfg.task.chat_template)  # before the task reads it
    return model


def prepare(cfg: RunConfig, rundir: pathlib.Path, model: pathlib.Path | None = None) -> dict[str, Any]:
    """The config the processes get: this run's socket, discovery file, audit and weight store, and its model
    folder (``model``: ``run_model(cfg)``'s, found here when not given)."""
    data = to_data(cfg)
    data["broker"].update(bind=f"ipc://{rundir / 'broker.sock'}", discovery_file=str(rundir / "broker.json"),
                          metrics_file=str(rundir / METRICS), timeline_file=str(rundir / TIMELINE),
                          eval_file=str(rundir / EVAL))  # fmt: skip
    data["broker"].setdefault("metrics_bind", "127.0.0.1:0")
    data["core"]["min_workers"] = cfg.run.workers
    data["learner"].update(audit_file=str(rundir / "audit.jsonl"), store=str(rundir / "weights"))
    data["learner"].setdefault("checkpoint_dir", str(rundir / "checkpoints"))
    data["broker"].setdefault("journal", str(rundir / "journal.jsonl"))
    for key in ("tensorboard_dir", "wandb_dir"):
        if key in data["metrics"] and not os.path.isabs(data["metrics"][key]):
            data["metrics"][key] = str(rundir / data["metrics"][key])
    data["log"]["format"] = "json"
    model = model if model is not None else run_model(cfg)
    if model is not None:
        data["rollout"]["model"] = data["learner"]["model"] = str(model)
        data["task"].setdefault("tokenizer", str(model))
    return data


@dataclass(frozen=True, slots=True)
class Threads:
    """OMP_NUM_THREADS of each kind of process `dora run` starts."""

    standalone: int
    learner_rank: int
    elastic: int

    def describe(self, *, elastic: int, standalone: int) -> str:
        parts = [f"{self.learner_rank} per learner rank"]
        parts += [f"{self.standalone} per standalone worker"] if standalone else []
        parts += [f"{self.elastic} per elastic worker (yielded to the learner for each step)"] if elastic else []
        return ", ".join(parts)


def thread_shares(cpus: int, *, workers: int, elastic: int, ranks: int) -> Threads:
    """This machine's cores shared out so that what runs at once fits them: the standalone workers always, and either
    the learner ranks (during a step) or the elastic workers (between steps: they yield for each step). Each
    standalone worker gets one share; the learner ranks and the elastic workers each split max(ranks, elastic)
    shares among themselves. At least one thread each."""
    alternating = max(ranks, elastic)
    each = max(1, cpus // (workers - elastic + alternating))
    return Threads(standalone=each, learner_rank=each * alternating // ranks,
                   elastic=each * alternating // elastic if elastic else each)  # fmt: skip


def check_task(data: dict[str, Any]) -> dict[str, Any]:
    """Load the task exactly as the processes will (a dataset: every row read, checked and rendered), so a bad
    file, row, field or template is one line before any process starts; what the task is."""
    from dora.config import build
    from dora.tasks.prompts import prompt_source

    return prompt_source(build(RunConfig, data))[1]


def check_eval(data: dict[str, Any]) -> None:
    """[eval]'s rows loaded as the held-out evaluation loads them, so a bad file, row or field is one line before any
    process starts."""
    from dora.config import build
    from dora.tasks.prompts import eval_task

    cfg = build(RunConfig, data)
    eval_task(cfg, cfg.task.tokenizer or data["rollout"]["model"])


def report_task(about: dict[str, Any]) -> None:
    if "dataset" not in about:
        return
    line = f"dora run: dataset {about['dataset']}: {about['rows']} rows"
    if about["filtered"]:
        shown = ", ".join(map(str, about["filtered_rows"])) + (", ..." if about["filtered"] > 20 else "")
        line += (f", {about['filtered']} filtered out (prompts over task.max_prompt_tokens = "
                 f"{about['max_prompt_tokens']} tokens: rows {shown}), {about['kept']} kept")  # fmt: skip
    print(line + f"; {about['kept']} groups make an epoch", file=sys.stderr)


@dataclass(slots=True)
class HeldOut:
    """`dora run`'s own [eval] of the starting weights (``before``) and of the final version (``after``), both
    scored by the same reward sources: a run whose `dora reward` it starts evaluates while that serves (the starting
    weights once it serves, before the broker starts; the final version once the others ended, before it stops);
    any other run before any process starts and after every process ended."""

    before: dict[str, Any] | None = None
    after: dict[str, Any] | None = None


def serves_rewards(cfg: RunConfig) -> bool:
    """Whether `dora run` starts `dora reward` for this run: a reward model or a judge, and no task.reward_server."""
    return bool(cfg.task.reward_model or cfg.task.reward_judge) and cfg.task.reward_server is None


@dataclass(frozen=True, slots=True)
class Prepared:
    """A run checked and set up, before any of its processes starts."""

    cfg: RunConfig
    steps: int
    """core.total_steps, which `dora run` needs."""
    placement: Placement
    rundir: pathlib.Path
    data: dict[str, Any]
    """The config the processes get (``prepare``)."""
    held_out: HeldOut
    """[eval] on the starting weights and the final version; None each without eval.dataset (``HeldOut``)."""


class Signals:
    """SIGINT and SIGTERM, caught from now on: the run then stops every process and exits 130."""

    def __init__(self) -> None:
        self.caught = False
        signal.signal(signal.SIGINT, self.catch)
        signal.signal(signal.SIGTERM, self.catch)

    def catch(self, signum: int, frame: Any) -> None:
        self.caught = True


def parse(argv: list[str]) -> argparse.Namespace:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="dora run", description=__doc__, formatter_class=fmt)
    p.add_argument("--config", metavar="FILE.toml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL on stop")
    return p.parse_args(argv)


def check_run(cfg: RunConfig) -> int:
    """What `dora run` needs of a config beyond what loading it checks, and whether its engine can start here; the
    run's train steps."""
    if cfg.core.total_steps is None:
        raise ConfigError("dora run needs core.total_steps")
    if cfg.task.env is not None and cfg.run.engine == "sim":
        raise ConfigError("task.env: multi-turn episodes run on run.engine = 'torch' or 'vllm', not 'sim'")
    if cfg.eval.dataset and cfg.run.engine == "sim":
        raise ConfigError("eval.dataset needs a model: run.engine torch or vllm")
    from dora.rollout.main import check_engine, check_sleep

    check_engine(cfg.run.engine, cfg)
    if cfg.task.reward_model or cfg.task.reward_judge:
        from dora.reward.main import check_models

        check_models(cfg.task)
    if cfg.rollout.sleep_on_yield:
        check_sleep(cfg.run.engine, cfg.rollout.device)
    return cfg.core.total_steps


def prepare_run(args: argparse.Namespace) -> Prepared:
    """The config loaded and checked, the GPUs placed, the model and the task checked, the run directory made and
    the starting weights evaluated; a user's mistake raises (ConfigError, ValueError, FileExistsError)."""
    cfg = load(RunConfig, path=args.config, env=os.environ, env_prefix="DORA_", overrides=args.set)
    steps = check_run(cfg)
    placement = plan(cfg, visible_gpus(os.environ) if wants_gpus(cfg) else ())
    model = run_model(cfg)
    rundir = pathlib.Path(cfg.run.dir) / time.strftime("%Y%m%d-%H%M%S")
    rundir.mkdir(parents=True, exist_ok=False)
    data = prepare(cfg, rundir, model)
    about = check_task(data)
    report_task(about)
    if cfg.run.engine != "sim" or cfg.run.trainer != "sim":
        check_run_model(cfg, pathlib.Path(data["rollout"]["model"]), cfg.run.engine, about)
    if cfg.eval.dataset and serves_rewards(cfg):
        check_eval(data)  # evaluated once `dora reward` serves; its rows are checked now
    evals = HeldOut(before=held_out(data, rundir, 0) if cfg.eval.dataset and not serves_rewards(cfg) else None)
    return Prepared(cfg, steps, placement, rundir, data, evals)


def announce(p: Prepared, run: LocalRun, shares: Threads, elastic: int) -> None:
    """The run's one-line summary, its CPU threads (unless run.threads gave them) and its GPUs."""
    cfg = p.cfg
    shared = f" ({elastic} elastic)" if elastic else ""
    print(f"dora run: {cfg.core.mode.value}, {cfg.run.workers} {cfg.run.engine} workers{shared}, "
          f"{cfg.run.trainer} trainer, {cfg.core.total_steps} steps; run directory {p.rundir}",
          file=sys.stderr)  # fmt: skip
    if not run.threads_given:
        print(f"dora run: CPU threads: {shares.describe(elastic=elastic, standalone=cfg.run.workers - elastic)}",
              file=sys.stderr)  # fmt: skip
    if p.placement.gpus:
        print(f"dora run: {p.placement.describe()}", file=sys.stderr)


def start_fleet(run: LocalRun, p: Prepared, shares: Threads, elastic: int) -> WorkerWatch:
    """`dora reward` when the task has a reward model or a judge and no task.reward_server (then the starting
    weights' held-out evaluation, scored by it), the broker, then the rollout workers (the first ``elastic`` of them
    elastic); the watch over the workers."""
    cfg = p.cfg
    if serves_rewards(cfg):
        print(f"dora run: reward server at {run.start_reward(cfg.run.worker_start_timeout_s)}", file=sys.stderr)
        if cfg.eval.dataset:
            p.held_out.before = held_out(run.cfg, p.rundir, 0)  # the run's config, pointing at the server
    run.start_broker()
    url = json.loads((p.rundir / "broker.json").read_text()).get("metrics_url")
    if url:
        print(f"dora run: Prometheus metrics at {url}", file=sys.stderr)
    extra = ["--model", str(p.data["rollout"]["model"])] if cfg.run.engine != "sim" else []
    for i in range(cfg.run.workers):
        flag, threads = (["--elastic"], shares.elastic) if i < elastic else ([], shares.standalone)
        run.start_worker(f"w{i}", cfg.run.engine, *extra, *flag, threads=threads)
    names = [f"w{i}" for i in range(cfg.run.workers)]
    return WorkerWatch(run, names, start_timeout_s=cfg.run.worker_start_timeout_s)


def start_learner(run: LocalRun, p: Prepared) -> None:
    """The learner: one process, or learner.ranks of them under torchrun (FSDP2 over local ranks)."""
    cfg = p.cfg
    learner = ["learner", "--trainer", cfg.run.trainer, "--broker", str(p.rundir / "broker.json")]
    if cfg.run.trainer == "torch" and cfg.learner.ranks > 1:
        run.spawn_command("learner", ["-m", "torch.distributed.run", "--standalone",
                                      f"--nproc-per-node={cfg.learner.ranks}", "-m", "dora", *learner])  # fmt: skip
    else:
        run.spawn("learner", *learner)


@dataclass(frozen=True, slots=True)
class Ended:
    """How the processes of a run ended."""

    codes: dict[str, int]
    """Each process's exit status."""
    broken: bool
    """The run could not go on (a process failed to start, the broker died, the fleet was stuck)."""
    lost: dict[str, int]
    """The rollout workers that exited while the run went on without them (none when broken)."""


def drive(run: LocalRun, p: Prepared, shares: Threads, elastic: int, signals: Signals, grace_s: float) -> Ended:
    """Start every process, follow the run to its end, then stop every process (by PID) and draw its figures."""
    broken = False
    watch: WorkerWatch | None = None
    try:
        watch = start_fleet(run, p, shares, elastic)
        start_learner(run, p)
        follow(run, p.rundir, p.steps, lambda: signals.caught, watch)
        if p.held_out.before is not None and "reward" in run.procs and not signals.caught:
            evaluate_served(run, p, grace_s, watch.lost)
    except (RuntimeError, TimeoutError) as e:
        broken = True
        print(f"dora run: {e}" + ("; stopping every process" if isinstance(e, RunStuck) else ""), file=sys.stderr)
    finally:
        codes = run.stop(grace_s=grace_s)
        if broken and watch is not None:
            watch.settle(codes)
        try:
            render(p.rundir)
        except PlotError as e:
            print(f"dora run: no figures: {e}", file=sys.stderr)
    return Ended(codes, broken, watch.lost if watch is not None and not broken else {})


def evaluate_served(run: LocalRun, p: Prepared, grace_s: float, lost: dict[str, int]) -> None:
    """A run whose `dora reward` this started, once it ended: every other process stopped, then the final version's
    held-out evaluation while the server still scores, as it scored the starting weights'. None when a process
    failed (``lost``: the workers the run went on without): the run reports that instead."""
    codes = run.stop(grace_s=grace_s, keep=frozenset({"reward"}))
    if all(code == 0 for name, code in codes.items() if name not in lost):
        p.held_out.after = held_out(run.cfg, p.rundir, final_version(p.data))


def conclude(p: Prepared, ended: Ended, stopped: bool) -> int:
    """The run's last lines and its exit status: 130 stopped, 1 failed or an invariant broken, else 0."""
    failed = {k: v for k, v in ended.codes.items() if v != 0 and k not in ended.lost}
    if stopped:
        print(f"dora run: stopped; every process ended ({ended.codes}); logs in {p.rundir}", file=sys.stderr)
        return 130
    if failed or ended.broken:
        print(f"dora run: processes failed: {failed}; logs in {p.rundir}", file=sys.stderr)
        return 1
    lost = ended.lost
    gone = f" ({len(lost)} rollout worker{'s' * (len(lost) > 1)} lost on the way: {', '.join(lost)})" if lost else ""
    print(f"dora run: done{gone}; metrics in {p.rundir / 'metrics.jsonl'}", file=sys.stderr)
    before = p.held_out.before
    if before is not None:
        after = p.held_out.after or held_out(p.data, p.rundir, final_version(p.data))
        rows = f"{int(after['rows'])} rows of {p.cfg.eval.dataset}, version 0 -> {after['version']}"
        print(f"dora run: held-out accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f} ({rows})",
              file=sys.stderr)  # fmt: skip
    return check_invariants(p.rundir)


def main(argv: list[str]) -> int:
    args = parse(argv)
    try:
        p = prepare_run(args)
    except (ConfigError, ValueError, FileExistsError) as e:
        print(f"dora run: {e}", file=sys.stderr)
        return 2
    cfg = p.cfg
    elastic = cfg.run.workers if cfg.rollout.elastic else cfg.run.elastic_workers
    ranks = cfg.learner.ranks if cfg.run.trainer == "torch" else 1
    t = cfg.run.threads
    shares = Threads(t, t, t) if t else thread_shares(os.cpu_count() or 1, workers=cfg.run.workers, elastic=elastic,
                                                       ranks=ranks)  # fmt: skip
    run = LocalRun(p.rundir, p.data, threads=shares.learner_rank, envs=p.placement.envs)
    signals = Signals()
    announce(p, run, shares, elastic)
    ended = drive(run, p, shares, elastic, signals, args.grace)
    return conclude(p, ended, signals.caught)


def final_version(data: dict[str, Any]) -> int:
    """The newest version in the run's weight store."""
    from dora.store import WeightStore

    return WeightStore(data["learner"]["store"]).versions()[-1]


def held_out(data: dict[str, Any], rundir: pathlib.Path, version: int) -> dict[str, Any]:
    """[eval] on the run's model at ``version`` (0: the starting weights, else from the run's weight store), in
    this process while no worker runs, scored by the reward sources ``data`` (a run's config) names; recorded in
    ``eval.jsonl`` and printed."""
    from dora.config import build
    from dora.ops.evaluate import evaluate_model, line

    cfg = build(RunConfig, data)
    metrics = evaluate_model(cfg, data["rollout"]["model"], data["learner"]["store"] if version else None,
                             version or None)  # fmt: skip
    with open(rundir / EVAL, "a") as f:
        f.write(json.dumps({"step": version, **metrics, "by": "dora run"}) + "\n")
    print(f"dora run: held-out, version {version}: {line(metrics)}", file=sys.stderr)
    return metrics


def check_invariants(rundir: pathlib.Path) -> int:
    """Print the run's invariant report (`dora audit RUN_DIR`); 1 if an invariant is broken."""
    from dora.broker.journal import JournalError
    from dora.ops.audit import audit_dir
    from dora.ops.audit import render as render_report

    try:
        report = audit_dir(rundir)
    except (ConfigError, JournalError) as e:
        print(f"dora run: no invariant report: {e}", file=sys.stderr)
        return 0
    print(render_report(report), file=sys.stderr)
    return 0 if report.ok else 1


def follow(run: LocalRun, rundir: pathlib.Path, total: int, stopped: Any, watch: WorkerWatch | None = None) -> None:
    """Show progress from the broker's metrics.jsonl as steps are trained, until the run ends; ``watch``: check
    the rollout workers on each pass (RunStuck when the run cannot go on)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    offset, tokens = 0, 0.0
    ending = False
    with Progress(
        TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"), transient=False,
    ) as bar:  # fmt: skip
        task = bar.add_task("run", total=total, info="")
        while not stopped():
            rows, offset = new_lines(rundir / METRICS, offset)
            for r in rows:
                tokens += r.get("tokens", 0)
                bar.update(task, completed=r["step"] + 1, info=(
                    f"reward {r.get('reward_mean', 0):.3f}  staleness {r['staleness']}  "
                    f"{tokens / max(r['elapsed_s'], 1e-9):,.0f} tok/s"))  # fmt: skip
            if ending:  # everyone was told goodbye: let them finish on their own
                for name in run.procs.keys() - {"reward"}:  # the reward server serves until stopped
                    with contextlib.suppress(TimeoutError):
                        run.wait(name, 30)
                return
            learner, broker = run.procs["learner"], run.procs["broker"]
            if learner.poll() is not None or broker.poll() == 0:  # done (the broker ends a finished run)
                ending = True  # one more pass reads the last steps
                time.sleep(0.3)
                continue
            if broker.poll() is not None:
                raise RuntimeError(f"the broker exited with {broker.returncode}; see {rundir}/broker.log")
            reward = run.procs.get("reward")
            if reward is not None and reward.poll() is not None:  # every sample would score 0 from now on
                raise RuntimeError(f"dora reward exited with {reward.returncode}; see {rundir}/reward.log")
            if watch is not None:
                watch.check()
            time.sleep(0.5)
