"""FedUQ's package metadata, without installing it: the built wheel's ``Requires-Dist`` covers every third-party
module the package imports, requirements.txt installs that one list, every folder of the package is in the wheel,
and no message or help text of the installed package names a path of the developers' clone.

The install itself, and a site's day from it, is ``tests/integration/test_wheel.py``.
"""

from __future__ import annotations

import ast
import configparser
import re
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE = REPO / "custom"
#: import name -> distribution name, where the two differ
DISTRIBUTION = {"PIL": "pillow", "SimpleITK": "simpleitk", "skimage": "scikit-image", "sklearn": "scikit-learn",
                "acvl_utils": "acvl-utils"}


def _third_party_imports() -> dict[str, str]:
    """Top-level module -> the first file importing it, for every absolute import in the package (functions too)."""
    found: dict[str, str] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "feduq":
                    found.setdefault(top, path.relative_to(REPO).as_posix())
    return found


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.fixture(scope="module")
def wheel_metadata(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(REPO)], check=True, capture_output=True, timeout=300)
    wheel, = out.glob("feduq-*.whl")
    with zipfile.ZipFile(wheel) as z:
        meta = Parser().parsestr(z.read("feduq-0.1.0.dist-info/METADATA").decode())
        return meta, z.namelist(), z.read("feduq-0.1.0.dist-info/entry_points.txt").decode()


def test_the_wheel_requires_every_third_party_module_the_package_imports(wheel_metadata):
    meta, _, _ = wheel_metadata
    required = {}
    for line in meta.get_all("Requires-Dist"):
        name = re.match(r"[A-Za-z0-9_.-]+", line).group(0)
        required[_normal(name)] = line
    imports = _third_party_imports()
    assert {"torch", "nvflare", "monai", "nnunetv2", "highdicom"} <= set(imports)
    missing = {m: f for m, f in imports.items() if _normal(DISTRIBUTION.get(m, m)) not in required}
    assert not missing, f"imported but not declared in setup.cfg install_requires: {missing}"
    base = {n: line for n, line in required.items() if "extra ==" not in line}
    assert base["torch"] == "torch==2.13.0" and base["nvflare"] == "nvflare==2.9.0"  # the tested pins
    assert not any(_normal(n) in ("pytest", "pytest-xdist") for n in base), "pytest is no runtime requirement"
    assert "pytest>=8; extra == \"test\"" in meta.get_all("Requires-Dist")


def test_the_wheel_installs_the_feduq_command_and_every_package_folder(wheel_metadata):
    _, names, entry_points = wheel_metadata
    assert "feduq = feduq.commands.main:console" in entry_points
    folders = {"feduq/" + p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*") if p.is_dir()
               and "__pycache__" not in p.parts}
    shipped = {"/".join(n.split("/")[:k]) for n in names if n.startswith("feduq/") for k in range(2, n.count("/") + 1)}
    assert folders - shipped == set(), "folders of custom/ missing from the wheel (setup.cfg packages)"
    for data in ("feduq/recipes/files/project.yml", "feduq/tasks/task_files/polyp.json",
                 "feduq/nnunet/plans/ct_2d.json", "feduq/splits/polyp/Kvasir-SEG.json", "feduq/_build.json"):
        assert data in names, data


def test_requirements_txt_installs_the_declared_list_and_names_no_package_of_its_own():
    lines = [x.strip() for x in (REPO / "requirements.txt").read_text().splitlines()]
    lines = [x for x in lines if x and not x.startswith("#")]
    assert lines == ["-e .[test,tracking]"]
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    assert set(cfg["options.extras_require"]) == {"test", "tracking"}


#: what a message must not name: a path that only exists in the developers' clone
CLONE_PATH = re.compile(r"(?<![\w/.])(tools|poc)/[\w.]+\.(py|yml)|python -m feduq\.(?!run\b|predict\b|flare\.simulator\b)|\.\./shared")


def _strings(tree) -> list[tuple[int, str]]:
    """Every string constant of a module with its line, docstrings included (they are the verbs' --help)."""
    return [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_no_message_or_help_names_a_path_of_the_clone():
    """The package's strings (messages, --help, the docstrings argparse shows) name ``feduq <verb>``, never
    ``tools/<x>.py``, ``poc/...`` or ``../shared``; developer tools (benchmarks, golden runs) may be named in prose
    about how a figure was measured, so only the verbs' modules are held to it whole, the rest by their non-docstring
    strings."""
    verbs = {PACKAGE / "run.py", PACKAGE / "predict.py", *PACKAGE.glob("commands/**/*.py"),
             *PACKAGE.glob("data/convert/*.py")}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                continue
            if path not in verbs and id(node) in docstrings:
                continue
            for m in CLONE_PATH.finditer(node.value):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {m.group(0)}")
    assert not found, "\n".join(found)
