"""The package layers, read from the source: every import statement of every module under dora/, lazy
imports inside functions included, is an edge of the import graph; the layer rules of ARCHITECTURE.md
(ARCHITECTURE.md#the-package-map) are checked on it.

- dora.core decides; it reads no sockets, clocks, threads, torch, engines or simulator, and imports no
  process package (directly or through what it imports).
- dora.broker imports nothing of dora.learner or dora.rollout, and no torch at run time (through anything).
- dora.wire imports no process package and nothing beside dora.ids and dora.samples (the in-process forms it
  packs).
- dora.sim drives dora.core and imports nothing of the broker, rollout or learner.
- No import circle between packages (a top-level module such as dora.store is a package of its own), nor
  between modules.
- No module outside dora.core reaches the core's parts (``.scheduler``, ``.ledger``, ``.transfer``): what the
  core holds is read through ``Core.view``.

Imports under ``if TYPE_CHECKING:`` never run: they count for circles (a circle of names is a circle of
meaning), not for what a process loads.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

PROCESS_PACKAGES = ("dora.broker", "dora.rollout", "dora.learner", "dora.launch", "dora.ops", "dora.sim")
CORE_FORBIDDEN = (
    "zmq", "socket", "asyncio", "selectors", "threading", "multiprocessing", "concurrent", "subprocess",
    "time", "datetime", "torch", "vllm", "transformers", "safetensors", "numpy", *PROCESS_PACKAGES,
    "dora.rollout.engines", "dora.store", "dora.actor", "dora.wire",
)  # fmt: skip
HEAVY = ("torch", "vllm")
"""Never loaded by the broker. transformers is not among them: the broker renders chat templates with its
tokenizer side, which loads no torch (tests/unit/test_datasets.py runs it and checks sys.modules)."""


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    type_only: bool
    line: int


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(source: str, name: str, is_package: bool) -> list[tuple[str, bool, int]]:
    """(imported module, under TYPE_CHECKING, line) for every import statement of a module."""
    found: list[tuple[str, bool, int]] = []
    package = name if is_package else name.rpartition(".")[0]

    def visit(node: ast.AST, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for sub in child.body:
                    visit_one(sub, True)
                for sub in child.orelse:
                    visit_one(sub, type_only)
                continue
            visit_one(child, type_only)

    def visit_one(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((a.name, type_only, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((base, type_only, node.lineno))
            for a in node.names:  # `from dora.core import events` imports the module dora.core.events
                found.append((f"{base}.{a.name}", type_only, node.lineno))
        visit(node, type_only)

    visit(ast.parse(source), False)
    return found


def import_graph(root: pathlib.Path = ROOT / "dora") -> tuple[set[str], list[Edge]]:
    modules = {module_name(p): p for p in sorted(root.rglob("*.py"))}
    edges = []
    for name, path in modules.items():
        for target, type_only, line in imports_of(path.read_text(), name, path.name == "__init__.py"):
            if target.startswith("dora.") and target not in modules:
                continue  # `from dora.x import SomeName`: the name is not a module; the module edge is kept
            edges.append(Edge(name, target, type_only, line))
    return set(modules), edges


def reach(start: str, edges: Iterable[Edge], *, runtime: bool) -> dict[str, list[str]]:
    """Every module reached from ``start`` (dora's own modules followed, others kept as leaves), with the path."""
    out: dict[str, list[Edge]] = {}
    for e in edges:
        if not (runtime and e.type_only):
            out.setdefault(e.source, []).append(e)
    paths = {start: [start]}
    todo = [start]
    while todo:
        node = todo.pop()
        for e in out.get(node, []):
            if e.target not in paths:
                paths[e.target] = [*paths[node], e.target]
                if e.target.startswith("dora"):
                    todo.append(e.target)
    return paths


def under(name: str, prefixes: Iterable[str]) -> str | None:
    return next((p for p in prefixes if name == p or name.startswith(p + ".")), None)


def package_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def package_cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one package (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


def package_graph(edges: Iterable[Edge]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for e in edges:
        if e.target.startswith("dora.") and package_of(e.source) != package_of(e.target):
            graph.setdefault(package_of(e.source), set()).add(package_of(e.target))
    return graph


MODULES, EDGES = import_graph()


def _violations(prefix: str, forbidden: Iterable[str], *, runtime: bool) -> list[str]:
    bad = []
    for name in sorted(m for m in MODULES if under(m, [prefix])):
        for target, path in reach(name, EDGES, runtime=runtime).items():
            hit = under(target, forbidden)
            if hit and not under(target, [prefix]):
                bad.append(" -> ".join(path))
    return bad


def test_the_graph_is_read_from_the_source():
    assert {"dora.core.core", "dora.broker.actor", "dora.wire.codec", "dora.store"} <= MODULES
    assert any(e.source == "dora.broker.actor" and e.target == "dora.core.core" for e in EDGES)


def test_core_reads_no_sockets_clocks_threads_torch_engines_or_simulator():
    assert _violations("dora.core", CORE_FORBIDDEN, runtime=False) == []


def test_broker_imports_no_learner_rollout_or_torch():
    assert _violations("dora.broker", ("dora.learner", "dora.rollout"), runtime=False) == []
    assert _violations("dora.broker", HEAVY, runtime=True) == []


def test_wire_imports_only_itself_ids_and_samples():
    for e in EDGES:
        if under(e.source, ["dora.wire"]) and e.target.startswith("dora"):
            assert under(e.target, ["dora.wire", "dora.ids", "dora.samples"]), f"{e.source}:{e.line} imports {e.target}"
    assert _violations("dora.wire", PROCESS_PACKAGES, runtime=False) == []


def test_sim_drives_the_core_without_the_broker_or_the_processes():
    assert _violations("dora.sim", ("dora.broker", "dora.rollout", "dora.learner"), runtime=False) == []


def test_no_import_circle_between_packages():
    assert package_cycles(package_graph(EDGES)) == []


def test_no_import_circle_between_modules():
    """Inside a package too (the broker's actor, metrics and snapshot once imported each other)."""
    graph: dict[str, set[str]] = {}
    for e in EDGES:
        if e.target in MODULES and e.target != e.source:
            graph.setdefault(e.source, set()).add(e.target)
    assert package_cycles(graph) == []


CORE_PARTS = frozenset({"scheduler", "ledger", "transfer"})
"""The core's parts: only dora.core reaches them; every other module reads ``Core.view``."""


def reaches_core_parts(source: str) -> list[int]:
    """The lines of a module's source that reach an attribute named like one of the core's parts."""
    nodes = ast.walk(ast.parse(source))
    return sorted(n.lineno for n in nodes if isinstance(n, ast.Attribute) and n.attr in CORE_PARTS)


def test_nothing_outside_the_core_reaches_its_parts():
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted((ROOT / "dora").rglob("*.py"))
        if not path.is_relative_to(ROOT / "dora" / "core")
        for line in reaches_core_parts(path.read_text())
    ]
    assert found == [], "read the core through Core.view"


def probes_an_engine(source: str) -> list[int]:
    """The lines of a module's source that ask an engine what it has (``getattr``/``hasattr`` on a name or an
    attribute called ``engine``): an engine's capabilities are declared by ``WorkerEngine`` and ``StepEngine``."""
    lines = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr") and n.args:
            target = n.args[0]
            name = target.id if isinstance(target, ast.Name) else ""
            name = target.attr if isinstance(target, ast.Attribute) else name
            if name == "engine" or name.endswith("_engine"):
                lines.append(n.lineno)
    return sorted(lines)


def test_no_engine_is_probed_for_what_it_has():
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted((ROOT / "dora").rglob("*.py"))
        for line in probes_an_engine(path.read_text())
    ]
    assert found == [], "declare the capability on the engine's base class or protocol"


# The checks themselves, on graphs with known faults: a rule that cannot fail proves nothing.


def test_a_reach_into_the_core_is_found():
    src = "def f(core):\n    n = core.view.newest\n    return core.scheduler.flights, n\n"
    assert reaches_core_parts(src) == [3]


def test_a_probe_of_an_engine_is_found():
    src = "def f(self, engine):\n    a = getattr(self.engine, 'asleep', False)\n    b = hasattr(engine, 'evaluate')\n" \
          "    return a, b, getattr(self.task, 'env', None)\n"
    assert probes_an_engine(src) == [2, 3]


def test_a_circle_through_three_packages_is_found():
    graph = {"dora.a": {"dora.b"}, "dora.b": {"dora.c"}, "dora.c": {"dora.a"}, "dora.d": {"dora.a"}}
    assert package_cycles(graph) == [["dora.a", "dora.b", "dora.c"]]


def test_a_type_only_import_closes_a_circle_but_loads_nothing():
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dora.broker.actor import BrokerActor\n"
    found = imports_of(src, "dora.broker.metrics", False)
    assert ("dora.broker.actor", True, 3) in found
    edges = [Edge("dora.x.m", "dora.y.n", True, 1), Edge("dora.y.n", "dora.x.k", False, 1)]
    assert package_cycles(package_graph(edges)) == [["dora.x", "dora.y"]]
    assert "dora.y.n" not in reach("dora.x.m", edges, runtime=True)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import zmq\n", "zmq"),
        ("def f():\n    import torch\n", "torch"),  # a lazy import counts
        ("from . import ledger\n", "dora.core.ledger"),
        ("from ..sim import des\n", "dora.sim.des"),
    ],
)
def test_every_kind_of_import_is_an_edge(source: str, expected: str):
    assert expected in [t for t, _, _ in imports_of(source, "dora.core.x", False)]
