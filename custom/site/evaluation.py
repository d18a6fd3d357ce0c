"""Score a saved FedUQ model on any site folder, with the job's own network, preprocessing and uncertainty.

A researcher asks two things of a trained federated model: how it does at a hospital that never took part (FedDG's
and FIVA's held-out site), and whether its uncertainty flags its errors. This module answers
both for every 2D segmentation method the same way, without a FLARE run:

* :func:`locate` finds the client config and the global model of a job's workspace (simulator, POC or
  production server folder), or takes a job folder plus a model file;
* :func:`load_model` rebuilds the method's 2D site from that config (:class:`feduq.site.site2d.Site2D`, not started:
  its argument checks, its network, its
  ``prob_fn`` and ``uncertainty_fn``: the **one interface** through which every method gives probabilities and its
  own uncertainty maps, ``primary_uncertainty`` naming the method's own: predictive entropy for FedAvg/FedProx/
  FedBN/FedA3I, evidential total uncertainty for FedEvi, vacuity for FedUAA and GraphFedSeg) and loads the
  weights, refusing a model that does not fit;
* :func:`site_dataset` reads a site's split, or **every** image/mask pair of a folder that is in no split file;
* :func:`evaluate_site` scores it exactly as the job's final ``test`` task does (:func:`feduq.scores.scoring.evaluate_test`:
  stored mask grid, largest component, Dice, HD95 in stored pixels, and in mm where ``provenance.csv`` records the
  pixel spacing) and adds the uncertainty quality of every map (:class:`feduq.scores.uncertainty_quality.PixelAccumulator`:
  ECE with 15 bins, Brier, NLL, AUROC/AUPRC of errors, Spearman ρ of image uncertainty vs Dice, AURC).

``feduq evaluate`` is the command line; ``feduq compare --holdout`` and ``feduq compare-report`` use it.
"""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.checkpoints import CheckpointError, check_finite, load_checkpoint
from ..common.classpath import resolve_class
from ..data import DataError, get_dataset, get_task
from ..core.training import load_params
from ..scores.scoring import evaluate_test
from ..scores.maps import image_stem
from ..sites.folder import SiteFolder
from ..sites.nnunet_raw import annotated_classes, site_cases
from ..tasks.spec import scan_center, task_folder
from ..core.partial_labels import scored_columns
from ..scores.volume_scores import CaseCollector, VolumeCaseLevel, volume_site_results
from ..scores.uncertainty_quality import PixelAccumulator

MODEL_FILES = {"best": "best_FL_global_model.pt", "last": "FL_global_model.pt"}
CLIENT_CONFIG = "config_fed_client.json"
SPLITS = ("all", "train", "val", "test")


class EvaluationError(ValueError):
    """A model, job or site that cannot be evaluated; the message names the file, site or parameter."""


def _unique(paths: list[Path], what: str, where: Path, hint: str) -> Path:
    paths = sorted(set(paths))
    if not paths:
        raise EvaluationError(f"no {what} under {where}; {hint}")
    if len(paths) > 1:
        listed = ", ".join(str(p) for p in paths[:4])
        raise EvaluationError(f"{len(paths)} {what} files under {where} ({listed}); {hint}")
    return paths[0]


def locate(job: str | os.PathLike, model: str | os.PathLike | None = None, which: str = "best") -> tuple[Path, Path]:
    """``(client config, model file)`` of a job.

    Args:
        job: a simulator/POC workspace or a server run folder (searched for ``app_server/``), a job folder
            (``app/config/config_fed_client.json``), or a ``config_fed_client.json``.
        model: the model file (``torch.save`` of ``{"model": state_dict}`` as FLARE's PT persistor writes it, or a
            bare state dict); default: the workspace's global model.
        which: ``"best"`` (the best global model by validation Dice; the last one where the job keeps no best) or
            ``"last"`` (the final global model).

    Raises:
        EvaluationError: nothing found, more than one candidate (pass ``model``), or an unknown ``which``.
    """
    if which not in MODEL_FILES:
        raise EvaluationError(f"which={which!r}: expected one of {sorted(MODEL_FILES)}")
    root = Path(job)
    config = client_config(root)
    if model is not None:
        return config, model_path(model)
    hint = "pass the model file (--model)"
    if root.is_dir():
        found = list(root.glob(f"**/app_server/{MODEL_FILES[which]}"))
        if not found and which == "best":
            found = list(root.glob(f"**/app_server/{MODEL_FILES['last']}"))
        return config, _unique(found, f"{MODEL_FILES[which]} (or {MODEL_FILES['last']})", root, hint)
    raise EvaluationError(f"{root} is a config file: {hint}")


