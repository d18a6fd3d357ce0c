"""What a finished run of a sweep ran with: ``feduq compare`` skips a finished run only when the
same settings would run it again on the same data.

Each run folder of a sweep gets ``RUN.json`` beside ``DONE``: the sweep's settings that shape the run (task, image
size, rounds, local epochs, items, network, sites, precision, protocol, selection, workflow and DP arguments, CT plans),
the SHA-256 of the job's configuration files, the data root (resolved) and the SHA-256 of each site's split file. A
re-run compares them in that order and names the first that differs.

A finished run whose ``RUN.json`` is missing (a sweep of before records) or unreadable is never reused unchecked:
it is checked against the job configuration it holds itself (what FLARE's simulator deployed:
``server/simulate_job/app_server/config/config_fed_*.json`` and ``server/simulate_job/meta.json``) and the data root
of its workspace (``local/feduq_site.json``); a difference is named, and a run holding no configuration of its own is
refused naming what to do.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Callable, Mapping, Sequence

__all__ = ["RECORD_FILE", "run_settings", "run_name", "RunChanged", "finished_run", "run_record", "read_record",
           "write_record", "record_difference", "settings_line", "job_configuration", "stored_configuration",
           "configuration_difference"]

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
    from ..sites.centers import site_center
    from ..sites.split_files import find_split_file

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
    """The settings of ``feduq compare``'s arguments ``args`` that shape one run (recorded beside DONE, compared on
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


