"""Issue 69 item 2: the MONAI Bundle exports tasks scored by nested regions (a declared task in nnU-Net's region syntax,
the built-in fundus task). Run by MONAI's own runner without FedUQ, it writes the label files ``predict`` writes for
the same model and inputs (nnU-Net's region painting: each region's largest component, painted back widest first),
and its README states what it does: the declared channels' normalisation, the input and output names, and which value
means which region."""

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import small_job
from helpers import read_png, run_bundle

CROPS = [(0, 0, 384, 300), (50, 0, 330, 384), (0, 0, 384, 384)]  # letterbox padding on both axes, and none


#: a top-two probability gap this small is a tie within float32 rounding of the network's and the resize's sums
TIE = 1e-4


def decision_margin(job, model, image_file):
    """predict's eager probabilities of one image on its own grid: the gap between its two most probable classes per
    pixel ``[H, W]`` (as label.png), computed as predict computes them (the job's transforms, to_stored_grid,
    prob_fn)."""
    from feduq.scores.scoring import to_stored_grid
    from feduq.predict.files import read_plane
    from feduq.predict.planes import Predictor
    from feduq.site.evaluation import load_model, locate

    config, model_file = locate(str(job), str(model), "best")
    predictor = Predictor(load_model(config, model_file), batch_size=1)
    plane, _ = read_plane(image_file, predictor.spec.in_channels)
    with torch.no_grad():
        logits = predictor.loaded.model(predictor.inputs([plane])).float()
        grid = to_stored_grid(logits, tuple(plane.shape[1:]), predictor.site.resize == "letterbox")
        top = predictor.site.prob_fn(grid)[0].topk(2, dim=0).values
    return (top[0] - top[1]).numpy().T


def fundus_inputs(data_root, folder, name=lambda stem: f"{stem}_0000.png", n=3):
    """``n`` REFUGE-val fundus images (a center no fixture site trains on), cropped to ``CROPS``, saved as ``name``."""
    folder.mkdir(parents=True)
    stems = []
    for box, image in zip(CROPS, sorted((data_root / "fundus" / "REFUGE-val" / "images").iterdir())[:n]):
        Image.open(image).convert("RGB").crop(box).save(folder / name(image.stem))
        stems.append(image.stem)
    return stems


def test_paint_regions_is_predicts_region_label_map_and_keeps_a_rim_the_cup_cuts_in_two():
    """Why the export was refused: the bundle's per-class largest component drops one arc of a disc rim cut in two by
    the cup, where predict (feduq.scores.metrics.region_label_map) keeps the disc as one region."""
    from monai.transforms import KeepLargestConnectedComponent

    from feduq.scores.metrics import region_label_map
    from feduq.bundle.scripts.bundle_regions import paint_regions

    label = torch.zeros(1, 12, 12, dtype=torch.long)
    label[0, 2:10, 2:10] = 1  # the rim
    label[0, 2:10, 5:7] = 2  # the cup cuts it into a left and a right arc
    label[0, 0, 11] = 2  # a stray cup pixel, apart from the disc: dropped
    regions = {"disc": (1, 2), "cup": (2,)}
    want = region_label_map(label[None], regions, True, 8)[0]
    got = paint_regions(label, [list(c) for c in regions.values()], 8)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert int((got == 1).sum()) == 48 and int((got == 2).sum()) == 16  # both arcs kept, the stray pixel gone
    per_class = KeepLargestConnectedComponent(applied_labels=[1, 2], is_onehot=False)(label)
    assert int((torch.as_tensor(per_class) == 1).sum()) == 24  # one arc lost


def test_a_declared_region_task_exports_a_bundle_that_writes_predicts_region_painting(tmp_path, data_root):
    import nnunet_sites

    from feduq.core.networks import build_network
    from feduq.commands.site.predict import main as predict

    task = nnunet_sites.fundus_region_task(data_root, tmp_path / "data", disc_only=(), max_items=1)
    job = small_job("fedavg", tmp_path / "job", task=task, sites=list(nnunet_sites.FUNDUS_SITES.values()),
                    network="light", image_size=64)
    model = tmp_path / "model.pt"  # seed 0: all three values on these images
    torch.save({"model": build_network("light", 3, 3, init_seed=0).state_dict()}, model)
    new = tmp_path / "new"
    cases = fundus_inputs(data_root, new)
    assert predict(["--job", str(job), "--model", str(model), "--input", str(new), "--out", str(tmp_path / "pred"),
                    "--no-progress"]) == 0
    bundle = tmp_path / "bundle"
    assert predict(["--job", str(job), "--model", str(model), "--export-bundle", str(bundle)]) == 0
    run_bundle(bundle, new, tmp_path / "bout")
    for case in cases:
        mine, theirs = read_png(tmp_path / "pred" / f"{case}.png"), read_png(tmp_path / "bout" / f"{case}.png")
        assert mine.shape == theirs.shape == read_png(new / f"{case}_0000.png").shape[:2]
        np.testing.assert_array_equal(theirs, mine)
        assert (tmp_path / "bout" / f"{case}_uncertainty_total.png").is_file()
    assert set(np.unique(np.concatenate([read_png(tmp_path / "bout" / f"{c}.png").ravel() for c in cases]))) == {0, 1, 2}
    assert not list((tmp_path / "bout").glob("*_seg.png"))

    meta = json.loads((bundle / "configs" / "metadata.json").read_text())
    assert meta["feduq"]["regions"] == {"optic_disc": [1, 2], "optic_cup": [2]}
    text = (bundle / "docs" / "README.md").read_text()
    assert "| labels | 0 = background, 1 = optic_disc (not optic_cup), 2 = optic_disc + optic_cup |" in text
    assert "| regions | optic_disc = values 1, 2; optic_cup = value 2 |" in text
    assert ("| input | 2D images named as nnU-Net names them, one file per channel: `<case>_0000.png` (R), "
            "`<case>_0001.png` (G), `<case>_0002.png` (B); or one RGB file `<case>_0000.png` holding all three; any "
            "size, no pixel spacing used |") in text
    zscore = "z-score per image, (x - mean) / std of the channel's pixels"
    assert (f"| preprocessing | each channel normalised as the sites read it (`scripts/channel_io.py`), R: {zscore}; "
            f"G: {zscore}; B: {zscore}; then the long side resized to 64 px (bilinear, anti-aliased), the short side "
            "zero-padded symmetrically |") in text
    assert ("Per case: `OUT/<case>.png` (uint8 label values at the image's own width x height, as nnU-Net's predictor "
            "names it) and `OUT/<case>_uncertainty_total.png`") in text
    assert "x / max" not in text and "_seg.png" not in text
    assert "each region's largest connected component (widest region first)" in text


