"""Write sites in nnU-Net v2's raw layout from FedUQ-layout data (tests, benchmarks and demonstrations; never committed
data): a prostate center's slices stacked back into NIfTI volumes per case, and polyp images as 2D nnU-Net files.

    feduq convert nnunet-raw --data-root /data/feduq --prostate RUNMC --out DATA/Dataset901_ProstateMR/Nijmegen \
        [--cases 8] [--channels T2 ADC]

The volumes' voxel axes are LPS (affine ``diag(-sx, -sy, sz)`` in NIfTI's RAS world), so FedUQ's reader, which
reorients to LPS, gives back ``vol[:, :, z]`` = the PNG slice in MONAI's (width, height) order: the same arrays the
slices give as PNG files. In-plane spacing: the native spacing of ``provenance.csv`` times the native width over the
stored 384 px.
"""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
from PIL import Image

PROSTATE_LABELS = {"background": 0, "PZ": 1, "TZ": 2}


def prostate_cases(data_root: Path, center: str) -> dict[str, list[dict]]:
    """``case -> provenance rows sorted by slice`` of a prostate center in FedUQ's layout."""
    rows = list(csv.DictReader(open(Path(data_root) / "prostate" / center / "provenance.csv")))
    cases = defaultdict(list)
    for r in rows:
        cases[r["case"]].append(r)
    return {c: sorted(v, key=lambda r: int(r["slice_z"])) for c, v in sorted(cases.items())}


def task_declaration(name: str, sites: list[str], *, channels=("T2",), labels=None, file_ending=".nii.gz",
                     **feduq) -> dict:
    return {"name": name, "channel_names": {str(i): c for i, c in enumerate(channels)},
            "labels": dict(labels or PROSTATE_LABELS), "file_ending": file_ending,
            "feduq": {"sites": list(sites), **feduq}}


def write_site_json(site_dir: Path, channels, labels, file_ending, num_training) -> None:
    site_dir.mkdir(parents=True, exist_ok=True)
    (site_dir / "dataset.json").write_text(json.dumps({
        "channel_names": {str(i): c for i, c in enumerate(channels)}, "labels": labels,
        "numTraining": num_training, "file_ending": file_ending}, indent=1))


def prostate_site(data_root: Path, center: str, site_dir: Path, *, max_cases: int | None = None, channels=("T2",),
                  labels: dict | None = None, keep=None, file_ending: str = ".nii.gz") -> list[str]:
    """Write ``center``'s slices as an nnU-Net raw site at ``site_dir``; returns the case names.

    Args:
        channels: channel names; a second channel is the first one inverted (255 - x), so the two differ.
        labels: the site's dataset.json labels (default PZ/TZ); ``keep``: label values kept in the label maps (the
            others set to 0, a site annotating a subset).
    """
    import nibabel as nib

    labels = dict(labels or PROSTATE_LABELS)
    src = Path(data_root) / "prostate" / center
    (site_dir / "imagesTr").mkdir(parents=True, exist_ok=True)
    (site_dir / "labelsTr").mkdir(parents=True, exist_ok=True)
    names = []
    for case, rows in list(prostate_cases(data_root, center).items())[:max_cases]:
        img = np.stack([np.asarray(Image.open(src / r["image_file"])).T for r in rows], axis=-1)
        seg = np.stack([np.asarray(Image.open(src / r["mask_file"])).T for r in rows], axis=-1).astype(np.uint8)
        if keep is not None:
            seg = np.where(np.isin(seg, list(keep)), seg, 0).astype(np.uint8)
        sx, sy, sz = (float(v) for v in rows[0]["spacing_mm"].split("x"))
        scale = float(rows[0]["orig_width"]) / img.shape[0]
        affine = np.diag([-sx * scale, -sy * scale, sz, 1.0])
        name = f"{case.lower()}"
        for c in range(len(channels)):
            data = img if c == 0 else 255 - img
            nib.save(nib.Nifti1Image(data.astype(np.int16), affine), site_dir / "imagesTr" / f"{name}_{c:04d}{file_ending}")
        nib.save(nib.Nifti1Image(seg, affine), site_dir / "labelsTr" / f"{name}{file_ending}")
        names.append(name)
    write_site_json(site_dir, channels, labels, file_ending, len(names))
    return names


