"""The exported MONAI Bundle's reading and writing for a volume job's 3D network, with nnU-Net v2, NumPy, PyTorch,
SimpleITK and MONAI only (no FedUQ import): the bundle carries this very file as ``scripts/bundle_nnunet3d.py`` and
FedUQ's :mod:`feduq.nnunet.volume_inference` as ``scripts/volume_inference.py`` beside it.

:func:`read_case` preprocesses a case's channel files with nnU-Net's ``DefaultPreprocessor`` and the bundle's
``configs/plans.json`` (as the sites and ``feduq.predict`` do); MONAI's ``SlidingWindowInferer`` (the plan's patch,
overlap 0.5, Gaussian) runs the network; :func:`save_case` takes the method's probabilities and uncertainty maps
(``head.ts``), maps them back onto the input's grid as nnU-Net does (``volume_inference.to_file_grid``) and writes
``<case><ending>`` with the plan's reader-writer (the task's label values) and ``<case>_uncertainty_<map>.nii.gz``
(float32, SimpleITK, the input's geometry) and, when the bundle carries a review rule (``configs/review.json``),
``<case>_review.json``: the rule's decision on the whole label volume and the method's own uncertainty volume, as
``feduq.predict`` decides it (``scripts/case_scores.py``, a copy of FedUQ's ``feduq.scores.case_scores``); a rule with
a familiarity part also takes the volume's pooled bottleneck features (``models/features.ts``: one window -> the
spatial mean of the encoder's last stage, averaged over the volume's windows by ``volume_inference.volume_features``,
as ``feduq.predict`` takes them).
"""

from __future__ import annotations

import importlib
import json
import os
from types import SimpleNamespace

import numpy as np
import torch

#: the properties nnU-Net's preprocessor gave each case, by case name (kept here, not in MONAI's metadata)
PROPERTIES: dict[str, dict] = {}
#: each case's pooled bottleneck features ``[F]`` float64, by case name (with a familiarity part only)
FEATURES: dict[str, np.ndarray] = {}


def _here(name: str):
    return importlib.import_module(f"{__package__}.{name}" if __package__ else name)


def pipeline(bundle_root: str, configuration: str, dataset_json: dict):
    """nnU-Net's plan of the bundle (``configs/plans.json``) as the pieces its preprocessor and export take."""
    from nnunetv2.utilities.plans_handling.plans_handler import PlansManager

    with open(os.path.join(bundle_root, "configs", "plans.json")) as f:
        pm = PlansManager(json.load(f))
    cm = pm.get_configuration(configuration)
    return SimpleNamespace(pm=pm, cm=cm, label_manager=pm.get_label_manager(dataset_json),
                           patch_size=tuple(int(p) for p in cm.patch_size), dataset_json=dataset_json)


def case_name(first_file: str, file_ending: str) -> str:
    name = os.path.basename(str(first_file))
    return name[: -len(f"_0000{file_ending}")]


def read_case(files, pipe, file_ending: str, features_net=None, device="cpu"):
    """A case's channel files -> ``MetaTensor [C, *preprocessed shape]`` (nnU-Net's preprocessing), its
    ``filename_or_obj`` the case's name; nnU-Net's properties kept in :data:`PROPERTIES` and, with ``features_net``
    (``models/features.ts``), its pooled bottleneck features in :data:`FEATURES`."""
    import contextlib
    import io

    from monai.data import MetaTensor
    from nnunetv2.preprocessing.preprocessors.default_preprocessor import DefaultPreprocessor

    with contextlib.redirect_stdout(io.StringIO()):
        data, _, props = DefaultPreprocessor(verbose=False).run_case([str(f) for f in files], None, pipe.pm, pipe.cm,
                                                                     pipe.dataset_json)
    name = case_name(files[0], file_ending)
    PROPERTIES[name] = props
    if features_net is not None:
        FEATURES[name] = _here("volume_inference").volume_features(features_net, data, pipe.patch_size,
                                                                   torch.device(device))
    return MetaTensor(torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)),
                      meta={"filename_or_obj": name})


def save_case(pred, meta, pipe, head, num_classes: int, output_dir: str, label_values, map_names, file_ending: str,
              review_rule=None, largest=None):
    """Write a case's label volume and uncertainty volumes from its logits ``pred [C, *shape]`` and, with
    ``review_rule`` (the review rule's dict), its review decision (module doc); ``map_names[0]`` is the method's own
    map, the rule's; ``largest``: the job's reduction of the class map to its largest components (predict's)."""
    import SimpleITK as sitk

    here = _here("volume_inference")
    name = str(meta["filename_or_obj"])
    props = PROPERTIES.pop(name)
    out = head(torch.as_tensor(pred)[None].float().cpu())[0]
    probs = out[:num_classes]
    maps = {n: out[num_classes + i] for i, n in enumerate(map_names)}
    seg, _, maps_file = here.to_file_grid(pipe, probs, props, maps, largest)
    os.makedirs(output_dir, exist_ok=True)
    values = np.asarray(label_values)
    writer = pipe.pm.image_reader_writer_class()
    writer.write_seg(values[seg.astype(np.int64)].astype(np.uint8 if values.max() < 256 else np.uint16),
                     os.path.join(output_dir, f"{name}{file_ending}"), props)
    stuff = props["sitk_stuff"]
    for n, m in maps_file.items():
        image = sitk.GetImageFromArray(np.ascontiguousarray(m, dtype=np.float32))
        image.SetSpacing(stuff["spacing"])
        image.SetOrigin(stuff["origin"])
        image.SetDirection(stuff["direction"])
        sitk.WriteImage(image, os.path.join(output_dir, f"{name}_uncertainty_{n}.nii.gz"), True)
    features = FEATURES.pop(name, None)
    if review_rule is not None:  # the decision on the whole volume (and its pooled features, with a familiarity part)
        record = _here("case_scores").review_record(torch.from_numpy(seg.astype(np.int64)),
                                                    torch.from_numpy(maps_file[map_names[0]]), review_rule, features)
        with open(os.path.join(output_dir, f"{name}_review.json"), "w") as f:
            f.write(json.dumps(record, indent=1) + "\n")
