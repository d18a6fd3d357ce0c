"""Helpers several test modules share (real sites cut small, seeded models, a bundle under MONAI's runner, DICOM
series written as a scanner writes them), kept out of the test modules so a test imports no other test."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from skimage.draw import disk

from conftest import SHARED_DATA as REAL_ROOT, small_job  # noqa: F401 (REAL_ROOT: the data root tests read)


POLYP = ["CVC-ClinicDB", "CVC-ColonDB"]


def light_model(path, in_channels=3, seed=3):
    """A seeded `light` network (its class maps have both classes on real images) saved as FLARE's persistor does."""
    from feduq.core.networks import build_network

    torch.save({"model": build_network("light", in_channels, 2, init_seed=seed).state_dict()}, path)
    return path


def cropped_site(data_root, folder, centers=POLYP, per_center=2):
    """A site folder of real polyp images and masks, cropped to non-square sizes (letterbox padding is exercised)."""
    (folder / "images").mkdir(parents=True)
    (folder / "masks").mkdir()
    shutil.copy(data_root / "polyp" / centers[0] / "labels.json", folder)
    boxes = [(0, 0, 384, 290), (40, 0, 290, 384)]
    for center in centers:
        for i, image in enumerate(sorted((data_root / "polyp" / center / "images").iterdir())[:per_center]):
            box, stem = boxes[i % 2], f"{center}_{image.stem}"
            Image.open(image).convert("RGB").crop(box).save(folder / "images" / f"{stem}.png")
            Image.open(data_root / "polyp" / center / "masks" / f"{image.stem}.png").crop(box).save(
                folder / "masks" / f"{stem}.png")
    return folder


