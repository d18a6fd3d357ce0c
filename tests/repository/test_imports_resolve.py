"""Every import of FedUQ in the package, the tests and the tools names a module that exists and, for ``from M import
n``, a name M defines or a submodule of M: read from the source (imports inside functions too), so a module moved to
another room without its importers is caught without running the code that imports it lazily."""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "custom"


def module_name(path: Path) -> tuple[str, bool]:
    """``(dotted name, is a package __init__)`` of a file under the package folder."""
    parts = ["feduq", *path.relative_to(PACKAGE).with_suffix("").parts]
    return (".".join(parts[:-1]), True) if parts[-1] == "__init__" else (".".join(parts), False)


MODULES = {module_name(p)[0] for p in PACKAGE.rglob("*.py")}


@lru_cache(maxsize=None)
def defined_names(module: str) -> set[str] | None:
    """The names a module binds anywhere in its source (None: it resolves names at run time, ``__getattr__``)."""
    base = PACKAGE.joinpath(*module.split(".")[1:])
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return None if "__getattr__" in names else names


def unresolved(path: Path) -> list[str]:
    """``"file:line: what"`` for each FedUQ import in ``path`` that does not resolve."""
    inside = PACKAGE in path.parents
    name, is_package = module_name(path) if inside else ("", False)
    shown = path.relative_to(REPO) if REPO in path.parents else path.name
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [f"{shown}:{node.lineno}: {a.name}" for a in node.names
                    if a.name.split(".")[0] == "feduq" and a.name not in MODULES]
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            if not inside:
                continue
            base = name.split(".") if is_package else name.split(".")[:-1]
            target = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
        elif node.module and node.module.split(".")[0] == "feduq":
            target = node.module
        else:
            continue
        if target not in MODULES:
            out.append(f"{shown}:{node.lineno}: no module {target}")
            continue
        names = defined_names(target)
        out += [f"{shown}:{node.lineno}: {target} has no {a.name}" for a in node.names
                if names is not None and a.name != "*" and a.name not in names and f"{target}.{a.name}" not in MODULES]
    return out


def test_the_checker_finds_a_moved_module_and_a_missing_name(tmp_path):
    f = tmp_path / "t.py"
    f.write_text("from feduq.inference.review import x\nfrom feduq.review.rule import no_such_name\n"
                 "def g():\n    import feduq.data.tasks\n    from feduq.review.rule import load_threshold\n")
    assert unresolved(f) == ["t.py:1: no module feduq.inference.review", "t.py:2: feduq.review.rule has no no_such_name",
                             "t.py:4: feduq.data.tasks"]


def test_every_feduq_import_resolves():
    files = [*PACKAGE.rglob("*.py"), *(REPO / "tests").rglob("*.py"), *(REPO / "tools").rglob("*.py")]
    found = [line for f in sorted(files) for line in unresolved(f)]
    assert found == []
