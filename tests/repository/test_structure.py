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
    assert "feduq.scores.tables" in graph["feduq.site.site2d"]
    assert "feduq.parts.site" in graph["feduq.methods.graphfedseg.parts"]  # from ..site import SitePart
    assert structure.room("feduq.core.training") == "core/" and structure.room("feduq.registry") == "registry/"


def test_no_import_cycles_between_modules_or_rooms():
    graph = structure.import_graph()
    found = structure.cycles(graph)
    assert found == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in found)
    floors = structure.floors(structure.room_graph(graph))  # ValueError naming a cycle between rooms
    assert floors["common/"] < floors["tasks/"] < floors["io/"] < floors["sites/"] < floors["data/"] < floors["scores/"]
    assert floors["core/"] < floors["scores/"] < floors["parts/"] < floors["methods/"]
    assert floors["core/"] == 1  # training, networks and the evidential math read no data and no file layout
    assert floors["parts/"] < floors["flare/"] < floors["recipes/"] < floors["run"]
    assert floors["parts/"] < floors["jobs/"] < floors["flare/"]  # a job is checked without FLARE's engine
    # a site's tools: the rule below predicting (a row carries its decision), the bundle and the report above both
    assert floors["review/"] < floors["predict/"] < min(floors["bundle/"], floors["report/"])
    assert floors["recipes/"] < floors["commands/"] and floors["report/"] < floors["commands/"]  # verbs on top


def test_flare_and_the_methods_never_import_each_other():
    """A method is FLARE-free and FLARE's glue knows no method: neither folder imports the other (a 2D job names
    FedUQ's one executor and controller with the method's parts, resolved by path at run time)."""
    rooms = structure.room_graph(structure.import_graph())
    assert "methods/" not in rooms["flare/"] and "flare/" not in rooms["methods/"]
    assert "methods/" not in rooms["site/"] and "methods/" not in rooms["parts/"]


def test_the_package_root_holds_only_the_commands_and_their_edges():
    """Every module lives in a folder but the command that keeps its ``python -m`` form (``feduq.run``), ``python -m
    feduq`` and what every command does at its edges (interrupts, output folders)."""
    top = {m for m, path in structure.modules().items() if m.count(".") == 1 and path.name != "__init__.py"}
    assert top == {"feduq.__main__", "feduq.cli", "feduq.outputs", "feduq.run"}
