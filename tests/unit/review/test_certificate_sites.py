"""A certificate holds for the site its patients were drawn from (feduq.predict.calibrate): a simulation with known
truth shows a rule certified on two sites' pooled patients failing the worse site alone far above δ (the negative
control), and the same procedure at that site alone keeping δ; so several sites are refused for a certified rule
before any case is scored, and a mixture's certificate (``--pooled-sites``) is stored and worded as the mixture's."""

import numpy as np
import pytest

from feduq.review.certificate import certify_units

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
    pooled = alone = site_a = 0
    for _ in range(DRAWS):
        a, b = _dice(rng, 0.8, N), _dice(rng, 0.6, N)
        score = rng.random(2 * N)
        units = [f"A/{i}" for i in range(N)] + [f"B/{i}" for i in range(N)]
        mixed = certify_units({"u_mean": score}, np.r_[a, b], units, TARGET, DELTA, max_unit_images=1)
        pooled += mixed.threshold is not None  # true for the mixture (0.70 >= 0.65), false for B (0.60)
        site_b = certify_units({"u_mean": score[N:]}, b, units[N:], TARGET, DELTA, max_unit_images=1)
        alone += site_b.threshold is not None
        # A alone (truth 0.80 >= 0.65: no certificate of A violates): the per-site procedure is not vacuous
        site_a += certify_units({"u_mean": score[:N]}, a, units[:N], TARGET, DELTA, max_unit_images=1).threshold \
            is not None
    assert _lower(pooled, DRAWS) > 3 * DELTA  # the negative control: pooling breaks B's promise (53 % [46.9, 59.0])
    assert _upper(alone, DRAWS) <= DELTA  # B's own certificate keeps it (0 of 200, upper bound 1.5 %)
    assert _lower(site_a, DRAWS) > 0.9  # and A's own certifies (97.5 % [94.8, 99.0]), none of them a violation


def test_several_sites_are_refused_for_a_certified_rule_before_any_case_is_scored(tmp_path):
    from feduq.predict.calibrate import calibrate
    from feduq.predict.files import PredictError

    missing = [tmp_path / "A", tmp_path / "B"]  # never read: the refusal comes first
    with pytest.raises(PredictError, match="certify at each site .* or give --pooled-sites"):
        calibrate(object(), target_dice=0.8, site_dirs=missing)
    with pytest.raises(PredictError, match="certify at each site"):
        calibrate(object(), target_dice=0.8, sites=["Kvasir-SEG", "CVC-ClinicDB"])
    with pytest.raises(PredictError, match="--pooled-sites certifies the mixture"):
        calibrate(object(), target_dice=0.8, site_dirs=missing[:1], pooled_sites=True)


def test_a_mixtures_certificate_is_said_as_the_mixtures_with_its_proportions():
    from feduq.review.notes import certified_for

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

    from feduq.review.calibration import SITE_RECORD, case_hashes, check_site_record, write_site_record

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


def test_a_rule_pooled_before_pooling_was_refused_is_said_as_a_mixture_everywhere():
    """A rule file certified over sites A, B before FedUQ refused pooling (no ``mixture``) still says "certified for
    A, B ... there"; read now, it is worded as the mixture's (shares unrecorded) in predict's note and the report."""
    from feduq.report.page import verdict_html
    from feduq.review.rule import ReviewThreshold
    from feduq.review.notes import certified_for, rule_note

    c = {"k": 80, "n_units": 80, "unit": "patient", "max_unit_images": 32, "delta": 0.1, "bound": 0.65,
         "sites": ["A", "B"]}
    rule = ReviewThreshold("total", 0.5, 0.65, 0.9, 0.7, 0.7, 80, ["A:val", "B:val"], certificate=c)
    whom = "the mixture of A and B (pooled, shares not recorded), not each site alone"
    assert certified_for(c) == whom and f"certified for {whom} (" in rule_note(rule)
    rows = [{"site": "B", "image": f"b{i}", "dice": 0.6} for i in range(3)]
    assert f"for new patients of {whom}:" in verdict_html(rule, rows, [[]] * 3)
    assert certified_for(None, ["A:val", "B:val"]) == "A:val, B:val"  # an empirical rule: where it was chosen


def test_an_older_pooled_certificates_record_is_not_called_edited(tmp_path):
    """A certificate pooled over two sites before each site's digest was kept (no ``site_digests``): a site's record
    cannot give the certificate's digest (it holds one site's cases), so it is said to be uncheckable, not edited; the
    same record with the site's digest checks, and its own digest is the salted SHA-256 computed here by hand."""
    import hashlib
    import json

    from feduq.review.calibration import SITE_RECORD, check_site_record, write_site_record

    rows, folders = [], {}
    for site in ("A", "B"):
        folder = tmp_path / site
        folder.mkdir()
        for i in range(2):
            (folder / f"{site.lower()}{i}.png").write_bytes(f"{site}{i}".encode())
            rows.append({"site": site, "image": f"{site.lower()}{i}",
                         "sha256": hashlib.sha256(f"{site}{i}".encode()).hexdigest()})
        folders[site] = folder
    units = [f"{r['site']}/{r['image']}" for r in rows]
    cert = {"k": 4, "n_units": 4, "delta": 0.1, "bound": 0.7, "sites": ["A", "B"]}
    cert.update(write_site_record(rows, units, folders, cert))
    record = json.loads((tmp_path / SITE_RECORD.format(site="A")).read_text())
    h = hashlib.sha256(record["salt"].encode())
    for r in rows[:2]:
        h.update(f"\nA/{r['image']} A/{r['image']} {r['sha256']}".encode())
    assert record["site_digest"] == cert["site_digests"]["A"] == h.hexdigest()
    assert check_site_record(cert, folders["A"]) is None and check_site_record(cert, folders["B"]) is None
    older = {k: v for k, v in cert.items() if k != "site_digests"}
    assert "pooled over several sites before FedUQ kept each site's digest" in check_site_record(older, folders["A"])