def finished_run(ws: Path, record: Mapping, label: str, rerun_changed: bool, echo: Callable[[str], None],
                 expected: Mapping | None = None) -> bool:
    """Whether the finished run ``ws`` may be skipped: True when its record matches ``record``, or, without a readable
    record, when the job configuration it holds itself matches ``expected`` (:func:`job_configuration` of the job this
    sweep would run; None for a reference run, which has no job) and its workspace's data root matches; False when it
    differs and ``rerun_changed`` (the folder is removed, to run again).

    Raises:
        RunChanged: the records (or configurations) differ, or the run has no readable record and no configuration of
            its own, and not ``rerun_changed``; the message names the folder and the difference (one line).
    """
    stored = read_record(ws)
    if stored is None:
        why = record_problem(ws)
        try:
            diff = _unrecorded_difference(ws, record, expected)
        except RunChanged as e:
            if not rerun_changed:
                raise RunChanged(f"{ws} finished, but its {RECORD_FILE} is {why} and {e}; run it again with "
                                 "--rerun-changed, or move it away (or use another --out)") from None
            diff = str(e)
        if diff is None:
            echo(f"[skip] {label}: finished earlier; its {RECORD_FILE} is {why}, and the job configuration it holds "
                 "and its data root match this sweep's (its split files are not checked)")
            return True
        if not rerun_changed:
            raise RunChanged(f"{ws} finished with other settings (its {RECORD_FILE} is {why}; its own job "
                             f"configuration says): {diff}; use another --out, or --rerun-changed to run it again")
    else:
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
    """A run folder's record, or None (a run of before records, or an unreadable file, or one that is not a
    record: :func:`record_problem` says which)."""
    try:
        record = json.loads((Path(ws) / RECORD_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("settings"), dict) else None


def record_problem(ws: Path) -> str:
    """Why :func:`read_record` gives None, in words: ``"missing"``, ``"unreadable (<reason>)"``, ``"not a run
    record"``."""
    path = Path(ws) / RECORD_FILE
    if not path.exists() and not path.is_symlink():
        return "missing"
    try:
        json.loads(path.read_text())
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    except ValueError as e:
        return f"unreadable (not JSON: {e})"
    return "not a run record"


#: where a finished simulator run keeps the job FLARE deployed: the server's app (the whole app: both config files)
#: first, else any site's
_APP_FOLDERS = ("server/simulate_job/app_server", "*/simulate_job/app_*")


def job_configuration(job: Path) -> dict:
    """What of a job folder a simulator run keeps in its workspace, to compare (:func:`configuration_difference`):
    each ``app/config/config_fed_*.json`` (parsed) and ``meta.json``'s deploy map (sites sorted) and ``min_clients``.

    Raises:
        OSError, ValueError: a file that cannot be read or is not JSON.
    """
    job = Path(job)
    found = {f.name: json.loads(f.read_text()) for f in sorted((job / "app" / "config").glob("config_fed_*.json"))}
    found["meta.json"] = _meta_part(json.loads((job / "meta.json").read_text()))
    return found


def _meta_part(meta) -> dict:
    meta = meta if isinstance(meta, dict) else {}
    deploy = meta.get("deploy_map") if isinstance(meta.get("deploy_map"), dict) else {}
    return {"deploy_map": {app: sorted(map(str, sites)) if isinstance(sites, list) else sites
                           for app, sites in deploy.items()}, "min_clients": meta.get("min_clients")}


def stored_configuration(ws: Path) -> tuple[Path, dict] | None:
    """The job configuration a finished simulator run holds itself (``(its config folder, configuration)`` as
    :func:`job_configuration` reads a job: what FLARE deployed into ``<ws>/server/simulate_job/app_server/config/``
    and its ``meta.json``, else a site's copy), or None when it holds none.

    Raises:
        RunChanged: a configuration file there that cannot be read or is not JSON (the message names it).
    """
    ws = Path(ws)
    for pattern in _APP_FOLDERS:
        for app in sorted(ws.glob(pattern)):
            files = sorted((app / "config").glob("config_fed_*.json"))
            if not files:
                continue
            found = {}
            for f in [*files, app.parent / "meta.json"]:
                if f.name == "meta.json" and not f.is_file():
                    continue  # (a copy of a site's or an archive's without FLARE's meta.json: its configs alone)
                try:
                    value = json.loads(f.read_text())
                except (OSError, ValueError) as e:
                    raise RunChanged(f"its own job configuration file {f} cannot be read ({e})") from None
                found[f.name] = _meta_part(value) if f.name == "meta.json" else value
            return app / "config", found
    return None


def configuration_difference(stored: Mapping, expected: Mapping) -> str | None:
    """The first difference between a run's own job configuration and the one this sweep would run
    (:func:`job_configuration`), as ``<file>: <key path> = <there> there, <now> now`` (a list entry with an ``id``
    named by it), or None when they match. A file the run does not hold (``meta.json`` of a copy) is not compared."""
    for name in sorted(set(stored) | set(expected)):
        if name == "meta.json" and name not in stored:
            continue
        if name not in stored or name not in expected:
            return f"{name}: {'absent there' if name not in stored else 'present there'}, " \
                   f"{'absent now' if name not in expected else 'present now'}"
        diff = _first_difference(stored[name], expected[name], "")
        if diff is not None:
            return f"{name}: {diff}"
    return None


def _shown(value) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _first_difference(there, now, path: str) -> str | None:
    if isinstance(there, dict) and isinstance(now, dict):
        for key in sorted(set(there) | set(now), key=str):
            where = f"{path}.{key}" if path else str(key)
            if key not in there or key not in now:
                return (f"{where} absent there, {_shown(now[key])} now" if key not in there
                        else f"{where} = {_shown(there[key])} there, absent now")
            diff = _first_difference(there[key], now[key], where)
            if diff is not None:
                return diff
        return None
    if isinstance(there, list) and isinstance(now, list):
        for i, (a, b) in enumerate(zip(there, now)):
            tag = a.get("id") if isinstance(a, dict) and isinstance(b, dict) and a.get("id") == b.get("id") else None
            diff = _first_difference(a, b, f"{path}[{tag if tag is not None else i}]")
            if diff is not None:
                return diff
        if len(there) != len(now):
            return f"{path or 'the list'} has {len(there)} entries there, {len(now)} now"
        return None
    return None if there == now else f"{path or 'the value'} = {_shown(there)} there, {_shown(now)} now"


def _unrecorded_difference(ws: Path, record: Mapping, expected: Mapping | None) -> str | None:
    """A finished run without a readable record against this sweep: the first difference of its own job
    configuration (:func:`stored_configuration`) and of its workspace's data root, or None.

    Raises:
        RunChanged: the run holds no configuration of its own (or ``expected`` is None: a reference run), or one that
            cannot be read; the message says so (the caller names the run).
    """
    stored = stored_configuration(ws) if expected is not None else None
    if stored is None:
        raise RunChanged("a reference run keeps no job configuration to check it against" if expected is None else
                         "it holds no job configuration of its own (server/simulate_job/app_server/config/) to check "
                         "it against")
    folder, config = stored
    diff = configuration_difference(config, expected)
    if diff is not None:
        return f"{diff} (in {folder})"
    try:
        site = json.loads((Path(ws) / "local" / "feduq_site.json").read_text())
    except (OSError, ValueError):
        site = None
    root = site.get("data_root") if isinstance(site, dict) else None
    if root is not None and str(root) != str(record.get("data_root")):
        return f"data root = {root} there, {record.get('data_root')} now"
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
    local epochs, items. A run reused without a readable record carries this sweep's settings with ``"checked":
    "job configuration"`` (checked against the configuration it holds: :func:`finished_run`); the line says so."""
    known = [r["settings"] for r in records if r]
    if not known:
        return f"settings not recorded by these runs, {seeds_text}"
    s = known[0]
    line = (f"task {s.get('task')}, {s.get('image_size')} px, {s.get('rounds')} rounds x {s.get('local_epochs')} local "
            f"epochs, {seeds_text}" + (f", first {s['max_items']} images per split" if s.get("max_items") else ""))
    unrecorded = sum(1 for r in records if r and r.get("checked"))
    if unrecorded:
        line += (f" ({unrecorded} runs without a record of their settings: checked against the job configuration "
                 "each holds; their split files not checked)")
    if len(known) < len(records):
        line += f" ({len(records) - len(known)} runs without a record of their settings: not checked)"
    return line
