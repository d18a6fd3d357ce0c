"""The privacy ledger as NVFlare filters on every site (declarations: :mod:`feduq.privacy.ledger`).

Every FedUQ job lists, on its sites, :class:`PrivacyLedgerFilter` twice for each of its tasks:

* as a **task-data filter** (``direction="in"``): it notes the keys and shapes of the model the server sent with the
  task (a site may send back only tensors of that model), and the round;
* as a **task-result filter** (``direction="out"``): it reads what the site is about to send (the DXO's model
  tensors, metrics and meta), checks it against the method's declaration, appends one row per key to the site's
  ``privacy_ledger.csv`` (``<site run dir>/privacy_ledger.csv``: round, task, section, key, form, shape, bytes) and
  **blocks** a result that would send anything undeclared: the site answers with an error that names the key, the
  server counts the site as failed for that task (its quorum rules apply), and the global model never sees the
  result.

What surrounds the DXO is checked too (:func:`feduq.privacy.ledger.check_envelope`): the message holds only its DXO and
headers, every header is one FLARE or FedUQ uses with a plain value, the DXO has only its kind, data and meta and is
a weights or metrics DXO. A result without a DXO passes only as an error reply (return code not OK), carrying nothing
but the site's reason (``feduq_site_error``, <= 1000 characters).

The ledger judges what a **site** sends, under the site's own FLARE identity, before FLARE's client runner adds its
bookkeeping (``__cookie_jar__``, the task's name and id: ``nvflare/private/fed/client/client_runner.py``
``_process_task``, after the result filters of ``_do_process_task``). It never runs on the server: in FLARE's
simulator one ``local/`` folder serves the server and every site, and FLARE's privacy configurator
(``nvflare/private/fed/app/fl_conf.py`` ``PrivacyConfiger``) gives a filter without its own ``"direction"`` the
server's direction on the server (task results *in*); so the site policy names its direction
(:func:`write_privacy_policy`), and a filter that finds itself on the server passes the message through. (FLARE
2.9's simulator gives its simulated sites no privacy scope at all, ``SimulatorClientRunManager`` in
``nvflare/private/fed/simulator/simulator_app_runner.py``: there the job's own ledger filters judge each site.)
"""

from __future__ import annotations

import csv
import threading
from pathlib import Path

import numpy as np

from nvflare.apis.dxo import DataKind, from_shareable
from nvflare.apis.filter import Filter
from nvflare.apis.fl_constant import FLContextKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.server_engine_spec import ServerEngineSpec
from nvflare.apis.shareable import ReservedHeaderKey, Shareable
from nvflare.app_common.app_constant import AppConstants

from ..privacy.ledger import LedgerViolation, check_envelope
from ..registry.ledger import ANY_METHOD, LEDGER, check_result
from .quorum import error_reply

LEDGER_FILE = "privacy_ledger.csv"
FIELDS = ["round", "task", "section", "key", "form", "shape", "bytes"]
_MODEL_KINDS = (DataKind.WEIGHTS, DataKind.WEIGHT_DIFF)
_RECEIVED: dict[tuple[str, str], dict] = {}  # (site, task) -> {"round": r, "model": {key: shape}}
_LOCK = threading.Lock()


def _dxo(shareable: Shareable):
    try:
        return from_shareable(shareable)
    except Exception:  # noqa: BLE001 - no DXO: an error reply or a bare header message
        return None