def client_config(job: str | os.PathLike) -> Path:
    """The client config of ``job`` (a workspace, run folder, job folder or the config file itself); see :func:`locate`.

    Raises:
        EvaluationError: ``job`` does not exist or holds no (or more than one) client config.
    """
    root = Path(job)
    if not root.exists():
        raise EvaluationError(f"job path {root} does not exist")
    if root.is_file():
        return root
    if (root / "app" / "config" / CLIENT_CONFIG).is_file():
        return root / "app" / "config" / CLIENT_CONFIG
    return _unique(list(root.glob(f"**/app_server/config/{CLIENT_CONFIG}")) or list(root.glob(f"**/{CLIENT_CONFIG}"))[:1],
                   CLIENT_CONFIG, root, "pass the job folder or the config file")


def model_path(model: str | os.PathLike, where: str | os.PathLike | None = None, name: str | None = None) -> Path:
    """``model`` as a path (EvaluationError when it is not a file), or, when ``model`` is None, the one file called
    ``name`` under the folder ``where`` (EvaluationError when there is none or more than one)."""
    if model is None:
        root = Path(where)
        return _unique(list(root.glob(f"**/{name}")) if root.is_dir() else [], name, root, "pass the model file (--model)")
    path = Path(model)
    if path.is_dir():
        found = sorted(path.glob(f"**/{name}")) if name else []
        raise EvaluationError(f"model file {path} is a folder; pass a model file" + (
            f" (it holds {found[0]})" if len(found) == 1 else f" (e.g. a {name} under it)" if name else ""))
    if not path.is_file():
        raise EvaluationError(f"model file {path} does not exist")
    return path


@dataclass
class LoadedModel:
    """A job's 2D site (:class:`feduq.site.site2d.Site2D`: arguments checked, not started), its network with the saved
    weights, and provenance."""

    site: Any
    model: torch.nn.Module
    config_file: Path
    model_file: Path
    method: str
    notes: list[str] = field(default_factory=list)

    @property
    def task(self) -> str:
        return self.site.task_name


