"""A volume site trained as nnU-Net trains volumes: its 3D full-resolution network from the federation's plan.

:class:`Site3D` is FedUQ's 2D site (:class:`feduq.site.site2d.Site2D`: the same tasks, method hooks, aggregation
payload, NaN policy, restart state and log records) with nnU-Net's volume pipeline in place of the slice pipeline
(:class:`feduq.nnunet.pipeline.SitePipeline` on the plan's ``3d_fullres`` configuration):

* **data**: the site's nnU-Net raw cases (``imagesTr/``, ``labelsTr/``, its split by case) preprocessed once at
  start-up with nnU-Net's ``DefaultPreprocessor`` (crop to the non-zero region, resample to the plan's spacing, the
  plan's normalisation) into a scratch folder of the site's run folder; label values read as the task's classes by
  name (:class:`feduq.sites.nnunet_raw.SiteLabels`), so partial labels train with the marginal loss as in 2D;
* **training**: nnU-Net's loader (patches with a third foreground-oversampled, its 3D augmentation) for
  ``iterations`` steps per local epoch (``iterations x local_epochs`` a round); nnU-Net's Dice + cross-entropy for a
  method that keeps FedAvg's loss, else the method's own loss (FedEvi's, FedUAA's; the marginal loss on partial
  labels), at each deep-supervision output with
  nnU-Net's weights (1, 1/2, 1/4, ..., the lowest 0, normalised); nnU-Net's SGD (lr 0.01, momentum 0.99, Nesterov, weight decay 3e-5),
  the gradient norm clipped at 12, and its poly schedule ``lr = lr0 (1 - r / R)^0.9`` stepped once per round over the job's R rounds;
* **validation**: fixed patches per validation case drawn once by nnU-Net's loader without augmentation (as
  nnU-Net's trainer validates on patches), scored as the 2D site scores its images (Dice, FedEvi's loss);
* **test**: each test case by Gaussian sliding windows over the preprocessed volume (MONAI, the plan's patch,
  overlap 0.5), the method's probabilities mapped back onto the file's grid by nnU-Net
  (``convert_predicted_logits_to_segmentation_with_correct_shape``), Dice per case and HD95 in mm with the file's
  spacing (:func:`feduq.scores.volume_scores.case_scores_3d`); the case is the unit of the site's per-case file.

The aggregation weight N_k is the number of training cases. A method's pass over the site's training or validation
images (FedEvi's A_k and G_k, GraphFedSeg's U_k) reads fixed patches: one per training case, ``val_patches_per_case``
per validation case.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Mapping

import numpy as np
import torch
from nvflare.app_common.abstract.fl_model import FLModel

from .. import data as fdata
from ..common.wire import FedUQMetaKey
from ..core.checkpoints import load_checkpoint
from ..scores.metrics import calibration_error
from ..core.partial_labels import group_names, scored_columns
from ..scores.tables import PER_CASE_TEST_FILE, per_image_test_path, write_rows
from ..core.training import LocalTrainer, resolve_device
from ..scores.volume_scores import WholeCaseMaps, volume_site_results
from ..sites import nnunet_raw as nr
from ..parts.site import SitePart
from ..nnunet.pipeline import SitePipeline, check_plan_channels, load_plans, make_optimizer
from ..nnunet.planned import PlannedNetwork
from .setup import CLIENT_STATE_FILE
from .site2d import Site2D

PREPROCESSED = "nnunet_preprocessed"  #: the scratch folder of preprocessed cases, in the site's run folder
#: the cases a run trained, validated and tested on, written into the site's run folder at start (site-local)
SPLIT_USED = "split_used.json"


class FixedPatches(torch.utils.data.Dataset):
    """``per_case`` fixed patches of each case, drawn on demand by nnU-Net's loader without augmentation (item ``i``
    always the same patch: :meth:`feduq.nnunet.pipeline.SitePipeline.validation_patches` seeded with ``seed + i``);
    a method's pass over the site's training images (GraphFedSeg's vacuity U_k) reads these."""

    def __init__(self, pipeline, folder: Path, identifiers, per_case: int = 1, seed: int = 0):
        self.pipeline, self.folder, self.ids = pipeline, Path(folder), list(identifiers)
        self.per_case, self.seed = int(per_case), int(seed)

    def __len__(self) -> int:
        return len(self.ids) * self.per_case

    def __getitem__(self, i: int) -> dict:
        case = self.ids[i // self.per_case]
        return self.pipeline.validation_patches(self.folder, [case], 1, self.seed + i)[0]


def deep_supervision_loss(loss, weights):
    """``loss(logits, label, round)`` of one output -> the weighted sum over deep-supervision outputs (lists of
    logits ``[B, C, *s_i]`` and labels ``[B, 1, *s_i]``; a single tensor passes through)."""

    def ds_loss(logits, label, round_index):
        if not isinstance(logits, (list, tuple)):
            return loss(logits, label, round_index)
        total = 0.0
        for w, lo, la in zip(weights, logits, label):
            if w:
                total = total + w * loss(lo, la, round_index)
        return total

    return ds_loss


class _Iterations:
    """One local 'epoch' of ``n`` batches of nnU-Net's (infinite) loader as ``{"image", "label"}`` dicts, the label
    the list of deep-supervision targets with nnU-Net's -1 (outside the crop) read as background."""

    def __init__(self, loader, n: int):
        self.loader, self.n = loader, int(n)

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        for _ in range(self.n):
            batch = next(self.loader)
            target = batch["target"] if isinstance(batch["target"], (list, tuple)) else [batch["target"]]
            yield {"image": batch["data"], "label": [t.clamp_min(0) for t in target]}


def class_lut(value_to_class: Mapping[int, int]) -> np.ndarray:
    """A site's label values -> the task's classes (:attr:`feduq.sites.nnunet_raw.SiteLabels.value_to_class`) as a
    lookup table ``[max value + 2]`` int16; its last entry keeps nnU-Net's -1 (outside the non-zero crop) at -1."""
    lut = np.zeros(max(value_to_class) + 2, np.int16)
    for v, c in value_to_class.items():
        lut[v] = c
    lut[-1] = -1
    return lut


def largest_components(site, spec) -> dict | None:
    """How a 3D job's class maps are reduced, as its 2D sites reduce theirs: ``keep_largest_component`` and the test
    protocol's ``connectivity`` (8: full, 26 neighbours in 3D; 4: faces, 6) of the job, per class or, for a task
    scored by nested regions, per region (:func:`feduq.nnunet.volume_inference.keep_largest_components`' keyword
    arguments); None when the job keeps every component. The site's test, ``feduq evaluate``, predict and the bundle
    all reduce with it."""
    if not getattr(site, "keep_largest_component", False) or len(spec.class_names) < 2:
        return None
    regions = {name: [int(c) for c in classes] for name, classes in (spec.eval_regions or {}).items()}
    return {"num_classes": len(spec.class_names), "regions": regions or None,
            "full": getattr(getattr(site, "test_protocol", None), "connectivity", 8) != 4}


def reference_classes(pipeline: SitePipeline, label_file, value_to_class: Mapping[int, int]) -> np.ndarray:
    """A case's label file on its own grid (the plan's reader), as the task's classes ``[*file shape]`` int16."""
    seg, _ = pipeline.pm.image_reader_writer_class().read_seg(str(label_file))
    return class_lut(value_to_class)[np.asarray(seg[0], dtype=np.int64)]


class Site3D(Site2D):
    """A volume site on nnU-Net's 3D network (module docstring).

    Args:
        plans: the federation's nnU-Net plans (a dict, as the job carries it, or a path; :mod:`feduq.nnunet.
            federated_plans`), with a ``configuration`` entry.
        configuration: the plan's configuration (``"3d_fullres"``).
        iterations: training iterations (batches) per local epoch, as nnU-Net's epoch of 250; a round trains
            ``iterations x local_epochs`` steps (said in the site's first log line).
        val_patches_per_case: fixed validation patches per validation case.
        lr, weight_decay: nnU-Net's SGD (its defaults).
        **kwargs: :class:`feduq.site.site2d.Site2D`'s (``task``, ``method``, ``max_items``, ``seed``, ``device``,
            ``amp``, ``num_threads``...); ``image_size``, ``batch_size`` (the plan's), ``network``, ``resize`` and
            ``intensity`` do not apply.

    Raises:
        ValueError: plans without ``configuration``; ``iterations`` or ``val_patches_per_case`` < 1; ``dp`` set (DP-SGD
            is not built for the 3D network).
    """

    check_test_split = False

    def __init__(self, plans: Mapping | str, configuration: str = "3d_fullres", iterations: int = 250,
                 val_patches_per_case: int = 2, lr: float = 0.01, weight_decay: float = 3e-5, **kwargs):
        super().__init__(lr=lr, weight_decay=weight_decay, **kwargs)
        if self.dp is not None:
            raise ValueError(f"executor argument dp: DP-SGD is not built for configuration {configuration!r} (nnU-Net's "
                             "3D network trains without it); use configuration '2d' for a private run")
        self.plans = load_plans(plans, configuration)  # ValueError naming the configuration it lacks
        self.configuration = configuration
        if int(iterations) < 1 or int(val_patches_per_case) < 1:
            raise ValueError(f"iterations={iterations}, val_patches_per_case={val_patches_per_case}: expected >= 1")
        self.iterations, self.val_patches_per_case = int(iterations), int(val_patches_per_case)
        self.total_rounds: int | None = None  # the job's rounds, from the first model received (the poly schedule)

    # -- set-up ---------------------------------------------------------------------------------------------------
    def build_network(self, spec: "fdata.TaskSpec") -> torch.nn.Module:
        """nnU-Net's network of the plan for task ``spec`` (:class:`feduq.nnunet.planned.PlannedNetwork`, the server's
        persistor model with the same arguments).

        Raises:
            ValueError: the task holds 2D images, or the plan was made for another number of channels.
        """
        if spec.kind != "3d":
            raise ValueError(f"configuration {self.configuration!r} trains volumes, but task {spec.name!r} holds 2D "
                             "images")
        check_plan_channels(self.plans, self.configuration, spec)
        return PlannedNetwork(self.plans, self.configuration, len(spec.channel_names),
                              len(spec.class_names), init_seed=self.seed)

    def make_pipeline(self, spec: "fdata.TaskSpec", file_ending: str | None = None) -> SitePipeline:
        """nnU-Net's pipeline of the plan for task ``spec``'s classes, reading files of ``file_ending`` (default the
        task's) with the plan's reader.

        Raises:
            ValueError: the plan was made for another number of channels.
        """
        check_plan_channels(self.plans, self.configuration, spec)
        dataset_json = {"channel_names": dict(enumerate(spec.channel_names)),
                        "labels": {name: i for i, name in enumerate(spec.class_names)},
                        "file_ending": file_ending or spec.file_ending}
        return SitePipeline(self.plans, spec.class_names[1:], configuration=self.configuration,
                            dataset_json=dataset_json)

    def _start(self, cfg: dict, run_folder: Path) -> None:
        spec, data_root = self._site_context(cfg)
        if spec.kind != "3d":
            raise fdata.DataError(f"site {self.site!r}: configuration {self.configuration!r} trains volumes, but task "
                                  f"{spec.name!r} holds 2D images (use the 2D site)")
        self.num_classes, self.class_names = len(spec.class_names), spec.class_names
        self.regions = spec.eval_regions or None
        center_dir = data_root / spec.folder / self.center
        labels = nr.read_site_labels(center_dir, spec, self.site)
        self.site_labels = labels
        self.annotated = labels.annotated if labels.partial else None
        if self.annotated is not None:
            columns, keep = scored_columns(spec.class_names, self.regions, self.annotated)
            self.regions = {name: columns[name] for i, name in enumerate(columns) if i in keep}
        self.cases = nr.list_cases(center_dir, spec, self.site, labels)
        split = nr.nnunet_split(center_dir, spec, self.site, list(self.cases))
        split = {k: v[: self.max_items] if self.max_items else list(v) for k, v in split.items()}
        train_ids, val_ids, self.test_ids = split["training"], split["validation"], split["testing"]
        # which cases this run trained, validated and tested on, readable at the site (case names never leave it)
        Path(run_folder).mkdir(parents=True, exist_ok=True)
        (Path(run_folder) / SPLIT_USED).write_text(json.dumps(
            {"site": self.site, "center_dir": str(center_dir), "training": list(train_ids),
             "validation": list(val_ids), "testing": list(self.test_ids)}, indent=1) + "\n")
        if not train_ids or not val_ids:
            raise fdata.DataError(f"site {self.site!r}: need >= 1 training and validation case (got {len(train_ids)} "
                                  f"and {len(val_ids)})")
        self.device = resolve_device(self.device_name)
        self.pipeline = self.make_pipeline(spec, labels.file_ending)
        self.batch_size = int(self.pipeline.cm.batch_size)
        self.scratch = run_folder / PREPROCESSED
        if self.scratch.exists():
            shutil.rmtree(self.scratch)
        for case in [*train_ids, *val_ids, *self.test_ids]:
            self._preprocess(case)
        self.train_ds = FixedPatches(self.pipeline, self.scratch, train_ids, 1, self.seed + 1)  # N_k: training cases
        self.val_ds = self.pipeline.validation_patches(self.scratch, val_ids, self.val_patches_per_case, self.seed)
        self.test_ds = list(self.test_ids)
        self.train_loader = _Iterations(self.pipeline.make_loader(self.scratch, train_ids, seed=self.seed),
                                        self.iterations)
        self.val_loader = torch.utils.data.DataLoader(self.val_ds, batch_size=1)
        model = self.build_network(spec)
        self.trainer = LocalTrainer(model, self.device, **self.optim_args, **self.speed_args)
        optimizer = make_optimizer(self.trainer.model, self.optim_args["lr"], self.optim_args["weight_decay"])
        poly = torch.optim.lr_scheduler.LambdaLR(optimizer, self._poly)
        self.trainer.set_optimizer(optimizer, poly)
        self.trainer.clip_grad_norm = 12.0  # nnU-Net's trainer clips the gradient norm at 12
        self.eval_model = copy.deepcopy(self.trainer.model)
        self._local_keys = None
        try:
            self.method.setup(self)
        except ValueError:
            self.trainer = None
            raise
        scales = self.pipeline.deep_supervision_scales()
        weights = np.array([1 / 2**i for i in range(len(scales))])
        weights[-1] = 0
        if type(self.method).loss is SitePart.loss and self.annotated is None:
            # a method that keeps FedAvg's loss trains with nnU-Net's own: Dice (batch Dice per the plan, no
            # background) + cross-entropy, wrapped for deep supervision with the same weights
            nnunet_loss = self.pipeline.build_loss()
            self.loss = lambda logits, label, round_index: nnunet_loss(logits, label)
        else:
            self.loss = deep_supervision_loss(self.build_loss(), (weights / weights.sum()).tolist())
        self.state_path = run_folder / CLIENT_STATE_FILE
        if self.state_path.is_file():
            state = load_checkpoint(self.state_path, map_location=self.device, what="site state")
            self.trainer.load_state(state)
            self.log(f"restored optimizer/scheduler state of round {state.get('round')}")
        self._start_local_entries()
        arch = self.pipeline.cm.network_arch_init_kwargs
        self.log(
            f"site {self.site!r} center {self.center!r}: train/val/test = {len(train_ids)}/{len(val_ids)}/"
            f"{len(self.test_ids)} cases from {center_dir}, nnU-Net {self.configuration} plan "
            f"{self.plans.get('plans_name')!r} (patch {list(self.pipeline.patch_size)}, spacing "
            f"{[round(float(s), 3) for s in self.pipeline.cm.spacing]} mm, {arch['n_stages']} stages, batch "
            f"{self.batch_size}), {self.iterations} iterations a local epoch x {self.local_epochs} local epochs = "
            f"{self.iterations * self.local_epochs} steps a round, device {self.device}"
            + ("" if self.annotated is None else ", partial labels: annotates "
               f"{group_names(spec.class_names, spec.eval_regions, self.annotated)} (marginal loss over the others)"))

    def _lut(self) -> np.ndarray:
        return class_lut(self.site_labels.value_to_class)

    def _preprocess(self, case: str) -> None:
        files = self.cases[case]
        data, seg, props = self.pipeline.preprocess_files(files["channels"], files["label"])
        spacing = np.asarray(props["spacing"], dtype=float)
        if not (np.isfinite(spacing).all() and (spacing > 0).all()):
            raise fdata.DataError(f"site {self.site!r}: {Path(files['channels'][0]).name} has voxel spacing "
                                  f"{spacing.tolist()}: expected every axis > 0 mm (set it in the image header)")
        seg = self._lut()[seg.astype(np.int64)]  # the site's label values as the task's classes
        self.pipeline.save_case(self.scratch, case, data, seg, props)

    def _poly(self, round_index: int) -> float:
        """nnU-Net's poly factor ``(1 - r / R)^0.9`` of round ``r`` (1 until the job's rounds R are known)."""
        if not self.total_rounds:
            return 1.0
        return max(0.0, 1.0 - min(round_index, self.total_rounds) / self.total_rounds) ** 0.9

    # -- tasks ----------------------------------------------------------------------------------------------------
    def train(self, received: FLModel) -> FLModel:
        """:meth:`Site2D.train` (the job's rounds set the poly schedule first)."""
        if received.total_rounds:
            self.total_rounds = int(received.total_rounds)
        return super().train(received)

    def case_prediction(self, model: torch.nn.Module, case: str, uncertainty: bool = False) -> tuple[dict, dict]:
        """One preprocessed case through ``model`` (:func:`feduq.nnunet.volume_inference.predict_volume`): its result
        (class map, probabilities and, with ``uncertainty``, the method's maps on the file's grid) and nnU-Net's
        properties of the case."""
        from nnunetv2.training.dataloading.nnunet_dataset import nnUNetDatasetBlosc2

        from ..nnunet.volume_inference import predict_volume

        data, _, _, props = nnUNetDatasetBlosc2(str(self.scratch), [case]).load_case(case)
        res = predict_volume(model, self.pipeline, np.asarray(data[:], dtype=np.float32), props, self.device,
                             self.prob_fn, self.uncertainty_fn() if uncertainty else None,
                             largest=largest_components(self, fdata.get_task(self.task_name)))
        return res, props

    def _reference(self, case: str) -> np.ndarray:
        """The case's label map on its file's grid (nnU-Net's reader), as the task's classes."""
        return reference_classes(self.pipeline, self.cases[case]["label"], self.site_labels.value_to_class)

    def test(self, received: FLModel) -> FLModel:
        """Per-case Dice and HD95 (mm) of the received model on the site's test cases (module docstring), scored and
        tabled as a slice-wise volume site's (:func:`feduq.scores.volume_scores.volume_site_results`); the per-case file
        and the paired tests' unit file (the case) stay on the site."""
        if not self.test_ids:
            self.warn(f"site {self.site!r}: the test split is empty; no test scores to report")
            return FLModel(metrics={}, meta={FedUQMetaKey.SITE: self.site})
        per_image_file = per_image_test_path(self.state_path.parent, (received.meta or {}).get(FedUQMetaKey.TEST_RESULTS))
        model = self._load_eval_model(received)
        from nnunetv2.training.dataloading.nnunet_dataset import nnUNetDatasetBlosc2

        cases, eces = WholeCaseMaps(), []
        for case in self.test_ids:
            res, props = self.case_prediction(model, case)
            cases.add(case, res["label"], self._reference(case), props["spacing"])
            _, pre_seg, _, _ = nnUNetDatasetBlosc2(str(self.scratch), [case]).load_case(case)
            label = torch.from_numpy(np.asarray(pre_seg[:], dtype=np.int64)).clamp_min(0)[None]
            probs = torch.from_numpy(res["probabilities_preprocessed"])[None]
            eces.append(float(calibration_error(probs, label)[0]))
        metrics, rows, units = volume_site_results(cases, np.asarray(eces), self.class_names,
                                                   fdata.get_task(self.task_name).eval_regions or None, self.site,
                                                   self.annotated)
        metrics["num_images"] = len(self.test_ids)
        write_rows(per_image_file.with_name(PER_CASE_TEST_FILE), rows)
        write_rows(per_image_file, units)  # the paired tests' unit: the case
        self.log("FEDUQ_TEST " + json.dumps({"site": self.site, **metrics}))
        self._log_test_local()
        return FLModel(metrics=metrics, meta={FedUQMetaKey.SITE: self.site})
