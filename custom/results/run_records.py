"""What a finished run of a sweep ran with (issue 65 item 2): ``tools/compare.py`` skips a finished run only when the
same settings would run it again on the same data.

Each run folder of a sweep gets ``RUN.json`` beside ``DONE``: the sweep's settings that shape the run (task, image
size, rounds, local epochs, items, network, sites, precision, protocol, selection, workflow and DP arguments, CT plans),
the SHA-256 of the job's configuration files, the data root (resolved) and the SHA-256 of each site's split file. A
re-run compares them in that order and names the first that differs.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Callable, Mapping, Sequence

__all__ = ["RECORD_FILE", "run_settings", "run_name", "RunChanged", "finished_run", "run_record", "read_record",
           "write_record", "record_difference", "settings_line"]

RECORD_FILE = "RUN.json"


def _sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def run_record(settings: Mapping, data_root, task: str, sites: Sequence[str], job: Path | None = None) -> dict:
    """The record of a run: ``settings`` (JSON-ready values), the job's configuration hash (``config_fed_*.json``
    and ``meta.json`` of ``job``; None for a reference run, which has no job), the data root and each site's split
    file hash (the file the site reads: its own ``split.json`` or FedUQ's packaged one; None when there is none).

    Raises:
        feduq.data.DataError: a site that is not one of the task's.
    """
    from ..data import get_task
    from ..data.sites import site_center
    from ..data.split_files import find_split_file

    root = Path(data_root).expanduser().resolve()
    folder = get_task(task).folder
    splits = {}
    for site in sorted(set(sites)):
        center = site_center(task, site)
        try:
            splits[site] = _sha(find_split_file(task, center, root / folder / center, None))
        except (OSError, ValueError):
            splits[site] = None
    job_sha = None
    if job is not None:
        h = hashlib.sha256()
        for f in sorted(Path(job).rglob("*.json")):
            if f.name.startswith("config_fed_") or f.name == "meta.json":
                h.update(f.relative_to(job).as_posix().encode() + b"\0" + f.read_bytes())
        job_sha = h.hexdigest()
    return {"settings": json.loads(json.dumps(dict(settings), default=str)), "job_sha256": job_sha,
            "data_root": str(root), "splits": splits}


def run_settings(method: str, seed: int, args, epsilon: float | None, ct: bool = False) -> dict:
    """The settings of ``tools/compare.py``'s arguments ``args`` that shape one run (recorded beside DONE, compared on
    a re-run); ``ct``: a CT job (its plans, iterations and samples count too)."""
    s = {"task": args.task, "method": method, "seed": seed, "image_size": args.image_size, "rounds": args.rounds,
         "local_epochs": args.local_epochs, "max_items": args.max_items, "network": args.network, "sites": args.sites,
         "amp": getattr(args, "amp", "auto"), "official_protocol": getattr(args, "official_protocol", False),
         "select_on": getattr(args, "select_on", None), "workflow_args": args.workflow_args.get(method)}
    if epsilon is not None:
        s["dp"] = {"epsilon": epsilon, "delta": args.dp_delta, "max_grad_norm": args.dp_max_grad_norm}
    if ct:
        s.update(plans=args.plans, iterations=args.iterations, samples=args.samples)
    return s


def run_name(method: str, seed: int, epsilon: float | None) -> str:
    """The folder of a run under ``<out>/runs/``: ``<method>_s<seed>`` (``<method>_eps<ε>_s<seed>`` in a DP sweep)."""
    return f"{method}_s{seed}" if epsilon is None else f"{method}_eps{epsilon:g}_s{seed}"


class RunChanged(RuntimeError):
    """A finished run of a sweep's folder ran with other settings or data than the sweep asks for."""


def finished_run(ws: Path, record: Mapping, label: str, rerun_changed: bool, echo: Callable[[str], None]) -> bool:
    """Whether the finished run ``ws`` may be skipped: True when its record matches ``record``, or it has none (a run
    of before records; ``echo`` says it is not checked); False when it differs and ``rerun_changed`` (the folder is
    removed, to run again).

    Raises:
        RunChanged: the records differ and not ``rerun_changed``; the message names the folder and the difference.
    """
    stored = read_record(ws)
    if stored is None:
        echo(f"[skip] {label}: finished earlier (its settings were not recorded: not checked)")
        return True
    diff = record_difference(stored, record)
    if diff is None:
        echo(f"[skip] {label}: finished earlier with the same settings and data")
        return True
    if not rerun_changed:
        raise RunChanged(f"{ws} finished with other settings: {diff}; use another --out, or --rerun-changed to run "
                         "it again")
    echo(f"[rerun] {label}: {diff}")
    shutil.rmtree(ws)
    return False


def read_record(ws: Path) -> dict | None:
    """A run folder's record, or None (a run of before records, or an unreadable file)."""
    try:
        return json.loads((Path(ws) / RECORD_FILE).read_text())
    except (OSError, ValueError):
        return None


def write_record(ws: Path, record: Mapping) -> Path:
    """Write ``record`` (:func:`run_record`) as ``ws/RUN.json``; return its path."""
    path = Path(ws) / RECORD_FILE
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return path


def record_difference(old: Mapping, new: Mapping) -> str | None:
    """The first difference between a finished run's record and the one this sweep would run, in words (``image_size
    = 32 there, 64 now``), or None when they match."""
    was, now = old.get("settings", {}), new.get("settings", {})
    for key in sorted(set(was) | set(now)):
        if was.get(key) != now.get(key):
            return f"{key} = {was.get(key)!r} there, {now.get(key)!r} now"
    if old.get("data_root") != new.get("data_root"):
        return f"data root = {old.get('data_root')} there, {new.get('data_root')} now"
    for site in sorted(set(old.get("splits", {})) | set(new.get("splits", {}))):
        if old.get("splits", {}).get(site) != new.get("splits", {}).get(site):
            return f"site {site}'s split file differs (SHA-256 {str(old['splits'].get(site))[:12]} there, " \
                   f"{str(new['splits'].get(site))[:12]} now)"
    if old.get("job_sha256") != new.get("job_sha256"):
        return "the job's configuration files differ (the same settings configured another job: FedUQ's jobs changed)"
    return None


def settings_line(records: Sequence[Mapping | None], seeds_text: str) -> str:
    """The sweep's settings for a report header, from its runs' records (never the command line): task, size, rounds,
    local epochs, items; a run without a record is said to be unchecked."""
    known = [r["settings"] for r in records if r]
    if not known:
        return f"settings not recorded by these runs, {seeds_text}"
    s = known[0]
    line = (f"task {s.get('task')}, {s.get('image_size')} px, {s.get('rounds')} rounds x {s.get('local_epochs')} local "
            f"epochs, {seeds_text}" + (f", first {s['max_items']} images per split" if s.get("max_items") else ""))
    if len(known) < len(records):
        line += f" ({len(records) - len(known)} runs finished before runs recorded their settings: not checked)"
    return line
