"""Quorum: how many valid site answers a task needs, and how a FedUQ job stops when it cannot get them.

Every FedUQ workflow applies the same rule. A job has K sites. A task needs ``q`` valid answers.
``q = K`` when ``min_clients`` is not set, so every site is required. Otherwise
``q = min(min_clients, K)``. "Valid" means the site answered without an error, and for a training
task the aggregator also accepted the update (finite, right names and shapes). When fewer than
``q`` sites can still answer validly, the workflow does not carry on. It logs one machine-readable
line, ``FEDUQ_JOB_FAILED {"reason": ..., "sites": {site: why}}``, and panics, so FLARE aborts the
job. ``feduq simulate`` and ``feduq.recipes.outcome`` read that line. A round therefore never "completes"
with fewer than ``q`` updates, and never with zero.

A site says why it failed in the header :data:`SITE_ERROR_HEADER` of its error reply (see
:meth:`feduq.flare.executor.FedUQExecutor.execute`). The header carries the site's own message,
e.g. ``site 'Kvasir-SEG': data root /data does not exist``, and no data.
"""

from __future__ import annotations

import json

from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.shareable import Shareable, make_reply

from ..common.wire import JOB_FAILED_MARKER, FedUQMetaKey

SITE_ERROR_HEADER = FedUQMetaKey.SITE_ERROR
MAX_REASON_CHARS = 1000
# wait_time_after_min_received when a task has no timeout: wait for every site that is alive (a site
# that failed answers with its error at once); only a silent site can then hold a task, as without a quorum
WAIT_FOREVER = 10**9  # seconds


def required_answers(min_clients: int | None, num_sites: int) -> int:
    """The quorum ``q``: ``num_sites`` when ``min_clients`` is None, else ``min(min_clients, num_sites)``.

    Raises:
        ValueError: ``min_clients`` < 1, or ``num_sites`` < 0.
    """
    if num_sites < 0:
        raise ValueError(f"num_sites must be >= 0, got {num_sites}")
    if min_clients is None:
        return num_sites
    if int(min_clients) < 1:
        raise ValueError(f"min_clients must be >= 1 or None, got {min_clients!r}")
    return min(int(min_clients), num_sites)


def error_reply(return_code: str, reason: str) -> Shareable:
    """A site's error reply carrying its reason (truncated to 1000 characters) for the server."""
    reply = make_reply(return_code)
    reply.set_header(SITE_ERROR_HEADER, str(reason)[:MAX_REASON_CHARS])
    return reply


def site_error(result: Shareable) -> str:
    """Why a site's reply is an error: the site's own reason, or the FLARE return code."""
    reason = result.get_header(SITE_ERROR_HEADER, None)
    rc = result.get_return_code(ReturnCode.OK)
    return str(reason) if reason else f"the site returned {rc} without a reason (see its log)"


def quorum_message(task: str, round_index, required: int, valid: list[str], failed: dict[str, str],
                   missing: list[str], num_sites: int | None = None) -> str:
    """One-paragraph reason naming the quorum, who answered, and every site that did not (with why).

    With ``num_sites`` the task is still running: the message says how many sites can still answer.
    """
    parts = [f"{site}: {why}" for site, why in sorted(failed.items())]
    parts += [f"{site}: no answer" for site in sorted(missing) if site not in failed]
    where = f"round {round_index} task {task!r}" if round_index is not None else f"task {task!r}"
    if num_sites is None:
        state = f"{len(valid)} valid answer(s) {sorted(valid)}"
    else:
        state = f"{len(failed)} of {num_sites} sites failed, so at most {num_sites - len(failed)} can answer"
    return (
        f"{where}: {state}, but the job needs {required} (min_clients; every site when not set). "
        f"Failed sites: " + ("; ".join(parts) or "none")
    )


def job_failed_line(reason: str, sites: dict[str, str]) -> str:
    """The machine-readable log line ``FEDUQ_JOB_FAILED {json}`` read by :mod:`feduq.recipes.outcome`."""
    return f"{JOB_FAILED_MARKER} " + json.dumps({"reason": reason, "sites": dict(sorted(sites.items()))})
