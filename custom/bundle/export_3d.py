"""Export a volume job's 3D model (``configuration 3d_fullres``) as a MONAI Bundle that runs without FedUQ's code.

``feduq predict --job WS --export-bundle DIR`` on a 3D job writes::

    DIR/configs/inference.json   MONAI's inference config: nnU-Net's preprocessing of each case, MONAI's
                                 SlidingWindowInferer (the plan's patch, overlap 0.5, Gaussian), the method's
                                 probabilities and uncertainty, the volumes written on the input's grid
    DIR/configs/plans.json       the federation's nnU-Net plan the sites trained with
    DIR/configs/metadata.json    MONAI's bundle metadata + FedUQ's provenance
    DIR/models/model.ts          the network (TorchScript, traced in evaluation mode: the full-resolution output)
    DIR/models/head.ts           logits -> [probabilities (C), uncertainty maps (K)] (the method's own)
    DIR/models/features.ts       one window -> its pooled bottleneck features [1, F], with a review rule's
                                 familiarity part (pooled over the volume's windows as predict pools them)
    DIR/scripts/                 bundle_nnunet3d.py (:mod:`feduq.bundle.scripts.bundle_nnunet3d`), volume_inference.py
                                 (:mod:`feduq.nnunet.volume_inference`), bundle_inputs.py (the input check)
    DIR/docs/README.md

and runs with MONAI's own bundle runner (``pip install monai fire pytorch-ignite nnunetv2 SimpleITK``)::

    python -m monai.bundle run --config_file DIR/configs/inference.json --bundle_root DIR \\
        --dataset_dir CASES --output_dir OUT

on a folder of nnU-Net-named cases (``<case>_0000.nii.gz``, ...), giving ``OUT/<case>.nii.gz`` (the task's label
values, as ``feduq.predict`` and nnU-Net's predictor write it) and ``OUT/<case>_uncertainty_<map>.nii.gz`` (the
method's own map, float32) in the input's geometry and, when a review rule is stored with the model
(``predict --calibrate``), ``OUT/<case>_review.json``: ``predict``'s decision and reasons for the case, on the whole
label volume and uncertainty volume (``configs/review.json``, ``scripts/case_scores.py``).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

__all__ = ["export_bundle_3d", "volume_3d_config"]


def volume_3d_config(configuration: str, dataset_json: dict, patch, num_classes: int, label_values, map_names,
                     file_ending: str, review: bool = False, largest: dict | None = None,
                     familiarity: bool = False) -> dict:
    """``inference.json`` of a 3D job (module doc); ``review``: the bundle carries ``configs/review.json``;
    ``largest``: the job's largest-component reduction (:func:`feduq.site.site3d.largest_components`);
    ``familiarity``: the rule has a familiarity part (``models/features.ts`` pools each case's features)."""
    from .export import _cases, _common

    E = file_ending
    return {
        "imports": ["$import glob", "$import os", "$import numpy as np", "$import torch", "$import monai",
                    "$import importlib", "$import json"],
        **_common(None),
        "review_rule": ("$json.load(open(os.path.join(@bundle_root, 'configs', 'review.json')))" if review else None),
        "features_net": ("$torch.jit.load(os.path.join(@bundle_root, 'models', 'features.ts'), "
                         "map_location=@device).eval()" if familiarity else None),
        "nnunet3d": "$importlib.import_module('scripts.bundle_nnunet3d')",
        "pipe": f"$@nnunet3d.pipeline(@bundle_root, {configuration!r}, {dataset_json!r})",
        "inputs": "$importlib.import_module('scripts.bundle_inputs')",
        "datalist": "$@inputs.checked(" + _cases(E)[1:] + f", @dataset_dir, 'cases named <case>_0000{E}', False)",
        "preprocessing": {"_target_": "Compose", "transforms": [
            {"_target_": "Lambdad", "keys": "image", "func": f"$lambda fs: @nnunet3d.read_case(fs, @pipe, {E!r}, "
                                                             "@features_net, @device)"}]},
        "dataset": {"_target_": "Dataset", "data": "$[{'image': f} for f in @datalist]", "transform": "@preprocessing"},
        "inferer": {"_target_": "SlidingWindowInferer", "roi_size": [int(p) for p in patch], "sw_batch_size": 1,
                    "overlap": 0.5, "mode": "gaussian"},
        "postprocessing": {"_target_": "Compose", "transforms": [
            {"_target_": "Lambda", "func": f"$lambda d: [@nnunet3d.save_case(d['pred'], d['image'].meta, @pipe, @head, "
                                           f"{int(num_classes)}, @output_dir, {list(label_values)!r}, "
                                           f"{list(map_names)!r}, {E!r}, @review_rule, {largest!r}), d][1]"}]},
    }


def _bottleneck_module(model: torch.nn.Module, example: torch.Tensor):
    """``window [1, C_in, *patch] -> [1, F]`` (float32) as TorchScript: ``model.bottleneck`` traced, checked against
    it on ``example``.

    Raises:
        feduq.predict.files.PredictError: the trace does not reproduce the features (nothing is exported)."""
    from ..predict.files import PredictError

    class _Bottleneck(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net.bottleneck(x)

    with torch.no_grad():
        ts = torch.jit.trace(_Bottleneck().eval(), example, check_trace=False)
        if not torch.allclose(ts(example), model.bottleneck(example), rtol=1e-4, atol=1e-5):
            raise PredictError("the traced bottleneck does not reproduce the model's features; not exported")
    return ts


def export_bundle_3d(loaded, out: str | os.PathLike, force: bool = False) -> Path:
    """Write ``loaded``'s 3D model as a MONAI Bundle into ``out`` (module doc), all at once.

    Raises:
        feduq.predict.files.PredictError: volumes not in NIfTI.
        feduq.outputs.OutputFolderError: ``out`` overlaps the model or the job, or holds files FedUQ did not write.
    """
    import monai
    import nnunetv2  # noqa: F401  (its version goes into the metadata)

    from ..scores import case_scores
    from ..data import get_task
    from ..nnunet import volume_inference
    from ..outputs import check_output_folder, staged_folder
    from .scripts import bundle_inputs, bundle_nnunet3d
    from ..common.provenance import job_provenance
    from .export import TOOL, _Head
    from ..predict.files import PredictError
    from ..review.rule import load_threshold
    from ..predict.rows import label_meanings, structures
    from ..site.site3d import largest_components

    site, spec = loaded.site, get_task(loaded.task)
    d = spec
    if not d.file_ending.startswith(".nii"):
        raise PredictError(f"task {spec.name!r} declares {d.file_ending} volumes; the bundle reads NIfTI "
                           "(predict reads NRRD and MHA)")
    out = check_output_folder(out, {"model file": loaded.model_file, "job config": loaded.config_file}, TOOL, force)
    pipe = site.make_pipeline(spec)
    C = len(spec.class_names)
    unc = site.uncertainty_fn()
    primary = site.primary_uncertainty
    example = torch.rand(1, spec.in_channels, *pipe.patch_size)
    model = loaded.model.to("cpu").eval()
    head = _Head(site.prob_fn, lambda z: {primary: unc(z)[primary]})
    dataset_json = {"channel_names": {str(k): v for k, v in pipe.dataset_json["channel_names"].items()},
                    "labels": dict(pipe.dataset_json["labels"]), "file_ending": d.file_ending}
    review = load_threshold(loaded.model_file)  # predict --calibrate's rule: its decision per case, as predict's
    if review is not None and review.certificate is not None and "cases" in review.certificate:
        review.certificate = {k: v for k, v in review.certificate.items() if k != "cases"}  # counts only leave
    provenance = job_provenance(Path(loaded.config_file))
    with staged_folder(out, overwrite=True, what=TOOL, marker=TOOL) as stage:
        for sub in ("configs", "models", "docs", "scripts"):
            (stage / sub).mkdir()
        with torch.no_grad():
            ts = torch.jit.trace(model, example, check_trace=False)
            if not torch.allclose(ts(example), model(example), rtol=1e-4, atol=1e-5):
                raise PredictError("the traced network does not reproduce the model's output; not exported")
        torch.jit.save(ts, str(stage / "models" / "model.ts"))
        torch.jit.save(torch.jit.trace(head.eval(), torch.randn(1, C, 3, 7, 5), check_trace=False),
                       str(stage / "models" / "head.ts"))
        familiarity = review is not None and review.familiarity is not None
        if familiarity:  # one window -> its pooled bottleneck features, predict's PlannedNetwork.bottleneck
            torch.jit.save(_bottleneck_module(model, example), str(stage / "models" / "features.ts"))
        (stage / "scripts" / "__init__.py").write_text("")
        for module, name in ((bundle_inputs, "bundle_inputs.py"), (bundle_nnunet3d, "bundle_nnunet3d.py"),
                             (volume_inference, "volume_inference.py"), (case_scores, "case_scores.py")):
            shutil.copyfile(module.__file__, stage / "scripts" / name)
        if review is not None:
            (stage / "configs" / "review.json").write_text(json.dumps(asdict(review), indent=1) + "\n")
        (stage / "configs" / "plans.json").write_text(json.dumps(site.plans, indent=1) + "\n")
        config = volume_3d_config(site.configuration, dataset_json, pipe.patch_size, C, d.label_values, [primary],
                                  d.file_ending, review is not None, largest_components(site, spec), familiarity)
        (stage / "configs" / "inference.json").write_text(json.dumps(config, indent=1) + "\n")
        meta = {
            "schema": "https://github.com/Project-MONAI/MONAI-extra-test-data/releases/download/0.8.1/"
                      "meta_schema_20220324.json",
            "version": "0.1.0", "changelog": {"0.1.0": f"exported by FedUQ from {Path(loaded.model_file).name}"},
            "monai_version": monai.__version__, "pytorch_version": torch.__version__.split("+")[0],
            "numpy_version": np.__version__,
            "required_packages_version": {"fire": "", "pytorch-ignite": "", "nnunetv2": nnunetv2.__version__
                                          if hasattr(nnunetv2, "__version__") else "", "SimpleITK": ""},
            "name": f"FedUQ {loaded.method} {spec.name} 3D segmentation",
            "task": f"{spec.name} segmentation ({', '.join(spec.class_names[1:])}), nnU-Net {site.configuration}",
            "description": f"{loaded.method} model trained by federated learning with FedUQ on nnU-Net's "
                           f"{site.configuration} network of the federation's plan; outputs label volumes and the "
                           f"method's own uncertainty ({primary}).",
            "authors": "FedUQ", "copyright": "see the training federation's data agreements",
            "network_data_format": {
                "inputs": {"image": {"type": "image", "format": "magnitude", "num_channels": spec.in_channels,
                                     "spatial_shape": list(pipe.patch_size), "dtype": "float32", "value_range": [],
                                     "is_patch_data": True,
                                     "channel_def": {str(i): c for i, c in enumerate(d.channel_names)}}},
                "outputs": {"pred": {"type": "image", "format": "segmentation", "num_channels": C,
                                     "spatial_shape": list(pipe.patch_size), "dtype": "float32", "value_range": [],
                                     "is_patch_data": True,
                                     "channel_def": label_meanings(spec.class_names, structures(
                                         spec.class_names, spec.eval_regions))}}},
            "feduq": {"method": loaded.method, "task": spec.name, "configuration": site.configuration,
                      "review_threshold": None if review is None else review.__dict__,
                      "plans_name": site.plans.get("plans_name"), "primary_uncertainty": primary,
                      "label_values": list(d.label_values), **provenance},
        }
        (stage / "configs" / "metadata.json").write_text(json.dumps(meta, indent=1) + "\n")
        (stage / "docs" / "README.md").write_text(
            f"# FedUQ {loaded.method}: {spec.name} (nnU-Net {site.configuration})\n\n" + (__doc__ or "")
            .split("\n\n", 1)[1].replace("``", "`") + "\n")
    return out
