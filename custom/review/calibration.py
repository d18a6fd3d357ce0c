"""Labelled cases for the review rule: each image of labelled sites scored as a site's test scores it, with the case
scores, area fractions and bottleneck features the rule is chosen on (``predict --calibrate``) and judged on (a
held-out site, :mod:`feduq.results.review_holdout`)."""

from __future__ import annotations

import hashlib
import re
import tempfile
from pathlib import Path

import numpy as np

__all__ = ["CASE_KEYS", "dataset_cases", "labelled_cases", "case_files", "case_hashes", "case_units", "UnitError", "SLICE_PATTERN"]

#: a volume's slice as FedUQ names it (``<case>_z012``): the case is its unit
SLICE_PATTERN = r"(.+)_z\d+"
#: how a unit is called by where its grouping comes from (a provenance column; else "patient")
UNIT_WORDS = {"sequence": "video", "video": "video", "case": "volume", "volume": "volume", "patient": "patient"}


class UnitError(ValueError):
    """The labelled images' units (patients) cannot be told apart as asked; one line naming the site or option."""


#: the per-case numbers :func:`labelled_cases` returns (fractions; the scores in the primary map's unit)
CASE_KEYS = ("u_mean", "u_foreground", "u_boundary", "area_fraction", "mask_fraction", "dice")


def dataset_cases(dataset, site: str) -> list[dict]:
    """The rows :func:`labelled_cases` will give a listed site dataset, before any is scored: ``{"site", "image"}``
    per case in order (a 3D job's volume, a declared volume task's case, else the image's stem), for the checks that
    need only which cases they are (training cases, units)."""
    if hasattr(dataset, "cases"):  # a 3D job's volumes (feduq.site.evaluation_3d.VolumeCases)
        return [{"site": site, "image": c} for c in dataset.cases]
    names = []
    for item in dataset.data:
        if "case" in item and "slice" in item:  # a volume task's slice: the case is the row (scored per volume)
            names.append(str(item["case"]))
        else:
            names.append(str(item.get("id") or Path(str(item["image"])).stem))
    return [{"site": site, "image": n} for n in dict.fromkeys(names)]


def labelled_cases(loaded, *, site_dirs=(), sites=(), data_root=None, split: str = "val",
                   max_items: int | None = None, quality: dict | None = None, center_dirs: dict | None = None,
                   before_scoring=None) -> tuple[dict, np.ndarray, list[str], list[dict]]:
    """Score every labelled image of ``site_dirs`` (all their images) and ``sites`` (their ``split``) with
    ``loaded``'s model, as :func:`feduq.site.evaluation.evaluate_site` scores them (``case_level``).

    Returns:
        ``(cases, features, where, rows)``: ``cases`` maps each of :data:`CASE_KEYS` to ``[N]`` float64, ``features``
        ``[N, F]`` the pooled bottleneck features (a 3D job's: each volume's, pooled over its sliding windows; None
        when a site gives none), ``where`` the ``site:split``
        sources, ``rows`` the per-case rows
        (an image; on a declared volume task a volume, scored in 3D as ``predict`` scores it)
        (``site``, ``image``, ``sha256`` of the case's files (:func:`case_hashes`), ...), in one order. ``quality``
        and ``center_dirs``, dicts when given, receive each site's pixel-level figures (``evaluate_site``'s
        ``quality``: map name -> figures with the reliability ``bins``) and its folder (resolved).
        ``before_scoring(cases, center_dirs)``, when given, is called once every site is listed and before any case is
        scored, with :func:`dataset_cases`' rows of all sites and site -> folder (resolved): a check that raises
        there refuses in seconds, not after minutes of scoring.

    Raises:
        ValueError: neither site folders nor sites given. feduq.data.DataError / EvaluationError: as ``evaluate_site``.
    """
    from ..site.evaluation import evaluate_site, site_dataset

    targets = [dict(site_dir=d) for d in site_dirs] + [dict(site=s, data_root=data_root) for s in sites]
    if not targets:
        raise ValueError("labelled cases need a site folder (images/, masks/, labels.json) or a site with a split")
    rows, features, where = [], [], []
    with tempfile.TemporaryDirectory(prefix="feduq-calibrate-") as work:
        listed = []
        for target in targets:  # every site listed (and its files checked) before any is scored
            split_here = "all" if "site_dir" in target else split
            listed.append((target, split_here, *site_dataset(loaded, split=split_here, work_dir=work,
                                                             max_items=max_items, **target)))
        if before_scoring is not None:
            before_scoring([r for _, _, name, dataset, _ in listed for r in dataset_cases(dataset, name)],
                           {name: Path(center_dir).resolve() for _, _, name, _, center_dir in listed})
        for target, split_here, name, dataset, center_dir in listed:
            result = evaluate_site(loaded, dataset, name, center_dir, case_level=True)
            if "volumes" in result:  # a volume task: the case is the volume (one decision per volume, 3D Dice)
                result["per_image"], result["features"] = result["volumes"], result["volume_features"]
            hashes = case_hashes(center_dir, [r["image"] for r in result["per_image"]])
            if quality is not None:
                quality[name] = result["quality"]
            if center_dirs is not None:
                center_dirs[name] = Path(center_dir).resolve()
            rows += [{**r, "sha256": hashes[r["image"]]} for r in result["per_image"]]
            features.append(result["features"])
            where.append(f"{target.get('site_dir') or name}:{split_here}")
    cases = {k: np.array([r[k] for r in rows], dtype=np.float64) for k in CASE_KEYS}
    # a site without pooled features (a network without a bottleneck to pool): no familiarity term then
    return cases, None if any(f is None for f in features) else np.concatenate(features), where, rows


