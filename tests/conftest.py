from __future__ import annotations

import compileall
import os
import pathlib
import sys

import pytest
from hypothesis import Phase, settings

# Torch's OpenMP threads spin between parallel regions before they sleep. Beside another xdist worker (or any load)
# that spinning takes the cores the other tests need: the learner and SFT tests took 164 CPU-s under -n 2 with it,
# 88 without. Set before any test imports torch; the processes the tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_configure(config: pytest.Config) -> None:
    """Compile dora's sources once, before any test starts a process. The processes the tests start (hundreds:
    brokers, workers, learners, CLIs) import dora from this tree, and where PYTHONDONTWRITEBYTECODE is set no
    process may write bytecode, so each compiled every module it imported anew: 0.3 s of CPU per process that
    imports the actors. Only the first pytest process compiles (xdist's workers find the files written)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        compileall.compile_dir(pathlib.Path(__file__).resolve().parents[1] / "dora", quiet=1, workers=1)
        if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", "no") != "no":
            rewrite_the_tests_once(config)
    else:
        share_the_cores()


def rewrite_the_tests_once(config: pytest.Config) -> None:
    """Under ``-n``: the test modules' asserts rewritten once, here, before the workers start. Each worker imports
    every test module to collect it, and pytest rewrites a module's asserts as it imports it unless the rewritten
    code is cached beside it (``__pycache__/*-pytest-*.pyc``, which no process writes where PYTHONDONTWRITEBYTECODE
    is set, and which three workers starting together on a fresh clone each make): 19 CPU-s a worker. Written here
    on each core, the workers read them (pytest checks each against its source's hash, so a stale one is unused)."""
    import multiprocessing

    if config.getoption("assertmode") != "rewrite" or sys.pycache_prefix:
        return
    files = sorted(f for f in TESTS.rglob("*.py") if f.name.startswith("test_") or f.name == "conftest.py")
    global _REWRITING
    _REWRITING = config
    try:
        with multiprocessing.get_context("fork").Pool(len(os.sched_getaffinity(0))) as pool:
            pool.map(_rewrite_one, files, chunksize=4)
    except OSError:  # a read-only tree: each worker rewrites for itself, as without this
        pass
    finally:
        _REWRITING = None


_REWRITING: pytest.Config | None = None
"""The config ``_rewrite_one`` rewrites with, in the forked processes of ``rewrite_the_tests_once``."""
TESTS = pathlib.Path(__file__).resolve().parent


def _rewrite_one(path: pathlib.Path) -> None:
    from _pytest.assertion.rewrite import PYC_TAIL, _read_pyc, _rewrite_test, _write_pyc, assertstate_key

    assert _REWRITING is not None
    pyc = path.parent / "__pycache__" / (path.name[:-3] + PYC_TAIL)
    if _read_pyc(path, pyc) is not None:
        return
    pyc.parent.mkdir(exist_ok=True)
    source_hash, code = _rewrite_test(path, _REWRITING)
    _write_pyc(_REWRITING.stash[assertstate_key], code, source_hash, pyc)


def share_the_cores() -> None:
    """An xdist worker's own torch threads: its share of the cores (1 where the workers outnumber them). By default
    each worker would run as many threads as the machine has cores, so three workers on 2 cores ran 6 threads whose
    parallel regions wait for each other: the SFT, packing, LoRA, loss, checkpoint, evaluation and engine files
    took 159 CPU-s under -n 3 on 2 cores that way, 152 with one thread a worker (one run each; most of the
    difference in the short in-process tests). The processes the tests start keep their own settings (`dora run`
    and LocalRun share the cores out themselves)."""
    import torch

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


# Used by tests/mutation.py: a failing property run should stop at the first counterexample, not shrink it.
settings.register_profile("mutation", phases=[Phase.explicit, Phase.reuse, Phase.generate], database=None)
# Every other run shrinks a counterexample but does not trace it to explain it: on Python 3.11 that tracing runs
# under sys.settrace, and a stateful core test shrinking under it ran past its 180 s timeout (a timeout and a
# "flaky strategy" error reported instead of the counterexample).
settings.register_profile("default", phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
settings.load_profile("default")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> pathlib.Path:
    """A tiny untied Qwen2 model and tokenizer, built offline once per session, loaded like any HF folder."""
    from dora.hf.tiny import build_model

    return build_model(tmp_path_factory.mktemp("tiny") / "model")


SHARED_MODULES = (
    "test_zoo_builds.py",
    "test_store_folders.py",
    "test_datasets.py",
    "test_sft_ranks.py",
    "test_sandbox.py",
    "test_fsdp.py",
)
"""Test files that run whole on one worker: module-scoped fixtures worth making once, and the sandbox's hostile
programs (a fork bomb), which must not run beside each other: each checks that no sandboxed process is left."""


def shared_scope(nodeid: str) -> str | None:
    """The tests that must run on one worker under ``-n`` (pytest-xdist), by their id: the Slurm tests share the
    session's cluster (``slurm``), the engine tests on vLLM share one engine (``vllm-engine``), and the files of
    ``SHARED_MODULES`` share their module's fixtures. None: the test goes wherever a worker is free."""
    path = nodeid.partition("::")[0]
    if path.startswith("tests/slurm/"):
        return "slurm"
    if path == "tests/engines/test_engines.py" and "vllm" in nodeid.partition("::")[2]:
        return "vllm-engine"
    if path.rpartition("/")[2] in SHARED_MODULES:
        return path
    return None


@pytest.hookimpl(optionalhook=True)  # xdist's hook: without xdist installed, never called and no error
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto`` or ``-n logical``: one worker more than the CPUs this process may run on. A sixth of the suite's
    time is spent waiting (heartbeat windows, Slurm's polling, processes starting and stopping), and one more worker
    fills it: on 2 cores, with 3 workers (and the order below), the three ended within 4 s of each other at 600 s,
    where 2 (in the order before) had ended at 624 and 654 s. PYTEST_XDIST_AUTO_NUM_WORKERS, when set, still decides
    (None: xdist's own answer)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    return len(os.sched_getaffinity(0)) + 1


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under ``-n``: xdist's load scheduling, each test on whichever worker is free, except the groups of
    ``shared_scope``, each sent whole to one worker (the biggest first)."""
    from xdist.scheduler import LoadScopeScheduling

    class Shared(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return shared_scope(nodeid) or nodeid

    return Shared(config, log)


LONG_UNIT_MODULES = (
    "test_sim_properties.py",
    "test_core_properties.py",
    "test_sft.py",
    "test_wire.py",
    "test_packed.py",
    "test_core_replay.py",
    "test_sim_agentic.py",
)
"""Unit test files with tests of 5-20 s (property runs, fuzzing, SFT epochs): they go before the other unit tests."""

WAITING_LIVE_MODULES = (
    "test_faults.py",
    "test_dead_workers.py",
    "test_security.py",
    "test_malformed.py",
    "test_dataset_epochs.py",
    "test_live_run.py",
)
"""Live files of sim runs that mostly wait (signals, liveness windows, restarts): 0.4 to 0.6 CPU-s per second while
they run under -n 3 on 2 cores, against 0.7 to 0.9 for the live runs on a model. They go after the long unit files,
beside the short CPU-bound unit tests, instead of at the start beside the Slurm tests, which wait too."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest tests first (Slurm, live, zoo, engines, then the long unit files, then the live files that mostly
    wait): under ``-n`` they go out at the start, so the workers finish together on tests of a second or less
    instead of one waiting on a long test that came late. (xdist sends the groups of ``shared_scope`` first, the
    biggest first, then the rest in this order.)"""
    order = ("slurm", "live", "zoo", "engines", "long unit", "waiting live")

    def rank(item: pytest.Item) -> int:
        where, name = item.path.parent.name, item.path.name
        if where == "live" and name in WAITING_LIVE_MODULES:
            return order.index("waiting live")
        if where in order:
            return order.index(where)
        return order.index("long unit") if name in LONG_UNIT_MODULES else len(order)

    items.sort(key=rank)
