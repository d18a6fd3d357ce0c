#!/usr/bin/env python3
"""Prepare a FLARE workspace (simulator, POC site or provisioned site) to run FedUQ jobs.

NVFlare 2.9 only builds job components whose class path is on the site's allow-list
(``class_allow_list`` in ``<workspace>/local/resources.json``) unless the job brings its own code (the committed
jobs do, see ``jobs/<method>/app/custom/README.md``; ``configure_job.py --allow-listed`` makes jobs that do not).
FedUQ is installed as the package ``feduq`` on each site, so each site allows the prefix ``feduq.`` in addition to
NVFlare's default list; the server (``--server``, and a simulator workspace, whose one ``local/`` serves server and
sites) also allows NVFlare's PyTorch model persistor, which unpickles checkpoints and so belongs on the server only
(FLARE 2.9's security notes). Nothing else is opened. Optionally the site also records where its own data is
(``local/feduq_site.json``), so no job ever carries a data path.

    # simulator: <ws>/local is copied into every simulated site
    python tools/prepare_site.py workspaces/fedevi --data-root ../shared/data
    nvflare simulator jobs/fedevi -w workspaces/fedevi

    # the server's startup kit, then one POC or production site (its startup kit folder)
    python tools/prepare_site.py /path/to/poc/example_project/prod_00/server --server
    python tools/prepare_site.py /path/to/poc/example_project/prod_00/Kvasir-SEG \\
        --data-root /data/feduq --center Kvasir-SEG
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from feduq.constants import SITE_CONFIG_FILE  # read by the executors (feduq.flare.executor.read_site_config)

FEDUQ_PREFIX = "feduq."
# NVFlare classes FedUQ's server uses that are not on NVFlare's default allow-list (never allowed on a site).
SERVER_NVFLARE_CLASSES = ("nvflare.app_opt.pt.file_model_persistor.PTFileModelPersistor",)


def allow_feduq(workspace: str | Path, server: bool = True) -> Path:
    """Allow FedUQ's classes in ``<workspace>/local/resources.json`` (idempotent).

    Args:
        workspace: a startup kit (or a simulator workspace).
        server: also allow FLARE's ``PTFileModelPersistor`` (the server's model file reader). Pass False for a
            site's kit: a site never needs to unpickle a model file.

    An existing ``resources.json`` (or ``resources.json.default``) is kept and extended; when it
    has no allow-list, NVFlare's default list is written first so nothing else changes.
    """
    from nvflare.app_common.default_component_policy import DEFAULT_CLASS_ALLOW_LIST

    local = Path(workspace) / "local"
    local.mkdir(parents=True, exist_ok=True)
    target = local / "resources.json"
    source = target if target.is_file() else local / "resources.json.default"
    resources = json.loads(source.read_text()) if source.is_file() else {"format_version": 2}
    allow = list(resources.get("class_allow_list", DEFAULT_CLASS_ALLOW_LIST))
    if "*" not in allow:
        allow += [p for p in (FEDUQ_PREFIX, *(SERVER_NVFLARE_CLASSES if server else ())) if p not in allow]
    resources["class_allow_list"] = allow
    target.write_text(json.dumps(resources, indent=2) + "\n")
    return target


def write_site_config(
    workspace: str | Path, data_root: str | None = None, center: str | None = None, on_bad_file: str | None = None
) -> Path:
    """Write ``<workspace>/local/feduq_site.json`` with the site's data root, center and bad-file policy.

    Raises:
        FileNotFoundError: ``data_root`` is given but is not a folder.
    """
    path = Path(workspace) / "local" / SITE_CONFIG_FILE
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    if data_root is not None:
        root = Path(data_root).expanduser().resolve()
        if not root.is_dir():
            raise FileNotFoundError(f"data root {root} is not a folder")
        cfg["data_root"] = str(root)
    if center is not None:
        cfg["center"] = center
    if on_bad_file is not None:
        cfg["on_bad_file"] = on_bad_file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workspace", type=Path, help="simulator workspace, or a POC/production site folder")
    p.add_argument("--server", action="store_true", help="the folder is the server's kit (or a simulator workspace)")
    p.add_argument("--data-root", help="this site's data root (contains <task>/<center>/)")
    p.add_argument("--center", help="this site's center when the site name differs from it")
    p.add_argument("--on-bad-file", choices=["error", "skip"],
                   help="an unreadable/truncated/mismatched file stops the site (error, default) or is skipped with a warning")
    a = p.parse_args(argv)
    try:
        if a.data_root is not None and not Path(a.data_root).expanduser().is_dir():  # before anything is written
            raise FileNotFoundError(f"--data-root {Path(a.data_root).expanduser().resolve()} is not a folder")
        print(f"allow-listed {FEDUQ_PREFIX!r} in {allow_feduq(a.workspace, server=a.server)}")
        if a.data_root or a.center or a.on_bad_file:
            print(f"site config: {write_site_config(a.workspace, a.data_root, a.center, a.on_bad_file)}")
    except (OSError, ValueError) as e:
        print(f"prepare_site.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
