"""``feduq project``: the NVFlare provisioning project of a FedUQ federation, to edit and hand to ``nvflare
provision`` (one signed startup kit per participant, mutual TLS).

    feduq project --out project.yml        # then edit the server's name, the sites and the admins
    nvflare provision -p project.yml -w /secure/feduq-provision

The file is the package's template (the polyp federation: a server, the four centers as sites, one project admin);
its comments say what to change. An existing file is kept unless ``--force``.
"""

from __future__ import annotations

import sys
from importlib import resources

from ...cli import verb_parser

TEMPLATE = "project.yml"


def template_text() -> str:
    """The packaged project template (``feduq/recipes/files/project.yml``)."""
    return resources.files("feduq.recipes.files").joinpath(TEMPLATE).read_text()


def main(argv=None) -> int:
    """Write the template to ``--out``; exit 2 with one line when the file may not be written."""
    from ...outputs import OutputFolderError, check_output_file

    p = verb_parser("feduq project", description=__doc__)
    p.add_argument("--out", required=True, help="the project file to write (e.g. project.yml)")
    p.add_argument("--force", action="store_true", help="replace an existing file")
    a = p.parse_args(argv)
    try:
        out = check_output_file(a.out, {}, "feduq project", force=a.force)
    except OutputFolderError as e:
        print(e, file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(template_text())
    print(f"wrote {out}; edit it, then: nvflare provision -p {out} -w <provisioning folder>")
    return 0