def prostate_slices_site(data_root: Path, center: str, site_dir: Path, *, max_cases: int | None = None,
                         channels=("T2", "ADC"), folder: str = "imagesTr") -> list[str]:
    """Write ``center``'s slices as a 2D nnU-Net site: each slice a case ``<case>_z<zz>`` with one gray PNG per
    channel (the second channel is 255 - the first) and, in ``imagesTr``, its label PNG (values 0/1/2). Returns the
    case names."""
    src = Path(data_root) / "prostate" / center
    (site_dir / folder).mkdir(parents=True, exist_ok=True)
    names = []
    for case, rows in list(prostate_cases(data_root, center).items())[:max_cases]:
        for r in rows:
            name = f"{case.lower()}_z{int(r['slice_z']):02d}"
            img = np.asarray(Image.open(src / r["image_file"]))
            for c in range(len(channels)):
                Image.fromarray(img if c == 0 else 255 - img).save(site_dir / folder / f"{name}_{c:04d}.png")
            if folder == "imagesTr":
                (site_dir / "labelsTr").mkdir(exist_ok=True)
                Image.open(src / r["mask_file"]).save(site_dir / "labelsTr" / f"{name}.png")
            names.append(name)
    if folder == "imagesTr":
        write_site_json(site_dir, channels, dict(PROSTATE_LABELS), ".png", len(names))
    return names


def polyp_site(data_root: Path, center: str, site_dir: Path, stems: list[str]) -> None:
    """Write polyp images of ``center`` as a 2D nnU-Net site: ``<stem>_0000.png`` (RGB, lossless from the stored
    JPEG's decoded pixels) and ``labelsTr/<stem>.png`` with values 0/1."""
    src = Path(data_root) / "polyp" / center
    (site_dir / "imagesTr").mkdir(parents=True, exist_ok=True)
    (site_dir / "labelsTr").mkdir(parents=True, exist_ok=True)
    for stem in stems:
        image = next(p for p in (src / "images").iterdir() if p.stem == stem)
        Image.open(image).convert("RGB").save(site_dir / "imagesTr" / f"{stem}_0000.png")
        mask = (np.asarray(Image.open(src / "masks" / f"{stem}.png")) > 127).astype(np.uint8)
        Image.fromarray(mask).save(site_dir / "labelsTr" / f"{stem}.png")
    write_site_json(site_dir, ("R", "G", "B"), {"background": 0, "polyp": 1}, ".png", len(stems))


def polyp_task(data_root: Path, root: Path, centers: list[str], max_items: int, name: str = "Dataset902_Polyp") -> Path:
    """The built-in polyp task re-expressed as a task file whose sites are nnU-Net raw datasets under ``root``: for
    each center the first ``max_items`` images of each committed split (``feduq/splits/polyp/<center>.json``), a
    ``split.json`` naming them as cases in the same order, and the center's ``provenance.csv`` (the sizes before the
    stretch, for the letterbox). Returns the task file's path."""
    from feduq.data import PACKAGE_SPLITS_DIR

    for center in centers:
        split = json.loads((PACKAGE_SPLITS_DIR / "polyp" / f"{center}.json").read_text())
        cases = {key: [Path(it["image"]).stem for it in split[key][:max_items]]
                 for key in ("training", "validation", "testing")}
        site_dir = root / name / center
        polyp_site(data_root, center, site_dir, [s for v in cases.values() for s in v])
        (site_dir / "split.json").write_text(json.dumps(cases))
        (site_dir / "provenance.csv").write_bytes((Path(data_root) / "polyp" / center / "provenance.csv").read_bytes())
    task = {"name": name, "channel_names": {"0": "R", "1": "G", "2": "B"}, "labels": {"background": 0, "polyp": 1},
            "file_ending": ".png", "feduq": {"sites": list(centers), "normalization": {str(c): "noNorm" for c in range(3)}}}
    path = root / f"{name}.json"
    path.write_text(json.dumps(task, indent=1))
    return path


