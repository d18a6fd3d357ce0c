"""The files a bundle carries (``feduq/bundle/scripts/``, and the two FedUQ-free modules copied beside them) import
nothing of FedUQ: MONAI's runner imports them from the bundle's own ``scripts/`` folder where FedUQ is not installed."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE = REPO / "custom"
CARRIED = sorted((PACKAGE / "bundle" / "scripts").glob("bundle_*.py")) + [PACKAGE / "scores" / "case_scores.py",
                                                                           PACKAGE / "io" / "channel_io.py"]
#: what a MONAI Bundle runs with (MONAI's own dependencies, and nnU-Net v2 for an nnU-Net 3D bundle)
ALLOWED = {"numpy", "torch", "monai", "nibabel", "SimpleITK", "nnunetv2", "PIL", "tifffile"}  # PIL, tifffile: 2D files


def imported_roots(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function, by its top-level name; a relative import as
    ``"."``."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            roots.add("." if node.level else node.module.split(".")[0])
    return roots


def test_the_scanner_sees_relative_and_nested_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\nfrom . import x\ndef g():\n    from feduq.core import maps\n    import numpy.linalg\n")
    assert imported_roots(f) == {"os", ".", "feduq", "numpy"}


@pytest.mark.parametrize("path", CARRIED, ids=lambda p: p.name)
def test_a_file_a_bundle_carries_imports_nothing_of_feduq(path):
    foreign = {r for r in imported_roots(path) if r not in sys.stdlib_module_names and r != "__future__"}
    assert foreign <= ALLOWED, f"{path.relative_to(REPO)} imports {sorted(foreign - ALLOWED)}"
    assert len(CARRIED) == 6  # the four scripts and the two modules the exports copy
