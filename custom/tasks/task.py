"""The one task type: :class:`TaskSpec`, a task file read and checked (:mod:`feduq.tasks.declared` reads it).

A built-in task (its file shipped in ``feduq/tasks/task_files/``) and a consortium's own task file become the same
type, read by the same code; :mod:`feduq.tasks.spec` keeps the registry (:func:`~feduq.tasks.spec.get_task`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..common.errors import DataError

__all__ = ["TaskSpec", "FILE_ENDINGS_2D", "FILE_ENDINGS_3D", "file_kind"]

FILE_ENDINGS_2D = (".png", ".bmp", ".tif", ".tiff")
FILE_ENDINGS_3D = (".nii.gz", ".nii", ".nrrd", ".mha")


def file_kind(file_ending: str) -> str:
    """``"2d"`` or ``"3d"`` for a declared ``file_ending``; :class:`DataError` for one FedUQ does not read."""
    ending = str(file_ending).lower()
    if ending in (".jpg", ".jpeg"):
        raise DataError(f"file_ending {file_ending!r} is not read: nnU-Net's 2D reader takes PNG, BMP and TIFF, not "
                        "JPEG, whose lossy compression gives label files values no one drew; store images and labels "
                        "as .png")
    if ending in FILE_ENDINGS_2D:
        return "2d"
    if ending in FILE_ENDINGS_3D:
        return "3d"
    raise DataError(f"file_ending {file_ending!r} is not one FedUQ reads: 2D {list(FILE_ENDINGS_2D)}, "
                    f"3D {list(FILE_ENDINGS_3D)}")



@dataclass(frozen=True)
class TaskSpec:
    """A multi-center segmentation task: its task file read and checked (nnU-Net's ``dataset.json`` with FedUQ's
    ``"feduq"`` keys, :mod:`feduq.tasks.declared`), the one description of a task every tool reads, a built-in task's
    (its file shipped in the package, :data:`feduq.tasks.spec.PACKAGE_TASKS_DIR`) and a user's alike.

    Attributes:
        name: the task's name (``dataset.json``'s ``name``): its folder under the data root and its name in tables.
        channel_names: one name per input channel, in stacking order (``<case>_0000`` first).
        label_values: the label values files hold, sorted, background (0) first; class index ``i`` is the ``i``-th.
        class_names: one name per class index (a region's name for the value that ``regions_class_order`` paints it
            with; ``label_<v>`` for a value no name has).
        labels: structure name -> its label values (one value for a plain label, several for a region).
        regions: True when the labels use nnU-Net's region syntax.
        file_ending: e.g. ``".nii.gz"``; :attr:`kind` says whether the files are 2D images or 3D volumes.
        sites: the federation's sites; ``held_out``: those of them that never train.
        group_pattern: site -> regular expression on the case name whose first capturing group that took part in the
            match groups the cases one split keeps together (``re.fullmatch``; ``r"(.+)_z?\\d+"``: ``Case07_z012`` ->
            ``Case07``); key ``"*"``: every site. :meth:`case_pattern` gives a site's. Precedence: ``group_column``,
            then ``group_column_if_present``, then the pattern; a site in none of them is split per image.
        normalization: per channel, ``(scheme, window low, window high, mean, std)`` (unused numbers None).
        score: structure name -> class indices whose union is scored at test time.
        hyperparameters: method -> executor argument -> value (``feduq.hyperparameters``), checked against the
            registered methods where a job is configured for the task.
        source: where the declaration came from (``"task file <path>"``, or ``"the job's task declaration"``), for
            messages.
        raw: the declaration as given (a JSON object), carried in a job's configuration.
        layout: ``"nnunet"`` (default) or ``"feduq"`` (:data:`LAYOUTS`): how a site keeps its files and how predict's
            inputs are named. A site folder holding nnU-Net's ``dataset.json`` and ``imagesTr/`` is read as nnU-Net's
            whatever the task says.
        data_dir: the task's folder under the data root when it is not its name (:attr:`folder`).
        group_column: site -> ``provenance.csv`` column whose value groups images that stay in one split (FedUQ's
            layout: a video sequence, a patient); ``group_column_if_present``: the same, used only when the site's
            ``provenance.csv`` has the column.
        merge_foreground: a binary task whose sites may mark the foreground with several values (their
            ``labels.json``): every value but the smallest is the foreground (prostate zones -> gland).
        partition_sites: sites outside ``sites`` that run as virtual sites ``<site>-p<k>of<K>`` (an IID partition).
        configuration: how the sites train (:data:`CONFIGURATIONS`; default ``"2d"``); a job's own setting wins.
    """

    name: str
    channel_names: tuple[str, ...]
    label_values: tuple[int, ...]
    class_names: tuple[str, ...]
    labels: dict[str, tuple[int, ...]]
    regions: bool
    file_ending: str
    sites: tuple[str, ...]
    held_out: tuple[str, ...] = ()
    group_pattern: dict[str, str] = field(default_factory=dict)
    normalization: tuple[tuple, ...] = ()
    score: dict[str, tuple[int, ...]] = field(default_factory=dict)
    hyperparameters: dict[str, dict] = field(default_factory=dict)
    source: str = "?"
    raw: dict = field(default_factory=dict)
    layout: str = "nnunet"
    data_dir: str | None = None
    group_column: dict[str, str] = field(default_factory=dict)
    group_column_if_present: dict[str, str] = field(default_factory=dict)
    merge_foreground: bool = False
    partition_sites: tuple[str, ...] = ()
    configuration: str = "2d"

    @property
    def centers(self) -> tuple[str, ...]:
        """The federation's sites (folder names), in the task file's order: :attr:`sites`."""
        return self.sites

    @property
    def in_channels(self) -> int:
        """Channels fed to the network (3 = RGB, 1 = gray): one per declared channel."""
        return len(self.channel_names)

    @property
    def num_classes(self) -> int:
        """Classes of the network's output (background and one per label value)."""
        return len(self.class_names)

    @property
    def folder(self) -> str:
        """Folder of the task under the data root: :attr:`data_dir` or, by default, :attr:`name`."""
        return self.data_dir or self.name

    @property
    def partition_centers(self) -> tuple[str, ...]:
        """Sites outside :attr:`sites` that run as IID virtual sites ``<site>-p<k>of<K>``: :attr:`partition_sites`."""
        return self.partition_sites

    @property
    def eval_regions(self) -> dict[str, tuple[int, ...]]:
        """Structure name -> class indices whose union is scored at test time (fundus: ``{"disc": (1, 2), "cup":
        (2,)}``); empty for a binary task scoring its one foreground class as plain ``dice``/``hd95``."""
        if self.regions or len(self.score) > 1 or len(self.score) < len(self.labels) - 1:
            return dict(self.score)
        return {}

    def case_pattern(self, site: str | None) -> str | None:
        """The regular expression grouping ``site``'s cases (:attr:`group_pattern`: the site's own, else the one for
        every site), or None."""
        return self.group_pattern.get(site) or self.group_pattern.get("*")

    @property
    def kind(self) -> str:
        """``"2d"`` (images, scored per image) or ``"3d"`` (volumes, trained per slice, scored per case)."""
        return file_kind(self.file_ending)

    @property
    def normalised_at_read(self) -> bool:
        """True when some channel is normalised as it is read (the job's ``intensity`` setting then leaves the
        values as they are); False when every channel is ``noNorm`` (the job's ``intensity`` applies, as for a
        built-in task)."""
        return any(n[0] != "noNorm" for n in self.normalization)

    @property
    def label_ending(self) -> str:
        """The ending predicted label files are written with: the task's, but PNG for BMP (8 bits)."""
        return ".png" if self.file_ending.lower() == ".bmp" else self.file_ending

    @property
    def missing_windows(self) -> tuple[int, ...]:
        """The ``CT`` channels whose window is still to be computed from the sites' intensity fingerprints
        (``feduq fingerprint``); a job does not run until there are none."""
        return tuple(i for i, n in enumerate(self.normalization) if n[0] == "CT" and n[1] is None)

    def class_of(self, label_name: str) -> int:
        """The class index of a plain label's name."""
        return self.label_values.index(self.labels[label_name][0])
