"""FedA3I's Contour Evolution Model (feduq.methods.feda3i.annotator_noise) and feduq noisy-labels, on small synthetic masks."""

import json

import numpy as np
import pytest
from PIL import Image
from scipy import ndimage
from skimage.draw import disk, ellipse

from conftest import load_tool
from helpers import disc, fake_center
from feduq.methods.feda3i import annotator_noise as N


def blob(shape=(128, 128)):
    """A non-convex object: a rotated ellipse plus a disc."""
    m = np.zeros(shape, dtype=bool)
    rr, cc = ellipse(64, 55, 40, 20, shape=shape, rotation=0.5)
    m[rr, cc] = True
    rr, cc = disk((64, 85), 15, shape=shape)
    m[rr, cc] = True
    return m


def rng(seed):
    return np.random.default_rng(seed)


# ------------------------------------------------------------------ CEM on masks
def test_trace_contour_is_the_ordered_closed_inner_boundary():
    m = blob()
    c = N.trace_contour(m)
    boundary = m & ~ndimage.binary_erosion(m)  # pixels with a 4-neighbour on the background
    assert {tuple(p) for p in c} == {tuple(p) for p in np.argwhere(boundary)}
    steps = np.abs(np.diff(np.vstack([c, c[:1]]), axis=0)).max(1)
    assert (steps == 1).all()  # 8-connected, closed
    assert len(N.trace_contour(np.zeros((5, 5), bool))) == 0
    assert len(N.trace_contour(np.pad(np.ones((1, 1), bool), 2))) == 1


def test_zero_noise_is_the_identity_and_values_are_kept():
    m = disc()
    for mask in (m, m > 0, (m > 0).astype(np.uint8)):
        out = N.noisy_label(mask, N.SiteNoise(0.0, 0.0), rng(0))
        assert out.mask.dtype == mask.dtype and np.array_equal(out.mask, mask)
        assert (out.objects, out.evolved, out.dropped) == (1, 1, 0)
    assert np.array_equal(N.evolve_mask(blob(), N.SiteNoise(0.3, 0.0), rng(0)), blob())
    ones_twos = np.where(m > 0, 2, 1).astype(np.uint8)  # foreground = the larger value
    assert np.array_equal(N.noisy_label(ones_twos, N.SiteNoise(0.0, 0.0), rng(0)).mask, ones_twos)
    assert np.array_equal(N.evolve_mask(ones_twos, N.SiteNoise(0.0, 0.0), rng(0)), m > 0)


def test_seed_reproduces_and_different_seeds_differ():
    m, noise = blob(), N.SiteNoise(-5.0, 4.0)
    a = N.noisy_label(m, noise, rng(7)).mask
    assert np.array_equal(a, N.noisy_label(m, noise, rng(7)).mask)
    assert not np.array_equal(a, N.noisy_label(m, noise, rng(8)).mask)


@pytest.mark.parametrize("mu", [10.0, -10.0])
def test_positive_mu_grows_and_negative_mu_shrinks(mu):
    clean = disc(25)
    areas = [N.evolve_mask(clean, N.SiteNoise(mu, 2.0), rng(s)).sum() for s in range(20)]
    expected = np.pi * (25 + mu) ** 2  # a disc of radius 25 + mu
    assert np.sign(np.mean(areas) - (clean > 0).sum()) == np.sign(mu)
    assert abs(np.mean(areas) - expected) < 0.15 * expected


def test_bias_is_clipped_to_30_px():
    clean = disc(25, shape=(160, 160), center=(80, 80)) > 0
    outside = ndimage.distance_transform_edt(~clean)  # px to the clean object
    for seed in range(3):
        noisy = N.evolve_mask(clean, N.SiteNoise(100.0, 2.0), rng(seed))
        assert outside[noisy].max() <= 31  # within the 31-px (disc) dilation
        assert noisy.sum() > 0.9 * np.pi * 55 ** 2  # and grown by about the full 30 px
    big = disc(50, shape=(160, 160), center=(80, 80)) > 0
    depth = ndimage.distance_transform_edt(big)  # px to the background
    for seed in range(3):
        noisy = N.evolve_mask(big, N.SiteNoise(-100.0, 2.0), rng(seed))
        assert not (noisy & ~big).any() and noisy[depth > 31].all()  # contains the 31-px erosion
        assert noisy.sum() < 1.1 * np.pi * 20 ** 2


