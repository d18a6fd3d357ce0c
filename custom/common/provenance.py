"""Which FedUQ wrote a file: the package's version and the commit it was built from, for reports and records.

An installed wheel or sdist carries ``feduq/_build.json``, written when it was built (``setup.py``'s build hook):
its commit, with ``+dirty`` when the package's code differed from it. A developer's clone (the package imported
from ``custom/`` of a FedUQ checkout, as ``pip install -e .`` does) asks git of that checkout alone, never of a
repository that merely surrounds the installed package (a virtual environment inside another project).
"""

from __future__ import annotations

import json
import subprocess
from functools import lru_cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]
BUILD_FILE = PACKAGE / "_build.json"


def _clone_commit() -> str | None:
    """The commit of the FedUQ checkout whose ``custom/`` is this package (``+dirty`` when the code differs)."""
    root = PACKAGE.parent
    if PACKAGE.name != "custom" or not (root / "setup.cfg").is_file() or "name = feduq" not in (
            root / "setup.cfg").read_text():
        return None

    def git(*args):
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else None

    try:
        if Path(git("rev-parse", "--show-toplevel") or "/nonexistent").resolve() != root.resolve():
            return None
        commit = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--", "custom", "setup.cfg", "setup.py")
    except (OSError, subprocess.SubprocessError):
        return None
    return commit and commit + ("+dirty" if dirty else "")


@lru_cache(maxsize=1)
def build_commit() -> str | None:
    """The commit this FedUQ was built from (``+dirty`` where the code differed), or None when it is not known."""
    try:
        return json.loads(BUILD_FILE.read_text())["commit"]
    except (OSError, ValueError, KeyError, TypeError):
        return _clone_commit()


def code_version() -> str:
    """``"FedUQ 0.1.0 (commit 1a2b3c4d5e6f)"``; ``"(commit not recorded)"`` for a build without one."""
    from .. import __version__

    commit = build_commit()
    return f"FedUQ {__version__} (commit {commit})" if commit else f"FedUQ {__version__} (commit not recorded)"


def job_provenance(config_file: Path) -> dict:
    """Sites and rounds of the FLARE job that trained a model, where its folder says: ``config_file`` is the job's
    ``config_fed_client.json`` (in a job folder or a run folder); returns ``{"sites": [...], "rounds": int}``, each key
    only where the folder says it (an unreadable ``meta.json`` or server config is skipped)."""
    out: dict = {}
    for folder in list(config_file.parents)[1:4]:
        meta = folder / "meta.json"
        if meta.is_file() and "sites" not in out:
            try:
                deploy = json.loads(meta.read_text()).get("deploy_map", {})
                out["sites"] = [s for sites in deploy.values() for s in sites if s != "server"]
            except (OSError, ValueError):
                pass
    server = config_file.with_name("config_fed_server.json")
    if server.is_file():
        try:
            text = json.loads(server.read_text())
            rounds = [w.get("args", {}).get("num_rounds") for w in text.get("workflows", [])]
            out["rounds"] = next((r for r in rounds if r), None)
        except (OSError, ValueError):
            pass
    return out
