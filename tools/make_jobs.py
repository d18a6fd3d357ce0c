#!/usr/bin/env python3
"""Write the committed ``jobs/<method>/`` folders: each is the export of its method's FLARE 2.9 Recipe
(:class:`feduq.recipes.recipe.FedUQRecipe`, built from the method's registration in :mod:`feduq.registry`), so two jobs
can never drift apart by accident. ``tests/unit/recipes/test_jobs.py`` checks that the committed folders equal the exports.
Run after changing a registration or a default::

    python tools/make_jobs.py            # rewrite jobs/ (and docs/reference/privacy.md's ledger table)
    python tools/make_jobs.py --check    # exit 1 if jobs/ is stale
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from feduq.recipes.recipe import FedUQRecipe
from feduq.registry import all_methods

REPO = Path(__file__).resolve().parents[1]
JOBS_DIR = REPO / "jobs"


LEDGER_START, LEDGER_END = "<!-- privacy-ledger:start (tools/make_jobs.py) -->", "<!-- privacy-ledger:end -->"


def readme_with_ledger(text: str) -> str:
    """README text with the block between the ledger markers replaced by :func:`feduq.registry.ledger.ledger_markdown`."""
    from feduq.registry.ledger import ledger_markdown

    head, sep, rest = text.partition(LEDGER_START)
    _, sep2, tail = rest.partition(LEDGER_END)
    if not sep or not sep2:
        raise SystemExit(f"docs/reference/privacy.md lacks the markers {LEDGER_START} ... {LEDGER_END}")
    return f"{head}{LEDGER_START}\n{ledger_markdown()}\n{LEDGER_END}{tail}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that jobs/ is up to date")
    parser.add_argument("--out", type=Path, default=JOBS_DIR)
    parser.add_argument("--force", action="store_true", help="write into an --out folder (not the package's jobs/) "
                                                             "that holds files FedUQ did not write (they are kept)")
    args = parser.parse_args(argv)
    keep = None
    if not args.check and args.out.resolve() != JOBS_DIR.resolve():  # the package's jobs/ is FedUQ's to regenerate
        from feduq.outputs import OutputFolderError, claim_output_folder

        try:
            args.out, keep = claim_output_folder(args.out, {}, "make_jobs.py", force=args.force)
        except OutputFolderError as e:
            print(e, file=sys.stderr)  # "<tool>: <why>", one line
            return 2
        clash = [f for f in keep if f.split("/")[0] in all_methods()]
        if clash:
            print(f"make_jobs.py: error: {args.out / clash[0]} is not FedUQ's and lies where a job is written; move "
                  f"it away", file=sys.stderr)
            return 2
    stale = []
    with tempfile.TemporaryDirectory(prefix="feduq-jobs-") as exported:
        for method in all_methods():
            FedUQRecipe(method).export(exported)
            for path in sorted(p for p in (Path(exported) / method).rglob("*") if p.is_file()):
                rel = path.relative_to(exported)
                target, text = args.out / rel, path.read_text()
                if args.check:
                    if not target.is_file() or target.read_text() != text:
                        stale.append(str(target))
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text(text)
    readme = REPO / "docs" / "reference" / "privacy.md"
    if args.out == JOBS_DIR:  # docs/reference/privacy.md's "What leaves a site" table comes from the same declarations
        text = readme_with_ledger(readme.read_text())
        if args.check and text != readme.read_text():
            stale.append(str(readme))
        elif not args.check:
            readme.write_text(text)
    if stale:
        print("stale job files (run python tools/make_jobs.py):\n  " + "\n  ".join(stale))
        return 1
    if keep is not None:
        from feduq.outputs import write_marker

        write_marker(args.out, "make_jobs.py", exclude=keep)
    if not args.check:
        print(f"wrote {len(all_methods())} jobs to {args.out}: {', '.join(all_methods())}")
    return 0


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("make_jobs.py", main))
