"""The package layering holds: no import cycle between megabert's packages or modules,
and the lower packages never reach up (checkpoint/ and planning/ know no model, trainer
or task); DeepSpeed is named only behind its door. Read from the source with ast, every
import statement counted: those inside functions (a lazy import cannot hide a cycle) and
those under `if TYPE_CHECKING:` (a type-only import is still a circle between modules)."""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megabert")

# (importer package, imported package): edges that must never exist.
FORBIDDEN = [
    ("checkpoint", "model"), ("checkpoint", "tasks"), ("checkpoint", "training"),
    ("planning", "training"), ("planning", "tasks"), ("planning", "model"),
    ("model", "tasks"), ("model", "training"),
    ("data", "tasks"), ("data", "corpus"), ("data", "training"),
    ("parallel", "model"), ("tensor_parallel", "model"), ("ops", "model"),
    ("training", "tasks"),
    # megabert's own data parallelism sits between them: below training/ (which runs it
    # inside a step), above parallel/, optim/, tensor_parallel/ and the configs (which know no
    # DP sharding). The rules and the planner read its ZeRO plan (data_parallel/zero_plan.py),
    # and it reads neither.
    ("data_parallel", "training"), ("data_parallel", "tasks"), ("data_parallel", "model"),
    ("data_parallel", "checkpoint"), ("data_parallel", "planning"), ("data_parallel", "rules"),
    ("parallel", "data_parallel"), ("optim", "data_parallel"), ("tensor_parallel", "data_parallel"),
    ("pipeline_parallel", "data_parallel"), ("checkpoint", "data_parallel"),
    ("model", "data_parallel"), ("config", "data_parallel"),
]


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    out: set[str] = set()

    def visit(node):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                parts = parts if is_package else parts[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            # `from pkg import module` imports pkg.module; `from pkg import name`, pkg.
            out.update(f"{base}.{a.name}" for a in node.names)
            out.add(base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def import_graph(root: str = ROOT) -> dict[str, set[str]]:
    """{megabert module: megabert modules it imports}."""
    files = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                files[_module_name(path)] = path
    graph = {}
    for module, path in files.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        targets = _imports(tree, module, path.endswith("__init__.py"))
        # A submodule's import of its own parent package (`from megabert.ops import
        # kernel_ops` inside megabert.ops) runs nothing new: Python imported the parent first.
        edges = {t for t in targets if t in files and t != module and not module.startswith(t + ".")}
        graph[module] = edges
    return graph


def cycle_path(graph: dict[str, set[str]], component: list[str]) -> str:
    """One circle through a strongly connected component, as "a -> b -> a"."""
    members, start = set(component), component[0]
    parents, frontier = {start: None}, [start]
    while frontier:  # breadth first from start, inside the component, back to start
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w == start:
                    path = [v]
                    while parents[path[-1]] is not None:
                        path.append(parents[path[-1]])
                    return " -> ".join([start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start])
                if w in members and w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    return " -> ".join(component)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def _package(module: str) -> str:
    """megabert.tasks.squad.model -> tasks; megabert.config -> config (a top-level module)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "megabert"


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        out.setdefault(_package(module), set()).update(_package(t) for t in targets if _package(t) != _package(module))
    return out


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_the_walk_sees_the_package_and_finds_a_planted_cycle(graph):
    assert len(graph) > 100 and sum(map(len, graph.values())) > 250
    assert "megabert.tasks.squad.model" in graph["megabert.tasks.squad"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    # A function-level import counts: this file's own walk of a lazy import.
    tree = ast.parse("def f():\n    from megabert.model import bert\n")
    assert "megabert.model.bert" in _imports(tree, "megabert.x", False)
    # A type-only import counts too: a circle through it is still a circle.
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megabert.config import ModelConfig\n")
    assert "megabert.config" in _imports(tree, "megabert.x", False)
    planted = {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    assert cycle_path(planted, cycles(planted)[0]) == "a -> b -> c -> a"


def test_no_import_cycle_between_modules(graph):
    found = [cycle_path(graph, c) for c in cycles(graph)]
    assert not found, "import cycle: " + "; ".join(found)


def test_no_import_cycle_between_packages(graph):
    packages = package_graph(graph)
    found = [cycle_path(packages, c) for c in cycles(packages)]
    assert not found, "import cycle between packages: " + "; ".join(found)


@pytest.mark.parametrize("importer,imported", FORBIDDEN)
def test_lower_packages_never_reach_up(graph, importer, imported):
    bad = sorted(f"{m} -> {t}" for m, targets in graph.items() if m.startswith(f"megabert.{importer}")
                 for t in targets if t == f"megabert.{imported}" or t.startswith(f"megabert.{imported}."))
    assert bad == []


def test_deepspeed_is_entered_through_one_door(graph):
    """Only the strategy builder and the run resolver open the DeepSpeed subpackage."""
    door = {"megabert.training.build", "megabert.training.resolve"}
    inside = {m for m in graph if m.startswith("megabert.training.deepspeed")}
    assert {"megabert.training.deepspeed.strategy", "megabert.training.deepspeed.ds_config"} <= inside
    users = sorted(f"{m} -> {t}" for m, targets in graph.items() if m not in inside | door
                   for t in targets if t in inside)
    assert users == []


# The core packages: DeepSpeed enters through megabert.training.deepspeed only, and its JSON
# is read there alone (everything else gets the resolved run's typed ZeroPlan).
CORE = ("parallel", "model", "checkpoint", "tensor_parallel", "pipeline_parallel", "data_parallel", "ops")


def _sources(*parts):
    base = os.path.join(ROOT, *parts)
    for dirpath, _, names in os.walk(base):
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8") as f:
                    yield os.path.relpath(path, os.path.dirname(ROOT)), f.read()


def test_core_packages_name_deepspeed_nowhere():
    named = [path for package in CORE for path, text in _sources(package) if "deepspeed" in text.lower()]
    assert named == []


def test_only_the_deepspeed_package_reads_its_json():
    door = os.path.join("megabert", "training", "deepspeed") + os.sep
    readers = [path for path, text in _sources() if "zero_optimization" in text and not path.startswith(door)]
    assert readers == []