#: nnU-Net's region syntax for the optic disc and cup: the disc is values 1 (rim) and 2 (cup), the cup value 2, painted
#: disc first then cup (``regions_class_order``), so a label map holds 0 / 1 (rim) / 2 (cup) as FedUQ's fundus masks do
FUNDUS_REGIONS = {"background": 0, "optic_disc": [1, 2], "optic_cup": 2}
#: the four fundus centers under new site names (a consortium's own names, not FedUQ's)
FUNDUS_SITES = {"Drishti-GS": "EyeClinic-A", "RIM-ONE-r3": "EyeClinic-B", "REFUGE-train": "EyeClinic-C",
                "REFUGE-val": "EyeClinic-D"}


def fundus_region_task(data_root: Path, root: Path, *, disc_only=("EyeClinic-D",), cup_only=(), max_items=None,
                       name: str = "Dataset903_FundusRegions") -> Path:
    """The fundus images as a region task in nnU-Net's raw layout under ``root/<name>/<site>/``: RGB
    ``<case>_0000.png``, labels in nnU-Net's region painting (0, 1 = disc rim, 2 = cup), the task's ``labels`` in the
    region syntax (:data:`FUNDUS_REGIONS`). A site in ``disc_only`` annotates the optic disc only (its dataset.json
    ``{"background": 0, "optic_disc": 1}``, masks 0/1); one in ``cup_only`` the cup only (``{"background": 0,
    "optic_cup": 1}``). Returns the task file's path (``root/<name>.json``)."""
    for center, site in FUNDUS_SITES.items():
        src = Path(data_root) / "fundus" / center
        site_dir = root / name / site
        (site_dir / "imagesTr").mkdir(parents=True, exist_ok=True)
        (site_dir / "labelsTr").mkdir(parents=True, exist_ok=True)
        stems = sorted(p.stem for p in (src / "images").iterdir() if not p.name.startswith("."))[:max_items]
        for stem in stems:
            image = next(p for p in (src / "images").iterdir() if p.stem == stem)
            Image.open(image).convert("RGB").save(site_dir / "imagesTr" / f"{stem}_0000.png")
            mask = np.asarray(Image.open(src / "masks" / f"{stem}.png")).astype(np.uint8)
            if site in disc_only:
                mask = (mask >= 1).astype(np.uint8)
            elif site in cup_only:
                mask = (mask == 2).astype(np.uint8)
            Image.fromarray(mask).save(site_dir / "labelsTr" / f"{stem}.png")
        labels = ({"background": 0, "optic_disc": 1} if site in disc_only else
                  {"background": 0, "optic_cup": 1} if site in cup_only else dict(FUNDUS_REGIONS))
        write_site_json(site_dir, ("R", "G", "B"), labels, ".png", len(stems))
        if labels == FUNDUS_REGIONS:
            own = json.loads((site_dir / "dataset.json").read_text())
            own["regions_class_order"] = [1, 2]
            (site_dir / "dataset.json").write_text(json.dumps(own, indent=1))
    task = {"name": name, "channel_names": {"0": "R", "1": "G", "2": "B"}, "labels": dict(FUNDUS_REGIONS),
            "regions_class_order": [1, 2], "file_ending": ".png",
            "feduq": {"sites": list(FUNDUS_SITES.values())}}
    path = root / f"{name}.json"
    path.write_text(json.dumps(task, indent=1))
    return path


TOOL = "feduq convert nnunet-raw"


class ArgumentError(Exception):
    """A bad argument: one line naming it (exit 2)."""


