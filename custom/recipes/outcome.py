"""Did a FLARE run succeed? The outcome of a simulator or POC run, read from its logs and results (no FLARE).

``nvflare simulator`` exits 0 even when the job was aborted, so the exit code says nothing about the run. A run is
*ok* only when the server wrote the per-client table (``per_client_table.csv``) and its log has no fatal marker:

* ``FEDUQ_JOB_FAILED {json}`` -- FedUQ's workflows log it when the quorum is lost or the job config is invalid
  (``{"reason": str, "sites": {site: reason}}``);
* ``FATAL_SYSTEM_ERROR`` or ``Exception in ScatterAndGather control_flow`` -- FLARE's own fatal errors.

For a failed run each site's first error line (the cause, not the downloads that fail after the server aborted) is
kept as its reason, so a user sees why each site failed without opening the logs::

    outcome = simulator_outcome(Path("workspaces/fedevi"))
    print(outcome.summary())

:func:`check_data_root` checks, before FLARE starts, that a data root holds every center of a task.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..common import wire as constants
from ..data import DataError, get_task, resolve_data_root, task_folder

__all__ = ["RunOutcome", "simulator_outcome", "poc_outcome", "vanished_job_processes", "site_first_error",
           "check_data_root"]

TABLE_FILE = "per_client_table.csv"
JOB_FAILED_MARKER = constants.JOB_FAILED_MARKER + " "
FATAL_MARKERS = ("FATAL_SYSTEM_ERROR", "Exception in ScatterAndGather control_flow")
# a site line with one of these is a failure whatever its log level (compared in lower case)
SITE_FAILURE_MARKERS = ("feduq setup failed", "failed:")
# ERROR lines that are consequences, not causes: the downloads and requests that fail once the server has aborted
NOISE = ("- ArrayConsumer -", "- NumpyArrayDecomposer -", "Cell - ERROR - exception sending request",
         "Communicator - ERROR - Error getting task")
# after these a site is shutting down: later errors are not its cause
END_OF_RUN = ("started end-run events sequence", "asked to abort", "Abort signal received")
# "2026-11-22 13:13:54,052 - FedUQExecutor - ERROR - [identity=Kvasir-SEG, run=simulate_job] - message"
RECORD = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[,.]\d+ - (?:(?P<logger>[\w.]+) - )?(?P<level>[A-Z]+) - "
    r"(?:\[[^\]]*\] - )?(?P<msg>.*)$"
)
# "TypeError: FedUQExecutor.__init__() got an unexpected keyword argument 'klweight'"
EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception)\b.*:")
SIMULATOR_NON_SITES = ("server", "startup", "local")
MAX_MESSAGE = 400


@dataclass
class RunOutcome:
    """What a FLARE run left behind.

    Attributes:
        ok: the per-client table exists and the server logged no fatal error.
        table: the per-client table (``per_client_table.csv``) found, else None.
        server_error: the server's reason for a failed run (from ``FEDUQ_JOB_FAILED``, a fatal FLARE error, or the
            missing table), else None.
        site_errors: site -> its first error message (log prefix stripped, no traceback).
        server_first_error: the server log's first error line that is a cause (as :func:`site_first_error`; for an
            exception, its ``Type: message`` line), else None.
    """

    ok: bool
    table: Path | None = None
    server_error: str | None = None
    site_errors: dict[str, str] = field(default_factory=dict)
    server_first_error: str | None = None

    def summary(self) -> str:
        """Where the results are (ok run), or the server's reason and one line per failing site (failed run)."""
        if self.ok:
            where = f"{self.table.parent}/ (per-client table {self.table.name}, .md beside it)" if self.table else "?"
            lines = [f"Results: {where}"]
            if self.site_errors:
                lines.append(f"{len(self.site_errors)} site(s) reported errors (the run completed despite them):")
        else:
            lines = [f"FAILED: {self.server_error or 'the run did not complete'}"]
            if self.server_first_error and self.server_first_error not in (self.server_error or ""):
                lines.append(f"  server's first error: {self.server_first_error}")
            if self.site_errors:
                lines.append(f"{len(self.site_errors)} site(s) failed:")
        lines += [f"  {site}: {msg}" for site, msg in sorted(self.site_errors.items())]
        return "\n".join(lines)


def _read_lines(path: Path | None) -> list[str]:
    if path is None or not path.is_file():
        return []
    return path.read_text(errors="replace").splitlines()