def load_model(config_file: Path, model_file: Path, device: str = "cpu", max_items: int | None = None) -> LoadedModel:
    """Rebuild the job's 2D segmentation site and network and load ``model_file`` into it (eval mode).

    The site is a :class:`feduq.site.site2d.Site2D` with the method's site part (the job's ``site_part`` argument, or its
    executor class's ``SITE_PART``), built from the job's arguments (:func:`feduq.parts.site.build_site_part`);
    no FLARE executor is made and nothing of FLARE runs.

    Raises:
        EvaluationError: the config is not a FedUQ 2D segmentation job (CT, classification), its executor cannot be
            imported or rejects its arguments, or the model's keys or shapes do not fit the network (the message
            names the model file, the network and the first offending keys).
    """
    try:
        spec = json.loads(Path(config_file).read_text())["executors"][0]["executor"]
        name = str(spec["path"]).rpartition(".")[2]
        cls = resolve_class(spec["path"])  # FedUQ's classes only: loading a job config never runs other code
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise EvaluationError(f"{config_file}: cannot read the site executor ({type(e).__name__}: {e})") from None
    from ..common.checks import method_part_class
    from ..parts.site import SitePart, build_site_part, job_site_part
    from .site2d import Site2D

    not_2d = (f"{config_file}: executor {spec['path']} is not a FedUQ 2D segmentation executor "
              "(CT and classification jobs are scored by their own final test task)")
    if not issubclass(cls, Site2D):
        raise EvaluationError(not_2d)
    args = {**spec.get("args", {}), "device": device}
    if max_items is not None:
        args["max_items"] = max_items
    args.pop("tracking_writer_id", None)  # FLARE's TensorBoard component: not here
    try:
        if args.get("site_class"):  # a method's own site (FedUAA's classification): its part says what it outputs
            cls = method_part_class(args.pop("site_class"), Site2D, "executor argument site_class",
                                    "feduq.methods.feduaa.classification.FedUAAClassificationSite")
        part_class = job_site_part(cls, args.pop("site_part", None))
    except ValueError as e:
        raise EvaluationError(f"{config_file}: {e}") from None
    if part_class.output != "segmentation":  # the method's site part says what its model outputs
        raise EvaluationError(not_2d)
    try:
        part, args = build_site_part(part_class, args)
        if args.get("configuration", "2d") != "2d":  # a volume job: nnU-Net's 3D network of the job's plan
            from .site3d import Site3D

            site = Site3D(method=part, **args)
        else:
            site = Site2D(method=part, **args)
    except (TypeError, ValueError) as e:
        raise EvaluationError(f"{config_file}: executor {name} rejects its arguments: {e}") from None
    try:
        task = get_task(site.task_name)
        model = site.build_network(task)
    except (TypeError, ValueError) as e:
        raise EvaluationError(f"{config_file}: executor {name} rejects its arguments: {e}") from None
    site.device = torch.device(device)
    site.num_classes = len(task.class_names)
    try:
        state = load_checkpoint(model_file, what="model file")  # weights_only: a crafted file never runs
    except CheckpointError as e:
        raise EvaluationError(str(e)) from None
    params = state.get("model", state) if isinstance(state, dict) else None
    if not isinstance(params, dict):
        raise EvaluationError(f"model file {model_file} holds no state dict (got {type(state).__name__})")
    try:
        check_finite(params, model_file)
    except CheckpointError as e:
        raise EvaluationError(str(e)) from None
    network = (f"nnU-Net {site.configuration} plan {site.plans.get('plans_name')}" if hasattr(site, "plans")
               else site.network_args.get("name", "fedevi_unet"))
    try:
        load_params(model, params, strict=True)
    except ValueError as e:
        raise EvaluationError(f"model file {model_file} does not fit the job's network {network!r} "
                              f"({config_file}): {e}") from None
    notes = [site.global_model_note] if site.global_model_note else []
    if not getattr(model, "paper_network", True):
        notes.append(f"network {network!r} is not the paper's")
    return LoadedModel(site, model.to(device).eval(), Path(config_file), Path(model_file),
                       "FedAvg" if type(part) is SitePart else type(part).__name__.removesuffix("Site"), notes)


def _rel(path: str, base: Path) -> str:
    return os.path.relpath(Path(path).resolve(), base.resolve())


