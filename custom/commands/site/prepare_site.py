"""Prepare a FLARE workspace (simulator, POC site or provisioned site) to run FedUQ jobs.

NVFlare 2.9 only builds job components whose class path is on the site's allow-list
(``class_allow_list`` in ``<workspace>/local/resources.json``) unless the job brings its own code (the committed
jobs do, see an exported job's ``app/custom/README.md``; ``feduq configure --allow-listed`` makes jobs that do not).
FedUQ is installed as the package ``feduq`` on each site, so each site allows the prefix ``feduq.`` in addition to
NVFlare's default list; the server (``--server``, and a simulator workspace, whose one ``local/`` serves server and
sites) also allows NVFlare's PyTorch model persistor, which unpickles checkpoints and so belongs on the server only
(FLARE 2.9's security notes). Nothing else is opened. A site also gets FedUQ's privacy ledger in its own FLARE
privacy policy (``local/privacy.json``: FLARE applies it to every job before the job's filters, and a job cannot
remove it). Optionally the site also records where its own data is (``local/feduq_site.json``), so no job ever
carries a data path.

A simulator workspace's one ``local/`` is read by the server too: each filter of the policy names its site direction
(task data in, results out), so the server, which filters results coming in, never runs the site's ledger on them
(it once did, under the server's name, and blocked FLARE's own ``__cookie_jar__``). FLARE 2.9's simulator applies
no site privacy policy on its simulated sites; there the job's own ledger filters judge what each site sends.

    # simulator: <ws>/local is copied into every simulated site
    mkdir -p workspaces && feduq prepare-site workspaces/fedevi --data-root /data/feduq
    feduq run fedevi --export-to exported && nvflare simulator exported/fedevi -w workspaces/fedevi

    # the server's startup kit, then one POC or production site (its startup kit folder)
    feduq prepare-site /path/to/poc/example_project/prod_00/server --server
    feduq prepare-site /path/to/poc/example_project/prod_00/Kvasir-SEG \\
        --data-root /data/feduq --center Kvasir-SEG

A startup kit must exist: a folder that does not is refused in one line naming it, and nothing is made, when its
parent folder does not exist either or is (or holds) a FLARE project's startup kits (a mistyped kit). Only a new
simulator workspace, in an existing folder that is not part of a project, is made.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from feduq.cli import verb_parser

from feduq.flare.ledger import read_privacy_policy, write_privacy_policy
from feduq.recipes.simulation import FEDUQ_PREFIX, allow_feduq, write_site_config


def is_kit(folder: Path) -> bool:
    """``folder`` is a site's or the server's startup kit (``startup/fed_client.json`` or ``fed_server.json``), not a
    simulator workspace."""
    return any((Path(folder) / "startup" / f).is_file() for f in ("fed_client.json", "fed_server.json"))


KIT_FILES = ("fed_client.json", "fed_server.json", "fed_admin.json")  # startup/ of a site's, server's, admin's kit


def check_workspace(folder: Path) -> None:
    """ValueError, one line naming ``folder``, unless it is an existing folder or may be a new simulator workspace:
    a folder that does not exist in an existing folder that is neither a startup kit nor holds any (a POC or
    provisioned project's ``prod_NN``: there it is a mistyped kit, which FLARE's provisioning would have made)."""
    folder = Path(folder).expanduser()
    expected = ("expected an existing FLARE startup kit (startup/fed_client.json, or fed_server.json with --server) or "
                "simulator workspace; nothing was made")
    if folder.exists():
        if not folder.is_dir():
            raise ValueError(f"{folder} is a file, not a folder: {expected}")
        return
    parent = folder.absolute().parent
    if not parent.is_dir():
        raise ValueError(f"{folder} does not exist, nor its folder {parent}: {expected}")

    def kit(p: Path) -> bool:
        return any((p / "startup" / f).is_file() for f in KIT_FILES)

    if kit(parent):
        raise ValueError(f"{folder} does not exist and its folder {parent} is a startup kit: {expected}")
    try:
        kits = sorted(p.name for p in parent.iterdir() if p.is_dir() and kit(p))
    except OSError:
        kits = []
    if kits:
        listed = ", ".join(kits[:8]) + (f" and {len(kits) - 8} more" if len(kits) > 8 else "")
        raise ValueError(f"{folder} does not exist: no startup kit of the FLARE project in {parent} has this name "
                         f"(its kits: {listed}); {expected}")


def check_center(center: str, task: str | None = None) -> None:
    """ValueError unless ``center`` is a center (or a virtual site ``<center>-p<k>of<K>``) of ``task`` (a built-in name
    or a task file) or, without one, of some built-in FedUQ task: a site configured with another name would start and
    stop at its first task."""
    from feduq.data import TASKS, DataError, get_task
    from feduq.sites.centers import site_center

    if task is not None:
        spec = get_task(task)  # DataError (a ValueError) naming the task file and the key
        try:
            site_center(spec.name, center)
        except DataError:
            raise ValueError(f"--center {center!r} is not a site of task {spec.name!r} ({', '.join(spec.centers)})") \
                from None
        return
    for task in TASKS:
        try:
            site_center(task, center)
            return
        except DataError:
            continue
    known = "; ".join(f"{t}: {', '.join(spec.centers)}" for t, spec in TASKS.items() if spec.centers)
    raise ValueError(f"--center {center!r} is not a center of any FedUQ task ({known}; built in); a site of a "
                     "declared task: add --task path/to/task.json")


def main(argv=None) -> int:
    p = verb_parser("feduq prepare-site", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workspace", type=Path, help="simulator workspace, or a POC/production site folder")
    p.add_argument("--server", action="store_true", help="the folder is the server's kit (or a simulator workspace)")
    p.add_argument("--data-root", help="this site's data root (contains <task>/<center>/)")
    p.add_argument("--center", help="this site's center when the site name differs from it")
    p.add_argument("--task", help="the task --center belongs to: a built-in name or a task file (nnU-Net's "
                                  "dataset.json with a \"feduq\" object; default: any built-in task)")
    p.add_argument("--on-bad-file", choices=["error", "skip"],
                   help="an unreadable/truncated/mismatched file stops the site (error, default) or is skipped with a warning")
    a = p.parse_args(argv)
    try:
        check_workspace(a.workspace)  # before anything is written
        if a.data_root is not None and not Path(a.data_root).expanduser().is_dir():  # before anything is written
            raise FileNotFoundError(f"--data-root {Path(a.data_root).expanduser().resolve()} is not a folder")
        if a.center is not None:
            check_center(a.center, a.task)
        if not a.server:  # a malformed privacy policy is named before resources.json is changed
            read_privacy_policy(a.workspace)
        print(f"allow-listed {FEDUQ_PREFIX!r} in {allow_feduq(a.workspace, server=a.server)}")
        if not a.server:  # the site's own privacy policy: FedUQ's ledger on every job, which a job cannot remove
            print(f"privacy policy: {write_privacy_policy(a.workspace)}")
            if not is_kit(a.workspace):
                print("note: no startup kit here (startup/fed_client.json), so a simulator workspace: FLARE's "
                      "simulator applies this policy on no simulated site (nor on the server); the job's own privacy "
                      "ledger filters judge what each site sends")
        if a.data_root or a.center or a.on_bad_file:
            print(f"site config: {write_site_config(a.workspace, a.data_root, a.center, a.on_bad_file)}")
    except (OSError, ValueError) as e:
        print(f"feduq prepare-site: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("feduq prepare-site", main))