def _message(line: str) -> str:
    """The message of a log line, without the timestamp, logger, level and ``[identity=...]`` context."""
    m = RECORD.match(line)
    msg = (m.group("msg") if m else line).strip()
    return msg if len(msg) <= MAX_MESSAGE else msg[: MAX_MESSAGE - 3] + "..."


def site_first_error(lines: list[str], noise: tuple[str, ...] = NOISE) -> str | None:
    """The first error of a site log that is a cause (see the module docstring), or None.

    Args:
        lines: the site log's lines.
        noise: substrings of lines to skip (default: the downloads that fail once the server aborted; the server's
            own log passes ``()``, since there a failed decode is the cause).

    Returns:
        The message of the first ERROR/CRITICAL line or line with a failure marker (``FedUQ setup failed``,
        ``failed:``), skipping the known consequences of an abort and stopping at the end of the run.
    """
    for i, line in enumerate(lines):
        m = RECORD.match(line)
        if m is None:  # traceback and other continuation lines
            continue
        if any(marker in line for marker in END_OF_RUN):
            return None
        if any(marker in line for marker in noise):
            continue
        lowered = m.group("msg").lower()
        if m.group("level") in ("ERROR", "CRITICAL") or any(k in lowered for k in SITE_FAILURE_MARKERS):
            if m.group("msg").startswith("Traceback"):  # the cause is the traceback's first exception line
                for follow in lines[i + 1:]:
                    if RECORD.match(follow):
                        break
                    if EXCEPTION_LINE.match(follow):
                        return _message(follow)
            return _message(line)
    return None


def server_failure(lines: list[str]) -> tuple[str | None, dict[str, str]]:
    """The server's fatal reason in its log lines, and the per-site reasons of a ``FEDUQ_JOB_FAILED`` record.

    Returns:
        (reason or None when the log has no fatal marker, site -> reason from ``FEDUQ_JOB_FAILED``).
    """
    for line in lines:
        if JOB_FAILED_MARKER in line:
            payload = line.split(JOB_FAILED_MARKER, 1)[1].strip()
            try:
                record = json.loads(payload)
            except ValueError:
                return _message(line), {}
            if not isinstance(record, dict):
                return _message(line), {}
            sites = record.get("sites") if isinstance(record.get("sites"), dict) else {}
            return str(record.get("reason") or "the job failed (FEDUQ_JOB_FAILED)"), {
                str(k): str(v) for k, v in sites.items()
            }
    for line in lines:
        if any(marker in line for marker in FATAL_MARKERS):
            return _message(line), {}
    return None, {}


def _abort_note(lines: list[str]) -> str:
    for line in lines:
        if "Abort signal received" in line or "asked to abort" in line:
            return f"; the server aborted the run ({_message(line)})"
    return ""


def _outcome(table: Path | None, server_lines: list[str], site_logs: dict[str, list[str]], where: str) -> RunOutcome:
    reason, job_sites = server_failure(server_lines)
    site_errors = {s: e for s, e in ((s, site_first_error(lines)) for s, lines in site_logs.items()) if e}
    for site, msg in job_sites.items():
        site_errors.setdefault(site, msg)
    if reason is None and table is None:
        reason = f"no per-client table ({TABLE_FILE}) was written in {where}" + _abort_note(server_lines)
    return RunOutcome(ok=reason is None, table=table, server_error=reason, site_errors=site_errors,
                      server_first_error=site_first_error(server_lines, noise=()))


def simulator_outcome(workspace: str | Path) -> RunOutcome:
    """The outcome of an ``nvflare simulator`` run from its workspace.

    Args:
        workspace: the simulator workspace ``WS`` (``-w``): table ``WS/server/simulate_job/results/``, server log
            ``WS/server/log.txt``, site logs ``WS/<site>/log.txt``.

    Returns:
        The :class:`RunOutcome`; ``ok`` needs the table and a server log without a fatal marker.
    """
    ws = Path(workspace)
    table = ws / "server" / "simulate_job" / "results" / TABLE_FILE
    sites = {}
    if ws.is_dir():
        for d in sorted(ws.iterdir()):
            if d.is_dir() and d.name not in SIMULATOR_NON_SITES and (d / "log.txt").is_file():
                sites[d.name] = _read_lines(d / "log.txt")
    return _outcome(table if table.is_file() else None, _read_lines(ws / "server" / "log.txt"), sites, str(ws))