def test_the_built_in_fundus_task_exports_a_bundle_that_writes_predicts_label_maps(tmp_path, data_root):
    from feduq.core.networks import build_network
    from feduq.commands.site.predict import main as predict

    job = small_job("fedavg", tmp_path / "job", task="fundus", network="light", image_size=32)
    model = tmp_path / "model.pt"
    torch.save({"model": build_network("light", 3, 3, init_seed=0).state_dict()}, model)
    images = tmp_path / "images"
    stems = fundus_inputs(data_root, images, name=lambda stem: f"{stem}.png", n=2)
    assert predict(["--job", str(job), "--model", str(model), "--input", str(images), "--out", str(tmp_path / "pred"),
                    "--no-progress"]) == 0
    bundle = tmp_path / "bundle"
    assert predict(["--job", str(job), "--model", str(model), "--export-bundle", str(bundle)]) == 0
    run_bundle(bundle, images, tmp_path / "bout")
    differing = 0
    for stem in stems:
        ours, theirs = read_png(tmp_path / "pred" / stem / "label.png"), read_png(tmp_path / "bout" / f"{stem}_seg.png")
        margin = decision_margin(job, model, images / f"{stem}.png")
        assert margin.shape == ours.shape == theirs.shape
        differ = ours != theirs
        # only where predict's top two classes lie within float rounding may TorchScript and eager round apart
        assert (margin[differ] < TIE).all(), (stem, sorted(margin[differ].tolist())[-3:])
        differing += int(differ.sum())
    assert differing <= 2  # bit for bit but at such ties (0 on most CPUs, 1 pixel of 107,520 seen on AVX-512)
    text = (bundle / "docs" / "README.md").read_text()
    assert "within float rounding of each other" in text
    assert "| labels | 0 = background, 1 = disc (not cup), 2 = disc + cup |" in text
    assert "| regions | disc = values 1, 2; cup = value 2 |" in text
    assert "intensity x / max per image (all channels); then the long side resized to 32 px" in text


def test_the_volume_bundle_paints_each_slice_by_region_as_predict():
    """The volume bundle's slice loop (scripts/bundle_volumes.PlaneInferer, with the bundle's own plane steps at the
    slice's size) on a declared region task's volume: each slice's class map is region_label_map's (the network is the
    identity, its input the one-hot logits of a rim cut in two by the cup, on two slices, one mirrored)."""
    from monai.bundle import ConfigParser
    from monai.data import MetaTensor

    from feduq.scores.metrics import region_label_map
    from feduq.bundle.export import _plane_steps
    from feduq.bundle.scripts.bundle_volumes import PlaneInferer

    label = torch.zeros(12, 12, 2, dtype=torch.long)
    label[2:10, 2:10] = 1
    label[2:10, 5:7] = 2
    label[0, 11] = 2
    label[..., 1] = label[..., 0].flip(0)
    logits = torch.nn.functional.one_hot(label, 3).permute(3, 0, 1, 2).float() * 5  # [3, 12, 12, 2]
    head = lambda z: torch.cat([z.softmax(1), z[:, :1]], 1)  # noqa: E731 - probabilities, then one "map"
    regions = {"disc": (1, 2), "cup": (2,)}
    plane = ConfigParser({"imports": ["$import torch"], "pre": {"_target_": "Compose",
                                                                "transforms": _plane_steps(12, "stretch", "raw")}})
    out = PlaneInferer(plane.get_parsed_content("pre"), head, 3, True, 8, [list(c) for c in regions.values()])(
        MetaTensor(logits[None]), torch.nn.Identity())
    assert tuple(out.shape) == (1, 2, 12, 12, 2)
    for z in range(2):
        want = region_label_map(label[None, None, :, :, z], regions, True, 8)[0, 0]
        np.testing.assert_array_equal(out[0, 0, :, :, z].long().numpy(), want.numpy())
    assert int((out[0, 0] == 1).sum()) == 96  # both arcs of both slices kept
