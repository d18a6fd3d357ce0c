"""The package's floor plan (tools/draw_structure.py): FedUQ's modules import one another without a cycle (every
import counted, those inside functions too), and so do its rooms (a folder such as ``core/`` or a top-level module),
so each floor can be read, tested and replaced knowing only the floors below it."""

from __future__ import annotations

from conftest import load_tool

structure = load_tool("draw_structure")


def test_the_cycle_finder_on_a_hand_made_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": set()}
    assert structure.cycles(graph) == [["a", "b", "c"]]
    assert structure.cycles({"a": {"b"}, "b": set()}) == []
    assert structure.floors({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == {"a": 3, "b": 2, "c": 1}


def test_the_graph_reads_relative_and_lazy_imports():
    graph = structure.import_graph()
    assert "feduq.core.evidential" in graph["feduq.core.evidential_loss"]  # from .evidential import (...)
    assert "feduq.reporting" in graph["feduq.site2d"]
    assert "feduq.methods.site" in graph["feduq.methods.graphfedseg.parts"]  # from ..site import SitePart
    assert structure.room("feduq.core.engine") == "core/" and structure.room("feduq.registry") == "registry"


def test_no_import_cycles_between_modules_or_rooms():
    graph = structure.import_graph()
    found = structure.cycles(graph)
    assert found == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in found)
    floors = structure.floors(structure.room_graph(graph))  # ValueError naming a cycle between rooms
    assert floors["data/"] < floors["core/"] < floors["methods/"] < floors["flare/"] < floors["jobspec"]