def site_dataset(loaded: LoadedModel, *, site_dir: str | os.PathLike | None = None, site: str | None = None,
                 data_root: str | os.PathLike | None = None, split: str = "all", work_dir: str | os.PathLike,
                 max_items: int | None = None):
    """``(site name, MONAI dataset, center folder)`` for :func:`evaluate_site`, preprocessed as the job's test split.

    Args:
        site_dir: a site folder (``images/``, ``masks/``, ``labels.json``), anywhere; it need not be in any split
            file nor have trained.
        site / data_root: or a site of a data root (a center or a virtual site ``<center>-p<k>of<K>``).
        split: ``"all"`` (every image/mask pair of the folder) or a split of the site's own split file.
        work_dir: where the ``all`` split file and the link to ``site_dir`` are written (the output folder).

    Raises:
        EvaluationError: neither or both of ``site_dir``/``site``, an unknown split; DataError (a ValueError naming
            the site and file) for a folder without images/masks, an unreadable file, or mask values that do not fit
            the task's classes.
    """
    from ..sites.centers import site_center

    if (site_dir is None) == (site is None):
        raise EvaluationError("give exactly one of site_dir and site")
    if split not in SPLITS:
        raise EvaluationError(f"split={split!r}: expected one of {SPLITS}")
    task, work_dir = loaded.task, Path(work_dir)
    if site_dir is not None:
        site_dir = Path(site_dir).resolve()
        if not site_dir.is_dir():
            raise EvaluationError(f"site folder {site_dir} does not exist")
        site = center = site_dir.name
        if site_dir.parent.name == task_folder(task):
            root = site_dir.parent.parent
        else:  # any folder: link it into a data root of its own
            root = work_dir / ".data"
            link = root / task_folder(task) / center
            link.parent.mkdir(parents=True, exist_ok=True)
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(site_dir, target_is_directory=True)
    else:
        center = site_center(task, site)
        from ..data import resolve_data_root

        root = resolve_data_root(data_root, site=site)
    center_dir = Path(root) / task_folder(task) / center
    try:
        exe = loaded.site
        if getattr(exe, "configuration", "2d") != "2d":  # a 3D job's model scores whole volumes
            from .evaluation_3d import volume_cases

            return site, volume_cases(task, center_dir, site, split, max_items), center_dir
        common = dict(data_root=root, image_size=exe.image_size, resize=exe.resize, intensity=exe.intensity,
                      max_items=max_items, cache=False, site=site,
                      stage="val" if exe.test_protocol.resolution == "training" else None)  # the job's test protocol
        folder = SiteFolder.of(task, center, root, site)  # half an nnU-Net dataset: what it lacks, in one line
        if folder.task.layout == "nnunet" and not folder.nnunet:
            from ..sites.nnunet_raw import read_site_labels

            read_site_labels(center_dir, folder.task, site)  # its dataset.json is missing: named
        if split == "all" and folder.nnunet:  # every case
            split_file = work_dir / f"{site}.all.json"
            split_file.parent.mkdir(parents=True, exist_ok=True)
            split_file.write_text(json.dumps({"training": [], "validation": [],
                                              "testing": site_cases(task, root, center, site)}))
            dataset = get_dataset(task, center, "test", split_file=split_file, **common)
        elif split == "all":
            pairs = scan_center(root, task, center)
            split_file = work_dir / f"{site}.all.json"
            split_file.parent.mkdir(parents=True, exist_ok=True)
            items = [{"image": _rel(p["image"], center_dir), "label": _rel(p["label"], center_dir)} for p in pairs]
            split_file.write_text(json.dumps({"training": [], "validation": [], "testing": items}, indent=1))
            dataset = get_dataset(task, center, "test", split_file=split_file, **common)
        else:
            dataset = get_dataset(task, center, split, **common)
        if len(dataset) == 0:
            raise DataError(f"site {site!r}: no images in split {split!r} of {center_dir}")
    except DataError as e:  # a linked folder's errors name the folder given, not the link in the output folder
        if site_dir is None or Path(root) != work_dir / ".data":
            raise
        raise DataError(str(e).replace(str(center_dir), str(site_dir))) from None
    return site, dataset, center_dir


def stored_pixel_mm(center_dir: str | os.PathLike) -> dict[str, float]:
    """Image stem -> side of one **stored** pixel in mm, where ``provenance.csv`` records an in-plane spacing
    (``spacing_mm`` ``"sx x sy x sz"`` at the original size ``orig_width`` x ``orig_height``) that stays isotropic
    after the resize to the stored grid; other images are absent (their HD95 is reported in pixels only)."""
    path = Path(center_dir) / "provenance.csv"
    if not path.is_file():
        return {}
    out = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            try:
                sx, sy = (float(v) for v in row["spacing_mm"].lower().split("x")[:2])
                ow, oh = float(row["orig_width"]), float(row["orig_height"])
            except (KeyError, ValueError, TypeError):
                continue
            stem = Path(row.get("image_file") or row.get("file") or "").stem
            if stem and sx > 0 and sy > 0 and ow > 0 and oh > 0:
                out[stem] = (sx * ow, sy * oh)  # field of view in mm; divided by the stored size per image
    return out