def _shallowest(root: Path | None, name: str) -> Path | None:
    """The file called ``name`` nearest to ``root`` (None if there is none)."""
    if root is None or not root.is_dir():
        return None
    return min(root.rglob(name), key=lambda p: (len(p.parts), str(p)), default=None)


def vanished_job_processes(job_id: str, parent_logs: dict[str, Path]) -> dict[str, str]:
    """Sites whose job process ended without a word (SIGKILL, the out-of-memory killer, a crash), from FLARE's own
    parent-process logs: a site's ``child worker process finished with RC n`` (n != 0) for the job, and the server's
    ``Failing job <id> due to reported failure from <site>``.

    Args:
        job_id: the job.
        parent_logs: participant -> its parent process's log (POC: ``<kit>/log.txt``; ``"server"`` for the server's);
            missing files are skipped.

    Returns:
        site -> reason (the exit code and FLARE's word), for the sites either log names.
    """
    job = re.escape(job_id)
    rc_line = re.compile(rf"run \({job}\): child worker process finished with RC (-?\d+)")
    failing = re.compile(rf"Failing job {job} due to reported failure from (\S+): (.*)$")
    found: dict[str, str] = {}
    for participant, path in parent_logs.items():
        for line in _read_lines(Path(path)):
            m = rc_line.search(line) if participant != "server" else None
            if m and m.group(1) != "0":
                found[participant] = (f"its job process ended with exit code {m.group(1)} without logging an error "
                                      "(killed, e.g. by SIGKILL or the out-of-memory killer, or crashed)")
            m = failing.search(line) if participant == "server" else None
            if m:
                found.setdefault(m.group(1), f"FLARE's server failed the job on this site's report ({m.group(2)}): "
                                             "its job process ended without logging an error")
    return found


def poc_outcome(
    result_dir: str | Path | None, site_log_paths: dict[str, Path], status: str | None = None,
    job_id: str | None = None, parent_logs: dict[str, Path] | None = None,
) -> RunOutcome:
    """The outcome of a POC (or deployed) job from its downloaded result and the sites' job logs.

    Args:
        result_dir: the downloaded job result (server log ``<result_dir>/**/log.txt``, table
            ``<result_dir>/**/per_client_table.csv``); None when nothing was downloaded.
        site_log_paths: site -> its job log (POC: ``<site kit>/<job_id>/log.txt``); missing files are skipped.
        status: the job's final status; anything but ``FINISHED:COMPLETED`` makes the run fail.
        job_id, parent_logs: where the parent processes' logs are on this machine (POC), the sites whose job process
            vanished (:func:`vanished_job_processes`) are named with that reason when their job log has no error.

    Returns:
        The :class:`RunOutcome`.
    """
    root = Path(result_dir) if result_dir is not None else None
    table, server_log = _shallowest(root, TABLE_FILE), _shallowest(root, "log.txt")
    sites = {site: _read_lines(Path(p)) for site, p in site_log_paths.items()}
    outcome = _outcome(table, _read_lines(server_log), sites, str(root))
    if job_id and parent_logs:
        for site, reason in vanished_job_processes(job_id, parent_logs).items():
            outcome.site_errors.setdefault(site, reason)
    if status is not None and status != "FINISHED:COMPLETED" and outcome.ok:
        outcome.ok, outcome.server_error = False, f"the job ended {status}"
    elif status is not None and status != "FINISHED:COMPLETED":
        outcome.server_error = f"the job ended {status}: {outcome.server_error}"
    return outcome


def check_data_root(data_root: str | Path, task: str, centers=None) -> Path:
    """Resolve a data root to an absolute folder and check that it holds the task's centers.

    Args:
        data_root: the data root, absolute or relative to the current folder (``~`` is expanded).
        task: the task; its folder under the root is :func:`feduq.data.task_folder`.
        centers: the centers to check (default: every center of the task).

    Returns:
        The absolute, resolved data root.

    Raises:
        DataError: the root is not a folder, or a center folder ``<root>/<task folder>/<center>/`` is missing (the
            message names the root, the task folder and every missing center).
    """
    root = resolve_data_root(data_root)  # absolute; DataError naming the path when it is not a folder
    centers = list(get_task(task).centers if centers is None else centers)
    folder = task_folder(task)
    missing = [c for c in centers if not (root / folder / c).is_dir()]
    if missing:
        raise DataError(
            f"data root {root} lacks {len(missing)} of the {len(centers)} center folder(s) of task {task!r} "
            f"under {root / folder}/: missing {', '.join(missing)}"
        )
    return root
