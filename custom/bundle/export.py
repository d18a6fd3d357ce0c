"""Export a trained FedUQ 2D segmentation model as a MONAI Bundle that runs without FedUQ's code.

``feduq predict --job WS --export-bundle DIR`` writes::

    DIR/configs/metadata.json    MONAI's bundle metadata (network input and output, labels) + FedUQ's provenance
    DIR/configs/inference.json   MONAI's inference config: the job's preprocessing, the network, the job's
                                 post-processing, label maps and the method's own uncertainty map written per image
    DIR/models/model.ts          the network as TorchScript (MONAI's convert_to_torchscript: scripted, else traced)
    DIR/models/head.ts           logits -> [probabilities (C), uncertainty maps (K)], TorchScript (the method's
                                 prob_fn and uncertainty_fn, e.g. FedEvi's Dirichlet maps)
    DIR/docs/README.md           task, labels, input handling, the training federation, the uncertainty output
    DIR/scripts/bundle_inputs.py the input check the runner runs first (feduq.bundle.scripts.bundle_inputs: a missing or
                                 empty --dataset_dir, or an image that does not decode, stops it in one line, exit 2)
    DIR/scripts/bundle_regions.py a task scored by nested regions: each region's largest component, painted back
                                 (feduq.bundle.scripts.bundle_regions, predict's region_label_map)
    DIR/configs/review.json      with a review rule stored for the model (predict --calibrate): the rule, applied per
    DIR/scripts/case_scores.py   image by FedUQ's own case-score code (a copy of feduq.scores.case_scores), and
    DIR/models/features.ts       the network's pooled bottleneck features for the rule's familiarity part

and runs with MONAI's own bundle runner (``pip install monai fire pytorch-ignite``)::

    python -m monai.bundle run --config_file DIR/configs/inference.json --bundle_root DIR \\
        --dataset_dir IMAGES --output_dir OUT

giving ``OUT/<image>_seg.png`` (uint8 class indices, the image's own width x height: the label maps of
:mod:`feduq.predict`) and ``OUT/<image>_uncertainty_<map>.png`` (the method's own map as 16-bit PNG,
``value = png / 65535 * scale`` with the scale of :func:`feduq.predict.files.map_scale`: ln C nats, or 1 for
vacuity; MONAI's writer truncates where :mod:`feduq.predict` rounds, so the two differ by at most 1 in 65535), and
with a review rule ``OUT/<image>_review.json``: the decision, its reasons and the case scores ``predict`` writes in
``predictions.csv`` (:func:`feduq.scores.case_scores.review_record`).

Preprocessing mirrors :func:`feduq.io.transforms.make_image_transforms` with MONAI transforms (``Resized`` with
``size_mode="longest"`` + ``SpatialPadd`` for the letterbox), and the network grid is mapped back to the image by
MONAI's ``Invertd``, as :func:`feduq.scores.scoring.to_stored_grid` does (bilinear logits); then the argmax and MONAI's
``KeepLargestConnectedComponentd`` as :func:`feduq.scores.scoring.segment`. A task scored by nested regions (the built-in
fundus task's disc = rim + cup, a declared task in nnU-Net's region syntax) keeps each region's largest component and
paints the regions back, widest first, as ``predict`` does (:func:`feduq.bundle.scripts.bundle_regions.paint_regions`, carried
as ``scripts/bundle_regions.py``; the per-class reduction would drop a rim arc the cup cuts off). The official FedEvi
``whole_image`` empty-prediction quirk is not exported (refused with one line). ``docs/README.md`` is written by
:func:`feduq.bundle.readme.readme`.

A declared 2D task (:mod:`feduq.tasks.declared`) exports the same way, but its inputs are named as nnU-Net names them
(``IMAGES/<case>_0000<ending>``, ``<case>_0001<ending>``, ... one file per channel), read and normalised by a copy of
the sites' own reader (``scripts/channel_io.py``, :mod:`feduq.io.channel_io`), and each label map is written as
``OUT/<case><ending>`` holding the task's label values, as nnU-Net's predictor names it. A declared task of NIfTI
volumes exports a bundle that reads each case's channel files, reorients them to LPS and normalises them as the sites
did, runs the network slice by slice with the same per-plane preprocessing and post-processing (a copy of
:mod:`feduq.bundle.scripts.bundle_volumes`), and writes ``OUT/<case>.nii.gz`` (label values) and
``OUT/<case>_uncertainty_<map>.nii.gz`` in the input's shape and affine: the volumes ``predict`` writes (no review
decision for volumes yet).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from ..common.provenance import job_provenance
from ..predict.files import PredictError, map_scale

__all__ = ["export_bundle", "inference_config"]

TOOL = "feduq export-bundle"
MODALITY = {"polyp": "endoscopy", "fundus": "fundus photograph", "prostate": "MRI (T2, axial slices)",
            "skin": "dermoscopy", "breast": "ultrasound"}


class _Head(torch.nn.Module):
    """``logits [B, C, H, W] -> [B, C + K, H, W]``: the method's probabilities, then its K uncertainty maps."""

    def __init__(self, prob_fn, uncertainty_fn):
        super().__init__()
        self.prob_fn, self.uncertainty_fn = prob_fn, uncertainty_fn

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        maps = self.uncertainty_fn(logits)
        return torch.cat([self.prob_fn(logits).float()] + [m.float()[:, None] for m in maps.values()], dim=1)