def evaluate_site(loaded: LoadedModel, dataset, site: str, center_dir: Path | None = None,
                  maps_dir: str | os.PathLike | None = None, max_maps: int = 0,
                  predictions_dir: str | os.PathLike | None = None, case_level: bool = False) -> dict:
    """Score every image of ``dataset`` (batch 1) as the job's final test does, plus uncertainty quality.

    Returns:
        ``{"per_image": [row], "summary": row, "quality": {map name: PixelAccumulator.result}}``. A per-image row:
        ``site, image, dice, hd95_px, hd95_mm`` (NaN without a known spacing), per scored structure (class, or
        region of a region task: fundus' disc and cup) ``dice_<structure>`` and ``hd95_px_<structure>``,
        ``ece`` (MONAI, per image), ``error_rate`` and ``u_<map>`` (the image's mean of each uncertainty map).
        The summary: ``site, method, n_images, dice, dice_std, hd95_px, hd95_mm, ece_monai``, the primary map's
        ``ece15, brier, nll, auroc, auprc, spearman_rho, aurc, optimal_aurc`` (``uncertainty`` names it) and, for
        every map, ``auroc_<map>, auprc_<map>, spearman_rho_<map>, aurc_<map>``. Dice and ECE are fractions,
        HD95 in stored pixels and mm.

    With ``predictions_dir`` the scored class map of each image is written there as ``<stem>.png`` (uint8 class
    indices at the stored size, :mod:`feduq.predict`'s ``label.png``). With ``case_level`` (the review rule's
    calibration, :func:`feduq.review.rule.choose_rule`) each row also has the primary map's
    :func:`feduq.scores.case_scores.case_scores` (``u_mean``, ``u_foreground``, ``u_boundary``, ``area_fraction``) and
    the labelled structure's ``mask_fraction``, and the result ``"features"``: the pooled bottleneck features
    ``[N, C]`` float64 (:class:`feduq.scores.case_scores.BottleneckTap`), in the rows' order; on a volume site also
    ``"volumes"`` (one such row per case, scored in 3D as ``predict`` scores a volume:
    :class:`feduq.scores.volume_scores.VolumeCaseLevel`) and ``"volume_features"`` ``[cases, C]``. A 3D job's site
    (:func:`site_dataset` gives its cases) is scored by :func:`feduq.site.evaluation_3d.evaluate_volume_site`.
    """
    from monai.data import DataLoader

    from .evaluation_3d import VolumeCases, evaluate_volume_site

    if isinstance(dataset, VolumeCases):  # a 3D job's site (site_dataset): whole volumes, nnU-Net's way
        return evaluate_volume_site(loaded, dataset, site, case_level, predictions_dir, max_maps)
    exe = loaded.site
    spec = get_task(loaded.task)
    regions = spec.eval_regions or None
    columns = list(regions) if regions else list(spec.class_names[1:])
    unc_fn = exe.uncertainty_fn()
    fov = stored_pixel_mm(center_dir) if center_dir is not None else {}
    accs: dict[str, PixelAccumulator] = {}
    rows: list[dict] = []

    if predictions_dir is not None:
        Path(predictions_dir).mkdir(parents=True, exist_ok=True)

    cases = (CaseCollector(regions, exe.keep_largest_component, exe.test_protocol.connectivity, exe.resize == "letterbox")
             if spec.kind == "3d" else None)  # volumes: per case
    annotated = None if center_dir is None else annotated_classes(  # partial labels: scored on what it annotates
        spec.name, Path(center_dir).parent.parent, Path(center_dir).name, site)
    keep = scored_columns(spec.class_names, regions, annotated)[1]
    columns = [columns[i] for i in keep]

    def observe(batch, logits, probs, scores, pred):
        if cases is not None:
            cases(batch, logits, probs, scores, pred)
        maps = {k: v.float() for k, v in unc_fn(logits).items()}
        label = batch["label"].cpu()
        for name, m in maps.items():
            accs.setdefault(name, PixelAccumulator()).update(probs, label, m)
        wrong = (probs.argmax(1) != label[:, 0].long()).double()
        stem = image_stem(batch) or "?"
        dice, hd = scores["dice"][0][keep], scores["hd95"][0][keep]
        h, w = label.shape[-2:]
        mm = float("nan")
        if stem in fov and math.isclose(fov[stem][0] / w, fov[stem][1] / h, rel_tol=1e-3):
            mm = float(np.mean(hd)) * fov[stem][0] / w
        row = {"site": site, "image": stem, "dice": float(np.mean(dice)), "hd95_px": float(np.mean(hd)),
               "hd95_mm": mm, **{f"dice_{c}": float(d) for c, d in zip(columns, dice)},
               **{f"hd95_px_{c}": float(v) for c, v in zip(columns, hd)},
               "ece": float(np.mean(scores["ece"])), "error_rate": float(wrong.mean())}
        row.update({f"u_{k}": float(v.mean()) for k, v in maps.items()})
        if case_level:
            from ..scores.case_scores import case_scores
            from ..scores.metrics import region_label_map

            shown = region_label_map(pred, regions, exe.keep_largest_component, proto.connectivity) if regions else pred
            row.update({k: float(v) for k, v in case_scores(shown[0, 0], maps[exe.primary_uncertainty][0]).items()})
            row["mask_fraction"] = float((label[0, 0] > 0).double().mean())
            if volumes is not None:
                volumes.add(batch, len(rows), shown[0, 0], maps[exe.primary_uncertainty][0], label[0, 0])
        rows.append(row)
        if predictions_dir is not None:
            from PIL import Image

            from ..scores.metrics import region_label_map

            labels = region_label_map(pred, regions, exe.keep_largest_component, proto.connectivity) if regions else pred
            Image.fromarray(labels[0, 0].numpy().T.astype(np.uint8)).save(Path(predictions_dir) / f"{stem}.png")

    proto = exe.test_protocol
    tap = None
    volumes = VolumeCaseLevel() if case_level and cases is not None else None
    if case_level:
        from ..scores.case_scores import BottleneckTap

        tap = BottleneckTap(loaded.model, spec.in_channels, exe.image_size)
    try:
        with torch.no_grad():
            evaluate_test(loaded.model, DataLoader(dataset, batch_size=1), exe.device, len(spec.class_names),
                          exe.prob_fn, exe.keep_largest_component, regions=regions, observe=observe,
                          letterbox=exe.resize == "letterbox" and proto.resolution == "stored",
                          connectivity=proto.connectivity, empty_prediction=proto.empty_prediction)
        features = tap.take().double().cpu().numpy() if tap is not None and rows else None
    finally:
        if tap is not None:
            tap.close()
    dice = np.array([r["dice"] for r in rows])
    quality = {name: acc.result(image_dice=dice) for name, acc in accs.items()}
    primary = exe.primary_uncertainty if exe.primary_uncertainty in quality else next(iter(quality))
    q = quality[primary]
    summary = {"site": site, "method": loaded.method, "n_images": len(rows), "dice": float(dice.mean()),
               "dice_std": float(dice.std()), "hd95_px": float(np.mean([r["hd95_px"] for r in rows])),
               "hd95_mm": float(np.mean([r["hd95_mm"] for r in rows])),
               "ece_monai": float(np.mean([r["ece"] for r in rows])), "uncertainty": primary,
               "ece15": q["ece"], "brier": q["brier"], "nll": q["nll"], "auroc": q["auroc"], "auprc": q["auprc"],
               "spearman_rho": q.get("spearman_rho", float("nan")), "aurc": q["aurc"], "optimal_aurc": q["optimal_aurc"]}
    if cases is not None and rows:  # a volume site: Dice and HD95 (mm) per case, as its test task reports them
        metrics, _, units = volume_site_results(cases, np.array([r["ece"] for r in rows]), spec.class_names, regions,
                                                site, annotated)
        summary.update(dice=metrics["dice"], hd95_mm=metrics["hd95_mm"], n_cases=metrics["num_cases"],
                       dice_std=float(np.std([u["dice"] for u in units])))
        if volumes is not None:  # the review rule's cases: the volumes, as predict accepts or flags them
            volume_rows, volume_features = volumes.rows(site, units, features)
    for name, r in quality.items():
        summary.update({f"auroc_{name}": r["auroc"], f"auprc_{name}": r["auprc"],
                        f"spearman_rho_{name}": r.get("spearman_rho", float("nan")), f"aurc_{name}": r["aurc"]})
    if maps_dir is not None and max_maps > 0:
        from ..scores.maps import save_uncertainty_maps

        save_uncertainty_maps(loaded.model, DataLoader(dataset, batch_size=1), exe.device, exe.prob_fn, unc_fn,
                              maps_dir, max_maps, letterbox=exe.resize == "letterbox", title=f"{site} {loaded.method}")
    return {"per_image": rows, "summary": summary, "quality": quality,
            **({"features": features} if case_level else {}),
            **({"volumes": volume_rows, "volume_features": volume_features} if volumes is not None and rows else {})}


