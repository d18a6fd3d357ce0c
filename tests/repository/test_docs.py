"""The documentation a user reads lives in the repository and its links resolve."""

from __future__ import annotations

import re
import subprocess

import pytest

from conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "jobs").glob("*/README.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", path.read_text(), flags=re.M)}


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            if not dest.exists():
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_job_has_a_readme_and_the_guide_stays_short():
    assert all((job / "README.md").is_file() for job in (REPO / "jobs").iterdir() if job.is_dir())
    assert len((REPO / "README.md").read_text().splitlines()) <= 400


def test_no_document_outside_the_repository_is_cited():
    """Docstrings and docs cite a paper and equation or a file in the repository, never a design note users lack."""
    found = subprocess.run(["git", "grep", "-n", "-E", r"methods\.md|design\.md", "--", "custom", "tools", "jobs",
                            "docs", "README.md"], cwd=REPO, capture_output=True, text=True).stdout
    assert found == ""


def test_the_fedevi_reference_tables_are_what_the_readme_shows():
    """jobs/fedevi/README.md's tables of the two codes are the output of benchmarks/fedevi-reference/tables.py on its
    committed per_round.csv (every table row printed is in the README), and the script's exact permutation test
    gives hand-computed values (complete separation of 3 and 4 runs 1/35, or 2/35 when the mirror split ties; a mixed
    case 5/35; identical groups 1)."""
    import contextlib
    import importlib.util
    import io

    path = REPO / "benchmarks" / "fedevi-reference" / "tables.py"
    spec = importlib.util.spec_from_file_location("fedevi_reference_tables", path)
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    assert tables.permutation_p([0.1, 0.2, 0.3], [0.5, 0.6, 0.7, 0.9]) == pytest.approx(1 / 35)
    # evenly spaced, the top three against the rest reach the same |Δ| = 0.35: 2/35
    assert tables.permutation_p([0.1, 0.2, 0.3], [0.4, 0.5, 0.6, 0.7]) == pytest.approx(2 / 35)
    assert tables.permutation_p([0.2, 0.2, 0.2], [0.2, 0.2, 0.2, 0.2]) == 1.0
    # pool 0,0,0,0,1,1,1 with observed |Δ| = 0.75: a 3-run group of k ones gives Δ = (3 - k)/4 - k/3, so |Δ| >= 0.75
    # for k = 0 (C(4,3) = 4 splits) and k = 3 (1 split): p = 5/35
    assert tables.permutation_p([0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0]) == pytest.approx(5 / 35)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert tables.main([]) == 0
    rows = [l for l in out.getvalue().splitlines()
            if l.startswith("| ") and not l.startswith("| round") and not l.startswith("|---")]
    assert len(rows) == 48
    readme = (REPO / "jobs" / "fedevi" / "README.md").read_text()
    missing = [r for r in rows if r not in readme]
    assert not missing, "\n".join(missing[:5])
