"""The package's floor plan: FedUQ's modules import one another without a cycle (every import counted, those inside
functions too), so each module can be read, tested and replaced knowing only what lies below it."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "custom"  # installed as ``feduq``


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(["feduq", *parts])


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts}


def import_graph() -> dict[str, set[str]]:
    """feduq module -> the feduq modules it imports (anywhere in its code, relative imports resolved; ``from X import
    name`` counts ``X.name`` when that is a module, else ``X``)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".")
                    base = base[: len(base) - node.level + (1 if is_package else 0)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
            for target in targets:
                while target and target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != name and target != "feduq":
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_on_a_hand_made_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_reads_relative_and_lazy_imports():
    graph = import_graph()
    assert "feduq.core.evidential" in graph["feduq.core.evidential_loss"]  # from .evidential import (...)
    assert "feduq.reporting" in graph["feduq.site2d"]
    assert "feduq.methods.site" in graph["feduq.methods.graphfedseg.parts"]  # from ..site import SitePart


def test_no_import_cycles():
    found = cycles(import_graph())
    assert found == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in found)