def evaluate_job(job, *, out, site_dirs=(), sites=(), data_root=None, split="all", model=None, which="best",
             device="cpu", max_items=None, maps=4, save_predictions=False, force=False) -> tuple[list[dict], dict]:
    """Score one model on several sites (``feduq evaluate``): ``per_image.csv``, ``per_site.csv``, a reliability
    diagram per site, ``risk_coverage.png``, uncertainty maps (``maps/``) and, with ``save_predictions``, the label
    maps (``predictions/``) in ``out``.

    The output folder is checked first (:func:`feduq.outputs.check_output_folder`: never the job's config, the model, a site
    folder or the data root; an existing one only when FedUQ wrote every file in it, or with ``force``, which keeps
    the other files) and written all at once (:func:`feduq.outputs.staged_folder`): a failure leaves nothing.

    Returns:
        ``(per-site rows, {site: feduq.site.evaluation.evaluate_site result})``.

    Raises:
        feduq.site.evaluation.EvaluationError / feduq.data.DataError: bad job, model or site (named).
    """
    import warnings

    from ..outputs import check_output_folder, staged_folder

    warnings.filterwarnings("ignore", message=".*always_return_as_numpy.*")  # MONAI's own HD95 call
    names = [Path(d).expanduser().resolve().name for d in site_dirs] + [str(s) for s in sites]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # one site's tables, maps and reliability diagram would be written twice, the first one lost
        raise EvaluationError(f"site {twice[0]!r} is named twice (--site-dir folders are named by their folder, "
                              f"--site by the site); score each site once")
    config, model_file = locate(job, model, which)
    inputs = {"job config": config, "model file": model_file, "data root": data_root,
              **{f"site folder {d}": d for d in site_dirs}}
    final = check_output_folder(out, inputs, "feduq evaluate", force=force)
    with staged_folder(final, overwrite=True, what="feduq evaluate", marker="feduq evaluate") as out:
        return _evaluate_job(config, model_file, out, site_dirs, sites, data_root, split, device, max_items, maps,
                         save_predictions)


