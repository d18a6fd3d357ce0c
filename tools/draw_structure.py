#!/usr/bin/env python3
"""Draw FedUQ's floor plan: the package's rooms (a top-level module, or a folder such as ``core/``) on floors, each
room above every room it imports, with one arrow per pair of rooms that import each other's code.

Every import of the package is read with ``ast`` (those inside functions too); relative imports are resolved. A room's
floor is one more than the highest floor it imports (a room importing nothing is on floor 1), so every arrow points
down; a cycle between rooms would make that impossible and is reported instead (``tests/repository/test_structure.py`` fails
on any cycle, between modules or between rooms).

    python tools/draw_structure.py docs/images/structure.png --force
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "custom"  # installed as ``feduq``


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    return ".".join(["feduq", *[p for p in rel.parts if p != "__init__"]])


def modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts}


def import_graph() -> dict[str, set[str]]:
    """feduq module -> the feduq modules it imports (anywhere in its code, relative imports resolved; ``from X import
    name`` counts ``X.name`` when that is a module, else ``X``)."""
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
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
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in mods else source for a in node.names]
            for target in targets:
                while target and target not in mods and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in mods and target not in (name, "feduq"):
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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


def room(module: str) -> str:
    """A module's room: its top-level folder (``core/``) or itself (``registry``); the package's own ``__init__``
    and the test helpers (``testing/``) are left out (None)."""
    parts = module.split(".")[1:]
    if not parts or parts[0] == "testing":
        return ""
    return parts[0] + "/" if (PACKAGE / parts[0]).is_dir() else parts[0]


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Room -> the rooms whose modules its modules import (other rooms only)."""
    rooms: dict[str, set[str]] = defaultdict(set)
    for m, targets in graph.items():
        r = room(m)
        if not r:
            continue
        rooms[r]
        for t in targets:
            if room(t) and room(t) != r:
                rooms[r].add(room(t))
    return dict(rooms)


def floors(rooms: dict[str, set[str]]) -> dict[str, int]:
    """Room -> floor (1 + the highest floor it imports; 1 for a room importing none).

    Raises:
        ValueError: the rooms import each other in a cycle (named).
    """
    found = cycles(rooms)
    if found:
        raise ValueError("rooms import each other in a cycle: " + "; ".join(" <-> ".join(c) for c in found))
    floor: dict[str, int] = {}

    def level(r: str) -> int:
        if r not in floor:
            floor[r] = 1 + max((level(t) for t in rooms[r]), default=0)
        return floor[r]

    for r in rooms:
        level(r)
    return floor


def draw(path: Path) -> Path:
    """Draw the rooms on their floors with their arrows into ``path`` (PNG, written beside it and moved into place);
    return it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rooms = room_graph(import_graph())
    floor = floors(rooms)
    by_floor: dict[int, list[str]] = defaultdict(list)
    for r, f in sorted(floor.items(), key=lambda x: x[0]):
        by_floor[f].append(r)
    top = max(by_floor)
    width = max(len(v) for v in by_floor.values())
    pos = {}
    for f, names in by_floor.items():
        for i, r in enumerate(names):
            pos[r] = ((i + 0.5) * width / len(names), f)
    fig, ax = plt.subplots(figsize=(min(22, 1.6 * width + 2), 0.75 * top + 1.5))
    for r, targets in rooms.items():
        for t in targets:
            (x0, y0), (x1, y1) = pos[r], pos[t]
            ax.annotate("", xy=(x1, y1 + 0.18), xytext=(x0, y0 - 0.18),
                        arrowprops=dict(arrowstyle="->", color="0.65", lw=0.6, shrinkA=0, shrinkB=0))
    for r, (x, y) in pos.items():
        folder = r.endswith("/")
        ax.text(x, y, r, ha="center", va="center", fontsize=8 if folder else 7,
                fontweight="bold" if folder else "normal",
                bbox=dict(boxstyle="round,pad=0.3", fc="#dbe8f5" if folder else "white", ec="0.3", lw=0.6))
    ax.set_xlim(-0.2, width + 0.2)
    ax.set_ylim(0.4, top + 0.6)
    ax.set_yticks(range(1, top + 1))
    ax.set_yticklabels([f"floor {f}" for f in range(1, top + 1)], fontsize=7)
    ax.set_xticks([])
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_title(f"feduq: {len(rooms)} rooms on {top} floors, every import points down (0 cycles)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{path.name}.partial.png")
    try:
        fig.savefig(staged, dpi=64)
        from PIL import Image

        with Image.open(staged) as image:  # a few grey levels and one blue: a palette keeps the file small
            image.convert("RGB").quantize(colors=32).save(staged, optimize=True)
        os.replace(staged, path)
    finally:
        plt.close(fig)
        staged.unlink(missing_ok=True)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="the PNG to write (e.g. docs/images/structure.png)")
    p.add_argument("--force", action="store_true", help="replace an existing file")
    a = p.parse_args(argv)
    from feduq.outputs import OutputFolderError, check_output_file

    try:  # never over an existing file without --force, never inside the package or the data root
        out = check_output_file(a.out, {"package": PACKAGE}, "draw_structure.py", force=a.force)
    except OutputFolderError as e:
        print(str(e), file=sys.stderr)
        return 2
    print(f"written: {draw(out)}")
    return 0


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("draw_structure.py", main))
