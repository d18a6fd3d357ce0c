"""Which labelled cases the model trained on: a site's calibration and acceptance cases must be new to the model.

A case a model trained on flatters it: its Dice is higher and its uncertainty lower than a new patient's, so a rule
chosen or certified on such cases, and a report of them, promise more than the site will see. The job knows what
its sites trained on: each site's ``training`` split (:func:`feduq.sites.split_files.load_split`, a declared task's
nnU-Net site :func:`feduq.sites.nnunet_raw.nnunet_split`), read from the data root its sites used (a simulator or POC
workspace's ``local/feduq_site.json`` above the run folder) or, failing that, ``--data-root`` /
``$FEDUQ_DATA_ROOT``. A labelled case is a training case when its image file is one of those training images: the
same resolved path, or the same bytes (SHA-256, checked only where the sizes agree), so a copy of a training image
in a site folder anywhere is found too; its mask does not matter (a relabelled training image was still seen).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["TrainingCheck", "TrainingCaseError", "training_check", "training_cases", "check_training_cases"]


class TrainingCaseError(ValueError):
    """Labelled cases the model trained on were given for calibration or the report; one line naming the site."""


@dataclass
class TrainingCheck:
    """What :func:`training_check` found.

    Attributes:
        cases: ``"<site>/<case>"`` of every labelled case whose image the job's sites trained on, in the rows' order.
        by_site: labelled site -> ``(training cases, labelled cases)`` of that site (every labelled site).
        training_sites: job site -> the number of its training images, for each job site whose split was read.
        unchecked: job site -> why its training split could not be read (no data root known, no such center there,
            a split that does not load); its cases may still be among the labelled ones.
    """

    cases: list[str] = field(default_factory=list)
    by_site: dict[str, tuple[int, int]] = field(default_factory=dict)
    training_sites: dict[str, int] = field(default_factory=dict)
    unchecked: dict[str, str] = field(default_factory=dict)

    def message(self) -> str:
        """One line naming the first labelled site with training cases and how many (empty when there are none)."""
        for site, (n, total) in self.by_site.items():
            if n:
                first = next(c for c in self.cases if c.startswith(f"{site}/"))
                others = [s for s, (m, _) in self.by_site.items() if m and s != site]
                return (f"site {site}: {n} of its {total} labelled cases are training cases of the model's job (e.g. "
                        f"{first.split('/', 1)[1]}; the model has seen them, so they flatter it)"
                        + (f", and so are cases of {', '.join(others)}" if others else "")
                        + "; label cases no site trained on, or give --allow-training-cases to use them anyway (the "
                          "report then names them as optimistic)")
        return ""


def _site_configs(config_file: Path) -> list[dict]:
    """The FedUQ site settings (``local/feduq_site.json``: ``data_root``, ``center``) found above a run folder
    (``<run>/app_server/config/``): a simulator workspace's own, or a POC's ``<site>/local/`` ones (``{"site": name,
    ...}``); nearest first. None for a job folder."""
    parents = list(Path(config_file).resolve().parents)
    if len(parents) < 5 or parents[1].name != "app_server":
        return []
    found = []
    for folder in parents[2:5]:  # the run folder, the server's folder, the workspace (or POC project)
        own = folder / "local" / "feduq_site.json"
        for path in [own, *sorted(folder.glob("*/local/feduq_site.json"))]:
            try:
                cfg = json.loads(path.read_text()) if path.is_file() else None
            except (OSError, ValueError):
                cfg = None
            if isinstance(cfg, dict) and cfg.get("data_root"):
                found.append({**cfg, **({} if path == own else {"site": path.parent.parent.name})})
    return found


def _training_images(task: str, site: str, center: str, root: Path, max_items: int | None = None) -> list[Path]:
    """Site ``site``'s training images (first channel) under ``root`` (resolved paths); ``max_items``: the job's
    (its sites train on the first N of the split only).

    Raises:
        feduq.data.DataError: as :func:`feduq.sites.split_files.load_split` / :func:`feduq.sites.nnunet_raw.nnunet_split`.
    """
    from ..sites.folder import SiteFolder

    return SiteFolder.of(task, center, root, site).training_images(max_items)


def _is_site(task: str, site: str) -> bool:
    from ..data import DataError
    from ..sites.centers import site_center

    try:
        site_center(task, site)
    except DataError:
        return False
    return True


def training_check(loaded, rows: list[dict], center_dirs: dict, *, data_root=None) -> TrainingCheck:
    """Find the labelled cases ``rows`` whose image ``loaded``'s job trained on (see the module doc).

    Args:
        loaded: the job's model (:func:`feduq.site.evaluation.load_model`): its client config locates the job's
            sites (``meta.json``) and the data root they used.
        rows: the labelled cases, dicts with ``site`` and ``image`` (the case's stem), as
            :func:`feduq.review.calibration.labelled_cases` returns them.
        center_dirs: labelled site -> its folder (``labelled_cases``'s ``center_dirs``).
        data_root: the data root to read the job's sites from when the run folder records none (default
            ``$FEDUQ_DATA_ROOT``).

    Returns:
        :class:`TrainingCheck`. A job site whose split cannot be read is listed in ``unchecked``, never an error.
    """
    from ..data import DataError, get_task
    from ..sites.centers import site_center
    from ..common.provenance import job_provenance
    from .calibration import case_files
    from .rule import file_sha256

    config = Path(loaded.config_file)
    task = loaded.task
    sites = list(job_provenance(config).get("sites") or [])
    if not sites:  # the job records no sites: the labelled sites that are sites of the task may be its own
        sites = [s for s in dict.fromkeys(r["site"] for r in rows) if _is_site(task, s)]
    configs = _site_configs(config)
    given = data_root if data_root not in (None, "") else os.environ.get("FEDUQ_DATA_ROOT") or None
    check = TrainingCheck()
    training: dict[Path, str] = {}
    folder = get_task(task).folder
    for site in sites:
        own = [c for c in configs if c.get("site") in (None, site)]
        center = next((c["center"] for c in own if c.get("center")), None)
        try:
            center = center or site_center(task, site)
        except DataError as e:
            check.unchecked[site] = str(e)
            continue
        roots = [Path(c["data_root"]).expanduser() for c in own] + ([Path(given).expanduser()] if given else [])
        root = next((r for r in roots if (r / folder / center).is_dir()), None)
        if root is None:
            check.unchecked[site] = ("no data root known: give --data-root" if not roots else
                                     f"no folder {folder}/{center} under {', '.join(map(str, roots))}")
            continue
        try:
            images = _training_images(task, site, center, root.resolve(), getattr(loaded.site, "max_items", None))
        except (DataError, OSError, ValueError) as e:
            check.unchecked[site] = str(e)
            continue
        check.training_sites[site] = len(images)
        training.update({p: site for p in images})
    sizes: dict[int, list[Path]] = {}
    for p in training:
        try:
            sizes.setdefault(p.stat().st_size, []).append(p)
        except OSError:
            pass
    hashes: dict[Path, str] = {}
    found = {}
    for site in dict.fromkeys(r["site"] for r in rows):
        stems = [r["image"] for r in rows if r["site"] == site]
        files = case_files(center_dirs[site], stems) if site in center_dirs else {}
        for stem in stems:
            image = next((f for f in files.get(stem, []) if f.parent.name.startswith("images")), None)
            seen = False
            if image is not None:
                image = image.resolve()
                seen = image in training
                if not seen and image.stat().st_size in sizes:
                    own_hash = file_sha256(image)
                    for p in sizes[image.stat().st_size]:
                        if p not in hashes:
                            hashes[p] = file_sha256(p)
                        if hashes[p] == own_hash:
                            seen = True
                            break
            found[(site, stem)] = seen
        check.by_site[site] = (sum(found[(site, s)] for s in stems), len(stems))
    check.cases = [f"{r['site']}/{r['image']}" for r in rows if found[(r["site"], r["image"])]]
    return check


def training_cases(loaded, rows: list[dict], center_dirs: dict, *, data_root=None) -> list[str]:
    """``"<site>/<case>"`` of the labelled ``rows`` whose image the job's sites trained on (:func:`training_check`)."""
    return training_check(loaded, rows, center_dirs, data_root=data_root).cases


def check_training_cases(loaded, rows: list[dict], center_dirs: dict, *, data_root=None,
                         allow: bool = False) -> TrainingCheck:
    """:func:`training_check`, refusing training cases unless ``allow`` (``--allow-training-cases``).

    Raises:
        TrainingCaseError: a labelled case is a training case of the job and ``allow`` is False (one line naming the
            site and how many of its cases are training cases).
    """
    check = training_check(loaded, rows, center_dirs, data_root=data_root)
    if check.cases and not allow:
        raise TrainingCaseError(check.message())
    return check