def case_files(center_dir, stems) -> dict[str, list[Path]]:
    """Each case's files under ``center_dir`` (image channels and mask, sorted by path): those whose name up to the
    first dot, less an nnU-Net channel suffix ``_0000``, is the case's stem (a volume's slice ``<case>_z012`` falls
    back to its volume's files); an empty list when none is found."""
    index: dict[str, set[Path]] = {}
    for f in Path(center_dir).resolve().rglob("*"):
        if f.is_file():
            key = f.name.split(".")[0]
            index.setdefault(key, set()).add(f)
            channel = re.fullmatch(r"(.+)_\d{4}", key)
            if channel:
                index.setdefault(channel.group(1), set()).add(f)
    return {stem: sorted(index.get(stem) or index.get(re.sub(r"_z?\d+$", "", stem)) or ()) for stem in stems}


def case_hashes(center_dir, stems) -> dict:
    """Each case's SHA-256 over its files' bytes (:func:`case_files`, in path order); None when no file is found."""
    out = {}
    for stem, files in case_files(center_dir, stems).items():
        h = hashlib.sha256()
        for f in files:
            h.update(f.read_bytes())
        out[stem] = h.hexdigest() if files else None
    return out


#: how :func:`case_units` says a mode in which each case is its own unit by construction (the certificate's M is 1)
EACH_IMAGE, EACH_VOLUME = "each image its own unit (--units images)", "each volume its own patient"


def one_case_a_unit(how: str) -> bool:
    """Whether :func:`case_units`' ``how`` says every site's cases are their own units by construction (M = 1 fixed
    before the data), not merely observed so."""
    return all(part == EACH_IMAGE or part.endswith(f": {EACH_VOLUME}") for part in how.split("; "))