def run_bundle(bundle, images, out):
    """``python -m monai.bundle run`` of ``bundle`` on the folder ``images`` into ``out``, in a fresh interpreter where
    FedUQ cannot be imported (the bundle needs MONAI and PyTorch only); fails the test with the runner's error."""
    import subprocess
    import sys

    argv = ["monai.bundle", "run", "--config_file", str(bundle / "configs" / "inference.json"), "--bundle_root",
            str(bundle), "--dataset_dir", str(images), "--output_dir", str(out)]
    code = (f"import runpy, sys; sys.modules['feduq'] = None; sys.argv = {argv!r}; "
            "runpy.run_module('monai.bundle', run_name='__main__', alter_sys=True)")
    run = subprocess.run([sys.executable, "-I", "-c", code], cwd=out.parent, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


def read_png(path):
    return np.asarray(Image.open(path))


SPLIT_KEYS = ("training", "validation", "testing")


needs_real = pytest.mark.skipif(
    not (REAL_ROOT / "polyp").is_dir(), reason=f"real data not found at {REAL_ROOT} (../shared/data of the repo root)"
)


def write_pair(center_dir: Path, stem: str, size=(32, 24), box=(4, 4, 14, 10), ext="png", mask_size=None) -> None:
    """RGB image whose red channel is high exactly where the 0/255 mask is set (box = x0, y0, x1, y1)."""
    w, h = size
    mask = np.zeros((h, w), np.uint8)
    x0, y0, x1, y1 = box
    mask[y0:y1, x0:x1] = 255
    rgb = np.stack([mask // 255 * 200 + 20, np.full_like(mask, 60), np.full_like(mask, 90)], -1).astype(np.uint8)
    (center_dir / "images").mkdir(parents=True, exist_ok=True)
    (center_dir / "masks").mkdir(parents=True, exist_ok=True)
    Image.fromarray(rgb).save(center_dir / "images" / f"{stem}.{ext}")
    m = Image.fromarray(mask)
    if mask_size:
        m = m.resize(mask_size, Image.Resampling.NEAREST)
    m.save(center_dir / "masks" / f"{stem}.png")


def make_site(root: Path, center: str = "CVC-ClinicDB", n: int = 3, **kw) -> Path:
    center_dir = root / "polyp" / center
    for i in range(n):
        write_pair(center_dir, f"img{i}", **kw)
    (center_dir / "labels.json").write_text(json.dumps({"labels": {"0": "background", "255": "polyp"}}))
    return center_dir


def prostate_case(tmp_path, data_root):
    """A 2D MRI job (stretch, min-max), a seeded 1-channel model and an LPS volume of 3 real RUNMC slices (96 x 80)."""
    job = small_job("fedavg", tmp_path / "job", task="prostate", sites=["RUNMC", "BMC"], network="light",
                    image_size=64, executor_args={"resize": "stretch", "intensity": "minmax"})
    model = light_model(tmp_path / "model.pt", in_channels=1, seed=1)
    slices = sorted((data_root / "prostate" / "RUNMC" / "images").glob("Case00_z*.png"))[8:11]
    lps = np.stack([np.asarray(Image.open(p).resize((96, 80))).T.astype(np.int16) * 7 + 40 for p in slices], axis=-1)
    return job, model, lps


def write_dicom_series(lps, folder, spacing=(0.6, 0.6, 3.0), origin=(-20.0, 15.0, 7.5), frame_of_reference=True):
    """An axial MR series (one .dcm per slice, LPS as DICOM; one study, patient and frame of reference, as a scanner
    writes them) written by SimpleITK's GDCM writer."""
    import SimpleITK as sitk

    from feduq.io.volumes import keep_locale

    folder.mkdir()
    root = "1.2.826.0.1.3680043.2.1125."
    shared = {"0020|000e": root + "1", "0020|000d": root + "2", "0010|0020": "FEDUQ-TEST", "0008|0060": "MR",
              "0020|0037": "1\\0\\0\\0\\1\\0", "0018|0050": str(spacing[2])}
    if frame_of_reference:
        shared["0020|0052"] = root + "3"
    for z in range(lps.shape[2]):
        plane = sitk.GetImageFromArray(np.ascontiguousarray(lps[:, :, z].T)[None].astype(np.int16))
        plane.SetSpacing(spacing)
        plane.SetOrigin((origin[0], origin[1], origin[2] + z * spacing[2]))
        for tag, value in {**shared, "0020|0013": str(z + 1),
                           "0020|0032": "\\".join(str(v) for v in (origin[0], origin[1], origin[2] + z * spacing[2]))
                           }.items():
            plane.SetMetaData(tag, value)
        writer = sitk.ImageFileWriter()
        writer.KeepOriginalImageUIDOn()
        writer.SetFileName(str(folder / f"slice{z:03d}.dcm"))
        with keep_locale():  # GDCM's writer leaves the process in the C locale
            writer.Execute(plane)


def disc(radius=25, shape=(128, 128), center=(64, 64), value=255):
    """A uint8 mask [H, W] holding ``value`` inside a disc of ``radius`` pixels around ``center`` (row, column)."""
    m = np.zeros(shape, dtype=np.uint8)
    rr, cc = disk(center, radius, shape=shape)
    m[rr, cc] = value
    return m


def fake_center(root, center, n=6):
    """A skin-lesion site of ``n`` 64 px images with discs of growing radius (the last one empty) and its own split."""
    cdir = root / "skin_lesion" / center
    (cdir / "images").mkdir(parents=True)
    (cdir / "masks").mkdir()
    items = []
    for i in range(n):
        stem = f"img{i}"
        Image.fromarray(np.full((64, 64, 3), 40 * i, np.uint8)).save(cdir / "images" / f"{stem}.png")
        Image.fromarray(disc(14 + i, shape=(64, 64), center=(32, 32))).save(cdir / "masks" / f"{stem}.png")
        items.append({"image": f"images/{stem}.png", "label": f"masks/{stem}.png"})
    Image.fromarray(np.zeros((64, 64), np.uint8)).save(cdir / "masks" / "img5.png")  # no foreground
    (cdir / "labels.json").write_text(json.dumps({"labels": {"0": "background", "255": "lesion"}}))
    (cdir / "provenance.csv").write_text("file\n" + "".join(f"img{i}.png\n" for i in range(n)))
    split = {"training": items[:3] + items[5:], "validation": items[3:4], "testing": items[4:5]}
    (cdir / "split.json").write_text(json.dumps(split))
    return cdir
