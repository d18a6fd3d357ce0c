"""The exported MONAI Bundle's ``docs/README.md`` (:mod:`feduq.bundle.export`): what the bundle reads, how it
normalises and resizes, what each output file and value means, as its ``configs/inference.json`` does it.

Sources of each statement: the input names and the per-channel normalisation are those of ``scripts/channel_io.py``
(:mod:`feduq.io.channel_io`, ``read_case_2d``/``normalise_channel``) for a declared task, else the job's
``intensity`` (:func:`feduq.bundle.export._intensity_steps`); the output names are the config's ``SaveImaged``
steps (2D) or ``scripts/bundle_volumes.save_case`` (volumes); a region task's values are nnU-Net's region painting
(``scripts/bundle_regions.paint_regions``).
"""

from __future__ import annotations

from pathlib import Path

from ..predict.files import map_scale

__all__ = ["readme", "channel_normalisation", "value_meanings"]

#: the built-in tasks' ``intensity`` settings, applied to the whole image (all channels)
INTENSITY = {"minmax": "(x - min) / (max - min) per image", "max": "x / max per image (all channels)",
             "raw": "the stored 0..255 values"}


def channel_normalisation(scheme) -> str:
    """One declared channel's normalisation in words (``scheme``: ``(name, low, high, mean, std)`` of
    :attr:`feduq.tasks.task.TaskSpec.normalization`), as :func:`feduq.io.channel_io.normalise_channel` does it."""
    name, low, high, mean, std = scheme
    if name == "zscore":
        return "z-score per image, (x - mean) / std of the channel's pixels"
    if name == "rescale_to_0_1":
        return "(x - min) / (max - min) per image"
    if name == "rgb_to_0_1":
        return "x / 255"
    if name == "CT":
        window = f"clipped to [{low:g}, {high:g}]"
        return f"{window}, then (x - {mean:g}) / {std:g}" if std is not None else \
            f"{window}, then (x - {low:g}) / ({high:g} - {low:g})"
    return "the stored values, unchanged (noNorm)"


def value_meanings(class_names, values, regions: dict | None) -> tuple[str, str]:
    """``(labels, regions)`` lines of the README: what each written value means and, for a region task, which values
    make each region.

    Args:
        class_names: the task's class names, background first (class index i is written as ``values[i]``).
        values: the written value of each class index (a declared task's label values, else 0..C-1).
        regions: region name -> class indices (nnU-Net's regions, fundus' disc = rim + cup), or None.

    Returns:
        e.g. ``("0 = background, 1 = optic_disc (not optic_cup), 2 = optic_disc + optic_cup", "optic_disc = values
        1, 2; optic_cup = value 2")``; the second is empty without regions.
    """
    if not regions:
        return ", ".join(f"{v} = {n}" for v, n in zip(values, class_names)), ""
    from ..predict.rows import class_meaning, structures

    ordered = sorted(regions.items(), key=lambda kv: len(kv[1]), reverse=True)  # widest first, as painted
    parts = dict(sorted(structures(class_names, regions).items(), key=lambda kv: len(kv[1]), reverse=True))
    labels = [f"{values[c]} = {class_meaning(c, class_names, parts)}" for c in range(len(class_names))]

    def listed(classes):
        vs = [values[c] for c in classes]
        return f"value{'s' if len(vs) > 1 else ''} {', '.join(map(str, vs))}"

    return ", ".join(labels), "; ".join(f"{name} = {listed(classes)}" for name, classes in ordered)


def _inputs(spec, declared) -> str:
    if declared is None:
        return (f"2D {'RGB' if spec.in_channels == 3 else 'gray'} images (PNG, JPEG, BMP) at any size, "
                f"`IMAGES/<image>.png`; no pixel spacing is used" +
                ("; a gray image is repeated to RGB, a 16-bit one first scaled to 8 bits (× 255 / 65535) as in training"
                 if spec.in_channels == 3 else ""))
    E, names = declared["file_ending"], declared["channel_names"]
    files = ", ".join(f"`<case>_{i:04d}{E}` ({n})" for i, n in enumerate(names))
    if declared.get("kind") == "3d":
        return (f"volumes named as nnU-Net names them, one file per channel: {files}; reoriented to LPS and run slice "
                "by slice along the third axis")
    one = f"; or one RGB file `<case>_0000{E}` holding all three" if len(names) == 3 else ""
    return f"2D images named as nnU-Net names them, one file per channel: {files}{one}; any size, no pixel spacing used"


def _preprocessing(site, declared, S: int) -> str:
    resize = ("the long side resized to {S} px (bilinear, anti-aliased), the short side zero-padded symmetrically"
              if site.resize == "letterbox" else "both sides resized to {S} px (bilinear, anti-aliased)").format(S=S)
    norm = declared["normalization"] if declared is not None else None
    if norm is not None and any(n[0] != "noNorm" for n in norm):  # channel_io normalises as it reads: nothing after
        each = "; ".join(f"{name}: {channel_normalisation(n)}"
                         for name, n in zip(declared["channel_names"], norm))
        return f"each channel normalised as the sites read it (`scripts/channel_io.py`), {each}; then {resize}"
    stored = "the stored values of each channel file; " if norm is not None else ""
    if site.resize == "letterbox":
        return f"{stored}intensity {INTENSITY[site.intensity]}; then {resize}"
    return f"{stored}{resize}; then intensity {INTENSITY[site.intensity]}"


