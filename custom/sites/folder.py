"""A site's folder with its layout decided once: FedUQ's own or nnU-Net's raw dataset.

A site's data lies in ``<data root>/<task folder>/<center>/``, in one of two layouts:

* **FedUQ's own** (a built-in 2D task): ``images/``, ``masks/``, ``labels.json``, and the split a site reads
  (``split.json``, a virtual site's part of the committed partition, or the packaged split), read by
  :mod:`feduq.sites.split_files`;
* **nnU-Net v2's raw dataset** (a task file's sites): ``dataset.json``, ``imagesTr/``, ``labelsTr/`` and an optional
  ``split.json`` of case names, read by :mod:`feduq.sites.nnunet_raw`.

:meth:`SiteFolder.of` decides which, once, and refuses half an nnU-Net dataset (``imagesTr/`` without its
``dataset.json``, or the reverse) naming what is missing; every reader that depends on the layout asks the object
(:meth:`SiteFolder.split_size`, :meth:`SiteFolder.training_images`, :meth:`SiteFolder.groups`) instead of looking at
the folder again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..tasks.spec import SPLIT_KEYS, TaskSpec, get_task, resolve_data_root
from .nnunet_raw import case_groups, half_nnunet_site, is_nnunet_site, list_cases, nnunet_split, read_site_labels
from .split_files import center_groups, load_split, split_size

__all__ = ["SiteFolder"]


@dataclass(frozen=True)
class SiteFolder:
    """One site's folder and its layout.

    Attributes:
        task: the task the site belongs to.
        center: the center whose folder it is (``<data root>/<task folder>/<center>``).
        site: the site reading it (a virtual site ``<center>-p<k>of<K>`` reads its part of the center's split;
            default the center).
        root: the data root the folder lies in.
        nnunet: True for nnU-Net's raw layout (``dataset.json`` and ``imagesTr/``), False for FedUQ's own.
        task_arg: the task as the caller named it (a registered name, or a task file's path), which the readers of
            each layout are given.
    """

    task: TaskSpec
    center: str
    site: str
    root: Path
    nnunet: bool
    task_arg: object = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, task, center: str, data_root: str | os.PathLike | None = None,
           site: str | None = None) -> "SiteFolder":
        """The folder of ``center`` under ``data_root`` (default ``$FEDUQ_DATA_ROOT``) for ``site``.

        Raises:
            feduq.tasks.spec.DataError: an unknown task; no data root; half an nnU-Net raw dataset (what is missing
                named, with the site).
        """
        spec = get_task(task)
        site = site or center
        root = resolve_data_root(data_root, site=site)
        path = root / spec.folder / center
        half_nnunet_site(path, site)
        return cls(spec, center, site, root, is_nnunet_site(path),
                   task if isinstance(task, (str, os.PathLike)) else spec.name)

    @property
    def layout(self) -> str:
        """``"nnunet"`` or ``"feduq"``."""
        return "nnunet" if self.nnunet else "feduq"

    @property
    def path(self) -> Path:
        """The folder, ``<root>/<task folder>/<center>``."""
        return self.root / self.task.folder / self.center

    def split_size(self, key: str) -> int:
        """How many items (FedUQ's layout: image/mask pairs; nnU-Net's: cases) the split ``key`` (``"training"``,
        ``"validation"``, ``"testing"``) lists as the site reads it with no site setting; FedUQ's files are not
        opened (a quick look before a run), an nnU-Net site's cases are listed as at start-up.

        Raises:
            feduq.tasks.spec.DataError: a missing or invalid split file; an nnU-Net site's declaration or cases.
        """
        if self.nnunet:
            return len(nnunet_split(self.path, self.task, self.site, list(self._cases()))[key])
        return split_size(self.task_arg, self.center, key, self.root, self.site)

    def training_images(self, max_items: int | None = None) -> list[Path]:
        """The resolved files of the site's training split (the first channel of an nnU-Net case), the first
        ``max_items`` when given, as the site trains on them.

        Raises:
            feduq.tasks.spec.DataError: as :func:`feduq.sites.split_files.load_split` or
                :func:`feduq.sites.nnunet_raw.nnunet_split`.
        """
        key = SPLIT_KEYS["train"]
        if self.nnunet:
            cases = self._cases()
            names = nnunet_split(self.path, self.task, self.site, list(cases))[key][:max_items]
            return [Path(cases[c]["channels"][0]).resolve() for c in names]
        items = load_split(self.task_arg, self.center, self.root, site=self.site, checked=(key,))[key]
        return [Path(i["image"]).resolve() for i in items[:max_items]]

    def groups(self) -> tuple[dict[str, str] | None, str]:
        """``({image stem or case: group}, unit name)``: the independent units of a paired test (a patient, a
        video sequence); ``(None, ...)`` when the site's images are independent.

        FedUQ's layout reads the group from the center's provenance (:func:`feduq.sites.split_files.center_groups`,
        unit: its column); nnU-Net's from the task's group pattern over case names (unit ``"group"``).

        Raises:
            feduq.tasks.spec.DataError: the provenance column or a case the pattern does not match (named).
        """
        if self.nnunet:
            return case_groups(self.task_arg, self.root, self.center, self.site), "group"
        column, _, table = center_groups(self.root, self.task_arg, self.center)
        return table, column or "group"

    def _cases(self) -> dict:
        """An nnU-Net site's cases (``case -> {"channels": [files], "label": file}``), its ``dataset.json`` read
        against the task, as at start-up."""
        return list_cases(self.path, self.task, self.site, read_site_labels(self.path, self.task, self.site))