def case_units(rows: list[dict], task, center_dirs: dict, *, units: str | None = None,
               unit_pattern: str | None = None) -> tuple[list[str], str, str]:
    """Each labelled image's independent unit (the patient: a volume, a video), as the certificate counts them.

    In order: ``units="images"``: each image its own unit (the user says its images are independent patients);
    ``unit_pattern``: a regular expression on the image name whose first group names the unit; else the task's own
    grouping of the site, the one its splits keep together (a ``provenance.csv`` column such as CVC's video
    ``sequence`` or a prostate site's ``case``; a declared task's ``group_pattern``; a built-in site's stem pattern)
    and, for a volume's slices ``<case>_z012``, the case.

    Args:
        rows: :func:`labelled_cases`'s rows (``site``, ``image``); center_dirs: site -> its folder.

    Returns:
        ``(units [k] as "site/unit", the word for a unit, how they were told apart)``.

    Raises:
        UnitError: ``units="images"`` with ``unit_pattern``; a pattern without a group, matching no image name, or
            putting every image in one unit; a site whose images cannot be told apart (named, with the two options).
    """
    from ..data import DataError, get_task
    from ..sites.split_files import provenance_columns
    from ..tasks.spec import read_groups, stem_groups

    if units not in (None, "images"):
        raise UnitError(f"--units {units!r}: the only value is 'images' (each image its own patient)")
    if units == "images" and unit_pattern:
        raise UnitError("--units images and --unit-pattern say two things: each image its own patient, or the "
                        "pattern's group; give one")
    if units == "images":
        return [f"{r['site']}/{r['image']}" for r in rows], "image", EACH_IMAGE
    sites = list(dict.fromkeys(r["site"] for r in rows))
    stems = {site: [r["image"] for r in rows if r["site"] == site] for site in sites}
    table: dict[tuple[str, str], str] = {}
    words, hows = set(), []
    if unit_pattern:
        try:
            rx = re.compile(unit_pattern)
        except re.error as e:
            raise UnitError(f"--unit-pattern '{unit_pattern}' is not a regular expression: {e}") from None
        if rx.groups == 0:
            raise UnitError(f"--unit-pattern '{unit_pattern}' has no group: its first group names the patient")
        for site in sites:
            found = {stem: next((g for g in m.groups() if g is not None), None) if (m := rx.fullmatch(stem)) else None
                     for stem in stems[site]}
            missed = [stem for stem, g in found.items() if g is None]
            if missed:
                raise UnitError(f"--unit-pattern '{unit_pattern}' does not match image {missed[0]!r} of site "
                                f"{site!r} ({len(missed)} of its {len(found)} images)")
            table.update({(site, stem): g for stem, g in found.items()})
        if len(set(table.values())) == 1 and len(rows) > 1:
            raise UnitError(f"--unit-pattern '{unit_pattern}' puts all {len(rows)} images in one unit "
                            f"({next(iter(table.values()))!r}): its first group must name the patient")
        return ([f"{r['site']}/{table[r['site'], r['image']]}" for r in rows], "patient",
                f"--unit-pattern {unit_pattern}")
    spec = get_task(task)
    for site in sites:
        folder = Path(center_dirs.get(site, ""))
        column = spec.group_column.get(site) or spec.group_column.get(folder.name)
        optional = spec.group_column_if_present.get(site) or spec.group_column_if_present.get(folder.name)
        present = provenance_columns(folder) if folder.is_dir() else []
        column = column if column in present else optional if optional in present else None
        pattern = spec.group_pattern.get(site) or spec.case_pattern(folder.name)
        try:
            if column:
                groups = read_groups(folder, column)
                missing = [s for s in stems[site] if s not in groups]
                if missing:
                    raise UnitError(f"site {site!r}: image {missing[0]!r} is not listed in {folder / 'provenance.csv'}"
                                    f" ({len(missing)} images), so its {column!r} is unknown")
                words.add(UNIT_WORDS.get(column, "patient"))
                hows.append(f"{site}: provenance.csv column {column!r}")
            elif pattern:
                groups = stem_groups(stems[site], pattern, site=site)
                words.add("volume" if re.fullmatch(SLICE_PATTERN, stems[site][0] or "") else "patient")
                hows.append(f"{site}: the task's group pattern {pattern}")
            elif spec.kind == "3d":  # the rows are volumes
                groups = {s: s for s in stems[site]}
                words.add("volume")
                hows.append(f"{site}: {EACH_VOLUME}")
            elif stems[site] and all(re.fullmatch(SLICE_PATTERN, s) for s in stems[site]):
                groups = stem_groups(stems[site], SLICE_PATTERN, site=site)
                words.add("volume")
                hows.append(f"{site}: slices <case>_zNNN of one case")
            else:
                raise UnitError(f"site {site!r}: its labelled images cannot be told apart by patient (no grouping in "
                                f"the task, no provenance.csv column, no <case>_zNNN slices): give --unit-pattern "
                                f"REGEX (its first group names the patient), or --units images if each image is its "
                                f"own patient (the certificate records it)")
        except DataError as e:
            raise UnitError(str(e)) from None
        table.update({(site, stem): groups[stem] for stem in stems[site]})
    word = words.pop() if len(words) == 1 else "patient"
    return [f"{r['site']}/{table[r['site'], r['image']]}" for r in rows], word, "; ".join(hows)


#: the site-local record of a certificate's labelled cases, written beside each site's folder
SITE_RECORD = "{site}.feduq-calibration.json"


def calibration_digest(salt: str, cases: dict) -> str:
    """The certificate's one digest of its labelled set: SHA-256 over the salt and the sorted ``"site/case unit
    sha256"`` lines (``cases``: ``"site/case" -> (unit, sha256)``); without the salt it names no case."""
    h = hashlib.sha256(salt.encode())
    for key in sorted(cases):
        unit, sha = cases[key]
        h.update(f"\n{key} {unit} {sha}".encode())
    return h.hexdigest()