class PrivacyLedgerFilter(Filter):
    """Record and enforce what a site sends (module doc).

    Args:
        method: the job's method, a key of :data:`feduq.registry.ledger.LEDGER` (``"fedevi"``, ``"fiva_p"``, ...), or ``"*"``
            for a site's own privacy policy (``local/privacy.json``, :func:`write_privacy_policy`): any FedUQ
            method's declaration (:data:`feduq.registry.ledger.SITE_POLICY`), enforced before the job's filters run, so a job
            without its ledger filters still cannot send anything undeclared. That one records only what it blocks.
        direction: ``"in"`` in ``task_data_filters``, ``"out"`` in ``task_result_filters``.

    Raises:
        ValueError: an unknown method or direction (at job start-up, naming both).
    """

    def __init__(self, method: str, direction: str = "out"):
        super().__init__()
        if method not in LEDGER and method != ANY_METHOD:
            raise ValueError(f"PrivacyLedgerFilter: method={method!r} has no ledger (known: {sorted(LEDGER)})")
        if direction not in ("in", "out"):
            raise ValueError(f"PrivacyLedgerFilter: direction={direction!r}: expected 'in' or 'out'")
        self.method, self.direction = method, direction
        self._seen: set[str] = set()

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        if isinstance(fl_ctx.get_engine(), ServerEngineSpec):  # a site's policy read by the server (module doc)
            if "<server>" not in self._seen:
                self._seen.add("<server>")
                self.log_info(fl_ctx, "FEDUQ_SITE_POLICY not applied on the server "
                                      f"({fl_ctx.get_identity_name()!r}): the privacy ledger judges what a site sends, "
                                      "on the site")
            return shareable
        site = fl_ctx.get_identity_name()
        task = fl_ctx.get_prop(FLContextKey.TASK_NAME, "?")
        dxo = _dxo(shareable)
        if self.direction == "in":
            model = {k: np.shape(v) for k, v in (dxo.data or {}).items()} if dxo and dxo.data_kind in _MODEL_KINDS else {}
            with _LOCK:
                _RECEIVED[(site, task)] = {"round": shareable.get_header(AppConstants.CURRENT_ROUND), "model": model}
                if model:  # a task sent without a model (submit_model) may return the last model the site received
                    _RECEIVED[(site, None)] = _RECEIVED[(site, task)]
            return shareable
        with _LOCK:
            got = dict(_RECEIVED.get((site, task), {"round": None, "model": {}}))
            if not got["model"]:
                got["model"] = _RECEIVED.get((site, None), {}).get("model", {})
        encoded = shareable.get("DXO")
        fields = None if encoded is None else list(encoded) if isinstance(encoded, dict) else [f"<{type(encoded).__name__}>"]
        try:
            check_envelope(site, task, list(shareable.keys()), shareable.get(ReservedHeaderKey.HEADERS) or {}, fields,
                           dxo.data_kind if dxo else None, shareable.get_return_code(ReturnCode.OK) == ReturnCode.OK)
        except LedgerViolation as e:
            return self._blocked(fl_ctx, task, got["round"], e)
        if dxo is None:  # an error reply: only the site's reason (checked above)
            return shareable
        data = {} if dxo.data is None else dxo.data
        meta = {} if dxo.meta is None else dxo.meta
        if dxo.data_kind in _MODEL_KINDS:  # the site's metrics ride in the meta's initial_metrics (FLARE's FLModel)
            model, metrics = data, meta.get("initial_metrics") or {}
            meta = {k: v for k, v in meta.items() if k != "initial_metrics"} if isinstance(meta, dict) else meta
        else:
            model, metrics = {}, data
        try:
            rows = check_result(self.method, task, site, model, metrics, meta, got["model"])
        except LedgerViolation as e:
            return self._blocked(fl_ctx, task, got["round"], e)
        if self.method == ANY_METHOD:  # the site's policy: the job's own ledger filter records what leaves
            if task not in self._seen:
                self._seen.add(task)
                self.log_info(fl_ctx, f"FEDUQ_SITE_POLICY the site's privacy policy checked task {task!r} (any FedUQ "
                                      "method's declaration)")
            return shareable
        self._write(fl_ctx, [{"round": got["round"], "task": task, **r} for r in rows])
        total = sum(r["bytes"] for r in rows)
        self.log_info(fl_ctx, f"privacy ledger: task {task!r} round {got['round']}: {len(rows)} keys, {total} bytes")
        return shareable

    def _blocked(self, fl_ctx: FLContext, task: str, round_index, e: LedgerViolation) -> Shareable:
        """Log and record a blocked result; the site answers with an error naming what was blocked."""
        self.log_error(fl_ctx, f"FEDUQ_LEDGER_BLOCKED {e}")
        self._write(fl_ctx, [{"round": round_index, "task": task, "section": "BLOCKED", "key": str(e)[:300],
                              "form": "", "shape": "", "bytes": 0}])
        return error_reply(ReturnCode.TASK_RESULT_FILTER_ERROR, str(e))

    def _write(self, fl_ctx: FLContext, rows: list[dict]) -> None:
        run_dir = Path(fl_ctx.get_engine().get_workspace().get_run_dir(fl_ctx.get_job_id()))
        path = run_dir / LEDGER_FILE
        new = not path.is_file()
        with _LOCK, open(path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            if new:
                w.writeheader()
            w.writerows(rows)


PRIVACY_FILE = "privacy.json"
SCOPE = "feduq"
#: the site policy's filters; the top-level ``"direction"`` is FLARE's (``PrivacyConfiger``): without it a server
#: reading the same ``local/privacy.json`` (FLARE's simulator) would run the task-result filter on the results it
#: receives, and the task-data filter on the tasks it sends
_POLICY_FILTERS = {"task_data_filters": {"path": f"{__name__}.PrivacyLedgerFilter", "direction": "in",
                                         "args": {"method": ANY_METHOD, "direction": "in"}},
                   "task_result_filters": {"path": f"{__name__}.PrivacyLedgerFilter", "direction": "out",
                                           "args": {"method": ANY_METHOD, "direction": "out"}}}


def read_privacy_policy(kit: str | Path) -> dict:
    """The site's own FLARE privacy policy, ``<kit>/local/privacy.json`` (FedUQ's ``feduq`` scope when there is none).

    Raises:
        ValueError: the file is not a JSON object with a list of named scopes (names the file and what is wrong).
    """
    import json

    path = Path(kit) / "local" / PRIVACY_FILE
    if not path.is_file():
        return {"scopes": [{"name": SCOPE}], "default_scope": SCOPE}
    try:
        policy = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable FLARE privacy policy ({type(e).__name__}: {e}); fix or remove it")
    scopes = policy.get("scopes") if isinstance(policy, dict) else None
    if not isinstance(scopes, list) or not all(isinstance(x, dict) and x.get("name") for x in scopes):
        raise ValueError(f"{path}: a FLARE privacy policy is a JSON object whose \"scopes\" lists objects with a "
                         f"\"name\"; fix or remove it")
    return policy


def write_privacy_policy(kit: str | Path) -> Path:
    """Put FedUQ's ledger into the site's own FLARE privacy policy, ``<kit>/local/privacy.json`` (idempotent).

    FLARE applies a site's privacy scope to every job it runs, before the job's own filters, and refuses a job that
    names a scope the site does not define; a job cannot remove it. Every scope of an existing policy gets the
    ledger (:data:`feduq.registry.ledger.ANY_METHOD`) as its last filter on task data and results; without a policy, scope
    ``feduq`` is written and made the default. Each filter names its FLARE direction (site: task data in, results
    out), so a server reading the same ``local/`` (FLARE's simulator) never runs it; a ledger filter written without
    one (an older FedUQ's) is replaced.

    Returns:
        The policy file's path.
    """
    import json

    path = Path(kit) / "local" / PRIVACY_FILE
    policy = read_privacy_policy(kit)
    for scope in policy.get("scopes") or []:
        for chain, spec in _POLICY_FILTERS.items():
            filters = scope.setdefault(chain, [])
            if spec not in filters:
                older = {k: v for k, v in spec.items() if k != "direction"}  # the same filter without its direction
                scope[chain] = filters = [f for f in filters if f != older]
                filters.append(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(policy, indent=2) + "\n")
    return path