def test_bias_sequence_statistics_and_closure():
    b, draws = N.bias_sequence(400, N.SiteNoise(-8.0, 2.0), rng(0))
    assert b.shape == (400,) and draws >= 1 and abs(b[0] - b[-1]) < N.MAX_CLOSURE_GAP
    assert abs(b.mean() + 8.0) < 3.0
    assert np.abs(N.bias_sequence(400, N.SiteNoise(0.0, 80.0), rng(1))[0]).max() <= N.MAX_BIAS
    with pytest.raises(ValueError, match="length"):
        N.bias_sequence(29, N.SiteNoise(0.0, 1.0), rng(0))


def test_small_components_dropped_and_separate_discs_kept():
    m = disc(15, center=(30, 30)) | disc(12, center=(95, 95))
    m[5:8, 110:114] = 255  # 12 px: dropped
    m[60:64, 5:9] = 255  # 16 px, contour 12 < 30: kept unchanged
    out = N.noisy_label(m, N.SiteNoise(3.0, 1.0), rng(0))
    assert (out.objects, out.evolved, out.dropped, out.unchanged) == (4, 2, 1, 1)
    labels, n = ndimage.label(out.mask > 0, structure=np.ones((3, 3)))
    assert n == 3
    assert not out.mask[5:8, 110:114].any() and out.mask[60:64, 5:9].all()
    assert out.mask[30, 30] and out.mask[95, 95]


def test_dice_falls_as_sigma_grows():
    clean = blob()
    means = [np.mean([N.dice(N.evolve_mask(clean, N.SiteNoise(0.0, s), rng(k)), clean) for k in range(4)])
             for s in (1.0, 4.0, 12.0)]
    assert means[0] > means[1] > means[2]
    assert means[0] > 0.95


def test_mask_checks():
    m = disc().astype(np.int32)
    m[0, 0] = 7
    with pytest.raises(ValueError, match="binary.*0, 7, 255"):
        N.noisy_label(m, N.SiteNoise(0.0, 1.0), rng(0))
    with pytest.raises(ValueError, match="2-D"):
        N.evolve_mask(np.zeros((4, 4, 3)), N.SiteNoise(0.0, 1.0), rng(0))
    with pytest.raises(ValueError, match="shape"):
        N.dice(disc(), np.zeros((32, 32)))
    empty = np.zeros((32, 32), np.uint8)
    out = N.noisy_label(empty, N.SiteNoise(5.0, 1.0), rng(0))
    assert out.objects == 0 and np.array_equal(out.mask, empty)
    assert N.dice(empty, empty) == 1.0 and N.dice(disc(), disc()) == 1.0 and N.dice(disc(), np.zeros_like(disc())) == 0.0


# ------------------------------------------------------------------ per-site parameters
def test_draw_site_noise_paper_mode():
    model = N.PRESETS["skin_ne"]
    sites = N.draw_site_noise(4000, model, rng(0))
    mu = np.array([s.mu for s in sites])
    sigma = np.array([s.sigma for s in sites])
    assert abs((mu > 0).mean() - 0.8) < 0.03
    assert mu.max() <= 25 and mu.min() >= -25 and abs(mu[mu > 0].mean() - 12.5) < 1.0
    assert sigma.min() >= 5 and sigma.max() <= 10
    breast = np.array([s.mu for s in N.draw_site_noise(2000, N.PRESETS["breast_ns"], rng(1))])
    assert abs((breast > 0).mean() - 0.2) < 0.03 and breast.min() >= -15 and breast.max() <= 25
    assert N.draw_site_noise(5, model, rng(3)) == N.draw_site_noise(5, model, rng(3))


@pytest.mark.parametrize("preset,k,negative", [("skin_ne", 10, 2), ("skin_ns", 10, 8), ("skin_ne", 50, 10),
                                               ("breast_ns", 7, 5)])