def write_site_record(rows: list[dict], units: list[str], center_dirs: dict, certificate: dict) -> dict:
    """Keep the labelled cases of a certificate at the site: beside each site's folder, ``<site>.feduq-calibration.
    json`` holds the salt, the digest and that site's cases (name, unit, SHA-256 of its files); what travels (the
    rule file, a MONAI Bundle) gets only ``{"digest": ..., "digest_of": ...}``. Hospital file names often hold patient
    or accession numbers: they stay where the images are.

    Returns:
        the fields to add to the certificate.

    Raises:
        OSError: a record cannot be written, or a file of its name that FedUQ did not write is in the way (named by
            the caller's error; nothing is replaced).
    """
    import errno
    import json
    import os
    import secrets

    salt = secrets.token_hex(16)
    cases = {f"{r['site']}/{r['image']}": (u, r.get("sha256") or "") for r, u in zip(rows, units)}
    digest = calibration_digest(salt, cases)
    site_digests = {}
    for site in sorted({r["site"] for r in rows}):
        folder = Path(center_dirs[site])
        path = folder.parent / SITE_RECORD.format(site=folder.name)
        mine = {k: v for k, v in cases.items() if k.startswith(f"{site}/")}
        site_digests[site] = calibration_digest(salt, mine)  # what the record's own list must give back
        record = {"digest": digest, "site_digest": site_digests[site], "salt": salt, "k": certificate["k"],
                  "n_units": certificate["n_units"], "delta": certificate["delta"], "bound": certificate["bound"],
                  "cases": {k: {"unit": u, "sha256": sha} for k, (u, sha) in sorted(mine.items())}}
        if path.exists() and not _is_record(path):  # a user's file of that name is never replaced
            raise FileExistsError(errno.EEXIST, "a file that is not a FedUQ calibration record is in the way", str(path))
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, path)
    return {"digest": digest, "site_digests": site_digests,
            "digest_of": "SHA-256 over a salt and the labelled cases' names, units and file hashes (each site's: "
                         "site_digests); the salt and the list stay beside the site's folder "
                         f"({SITE_RECORD.format(site='<site>')})"}


def _is_record(path: Path) -> bool:
    """Whether ``path`` is a calibration record FedUQ wrote (a JSON object with its digest, salt and cases)."""
    import json

    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and {"digest", "salt", "cases"} <= set(record)


def check_site_record(certificate: dict, center_dir) -> str | None:
    """Whether a certificate's labelled cases are this site's, by its site-local record: None when the record beside
    ``center_dir`` is FedUQ's own (not a link, not a user's file), its case list still gives the digest it was
    written with (an edited list or hash is caught) and its cases, re-hashed from their files now, are unchanged;
    else one line saying what differs (no record; a link, a foreign or truncated file; an edited list; a case changed
    or missing; another certificate)."""
    import json

    folder = Path(center_dir)
    path = folder.parent / SITE_RECORD.format(site=folder.name)
    if path.is_symlink():  # a record is FedUQ's own file beside the site's folder, never one pointed to
        return f"calibration record {path} is a symbolic link; FedUQ reads only the record it wrote there"
    if not path.is_file():
        return f"no calibration record {path.name} beside {folder}: the certificate's cases cannot be checked here"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return f"calibration record {path} cannot be read ({type(e).__name__}: truncated or not JSON)"
    if not _is_record(path) or not isinstance(record.get("salt"), str):
        return f"{path} is not a FedUQ calibration record (no digest, salt and cases); it was not written by FedUQ"
    if record.get("digest") != certificate.get("digest"):
        return f"calibration record {path} is of another certificate (digest differs)"
    try:
        listed = {k: (v["unit"], v["sha256"]) for k, v in record["cases"].items()}
    except (AttributeError, KeyError, TypeError):
        return f"calibration record {path}: its case list is damaged (a case without unit or sha256)"
    sites = {k.split("/", 1)[0] for k in listed}
    expected = (certificate.get("site_digests") or {}).get(next(iter(sites))) if len(sites) == 1 else None
    if expected is None and len(certificate.get("sites") or sites) == 1:  # a one-site certificate: its own digest
        expected = certificate.get("digest")
    if expected is None and "site_digests" not in certificate:  # pooled before each site's digest was kept
        return (f"calibration record {path} is of a certificate pooled over several sites before FedUQ kept each "
                "site's digest: its case list cannot be checked against the certificate here; certify again at this "
                "site (feduq calibrate)")
    if expected is None or calibration_digest(record["salt"], listed) != expected:
        return (f"calibration record {path}: its case list or file hashes were edited since the certificate (they "
                "no longer give its digest)")
    stems = {k.split("/", 1)[1]: k for k in record["cases"]}
    now = case_hashes(folder, list(stems))
    changed = [stem for stem, key in stems.items() if now[stem] != record["cases"][key]["sha256"]]
    if changed:
        return (f"{len(changed)} of the {len(stems)} calibration cases at {folder} changed or are missing since the "
                f"certificate (first: {changed[0]})")
    return None
