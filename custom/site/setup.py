"""How FedUQ's 2D site is set up once per run, without FLARE's engine: its task and center, data root, threads and
seed, its train/validation/test datasets and loaders, its network, optimiser and method, and its restart state.

:class:`SiteSetup` is the set-up half of :class:`feduq.site.site2d.Site2D` (the other half runs the round's tasks);
a method with its own loop (FedUAA's classification site) overrides :meth:`SiteSetup._start` and reuses the rest.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from monai.data import DataLoader

from .. import data as fdata
from ..common.wire import SITE_CONFIG_FILE
from ..core.checkpoints import load_checkpoint
from ..core.networks import DEFAULT_NETWORK, build_network, check_input_size, network_note
from ..core.partial_labels import group_names, scored_columns
from ..core.training import LocalTrainer, resolve_device
from ..sites.centers import site_center
from ..privacy.dp_sgd import check_private_model
from .settings import training_loader

CLIENT_STATE_FILE = "feduq_client_state.pt"  # optimizer + scheduler state, in the site's run folder


#: validation batches hold this many training batches on a GPU (no gradients: 4x the images fit in less memory than
#: one training step's activations, and the device is not left waiting on small batches)
CUDA_EVAL_BATCHES = 4


def eval_batch_size(batch_size: int, device: torch.device) -> int:
    """The validation batch of a site training with ``batch_size``: the same on a CPU (so a CPU run's numbers do not
    move with it), :data:`CUDA_EVAL_BATCHES` times it on CUDA. Scores are per image either way."""
    return batch_size * (CUDA_EVAL_BATCHES if device.type == "cuda" else 1)


class SiteSetup:
    """The set-up of a FedUQ 2D site (see the module docstring); its settings are :class:`feduq.site.site2d.Site2D`'s
    attributes, made in its constructor."""

    #: read and transform the test split once at set-up to check it (a site that never tests, e.g. a virtual site
    #: whose shared test list another site scores in ``feduq virtual``, skips it: its files are still
    #: listed and decoded)
    check_test_split = True

    def build_network(self, spec: "fdata.TaskSpec") -> torch.nn.Module:
        """The site's network for task ``spec`` (the same layout as the server's persistor model).

        Raises:
            ValueError: the network options do not fit the task, or ``image_size`` is not a size the
                network can take (:func:`feduq.core.networks.check_input_size`).
        """
        return self._build_named_network(spec.in_channels, len(spec.class_names))

    def _build_named_network(self, in_channels: int, out_channels: int) -> torch.nn.Module:
        options = dict(self.network_args)
        model = build_network(options.pop("name", DEFAULT_NETWORK), in_channels, out_channels, **options)
        check_input_size(model, self.image_size)
        return model

    # -- setup -----------------------------------------------------------------------------------
    def start(self, site: str, config: dict, run_folder: str | Path) -> None:
        """Set the site up: its data, network, optimiser and method; its restart state when ``run_folder`` holds it.

        Args:
            site: the site's name (a center of the task, or a virtual site ``<center>-p<k>of<K>``).
            config: the site's own settings (``data_root``, ``center``, ``on_bad_file``; the content of
                ``feduq_site.json``).
            run_folder: where this site keeps its restart state (optimiser, local entries) and per-image test scores
                (made if missing).

        Raises:
            DataError: the site is not a center of the task, has no data root, or too few images.
            ValueError: the network, or the method, does not fit the task; a corrupt restart state.
        """
        self.site = site
        try:
            Path(run_folder).mkdir(parents=True, exist_ok=True)
            self._start(dict(config), Path(run_folder))
        except Exception:
            self._setup_failed()  # no task may run on a half-built site
            raise

    def _site_context(self, cfg: dict):
        """This site's settings: ``(TaskSpec, data root)`` from its config ``cfg``; also sets the center, torch
        threads and seed.

        Raises:
            DataError: the site is not a center of the task, or it has no data root.
        """
        spec = fdata.get_task(self.task_name)
        try:  # a center, or a virtual site <center>-p<k>of<K> (feduq.sites.centers)
            self.center = site_center(self.task_name, cfg.get("center", self.site))
        except fdata.DataError as e:
            raise fdata.DataError(f"{e}; name the site after its center or set \"center\" in local/{SITE_CONFIG_FILE}") from None
        data_root = fdata.resolve_data_root(cfg.get("data_root"), site=self.site)
        threads = self.num_threads
        if isinstance(threads, dict):
            threads = threads.get(self.center, threads.get("default", 0))
        if threads > 0:
            torch.set_num_threads(threads)
        else:  # 0: this site's share of the host's cores among the job's sites that compute now (feduq.core.threads)
            self.take_core_share()
        torch.manual_seed(self.seed)
        return spec, data_root

    def _build_splits(self, get_dataset, common: dict, eval_batch_size: int, min_train: int = 1,
                      test_batch_size: int | None = None) -> None:
        """This site's train/val/test datasets (``get_dataset(task, center, split, **common)``) and loaders.

        Training: :func:`feduq.site.settings.training_loader` (seeded shuffle, last incomplete batch dropped).

        Raises:
            DataError: fewer than ``min_train`` training images or an empty validation split.
        """
        # the test at the training resolution reads the test split with the validation transforms; a split tested
        # once, at the end, is read and checked now but not kept (a site's memory between tasks)
        test = {"cache": True if self.test_protocol.every_round else "check" if self.check_test_split else False}
        stages = {"test": {**test, **({"stage": "val"} if self.test_protocol.resolution == "training" else {})}}
        self.train_ds, self.val_ds, self.test_ds = (
            get_dataset(self.task_name, self.center, split, site=self.site, **stages.get(split, {}), **common)
            for split in ("train", "val", "test")
        )
        if len(self.train_ds) < min_train or len(self.val_ds) == 0:
            raise fdata.DataError(
                f"site {self.site!r}: need >= {min_train} training image(s) and a non-empty validation split "
                f"(got {len(self.train_ds)} and {len(self.val_ds)})"
            )
        self.train_loader = training_loader(self.train_ds, self.batch_size, self.seed, self.device, self.num_workers)
        pin = self.device.type == "cuda"  # pinned host batches: the copy to the GPU does not stall the host
        self.val_loader = DataLoader(self.val_ds, batch_size=eval_batch_size, pin_memory=pin)
        self.test_loader = DataLoader(self.test_ds, batch_size=test_batch_size or eval_batch_size, pin_memory=pin)

    def _start(self, cfg: dict, run_folder: Path) -> None:
        spec, data_root = self._site_context(cfg)
        self.num_classes = len(spec.class_names)
        self.regions = spec.eval_regions or None  # fundus: select models on disc/cup Dice, as the test reports
        self.class_names = spec.class_names
        # partial labels: the task's classes this site annotates (None: all), from its own dataset.json; its validation
        # Dice (model selection) then counts only those structures, as its test does
        self.annotated = fdata.annotated_classes(spec, data_root, self.center, self.site)
        if self.annotated is not None:
            columns, keep = scored_columns(spec.class_names, self.regions, self.annotated)
            self.regions = {name: columns[name] for i, name in enumerate(columns) if i in keep}
        on_bad_file = cfg.get("on_bad_file", "error")  # site setting: "error" (default) or "skip" with a warning
        common = dict(
            data_root=data_root,
            image_size=self.image_size,
            max_items=self.max_items,
            on_bad_file=on_bad_file,
            resize=self.resize,
            intensity=self.intensity,
        )
        self.device = resolve_device(self.device_name)
        self._common = common  # dataset settings, for a method's extra datasets (FedA3I's noise estimation)
        # validation images all have the training size: their forward passes (the received model's validation,
        # FedEvi's A_k and G_k) run in batches (scores stay per image; docs/reference/networks.md); the test reads stored
        # sizes that differ, one image at a time
        self._build_splits(fdata.get_dataset, common, eval_batch_size=eval_batch_size(self.batch_size, self.device),
                           test_batch_size=1)
        model = self.build_network(spec)
        self.trainer = LocalTrainer(model, self.device, **self.optim_args, **self.speed_args)
        self.eval_model = copy.deepcopy(self.trainer.model)  # scratch copy for models that are not ours
        if self.dp is not None:
            check_private_model(self.trainer.model, self.site)
        self._local_keys = None
        try:
            self.method.setup(self)  # e.g. FedBN: the network must have normalisation layers with state
        except ValueError:
            self.trainer = None  # no task may run with a model the method cannot use
            raise
        self.loss = self.build_loss()
        self.state_path = run_folder / CLIENT_STATE_FILE
        if self.state_path.is_file():  # this site's process was restarted within the job
            state = load_checkpoint(self.state_path, map_location=self.device, what="site state")
            self.trainer.load_state(state)
            self.log(f"restored optimizer/scheduler state of round {state.get('round')}")
        self._start_local_entries()
        self.log(
            f"site {self.site!r} center {self.center!r}: train/val/test = "
            f"{len(self.train_ds)}/{len(self.val_ds)}/{len(self.test_ds)} images at {self.image_size}px "
            f"from {data_root / spec.folder / self.center}, device {self.device}, training precision "
            f"{self._precision()}, "
            f"{network_note(self.trainer.model)}"
            + ("" if self.annotated is None else ", partial labels: annotates "
               f"{group_names(spec.class_names, spec.eval_regions, self.annotated)} (marginal loss over the others)"),
        )
        if not getattr(self.trainer.model, "paper_network", True):
            self.warn(f"{network_note(self.trainer.model)}: results are not comparable with the papers' tables")

    def _precision(self) -> str:
        """Training's precision as the start line names it: "float32 (DP-SGD)" where DP-SGD will switch autocast off
        at the first train task, else "bfloat16 autocast", "float16 autocast" or "float32"."""
        if getattr(self, "dp", None) is not None:
            return "float32 (DP-SGD)"
        return str(self.trainer.autocast_dtype).replace("torch.", "") + " autocast" if self.trainer.amp else "float32"
