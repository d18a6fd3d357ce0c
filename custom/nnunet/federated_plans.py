"""nnU-Net v2's experiment plan of a federation, from the sites' fingerprints (no voxel leaves a site).

nnU-Net plans a dataset from its **fingerprint** (``DatasetFingerprintExtractor``): per training case the voxel
spacing, the shape after cropping to the non-zero region and the relative size of that crop, and per channel the
statistics of foreground intensities sampled per case (``10e7 // n_cases`` voxels per case, with replacement, seed
1234). Its planner (``ExperimentPlanner``) takes medians and percentiles of those lists and of the case count. A
federation cannot pool the voxels, so (as FednnU-Net and the Flower nnU-Net app share fingerprints):

1. each site computes :func:`site_fingerprint` with nnU-Net's own per-case analysis (``analyze_case``: its reader,
   crop and sampling; the number of samples per case from the **pooled** case count, :func:`samples_per_case`) and
   sends only summary numbers: the per-case lists (spacings, shapes after crop, relative sizes: what the planner
   reads) and per channel the count, mean, sum of squared deviations, minimum, maximum and the sample's quantiles at
   :data:`QUANTILE_LEVELS` (no sample value);
2. the server merges them (:func:`merge_fingerprints`) into nnU-Net's ``dataset_fingerprint.json``: the lists
   concatenated in site order, mean and standard deviation exactly as over the pooled samples (Chan et al.'s parallel
   variance), minimum and maximum exactly, the 0.5/50/99.5 percentiles from the sites' quantile functions weighted by
   their counts (within one quantile step of the pooled sample's: :data:`QUANTILE_LEVELS` has 2001 levels);
3. nnU-Net's planner runs once on it (:func:`plan_from_fingerprint`: ``nnUNetv2_plan_experiment`` in a subprocess
   with nnU-Net's path variables on a scratch folder, as ``tools/make_ct_plans.py`` runs it, on a ``dataset.json``
   with the pooled ``numTraining`` and the sites' reader), and the plan travels in the job;
4. :func:`slim_plan_3d` derives the CPU/test plan from it (fewer stages and features, a smaller patch: a documented
   transformation of the federated plan, as the 2D slim plan is of the 2D one).

What a site sends is declared in FedUQ's privacy ledger (per-case spacings and shapes are per-patient numbers).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

#: nnU-Net's ``num_foreground_voxels_for_intensitystats``: foreground voxels sampled over the whole dataset
NNUNET_FOREGROUND_VOXELS = 10e7
#: the quantile levels (fractions) of a site's foreground sample that it sends: 0, 0.0005, ..., 1
QUANTILE_LEVELS = np.linspace(0.0, 1.0, 2001)
#: the slim 3D plan (tests and CPU demonstrations): at most 4 stages of 8..64 features, the patch capped at 32 voxels
#: along the plan's first (through-plane) axis and 64 in-plane, batch 2, and the spacing coarsened per axis so the
#: median case is at most 32 x 96 x 96 voxels
SLIM_3D = {"n_stages": 4, "features": (8, 16, 32, 64), "max_patch": (32, 64, 64), "batch_size": 2,
           "max_median_shape": (32, 96, 96)}
#: the dataset number used on the scratch folder where nnU-Net's planner runs (never a user's folder)
SCRATCH_DATASET = (990, "Dataset990_FedUQFederation")


class FingerprintError(ValueError):
    """A site's fingerprint cannot be computed, or the sites' fingerprints cannot be merged (the message names the
    site, case or parameter)."""


def samples_per_case(pooled_cases: int, foreground_voxels: float = NNUNET_FOREGROUND_VOXELS) -> int:
    """Foreground voxels each case samples, as nnU-Net's fingerprint: ``int(foreground_voxels // pooled_cases)``.

    Raises:
        FingerprintError: ``pooled_cases`` < 1.
    """
    if int(pooled_cases) < 1:
        raise FingerprintError(f"pooled_cases={pooled_cases}: the federation has no training case")
    return int(foreground_voxels // int(pooled_cases))


def site_fingerprint(cases: Sequence[tuple[Sequence[str], str]], reader_writer_class, num_samples: int,
                     site: str = "site") -> dict:
    """One site's fingerprint summary: what it sends to the server.

    Args:
        cases: ``(image files in channel order, label file)`` per training case.
        reader_writer_class: the nnU-Net reader of the site's files (e.g. ``SimpleITKIO``).
        num_samples: foreground voxels sampled per case (:func:`samples_per_case` of the pooled count).
        site: the site's name (in errors).

    Returns:
        ``{"n_cases", "spacings": [[z, y, x] mm per case], "shapes_after_crop": [[z, y, x] voxels per case],
        "relative_sizes_after_cropping": [float per case], "channels": {"<c>": {"count", "mean", "m2", "min",
        "max", "quantiles": [len(QUANTILE_LEVELS) floats]}}}``, JSON-ready. ``m2``: the sum of squared deviations
        from the site's mean.

    Raises:
        FingerprintError: no case, or no foreground voxel in any case (naming the site); a file whose header gives no
            spacing (every case's headers are read first) or with a NaN or infinite voxel, which nnU-Net's reader
            would read as 1 mm or as 0 (naming the site and the file:
            :func:`feduq.io.volume_checks.check_volume_file`).
    """
    from nnunetv2.experiment_planning.dataset_fingerprint.fingerprint_extractor import DatasetFingerprintExtractor

    from ..io.volume_checks import check_case_files
    from ..io.volumes import VolumeError

    if not cases:
        raise FingerprintError(f"site {site!r}: no training case to fingerprint")
    spacings, shapes, relative, samples = [], [], [], []
    try:
        for voxels in (False, True):  # every header before any voxel is read
            for images, label in cases:
                check_case_files({"channels": list(images), "label": label}, voxels=voxels)
    except VolumeError as e:
        raise FingerprintError(f"site {site!r}: {e}") from None
    for images, label in cases:
        shape, spacing, intensities, _, rel = DatasetFingerprintExtractor.analyze_case(
            list(map(str, images)), str(label), reader_writer_class, num_samples)
        if not np.all(np.asarray(spacing, dtype=float) > 0):
            raise FingerprintError(f"site {site!r}: {Path(images[0]).name} has voxel spacing {list(spacing)}: "
                                   "expected every axis > 0 mm (set the spacing in the image header)")
        spacings.append([float(s) for s in spacing])
        shapes.append([int(s) for s in shape])
        relative.append(float(rel))
        samples.append([np.asarray(x, dtype=np.float64) for x in intensities])
    channels = {}
    for c in range(len(samples[0])):
        values = np.concatenate([s[c] for s in samples])
        if values.size == 0:
            raise FingerprintError(f"site {site!r}: no foreground voxel (label > 0) in any of its {len(cases)} "
                                   "training cases: the intensity fingerprint needs annotated cases")
        mean = float(values.mean())
        channels[str(c)] = {"count": int(values.size), "mean": mean, "m2": float(((values - mean) ** 2).sum()),
                            "min": float(values.min()), "max": float(values.max()),
                            "quantiles": [float(q) for q in np.quantile(values, QUANTILE_LEVELS)]}
    return {"n_cases": len(cases), "spacings": spacings, "shapes_after_crop": shapes,
            "relative_sizes_after_cropping": relative, "channels": channels}


def reader_class(declaration: Mapping, example_file: str | Path):
    """The nnU-Net reader of a task's files: ``overwrite_image_reader_writer`` when the declaration names one, else
    nnU-Net's choice for the file ending (``determine_reader_writer_from_dataset_json``; e.g. ``SimpleITKIO``)."""
    import contextlib
    import io

    from nnunetv2.imageio.reader_writer_registry import determine_reader_writer_from_dataset_json

    with contextlib.redirect_stdout(io.StringIO()):
        return determine_reader_writer_from_dataset_json(dict(declaration), str(example_file), verbose=False)


def reader_name(file_ending: str) -> str:
    """nnU-Net's reader class name for a file ending, as nnU-Net picks one (the first of its registry's readers that
    takes the ending: ``SimpleITKIO`` for ``.nii.gz``, ``.nrrd``, ``.mha``)."""
    from nnunetv2.imageio.reader_writer_registry import LIST_OF_IO_CLASSES

    for cls in LIST_OF_IO_CLASSES:
        if file_ending.lower() in [e.lower() for e in cls.supported_file_endings]:
            return cls.__name__
    raise FingerprintError(f"no nnU-Net reader takes {file_ending!r} files")


#: the flat metric names of a site's summary on the wire (:func:`to_wire`): per-case lists and per-channel numbers
WIRE_CASE_LISTS = ("spacings", "shapes_after_crop", "relative_sizes_after_cropping")
WIRE_CHANNEL_KEYS = ("count", "mean", "m2", "min", "max", "quantiles")


def to_wire(summary: Mapping) -> dict:
    """A site's summary (:func:`site_fingerprint`) as flat metrics: ``n_cases``; ``spacings``, ``shapes_after_crop``
    (lists of ``[z, y, x]`` rows), ``relative_sizes_after_cropping`` (a list of ``[r]`` rows); per channel ``c``:
    ``channel_<c>_count``, ``_mean``, ``_m2``, ``_min``, ``_max`` (numbers) and ``channel_<c>_quantiles`` (a list of
    ``len(QUANTILE_LEVELS)`` numbers): the keys and forms FedUQ's privacy ledger declares for this job."""
    out = {"n_cases": int(summary["n_cases"]), "spacings": [list(map(float, r)) for r in summary["spacings"]],
           "shapes_after_crop": [list(map(int, r)) for r in summary["shapes_after_crop"]],
           "relative_sizes_after_cropping": [[float(r)] for r in summary["relative_sizes_after_cropping"]]}
    for c, stats in summary["channels"].items():
        for key in WIRE_CHANNEL_KEYS:
            out[f"channel_{c}_{key}"] = stats[key]
    return out


def from_wire(metrics: Mapping, site: str = "site") -> dict:
    """:func:`to_wire`'s metrics back as a summary.

    Raises:
        FingerprintError: a missing key, or per-case lists whose lengths differ from ``n_cases`` (naming the site).
    """
    try:
        n = int(metrics["n_cases"])
        out = {"n_cases": n, "spacings": [list(r) for r in metrics["spacings"]],
               "shapes_after_crop": [list(r) for r in metrics["shapes_after_crop"]],
               "relative_sizes_after_cropping": [float(r[0]) for r in metrics["relative_sizes_after_cropping"]],
               "channels": {}}
        channels = sorted({k.split("_")[1] for k in metrics if k.startswith("channel_")}, key=int)
        for c in channels:
            out["channels"][c] = {key: metrics[f"channel_{c}_{key}"] for key in WIRE_CHANNEL_KEYS}
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise FingerprintError(f"site {site!r}: its fingerprint lacks or garbles {e}") from None
    if any(len(out[k]) != n for k in WIRE_CASE_LISTS) or not channels:
        raise FingerprintError(f"site {site!r}: its fingerprint's per-case lists do not hold its {n} cases, or it "
                               "has no channel")
    return out


def _pooled_percentiles(parts: Sequence[Mapping], percents=(0.5, 50.0, 99.5)) -> list[float]:
    """Percentiles of the pooled samples from each site's quantile function (linear between its levels), weighted by
    the site's count: the pooled CDF ``F(x) = sum_s n_s F_s(x) / N`` inverted at each level."""
    xs = np.unique(np.concatenate([np.asarray(p["quantiles"], dtype=np.float64) for p in parts]))
    total = float(sum(p["count"] for p in parts))
    cdf = np.zeros_like(xs)
    for p in parts:
        q = np.asarray(p["quantiles"], dtype=np.float64)
        # a site's CDF at x: the largest level whose quantile is <= x, linear between levels (flat runs: the last)
        cdf += p["count"] / total * np.interp(xs, q, QUANTILE_LEVELS, left=0.0, right=1.0)
    cdf = np.maximum.accumulate(cdf)
    keep = np.concatenate([[True], np.diff(cdf) > 0])
    return [float(np.interp(pct / 100.0, cdf[keep], xs[keep])) for pct in percents]


def merge_fingerprints(sites: Mapping[str, Mapping]) -> dict:
    """The sites' summaries (:func:`site_fingerprint`, site -> summary) as nnU-Net's ``dataset_fingerprint.json``.

    Returns:
        ``{"spacings", "shapes_after_crop", "foreground_intensity_properties_per_channel": {"<c>": {"mean", "median",
        "std", "min", "max", "percentile_99_5", "percentile_00_5"}}, "median_relative_size_after_cropping"}``: the
        lists in the given site order; ``std`` the population standard deviation (``np.std``), as nnU-Net's.

    Raises:
        FingerprintError: no site, or sites whose channels differ (naming them).
    """
    if not sites:
        raise FingerprintError("no site fingerprint to merge")
    names = list(sites)
    channels = sorted(sites[names[0]]["channels"], key=int)
    for s in names[1:]:
        if sorted(sites[s]["channels"], key=int) != channels:
            raise FingerprintError(f"site {s!r} sends channels {sorted(sites[s]['channels'], key=int)}, site "
                                   f"{names[0]!r} {channels}: every site must hold the task's channels")
    out = {"spacings": [], "shapes_after_crop": [], "foreground_intensity_properties_per_channel": {}}
    relative = []
    for s in names:
        out["spacings"] += [list(x) for x in sites[s]["spacings"]]
        out["shapes_after_crop"] += [list(x) for x in sites[s]["shapes_after_crop"]]
        relative += list(sites[s]["relative_sizes_after_cropping"])
    for c in channels:
        parts = [sites[s]["channels"][c] for s in names]
        n = sum(p["count"] for p in parts)
        mean = sum(p["count"] * p["mean"] for p in parts) / n
        m2 = sum(p["m2"] + p["count"] * (p["mean"] - mean) ** 2 for p in parts)  # Chan et al.'s parallel variance
        p005, median, p995 = _pooled_percentiles(parts)
        out["foreground_intensity_properties_per_channel"][c] = {
            "mean": float(mean), "median": median, "std": float(np.sqrt(m2 / n)),
            "min": float(min(p["min"] for p in parts)), "max": float(max(p["max"] for p in parts)),
            "percentile_99_5": p995, "percentile_00_5": p005}
    out["median_relative_size_after_cropping"] = float(np.median(relative))
    return out


def planning_dataset_json(declaration: Mapping, pooled_cases: int, reader: str) -> dict:
    """nnU-Net's ``dataset.json`` the planner reads: the task's channels, labels (or regions) and ending, the pooled
    ``numTraining``, the sites' reader (``overwrite_image_reader_writer``) and one placeholder entry per case (the
    planner counts cases; it reads no image when the reader is named)."""
    keys = ("channel_names", "labels", "file_ending", "regions_class_order")
    out = {k: copy.deepcopy(declaration[k]) for k in keys if k in declaration}
    out["numTraining"] = int(pooled_cases)
    out["overwrite_image_reader_writer"] = reader
    ending = out["file_ending"]
    out["dataset"] = {f"case{i:05d}": {"images": [f"imagesTr/case{i:05d}_0000{ending}"],
                                       "label": f"labelsTr/case{i:05d}{ending}"} for i in range(int(pooled_cases))}
    return out


def plan_from_fingerprint(declaration: Mapping, fingerprint: Mapping, reader: str,
                          configuration: str = "3d_fullres", planner: str = "ExperimentPlanner",
                          plans_name: str = "FedUQ_federated") -> dict:
    """nnU-Net's plan of the merged fingerprint: ``nnUNetv2_plan_experiment`` on a scratch folder.

    Args:
        declaration: the task's ``dataset.json`` keys (channel_names, labels, file_ending, regions_class_order).
        fingerprint: :func:`merge_fingerprints`' output.
        reader: the nnU-Net reader class name of the sites' files (e.g. ``"SimpleITKIO"``).
        configuration: the configuration kept (the others are dropped).
        planner: nnU-Net's planner class (``-pl``).

    Returns:
        the plans dict with only ``configuration``, ``plans_name`` set and a ``feduq_note`` saying where it came from.

    Raises:
        FingerprintError: the planner failed (its last output lines) or made no ``configuration`` (e.g. ``3d_fullres``
            for a 2D dataset, whose median shape has one slice).
    """
    number, name = SCRATCH_DATASET
    pooled = len(fingerprint["spacings"])
    with tempfile.TemporaryDirectory(prefix="feduq-plan-") as tmp:
        tmp = Path(tmp)
        raw, pre = tmp / "raw" / name, tmp / "pre" / name
        raw.mkdir(parents=True)
        pre.mkdir(parents=True)
        (raw / "dataset.json").write_text(json.dumps(planning_dataset_json(declaration, pooled, reader)))
        (pre / "dataset_fingerprint.json").write_text(json.dumps(fingerprint))
        env = dict(os.environ, nnUNet_raw=str(tmp / "raw"), nnUNet_preprocessed=str(tmp / "pre"),
                   nnUNet_results=str(tmp / "res"))
        command = [str(Path(sys.executable).parent / "nnUNetv2_plan_experiment"), "-d", str(number), "-pl", planner]
        res = subprocess.run(command, env=env, capture_output=True, text=True)
        path = pre / "nnUNetPlans.json"
        if res.returncode != 0 or not path.is_file():
            tail = " | ".join((res.stderr or res.stdout).strip().splitlines()[-3:])
            raise FingerprintError(f"nnU-Net's planner failed on the merged fingerprint (exit {res.returncode}): {tail}")
        plans = json.loads(path.read_text())
    if configuration not in plans["configurations"]:
        raise FingerprintError(f"nnU-Net's planner made no {configuration!r} configuration for this federation "
                               f"(it made {sorted(plans['configurations'])}); 3d_fullres needs volumes of more than one "
                               "slice")
    plans["configurations"] = {configuration: plans["configurations"][configuration]}
    plans["plans_name"] = plans_name
    plans["dataset_name"] = str(declaration.get("name", "FedUQ_federation"))
    plans["feduq_note"] = (f"nnU-Net v2 {configuration} plan ({planner}) of the federated fingerprint of {pooled} "
                           "training cases (feduq.nnunet.federated_plans)")
    return plans


def slim_plan_3d(plans: Mapping, configuration: str = "3d_fullres") -> dict:
    """The federated plan with the slim architecture of :data:`SLIM_3D` (tests, CPU demonstrations; not nnU-Net's
    network): the first ``n_stages`` stages of the plan's kernels and strides, ``features`` per stage, the patch
    capped per axis at ``max_patch`` and rounded down to a multiple of the network's total stride along that axis,
    the batch ``batch_size``, the spacing multiplied per axis by ``median / max_median_shape`` where the plan's
    median case is larger (its ``median_image_size_in_voxels`` scaled alike); normalisation and everything else the
    plan's. ``plans_name`` gains ``_slim``.

    Raises:
        FingerprintError: the plan has no ``configuration``.
    """
    if configuration not in plans.get("configurations", {}):
        raise FingerprintError(f"plans {plans.get('plans_name')!r} have no {configuration!r} configuration")
    out = copy.deepcopy(dict(plans))
    out["plans_name"] = str(plans.get("plans_name", "plans")) + "_slim"
    cfg = out["configurations"][configuration]
    arch = cfg["architecture"]["arch_kwargs"]
    n = min(SLIM_3D["n_stages"], int(arch["n_stages"]))
    arch["n_stages"] = n
    arch["features_per_stage"] = list(SLIM_3D["features"][:n])
    for key in ("kernel_sizes", "strides", "n_conv_per_stage"):
        arch[key] = arch[key][:n]
    arch["n_conv_per_stage_decoder"] = arch["n_conv_per_stage_decoder"][: n - 1]
    cfg["pool_op_kernel_sizes"] = arch["strides"]
    cfg["conv_kernel_sizes"] = arch["kernel_sizes"]
    stride = np.prod(np.asarray(arch["strides"], dtype=int), axis=0)
    cfg["patch_size"] = [int(max(s, min(p, m) // s * s)) for p, m, s in zip(cfg["patch_size"], SLIM_3D["max_patch"],
                                                                             stride)]
    cfg["batch_size"] = SLIM_3D["batch_size"]
    median = np.asarray(cfg["median_image_size_in_voxels"], dtype=float)
    factor = np.maximum(1.0, median / np.asarray(SLIM_3D["max_median_shape"], dtype=float))
    cfg["spacing"] = [float(s * f) for s, f in zip(cfg["spacing"], factor)]
    cfg["median_image_size_in_voxels"] = [float(m / f) for m, f in zip(median, factor)]
    out["feduq_note"] = str(plans.get("feduq_note", "")) + "; SLIM architecture for tests and CPU demos (not nnU-Net's)"
    return out