def _features_module(model: torch.nn.Module, in_channels: int, image_size: int, example: torch.Tensor):
    """``image [B, in_channels, S, S] -> pooled bottleneck features [B, F]`` (float32) as TorchScript: the network's
    forward traced with :class:`feduq.scores.case_scores.BottleneckTap`'s hook, so the bundle's features are predict's."""
    from ..scores.case_scores import BottleneckTap

    tap = BottleneckTap(model, in_channels, image_size)

    class _Features(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.net(x)
            return tap.take()

    import warnings

    try:
        with warnings.catch_warnings():  # shape checks of the network traced as constants: the input size is fixed
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            return torch.jit.trace(_Features().eval(), example, check_trace=False)
    finally:
        tap.close()


def _intensity_steps(intensity: str) -> list[dict]:
    if intensity == "minmax":
        return [{"_target_": "ScaleIntensityd", "keys": "image", "minv": 0.0, "maxv": 1.0}]
    if intensity == "max":  # feduq.io.transforms._DivideByMax
        return [{"_target_": "Lambdad", "keys": "image", "func": "$lambda x: x / x.max() if float(x.max()) > 0 else x"}]
    return []  # raw: the stored 0..255 values


def inference_config(image_size: int, in_channels: int, resize: str, intensity: str, num_classes: int,
                     keep_largest_component: bool, connectivity: int, map_names: list[str], review: bool = False,
                     familiarity: bool = False, declared: dict | None = None, regions: list | None = None) -> dict:
    """The bundle's ``inference.json`` (a MONAI bundle config dict; see the module doc); ``review``: the bundle
    carries a review rule (``configs/review.json``, ``scripts/case_scores.py``), ``familiarity``: with a
    familiarity part (``models/features.ts``); ``declared``: a declared 2D task's ``{"file_ending",
    "normalization": [scheme per channel], "label_values": [value per class]}`` (its inputs named as nnU-Net names
    them, read and normalised by ``scripts/channel_io.py``, each label map ``<case><ending>`` of label values);
    ``regions``: the class indices of each nested region (e.g. fundus ``[[1, 2], [2]]``) when the label map is painted
    region by region (``scripts/bundle_regions.py``), else None (the largest component per class)."""
    S = int(image_size)
    # feduq.io.transforms.gray_to_8bit's scaling of a 16-bit gray image, then RGB (Pillow's convert alone clips at
    # 255); what gray_to_8bit refuses (float, negative or > 65535) cannot come from the PNG/JPEG/BMP files read here
    converter = ("$lambda im: im if im.mode == 'RGB' else (Image.fromarray(np.rint(np.asarray(im, dtype=np.float64) "
                 "* (255.0 / 65535.0)).astype(np.uint8), 'L') if im.mode.startswith('I;16') or (im.mode == 'I' and "
                 "int(np.asarray(im).max(initial=0)) > 255) else im).convert('RGB')" if in_channels == 3 else
                 "$lambda im: im if im.mode in ('L', 'I', 'I;16', 'F') else im.convert('L')")
    load = [{"_target_": "LoadImaged", "keys": "image", "reader": "PILReader", "converter": converter,
             "image_only": True},
            {"_target_": "EnsureChannelFirstd", "keys": "image"}]
    if declared is not None:  # the channel files of a case, read and normalised as the sites did
        E = declared["file_ending"]
        load = [{"_target_": "Lambdad", "keys": "image",
                 "func": f"$lambda fs: monai.data.MetaTensor(torch.as_tensor(@channel_io.read_case_2d(fs, "
                         f"{[list(n) for n in declared['normalization']]!r})), meta={{'filename_or_obj': "
                         f"os.path.join(os.path.dirname(fs[0]), @channel_io.case_of(fs[0], {E!r}) + {E!r})}})"}]
    pre = load + _plane_steps(S, resize, intensity)
    if declared is not None and declared.get("kind") == "3d":
        return _volume_config(pre[len(load):], num_classes, keep_largest_component, connectivity, map_names, declared,
                              regions)
    return _image_config(pre, num_classes, keep_largest_component, connectivity, map_names, review, familiarity,
                         declared, regions)


def _plane_steps(S: int, resize: str, intensity: str) -> list[dict]:
    """A loaded plane ``[C, W, H]``'s steps to the network's input: the 8-bit mark, resize, intensity, 8-bit
    compaction (:func:`feduq.io.transforms.make_image_transforms`' test stage)."""
    pre = [  # feduq.io.transforms._Mark8Bit: does the stored image hold 8-bit values
           {"_target_": "Lambdad", "keys": "image",
            "func": "$lambda x: x.meta.update(feduq_8bit=bool(x.min() >= 0 and x.max() <= 255 "
                    "and (x == x.round()).all())) or x"}]
    if resize == "letterbox":
        pre += _intensity_steps(intensity) + [
            {"_target_": "Resized", "keys": "image", "spatial_size": S, "size_mode": "longest", "mode": "bilinear",
             "anti_aliasing": True},
            {"_target_": "SpatialPadd", "keys": "image", "spatial_size": [S, S], "method": "symmetric"}]
    else:
        pre += [{"_target_": "Resized", "keys": "image", "spatial_size": [S, S], "mode": "bilinear",
                 "anti_aliasing": True}] + _intensity_steps(intensity)
    # feduq.io.transforms._Compact + _Expand: the resampled image of an 8-bit file kept to 8 bits, as a site keeps it
    scale = 1.0 if intensity == "raw" else 255.0
    pre += [{"_target_": "Lambdad", "keys": "image",
             "func": f"$lambda x: (x * {scale}).round().clamp(0, 255) / {scale} if x.meta.get('feduq_8bit') else x"},
            {"_target_": "EnsureTyped", "keys": "image", "dtype": "$torch.float32"}]
    return pre


def _common(declared, regions=None) -> dict:
    """The config entries every export shares: folders, device, the networks, the loader, the evaluator."""
    return {
        "bundle_root": ".",
        "output_dir": "$os.path.join(@bundle_root, 'eval')",
        "dataset_dir": "$os.path.join(@bundle_root, 'images')",
        "device": "$torch.device('cuda:0' if torch.cuda.is_available() else 'cpu')",
        "network_def": "$torch.jit.load(os.path.join(@bundle_root, 'models', 'model.ts'), map_location=@device)",
        "network": "$@network_def.to(@device).eval()",
        "head": "$torch.jit.load(os.path.join(@bundle_root, 'models', 'head.ts'), map_location='cpu').eval()",
        "dataloader": {"_target_": "DataLoader", "dataset": "@dataset", "batch_size": 1, "shuffle": False,
                       "num_workers": 0},
        "evaluator": {"_target_": "SupervisedEvaluator", "device": "@device", "val_data_loader": "@dataloader",
                      "network": "@network", "inferer": "@inferer", "postprocessing": "@postprocessing",
                      "amp": False},
        "initialize": ["$monai.utils.set_determinism(seed=0)"],
        "run": ["$@evaluator.run()"],
        **({"channel_io": "$importlib.import_module('scripts.channel_io')"} if declared is not None else {}),
        **({"regions_post": "$importlib.import_module('scripts.bundle_regions')"} if regions else {}),
    }


def _cases(E: str) -> str:
    """The datalist expression of nnU-Net-named inputs: per case its channel files ``<case>_XXXX<E>``, in order."""
    return (f"$[sorted(glob.glob(glob.escape(f[:-len('_0000{E}')]) + '_[0-9][0-9][0-9][0-9]{E}')) for f in "
            f"sorted(glob.glob(os.path.join(@dataset_dir, '*_0000{E}')))]")


def _volume_config(plane: list[dict], num_classes: int, keep_largest_component: bool, connectivity: int,
                   map_names: list[str], declared: dict, regions: list | None = None) -> dict:
    """``inference.json`` of a declared task of volumes: ``scripts/bundle_volumes.py`` reads each case (LPS,
    normalised), runs the network slice by slice with ``plane`` (the 2D steps) and writes the label and uncertainty
    volumes in the input's geometry."""
    E, norm = declared["file_ending"], [list(n) for n in declared["normalization"]]
    return {
        "imports": ["$import glob", "$import os", "$import numpy as np", "$import torch", "$import monai",
                    "$import importlib"],
        **_common(declared, regions),
        "volumes": "$importlib.import_module('scripts.bundle_volumes')",
        "inputs": "$importlib.import_module('scripts.bundle_inputs')",
        "datalist": "$@inputs.checked(" + _cases(E)[1:] + f", @dataset_dir, 'cases named <case>_0000{E}', False)",
        "plane_preprocessing": {"_target_": "Compose", "transforms": plane},
        "preprocessing": {"_target_": "Compose", "transforms": [
            {"_target_": "Lambdad", "keys": "image", "func": f"$lambda fs: @volumes.read_case(fs, {norm!r}, {E!r})"}]},
        "dataset": {"_target_": "Dataset", "data": "$[{'image': f} for f in @datalist]", "transform": "@preprocessing"},
        "inferer": f"$@volumes.PlaneInferer(@plane_preprocessing, @head, {num_classes}, {bool(keep_largest_component)}, "
                   f"{int(connectivity)}, {regions!r})",
        "postprocessing": {"_target_": "Compose", "transforms": [
            {"_target_": "Lambda", "func": f"$lambda d: [@volumes.save_case(d['pred'], d['image'].meta, @output_dir, "
                                           f"{list(declared['label_values'])!r}, {map_names[0]!r}), d][1]"}]},
    }


def _image_config(pre: list[dict], num_classes: int, keep_largest_component: bool, connectivity: int,
                  map_names: list[str], review: bool, familiarity: bool, declared, regions=None) -> dict:
    """``inference.json`` of 2D images (a built-in task's files, or a declared 2D task's nnU-Net-named ones)."""
    # the review rule's familiarity: the pooled bottleneck features of the network's input (predict's BottleneckTap)
    post = [{"_target_": "Lambda", "func": "$lambda d: dict(d, features=@features_net(d['image'].as_tensor()[None]"
                                           ".float().to(@device))[0].double().cpu().numpy())"}] if familiarity else []
    post += [
        {"_target_": "Invertd", "keys": "pred", "transform": "@preprocessing", "orig_keys": "image",
         "nearest_interp": False, "to_tensor": True},
        {"_target_": "Lambdad", "keys": "pred",
         "func": "$lambda x: monai.data.MetaTensor(@head(x.as_tensor()[None].float().cpu())[0], meta=x.meta)"},
        {"_target_": "CopyItemsd", "keys": "pred", "names": "uncertainty"},
        {"_target_": "Lambdad", "keys": "uncertainty", "func": f"$lambda x: x[{num_classes}:{num_classes + 1}]"},
        {"_target_": "Lambdad", "keys": "pred", "func": f"$lambda x: x[:{num_classes}]"},
        {"_target_": "AsDiscreted", "keys": "pred", "argmax": True},
    ]
    if regions:  # nested regions: each region's largest component, painted back widest first (predict's)
        post.append({"_target_": "Lambdad", "keys": "pred", "func": f"$lambda x: @regions_post.paint_regions(x, "
                                                                    f"{regions!r}, {int(connectivity)})"})
    elif keep_largest_component:
        post.append({"_target_": "KeepLargestConnectedComponentd", "keys": "pred",
                     "applied_labels": list(range(1, num_classes)), "is_onehot": False,
                     "connectivity": 1 if connectivity == 4 else 2})
    values = list(declared["label_values"]) if declared is not None else list(range(num_classes))
    if values != list(range(num_classes)):  # a declared task's label values (its regions' atomic values)
        post.append({"_target_": "Lambdad", "keys": "pred", "func": f"$lambda x: torch.as_tensor({values!r}, "
                                                                    "dtype=x.dtype)[x.long()]"})
    post += [  # a declared task's label map is <case><ending>, as nnU-Net's predictor names it
        {"_target_": "SaveImaged", "keys": "pred", "output_dir": "@output_dir",
         "output_postfix": "" if declared is not None else "seg",
         "output_ext": declared["label_ending"] if declared is not None else ".png",
         "output_dtype": "$np.uint8" if max(values) < 256 else "$np.uint16", "resample": False, "scale": None,
         "separate_folder": False, "writer": "PILWriter", "print_log": False}]
    if review:  # <image>_review.json: predict's decision, reasons and case scores (scripts/case_scores.review_record)
        post.append({"_target_": "Lambda", "func": "$lambda d: [@write_review(d), d][1]"})
    post += [
        {"_target_": "Lambdad", "keys": "uncertainty", "func": f"$lambda x: x / {map_scale(map_names[0], num_classes)!r}"},
        {"_target_": "SaveImaged", "keys": "uncertainty", "output_dir": "@output_dir",
         "output_postfix": f"uncertainty_{map_names[0]}", "output_ext": ".png", "output_dtype": "$np.uint16",
         "resample": False, "scale": 65535, "separate_folder": False, "writer": "PILWriter", "print_log": False},
    ]
    extra = {}
    if review:
        extra = {"review_rule": "$json.load(open(os.path.join(@bundle_root, 'configs', 'review.json')))",
                 "case_scores": "$importlib.import_module('scripts.case_scores')",
                 "write_review": "$lambda d: pathlib.Path(@output_dir, os.path.splitext(os.path.basename(str(d['image']"
                                 ".meta['filename_or_obj'])))[0] + '_review.json').write_text(json.dumps("
                                 "@case_scores.review_record(d['pred'].as_tensor()[0], d['uncertainty'].as_tensor()[0], "
                                 "@review_rule, d.get('features')), indent=1) + chr(10))"}
    if familiarity:
        extra["features_net"] = ("$torch.jit.load(os.path.join(@bundle_root, 'models', 'features.ts'), "
                                 "map_location=@device).eval()")
    return {
        "imports": ["$import glob", "$import os", "$import numpy as np", "$import torch", "$import monai",
                    "$from PIL import Image", "$import importlib"] + (["$import json", "$import pathlib"] if review
                                                                      else []),
        **_common(declared, regions),
        "inputs": "$importlib.import_module('scripts.bundle_inputs')",
        "datalist": "$@inputs.checked(sorted(f for e in ('png', 'jpg', 'jpeg', 'bmp', 'PNG', 'JPG', 'JPEG') "
                    "for f in glob.glob(os.path.join(@dataset_dir, '*.' + e))), @dataset_dir)" if declared is None else
                    "$@inputs.checked(" + _cases(declared["file_ending"])[1:] + ", @dataset_dir, "
                    f"'cases named <case>_0000{declared['file_ending']}', "
                    f"{declared['file_ending'].lower() in ('.png', '.jpg', '.jpeg', '.bmp')})",
        "preprocessing": {"_target_": "Compose", "transforms": pre},
        "dataset": {"_target_": "Dataset", "data": "$[{'image': f} for f in @datalist]", "transform": "@preprocessing"},
        "inferer": {"_target_": "SimpleInferer"},
        "postprocessing": {"_target_": "Compose", "transforms": post},
        **extra,
    }


def export_bundle(loaded, out: str | os.PathLike, force: bool = False) -> Path:
    """Write ``loaded``'s model as a MONAI Bundle into ``out`` (see the module doc), all at once.

    Raises:
        PredictError: the ``whole_image`` empty-prediction protocol, ``resize="stretch_bicubic"`` (no MONAI transform
            resizes as PIL's bicubic filter does), or a declared task of volumes not in NIfTI.
        feduq.outputs.OutputFolderError: ``out`` overlaps the model or the job, or holds files FedUQ did not write.
    """
    import monai
    from monai.networks.utils import convert_to_torchscript

    from ..data import get_task
    from ..outputs import check_output_folder, staged_folder
    from .readme import readme
    from ..predict.planes import Predictor
    from ..review.rule import load_threshold

    site, spec = loaded.site, get_task(loaded.task)
    # nnU-Net-named inputs and label values (None: a task in FedUQ's own layout: image files and class indices)
    d = spec if spec.layout == "nnunet" else None
    proto = site.test_protocol
    if d is not None and d.kind == "3d" and not d.file_ending.startswith(".nii"):
        raise PredictError(f"task {spec.name!r} declares {d.file_ending} volumes; the bundle reads NIfTI "
                           "(predict reads NRRD and MHA)")
    # nested regions (fundus' disc = rim + cup, nnU-Net's region syntax): predict's own choice of the tasks whose
    # label map it paints region by region (feduq.scores.metrics.region_label_map), so the bundle paints the same ones
    regions = Predictor(loaded, 1).regions or None
    painted = [list(c) for c in regions.values()] if regions and site.keep_largest_component else None
    if proto.empty_prediction != "empty":
        raise PredictError(f"test_protocol.empty_prediction={proto.empty_prediction!r} (the official FedEvi quirk) is "
                           f"not exported; the bundle scores an empty prediction as empty")
    if site.resize not in ("stretch", "letterbox"):  # the bundle's MONAI transforms have no PIL bicubic resize
        raise PredictError(f"resize={site.resize!r} (PIL's bicubic filter) is not exported; the bundle resizes with "
                           "MONAI's bilinear Resized, so it would not be the model's own preprocessing "
                           "(use feduq predict)")
    out = check_output_folder(out, {"model file": loaded.model_file, "job config": loaded.config_file}, TOOL, force)
    C, S = len(spec.class_names), int(site.image_size)
    unc = site.uncertainty_fn()
    names = list(unc(torch.zeros(1, C, 2, 2)).keys())
    primary = site.primary_uncertainty
    ordered = [primary] + [n for n in names if n != primary]
    example = torch.rand(1, spec.in_channels, S, S)
    model = loaded.model.to("cpu").eval()
    head = _Head(site.prob_fn, lambda z: {k: unc(z)[k] for k in ordered})
    review = load_threshold(loaded.model_file)
    if review is not None and review.certificate is not None and "cases" in review.certificate:
        # a rule certified before the per-patient certificate lists its cases by file name (hospital names may hold patient numbers):
        # what leaves the site carries the counts only
        review.certificate = {k: v for k, v in review.certificate.items() if k != "cases"}
    if d is not None and d.kind == "3d":
        review = None  # the volume bundle writes label and uncertainty volumes, no review decision (predict does)
    provenance = job_provenance(Path(loaded.config_file))
    with staged_folder(out, overwrite=True, what=TOOL, marker=TOOL) as stage:
        for sub in ("configs", "models", "docs"):
            (stage / sub).mkdir()
        try:
            ts = convert_to_torchscript(model, verify=True, inputs=[example], rtol=1e-4, atol=1e-5)
        except Exception:  # noqa: BLE001 - a network torch cannot script is traced at the job's input size
            ts = convert_to_torchscript(model, verify=True, inputs=[example], use_trace=True, rtol=1e-4, atol=1e-5)
        torch.jit.save(ts, str(stage / "models" / "model.ts"))
        torch.jit.save(torch.jit.trace(head.eval(), torch.randn(1, C, 7, 5), check_trace=False),
                       str(stage / "models" / "head.ts"))
        if review is not None:  # the rule, and the code that applies it as predict does (a copy of FedUQ's own)
            from ..scores import case_scores

            (stage / "configs" / "review.json").write_text(json.dumps(asdict(review), indent=1) + "\n")
            (stage / "scripts").mkdir(exist_ok=True)
            (stage / "scripts" / "__init__.py").write_text("")
            shutil.copyfile(case_scores.__file__, stage / "scripts" / "case_scores.py")
        if review is not None and review.familiarity is not None:
            torch.jit.save(_features_module(model, spec.in_channels, S, example), str(stage / "models" / "features.ts"))
        from .scripts import bundle_inputs  # the input check MONAI's runner runs first (a copy of FedUQ's own)

        (stage / "scripts").mkdir(exist_ok=True)
        (stage / "scripts" / "__init__.py").write_text("")
        shutil.copyfile(bundle_inputs.__file__, stage / "scripts" / "bundle_inputs.py")
        if painted:  # each region's largest component, painted back (predict's region_label_map, MONAI only)
            from .scripts import bundle_regions

            shutil.copyfile(bundle_regions.__file__, stage / "scripts" / "bundle_regions.py")
        declared = None
        if d is not None:  # nnU-Net-named inputs read and normalised by the sites' own reader (a copy of it)
            from ..io import channel_io

            (stage / "scripts").mkdir(exist_ok=True)
            (stage / "scripts" / "__init__.py").write_text("")
            shutil.copyfile(channel_io.__file__, stage / "scripts" / "channel_io.py")
            if d.kind == "3d":  # volumes slice by slice, written back in the input's geometry
                from .scripts import bundle_volumes

                shutil.copyfile(bundle_volumes.__file__, stage / "scripts" / "bundle_volumes.py")
            declared = {"file_ending": d.file_ending, "label_ending": d.label_ending,
                        "normalization": [list(n) for n in d.normalization],
                        "label_values": list(d.label_values), "kind": d.kind,
                        "channel_names": list(d.channel_names)}
        intensity = "raw" if d is not None and d.normalised_at_read else site.intensity  # as the sites' pipeline
        config = inference_config(S, spec.in_channels, site.resize, intensity, C,
                                  site.keep_largest_component, proto.connectivity, ordered, review is not None,
                                  review is not None and review.familiarity is not None, declared, painted)
        (stage / "configs" / "inference.json").write_text(json.dumps(config, indent=1) + "\n")
        from ..predict.rows import label_meanings, structures

        labels = label_meanings(spec.class_names, structures(spec.class_names, spec.eval_regions))
        values = list(d.label_values) if d is not None else list(range(C))  # written value of each class index
        meta = {
            "schema": "https://github.com/Project-MONAI/MONAI-extra-test-data/releases/download/0.8.1/"
                      "meta_schema_20220324.json",
            "version": "0.1.0",
            "changelog": {"0.1.0": f"exported by FedUQ from {Path(loaded.model_file).name}"},
            "monai_version": monai.__version__, "pytorch_version": torch.__version__.split("+")[0],
            "numpy_version": np.__version__, "required_packages_version": {"fire": "", "pytorch-ignite": ""},
            "name": f"FedUQ {loaded.method} {loaded.task} segmentation",
            "task": f"{loaded.task} segmentation ({', '.join(spec.class_names[1:])})",
            "description": f"{loaded.method} model trained by federated learning with FedUQ; outputs label maps and "
                           f"the method's own uncertainty ({primary}).",
            "authors": "FedUQ", "copyright": "see the training federation's data agreements",
            "network_data_format": {
                "inputs": {"image": {"type": "image", "format": "magnitude", "modality": MODALITY.get(loaded.task, ""),
                                     "num_channels": spec.in_channels, "spatial_shape": [S, S], "dtype": "float32",
                                     "value_range": ([] if d is not None and d.normalised_at_read else
                                                     [0, 1] if intensity != "raw" else [0, 255]),
                                     "is_patch_data": False,
                                     "channel_def": {str(i): c for i, c in enumerate(
                                         d.channel_names if d is not None else "RGB" if spec.in_channels == 3
                                         else ["gray"])}}},
                "outputs": {"pred": {"type": "image", "format": "segmentation", "num_channels": C,
                                     "spatial_shape": [S, S], "dtype": "float32", "value_range": [],
                                     "is_patch_data": False, "channel_def": labels}}},
            "feduq": {"method": loaded.method, "task": loaded.task, "image_size": S, "resize": site.resize,
                      "intensity": site.intensity, "keep_largest_component": bool(site.keep_largest_component),
                      "connectivity": proto.connectivity, "uncertainty_maps": ordered, "primary_uncertainty": primary,
                      "uncertainty_scale": {n: map_scale(n, C) for n in ordered}, **provenance,
                      "label_values": values,  # nnU-Net's regions by their values: fundus disc = [1, 2], cup = [2]
                      **({"regions": {n: [values[c] for c in cs] for n, cs in regions.items()}} if regions else {}),
                      "review_threshold": None if review is None else review.__dict__},
        }
        (stage / "configs" / "metadata.json").write_text(json.dumps(meta, indent=1) + "\n")
        (stage / "docs" / "README.md").write_text(readme(loaded, spec, S, ordered, provenance, review, declared,
                                                         regions))
    return out