def check_arguments(data_root: Path, center: str, cases: int | None, channels) -> dict[str, list[dict]]:
    """Everything :func:`main` checks before it creates a folder: the data root, the center (its ``provenance.csv``
    and the files of the cases written), ``--cases`` (1 to the center's number of cases) and ``--channels`` (distinct
    names). Returns the center's cases (:func:`prostate_cases`). Raises :class:`ArgumentError` naming the argument."""
    data_root = Path(data_root).expanduser()
    if not data_root.is_dir():
        raise ArgumentError(f"--data-root {data_root}: no such folder")
    if not (data_root / "prostate").is_dir():
        raise ArgumentError(f"--data-root {data_root}: holds no prostate/ folder (FedUQ's layout: "
                            f"prostate/<center>/provenance.csv)")
    centers = sorted(p.name for p in (data_root / "prostate").iterdir() if (p / "provenance.csv").is_file())
    if center not in centers:
        raise ArgumentError(f"--prostate {center}: no such center under {data_root / 'prostate'} (centers with a "
                            f"provenance.csv: {', '.join(centers) or 'none'})")
    provenance = data_root / "prostate" / center / "provenance.csv"
    try:
        found = prostate_cases(data_root, center)
    except (OSError, UnicodeDecodeError, csv.Error, KeyError, ValueError) as e:
        raise ArgumentError(f"--prostate {center}: {provenance} cannot be read as FedUQ's provenance.csv "
                            f"(case, slice_z, image_file, mask_file, spacing_mm, orig_width): {e!r}") from None
    if not found:
        raise ArgumentError(f"--prostate {center}: {provenance} lists no slices")
    if cases is not None and not 1 <= cases <= len(found):
        raise ArgumentError(f"--cases {cases}: expected a whole number from 1 to {len(found)} (the cases of "
                            f"{center}), or no --cases for all of them")
    if len(set(channels)) != len(channels) or not all(str(c).strip() for c in channels):
        raise ArgumentError(f"--channels {' '.join(channels)}: expected distinct, non-empty channel names")
    src = data_root / "prostate" / center
    for rows in list(found.values())[:cases]:
        for r in rows:
            for key in ("image_file", "mask_file"):
                if not (src / r[key]).is_file():
                    raise ArgumentError(f"--prostate {center}: {src / r[key]} is listed in {provenance} "
                                        f"({key}) and missing")
    return found


def undecodable(data_root: Path, center: str, cases: int | None) -> Path | None:
    """The first image or mask of the first ``cases`` cases that Pillow cannot decode (None: all decode)."""
    src = Path(data_root) / "prostate" / center
    for rows in list(prostate_cases(data_root, center).values())[:cases]:
        for r in rows:
            for key in ("image_file", "mask_file"):
                try:
                    with Image.open(src / r[key]) as im:
                        im.load()
                except Exception:
                    return src / r[key]
    return None


def main(argv=None) -> int:
    import argparse
    import shutil
    import sys

    class Parser(argparse.ArgumentParser):
        def error(self, message):  # one line, exit 2 (argparse prints its usage too)
            self.exit(2, f"{TOOL}: error: {message} (see --help)\n")

    p = Parser(prog=TOOL, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-root", required=True, help="FedUQ-layout data root holding prostate/<center>/")
    p.add_argument("--prostate", required=True, help="the prostate center whose slices become volumes (RUNMC, BMC)")
    p.add_argument("--out", type=Path, required=True, help="the nnU-Net site folder to write (new or empty)")
    p.add_argument("--cases", type=int, help="the first N cases, 1 to the center's number (default: all)")
    p.add_argument("--channels", nargs="+", default=["T2"], help="channel names (a second one is 255 - the first)")
    p.add_argument("--force", action="store_true", help="write into an --out folder that holds files FedUQ did not "
                                                        "write (they are kept)")
    a = p.parse_args(argv)
    from feduq.outputs import OutputFolderError, check_output_folder, staged_folder

    try:  # every check before any folder is made
        check_arguments(Path(a.data_root), a.prostate, a.cases, a.channels)
        # the site folder may lie in a data root of its own: only the source data root is kept clear
        out = check_output_folder(a.out, {"source data root": a.data_root}, TOOL, force=a.force,
                                  env_data_root=False)
    except ArgumentError as e:
        print(f"{TOOL}: error: {e}", file=sys.stderr)
        return 2
    except OutputFolderError as e:
        print(str(e) if str(e).startswith(TOOL) else f"{TOOL}: error: {e}", file=sys.stderr)
        return 2
    made = next((d for d in reversed([out, *out.parents]) if not d.exists()), None)  # the first folder this run makes
    try:  # FedUQ's staging (feduq.outputs.staged_folder): moved into --out only when complete, the user's files kept
        with staged_folder(out, overwrite=True, what=TOOL, marker=TOOL) as stage:
            names = prostate_site(Path(a.data_root), a.prostate, stage, max_cases=a.cases, channels=tuple(a.channels))
    except Exception as e:  # a file that does not decode: nothing of this run is left
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        bad = undecodable(Path(a.data_root), a.prostate, a.cases)
        print(f"{TOOL}: error: --prostate {a.prostate}: writing the site failed, nothing written: "
              f"{f'{bad}: ' if bad else ''}{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"wrote {len(names)} cases to {out}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