def _evaluate_job(config, model_file, out, site_dirs, sites, data_root, split, device, max_items, maps, save_predictions):
    import numpy as np

    from ..scores.tables import write_rows
    from ..scores.uncertainty_quality import plot_reliability, plot_risk_coverage

    loaded = load_model(config, model_file, device=device)
    for note in loaded.notes:
        print(f"note: {note}")
    print(f"{loaded.method} model {model_file} (task {loaded.task}, uncertainty "
          f"{loaded.site.primary_uncertainty!r})")
    per_image, per_site, curves, results = [], [], {}, {}
    targets = [dict(site_dir=d) for d in site_dirs] + [dict(site=s, data_root=data_root) for s in sites]
    if not targets:
        raise ValueError("name at least one site (--site-dir or --site)")
    for target in targets:
        name, dataset, center_dir = site_dataset(loaded, split=split, work_dir=out, max_items=max_items, **target)
        result = evaluate_site(loaded, dataset, name, center_dir, maps_dir=out / "maps" / name, max_maps=maps,
                               predictions_dir=out / "predictions" / name if save_predictions else None)
        row = {**result["summary"], "split": split, "model_file": str(model_file), "note": "; ".join(loaded.notes)}
        results[name] = result
        per_image += result["per_image"]
        per_site.append(row)
        q = result["quality"][row["uncertainty"]]
        plot_reliability(q["bins"], out / f"reliability_{name}.png", f"{loaded.method} {name}")
        curves[name] = (q["coverage"], q["risk"])
        if "n_cases" in row:  # volumes: Dice and HD95 per case
            slices = f" ({row['n_images']} slices)" if row["n_images"] != row["n_cases"] else ""  # 2D: slice-wise
            head = f"{row['n_cases']} cases{slices}, Dice per case {100 * row['dice']:.2f}%, HD95 "
            head += f"{row['hd95_mm']:.2f} mm"
        else:
            head = (f"{row['n_images']} images, Dice {100 * row['dice']:.2f}%, HD95 {row['hd95_px']:.2f} px"
                    + ("" if np.isnan(row["hd95_mm"]) else f" ({row['hd95_mm']:.2f} mm)"))
        print(f"{name}: {head}"
              + f", pooled ECE (15 bins) {row['ece15']:.4f}, AUROC({row['uncertainty']}) {row['auroc']:.3f}, AURC {row['aurc']:.4f}")
    write_rows(out / "per_image.csv", per_image)
    write_rows(out / "per_site.csv", per_site)
    plot_risk_coverage(curves, out / "risk_coverage.png", f"{loaded.method}: risk-coverage per site")
    return per_site, results
