"""The package layering holds: no import cycle between megabert's packages or modules,
and the lower packages never reach up (checkpoint/ and planning/ know no model, trainer
or task). Read from the source with ast, imports inside functions included, so a lazy
import cannot hide a cycle; imports under `if TYPE_CHECKING:` are type hints, not edges."""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megabert")

# megabert/__init__.py is the public façade: `megabert.BertForPreTraining` and friends are
# imported on first access (PEP 562 __getattr__), from the task packages. Nothing inside
# the package imports `megabert` itself for them, so these edges close no loop that code
# runs through; they are exempt by name.
FACADE_LAZY = {"megabert.model", "megabert.tasks.pretraining", "megabert.tasks.squad", "megabert.tasks.glue"}

# (importer package, imported package): edges that must never exist.
FORBIDDEN = [
    ("checkpoint", "model"), ("checkpoint", "tasks"), ("checkpoint", "training"),
    ("planning", "training"), ("planning", "tasks"), ("planning", "model"),
    ("model", "tasks"), ("model", "training"),
    ("data", "tasks"), ("data", "corpus"), ("data", "training"),
    ("parallel", "model"), ("tensor_parallel", "model"), ("ops", "model"),
    ("training", "tasks"),
]


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    out: set[str] = set()

    def visit(node):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
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
        if module == "megabert":
            edges -= FACADE_LAZY
        graph[module] = edges
    return graph


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
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megabert.config import ModelConfig\n")
    assert "megabert.config" not in _imports(tree, "megabert.x", False)


def test_no_import_cycle_between_modules(graph):
    assert cycles(graph) == []


def test_no_import_cycle_between_packages(graph):
    assert cycles(package_graph(graph)) == []


@pytest.mark.parametrize("importer,imported", FORBIDDEN)
def test_lower_packages_never_reach_up(graph, importer, imported):
    bad = sorted(f"{m} -> {t}" for m, targets in graph.items() if m.startswith(f"megabert.{importer}")
                 for t in targets if t == f"megabert.{imported}" or t.startswith(f"megabert.{imported}."))
    assert bad == []


def test_deepspeed_is_entered_through_one_door(graph):
    """Only the strategy builder and the run resolver open the DeepSpeed subpackage."""
    door = {"megabert.training.build", "megabert.training.resolve"}
    inside = {m for m in graph if m.startswith("megabert.training.deepspeed")}
    assert {"megabert.training.deepspeed.strategy", "megabert.training.deepspeed.config"} <= inside
    users = sorted(f"{m} -> {t}" for m, targets in graph.items() if m not in inside | door
                   for t in targets if t in inside)
    assert users == []
