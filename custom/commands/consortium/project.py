"""``feduq project``: the NVFlare provisioning project of a FedUQ federation, to edit and hand to ``nvflare
provision`` (one signed startup kit per participant, mutual TLS).

    feduq project --out project.yml        # then edit the server's name, the sites and the admins
    nvflare provision -p project.yml -w /secure/feduq-provision

The file is the package's template (the polyp federation: a server, the four centers as sites, one project admin);
its comments say what to change. An existing file is kept unless ``--force``.

    feduq project --docker-image feduq:0.1.0 --out project.yml

names the image the kits start: ``docker_image`` in the StaticFileBuilder's args (NVFlare's provisioning then writes
``startup/docker.sh`` into the server's and every site's kit; ``feduq container start`` starts a kit in it with the
site's data mounted read-only, docs/how-to/containers.md).
"""

from __future__ import annotations

import re
import sys
from importlib import resources

from ...cli import verb_parser

TEMPLATE = "project.yml"
#: what a container image reference may hold ([registry/]name[:tag][@digest]); anything else (spaces, quotes) would
#: break the docker.sh provisioning writes
IMAGE_NAME = re.compile(r"^[a-z0-9][a-z0-9._/-]*(:[\w][\w.-]{0,127})?(@sha256:[0-9a-f]{64})?$")
STATIC_FILE_ARGS = "  - path: nvflare.lighter.impl.static_file.StaticFileBuilder\n    args:\n"


def template_text() -> str:
    """The packaged project template (``feduq/recipes/files/project.yml``)."""
    return resources.files("feduq.recipes.files").joinpath(TEMPLATE).read_text()


def with_docker_image(text: str, image: str) -> str:
    """The project text with ``docker_image: <image>`` as the StaticFileBuilder's first arg.

    Raises:
        ValueError: ``image`` is not an image reference, or the text has no StaticFileBuilder with ``args``.
    """
    if not IMAGE_NAME.match(image):
        raise ValueError(f"--docker-image {image!r} is not an image name ([registry/]name[:tag], lower case)")
    if STATIC_FILE_ARGS not in text:
        raise ValueError("the project has no StaticFileBuilder with args to put docker_image in")
    return text.replace(STATIC_FILE_ARGS, f"{STATIC_FILE_ARGS}      docker_image: {image}\n", 1)


def main(argv=None) -> int:
    """Write the template to ``--out``; exit 2 with one line when the file may not be written."""
    from ...outputs import OutputFolderError, check_output_file

    p = verb_parser("feduq project", description=__doc__)
    p.add_argument("--out", required=True, help="the project file to write (e.g. project.yml)")
    p.add_argument("--force", action="store_true", help="replace an existing file")
    p.add_argument("--docker-image", metavar="IMAGE",
                   help="the image the kits start (e.g. feduq:0.1.0): provisioning writes startup/docker.sh")
    a = p.parse_args(argv)
    text = template_text()
    if a.docker_image is not None:
        try:
            text = with_docker_image(text, a.docker_image)
        except ValueError as e:
            print(f"feduq project: {e}", file=sys.stderr)
            return 2
    try:
        out = check_output_file(a.out, {}, "feduq project", force=a.force)
    except OutputFolderError as e:
        print(e, file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}; edit it, then: nvflare provision -p {out} -w <provisioning folder>")
    return 0
