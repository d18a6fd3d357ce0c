"""The documentation a user reads lives in the repository and its links resolve."""

from __future__ import annotations

import re
import subprocess

from conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "jobs").glob("*/README.md"))]
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