def test_draw_site_noise_code_mode_exact_count(preset, k, negative):
    model = N.PRESETS[preset]
    for seed in range(3):
        sites = N.draw_site_noise(k, model, rng(seed), mode="code")
        mu = np.array([s.mu for s in sites])
        assert (mu < 0).sum() == negative
        assert mu.min() >= model.mu_min and mu.max() <= model.mu_max
        assert all(model.sigma_max / 2 <= s.sigma <= model.sigma_max for s in sites)


@pytest.mark.parametrize("args,name", [((-1, -20, 10, 0.2), "mu_max"), ((20, 1, 10, 0.2), "mu_min"),
                                       ((20, -20, 0, 0.2), "sigma_max"), ((20, -20, 10, 1.5), "p_d"),
                                       ((20, -20, float("nan"), 0.2), "sigma_max")])
def test_bad_model_parameters(args, name):
    with pytest.raises(ValueError, match=name):
        N.NoiseModel(*args)


def test_bad_draw_arguments():
    with pytest.raises(ValueError, match="num_sites"):
        N.draw_site_noise(0, N.PRESETS["skin_ns"], rng(0))
    with pytest.raises(ValueError, match="mode"):
        N.draw_site_noise(3, N.PRESETS["skin_ns"], rng(0), mode="bernoulli")
    with pytest.raises(ValueError, match="sigma"):
        N.SiteNoise(1.0, -1.0)


# ------------------------------------------------------------------ feduq noisy-labels


def test_make_noisy_labels_tool(tmp_path, capsys):
    tool = load_tool("make_noisy_labels")
    data, out = tmp_path / "data", tmp_path / "out"
    clean = {c: fake_center(data, c) for c in ("ISIC-2017", "HAM10000-rosendahl")}
    argv = ["--data-root", str(data), "--task", "skin", "--sites", "ISIC-2017,HAM10000-rosendahl",
            "--preset", "skin_ne", "--seed", "3", "--out", str(out)]
    assert tool.main(argv) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "WARNING" in captured.err and "masks/img5.png" in captured.err  # the empty mask is named
    for site, cdir in clean.items():
        odir = out / "skin_lesion" / site
        assert (odir / "images").resolve() == (cdir / "images").resolve() and (odir / "images").is_symlink()
        assert (odir / "labels.json").read_text() == (cdir / "labels.json").read_text()
        assert (odir / "provenance.csv").is_file()
        split = json.loads((odir / "splits" / f"{site}.json").read_text())
        assert [it["label"] for it in split["testing"]] == ["masks/img4.png"]
        assert {it["label"] for it in split["training"] + split["validation"]} == {
            f"noisy/{site}/img{i}.png" for i in (0, 1, 2, 3, 5)}
        noisy = np.array(Image.open(odir / "noisy" / site / "img0.png"))
        assert set(np.unique(noisy)) <= {0, 255} and noisy.shape == (64, 64)
        info = json.loads((odir / "noise" / f"{site}.json").read_text())
        assert 0 < info["dice_mean"] <= 1 and info["dice_min"] <= info["dice_mean"]
        assert info["num_masks"] == 5 and info["kept_clean"] == ["masks/img5.png"]
        assert info["preset"] == "skin_ne" and info["model"]["p_d"] == 0.8 and info["seed"] == 3
        assert f"{site}" in printed
    # the same seed writes the same masks
    first = (out / "skin_lesion" / "ISIC-2017" / "noisy" / "ISIC-2017" / "img1.png").read_bytes()
    assert tool.main(argv[:-1] + [str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "skin_lesion" / "ISIC-2017" / "noisy" / "ISIC-2017" / "img1.png").read_bytes() == first
    # --clean-val keeps validation labels clean
    assert tool.main(argv[:-1] + [str(tmp_path / "cv"), "--clean-val", "--sites", "ISIC-2017"]) == 0
    split = json.loads((tmp_path / "cv" / "skin_lesion" / "ISIC-2017" / "splits" / "ISIC-2017.json").read_text())
    assert [it["label"] for it in split["validation"]] == ["masks/img3.png"]
