"""A certificate holds for the site its patients were drawn from (feduq.inference.calibrate): a simulation with known
truth shows a rule certified on two sites' pooled patients failing the worse site alone far above δ (the negative
control), and the same procedure at that site alone keeping δ; so several sites are refused for a certified rule
before any case is scored, and a mixture's certificate (``--pooled-sites``) is stored and worded as the mixture's."""

import numpy as np
import pytest

from feduq.inference.certify import certify_units

N, TARGET, DELTA, DRAWS = 40, 0.65, 0.1, 200


def _dice(rng, mean, n):
    return rng.beta(10 * mean, 10 * (1 - mean), n)


def _upper(k, n, level=0.95):
    """Clopper-Pearson upper bound of a binomial rate."""
    from scipy.stats import beta

    return 1.0 if k == n else float(beta.ppf(level, k + 1, n - k))


def _lower(k, n, level=0.95):
    from scipy.stats import beta

    return 0.0 if k == 0 else float(beta.ppf(1 - level, k, n - k + 1))


def test_a_pooled_certificate_fails_the_worse_site_and_a_per_site_one_keeps_delta():
    """Site A's patients at mean Dice 0.80, B's at 0.60, 40 each, the score uninformative, so the accepted mean Dice
    at any threshold is the site's own mean (the known truth). Target 0.65: B alone cannot carry it, the mixture
    (0.70) can. A certificate promises the target where its units came from; for B, any certificate is a violation."""
    rng = np.random.default_rng(0)
    pooled = alone = 0
    for _ in range(DRAWS):
        a, b = _dice(rng, 0.8, N), _dice(rng, 0.6, N)
        score = rng.random(2 * N)
        units = [f"A/{i}" for i in range(N)] + [f"B/{i}" for i in range(N)]
        mixed = certify_units({"u_mean": score}, np.r_[a, b], units, TARGET, DELTA, max_unit_images=1)
        pooled += mixed.threshold is not None  # true for the mixture (0.70 >= 0.65), false for B (0.60)
        site_b = certify_units({"u_mean": score[N:]}, b, units[N:], TARGET, DELTA, max_unit_images=1)
        alone += site_b.threshold is not None
    assert _lower(pooled, DRAWS) > 3 * DELTA  # the negative control: pooling breaks B's promise (53 % here)
    assert _upper(alone, DRAWS) <= DELTA  # B's own certificate keeps it (0 of 200 here)


def test_several_sites_are_refused_for_a_certified_rule_before_any_case_is_scored(tmp_path):
    from feduq.inference.calibrate import calibrate
    from feduq.inference.files import PredictError

    missing = [tmp_path / "A", tmp_path / "B"]  # never read: the refusal comes first
    with pytest.raises(PredictError, match="certify at each site .* or give --pooled-sites"):
        calibrate(object(), target_dice=0.8, site_dirs=missing)
    with pytest.raises(PredictError, match="certify at each site"):
        calibrate(object(), target_dice=0.8, sites=["Kvasir-SEG", "CVC-ClinicDB"])
    with pytest.raises(PredictError, match="--pooled-sites certifies the mixture"):
        calibrate(object(), target_dice=0.8, site_dirs=missing[:1], pooled_sites=True)


def test_a_mixtures_certificate_is_said_as_the_mixtures_with_its_proportions():
    from feduq.inference.review_notes import certified_for

    c = {"sites": ["A", "B"], "mixture": {"A": 30, "B": 10}, "unit": "patient"}
    assert certified_for(c) == "the mixture of A (30 patients, 75 %) and B (10 patients, 25 %), not each site alone"
    assert certified_for({"sites": ["Hospital-X"]}) == "Hospital-X"


def _site(tmp_path, data_root, n=3):
    import shutil

    folder = tmp_path / "Hospital-X"
    for sub in ("images", "masks"):
        (folder / sub).mkdir(parents=True)
    src = data_root / "polyp" / "Kvasir-SEG"
    shutil.copy(src / "labels.json", folder)
    stems = [p.stem for p in sorted((src / "images").iterdir())[:n]]
    for stem in stems:
        shutil.copy(next((src / "images").glob(f"{stem}.*")), folder / "images")
        shutil.copy(src / "masks" / f"{stem}.png", folder / "masks")
    return folder, stems


def test_the_site_record_is_checked_against_its_own_digest(tmp_path, data_root):
    """An edited case list or hash, a truncated record, a link to another file and a user's own file of the record's
    name are each named, never taken as "unchanged" (the record's digest was re-hashed from its files only)."""
    import json
    import os

    from feduq.inference.calibration import SITE_RECORD, case_hashes, check_site_record, write_site_record

    folder, stems = _site(tmp_path, data_root)
    hashes = case_hashes(folder, stems)
    rows = [{"site": "Hospital-X", "image": s, "sha256": hashes[s]} for s in stems]
    cert = {"k": 3, "n_units": 3, "delta": 0.1, "bound": 0.7, "sites": ["Hospital-X"]}
    cert.update(write_site_record(rows, [f"Hospital-X/{s}" for s in stems], {"Hospital-X": folder}, cert))
    path = tmp_path / SITE_RECORD.format(site="Hospital-X")
    assert check_site_record(cert, folder) is None
    good = path.read_text()
    record = json.loads(good)
    for edit in ("drop", "hash", "unit"):
        changed = json.loads(good)
        key = sorted(changed["cases"])[0]
        if edit == "drop":
            del changed["cases"][key]  # its remaining cases are still on disk, unchanged: a re-hash alone passes
        elif edit == "hash":
            changed["cases"][key]["sha256"] = "0" * 64
        else:
            changed["cases"][key]["unit"] = "Hospital-X/another"
        path.write_text(json.dumps(changed))
        assert "were edited since the certificate" in check_site_record(cert, folder), edit
    path.write_text(good[: len(good) // 2])
    assert "cannot be read" in check_site_record(cert, folder) and "truncated" in check_site_record(cert, folder)
    path.write_text(json.dumps({"my": "notes"}))
    assert "is not a FedUQ calibration record" in check_site_record(cert, folder)
    (tmp_path / "elsewhere.json").write_text(good)
    path.unlink()
    os.symlink(tmp_path / "elsewhere.json", path)
    assert "is a symbolic link" in check_site_record(cert, folder)
    assert record["site_digest"] == cert["site_digests"]["Hospital-X"] and stems[0] not in json.dumps(cert)