def _outputs(declared, maps: list[str], C: int, big: bool) -> str:
    scale = f"{map_scale(maps[0], C):.6g}"
    if declared is None:
        return (f"Per image: `OUT/<image>_seg.png` (uint8 class indices at the image's own width x height) and "
                f"`OUT/<image>_uncertainty_{maps[0]}.png` (16-bit: value = png / 65535 x {scale}).")
    kind = "uint16" if big else "uint8"
    if declared.get("kind") == "3d":
        return (f"Per case: `OUT/<case>.nii.gz` ({kind} label values in the input's shape and affine, as nnU-Net's "
                f"predictor names it) and `OUT/<case>_uncertainty_{maps[0]}.nii.gz` (float32, the map's own unit).")
    return (f"Per case: `OUT/<case>{declared['label_ending']}` ({kind} label values at the image's own width x height, "
            f"as nnU-Net's predictor names it) and `OUT/<case>_uncertainty_{maps[0]}.png` (16-bit: value = png / 65535 "
            f"x {scale}).")


def readme(loaded, spec, S: int, maps: list[str], provenance: dict, review, declared: dict | None = None,
           regions: dict | None = None) -> str:
    """The bundle's ``docs/README.md``.

    Args:
        loaded: the model (:func:`feduq.site.evaluation.load_model`): method, task, site settings.
        spec: the task's :class:`feduq.tasks.task.TaskSpec`.
        S: the network's input size.
        maps: the uncertainty maps, the method's own first.
        provenance: :func:`feduq.common.provenance.job_provenance`.
        review: the stored review rule, or None.
        declared: the bundle's declared-task dict (``file_ending``, ``label_ending``, ``normalization``,
            ``label_values``, ``channel_names``, ``kind``), or None for a built-in task.
        regions: region name -> class indices when the label map is nnU-Net's region painting, else None.
    """
    from ..review.notes import certified_for, drawn

    site = loaded.site
    C = len(spec.class_names)
    stem, what = ("image", "label maps") if declared is None else ("case", "label files")
    values = list(declared["label_values"]) if declared is not None else list(range(C))
    labels, region_line = value_meanings(spec.class_names, values, regions)
    units = "; ".join(f"{m}: {'C/S, in (0, 1]' if m == 'vacuity' else 'nats, in [0, ln C]'}" for m in maps)
    sites = ", ".join(provenance.get("sites", [])) or "not recorded in the job folder"
    if regions and site.keep_largest_component:
        lcc = (", then each region's largest connected component (widest region first), painted back with the "
               "narrowest region's value (nnU-Net's region painting, as `feduq predict`)")
    else:
        lcc = ", largest connected component per class" if site.keep_largest_component else ""
    if review is None:
        flag = "none stored: choose one with `feduq predict --calibrate` before export"
    else:
        parts = [f"its {review.score} of {review.uncertainty} is above {review.threshold:.6g}"]
        if review.size_floor is not None:
            parts.append(f"its predicted area fraction is below {review.size_floor:.4g} (implausible size)")
        if review.familiarity is not None:
            parts.append(f"its bottleneck features lie farther than {review.familiarity['threshold']:.4g} from the "
                         f"calibration images' (unfamiliar input)")
        flag = (f"flag an image for review when {', or '.join(parts)}; on {review.n_cases} labelled images: coverage "
                f"{100 * review.coverage:.1f} %, accepted mean Dice {100 * review.accepted_dice:.2f} % against a "
                f"target of {100 * review.target_dice:.1f} %. Applied by this bundle: `OUT/<{stem}>_review.json`")
        c = review.certificate
        flag += (" Not certified: these figures describe the calibration images only." if c is None else
                 f" Certified for {certified_for(c, review.calibrated_on)} ({drawn(c)} labelled there): "
                 f"there, the accepted images' mean Dice is at least {100 * c['bound']:.1f} % with probability "
                 f"at least {100 * (1 - c['delta']):g} % (Learn then Test; `configs/metadata.json` "
                 f"feduq.review_threshold.certificate); for images of another site it promises nothing.")
    region_row = f"| regions | {region_line} |\n" if region_line else ""

    return f"""# FedUQ {loaded.method}: {loaded.task} segmentation

Exported by FedUQ (`feduq predict --export-bundle`) from `{Path(loaded.model_file).name}`.

| | |
|---|---|
| task | {loaded.task}: {", ".join(spec.class_names[1:])} against background |
| labels | {labels} |
{region_row}| input | {_inputs(spec, declared)} |
| preprocessing | {_preprocessing(site, declared, S)} |
| network | `models/model.ts` (TorchScript), input [B, {spec.in_channels}, {S}, {S}] float32, output logits [B, {C}, {S}, {S}] |
| post-processing | logits mapped back onto the image (inverse of the resize and padding, bilinear), argmax of the method's probabilities{lcc} |
| uncertainty | `models/head.ts`: logits -> [probabilities, {", ".join(maps)}]; {units}; the bundle writes `{maps[0]}`, the method's own |
| training federation | {loaded.method}; sites: {sites}; rounds: {provenance.get("rounds", "not recorded")} |
| review threshold | {flag} |

## Run

```bash
pip install monai fire pytorch-ignite
python -m monai.bundle run --config_file configs/inference.json --bundle_root . --dataset_dir IMAGES --output_dir OUT
```

{_outputs(declared, maps, C, max(values) > 255)} They are the {what} `feduq predict` writes for the
same model and inputs, except where two classes' probabilities lie within float rounding of each other: the
bundle's TorchScript network and predict's PyTorch one may round such a pixel to either class (seen: 1 pixel in
10^5, on an edge).{"" if review is None else f" With the review rule, also `OUT/<{stem}>_review.json`: review (yes/no), review_reason (implausible size; unfamiliar input; uncertain), the case scores and the familiarity distance, as predict's predictions.csv has them."}
"""
