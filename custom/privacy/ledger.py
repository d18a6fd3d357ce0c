"""The privacy ledger: the forms a site's result may take and the check of a result against its declaration (no FLARE).

A site's task result carries three things (NVFlare DXO): **model** tensors (the data of a weights DXO), **metrics**
(a metrics DXO's data, or the ``initial_metrics`` of a weights DXO) and **meta**. For every method and task this
method declares which keys may appear in each, with their form:

* ``"model"``: a tensor of the model the server sent with this task, under the same key and with the same shape (a
  site can only send back the shared model it received, or a part of it: FedBN without its normalisation layers,
  FedUAA without its head). The only exception is declared by name: the CT site's head, sent once (``submit_head``);
* ``"scalar"``: one plain finite number (Python bool/int/float, a numpy scalar or 0-d array of a numeric dtype; NaN
  and None allowed) — N_k, A_k, G_k, U_k, θ_k, a site's mean test Dice. Not a dict, set, string, object array or DXO;
* ``"vector:<n>"``: a list/array of n plain finite numbers (FedA3I's q_k = [q_in, q_out]);
* ``"per_case:<k>"``: a list of at most :data:`MAX_CASES` rows of k plain finite numbers, one row per case of the
  site (the federated nnU-Net plan's spacings and shapes: what nnU-Net's planner takes medians of);
* ``"name"``/``"names"``: the site's own name (equal to the sending site's FLARE identity: a site cannot answer for
  another), or a short list of organ names (CT heads), strings of <= 200 characters.

Model tensors must be numeric numpy arrays. Keys are names of at most :data:`MAX_KEY_CHARS` characters, declared
exactly or by an ``fnmatch`` pattern (``dice_*`` covers the per-class and per-region test columns, at most
:data:`MAX_KEYS_PER_PATTERN` keys per result, so one key per pixel cannot pass). What surrounds the DXO is checked by
:func:`check_envelope`: the message's own keys and headers, the DXO's fields and kind. Anything else is
undeclared, and :func:`check_declared` raises :class:`LedgerViolation` naming it: a per-image Dice list, a mask, a new
statistic added to a method without declaring it. What each method declares is part of its registration
(:class:`feduq.registry.MethodSpec` ``ledger``, built with :func:`declare`); :mod:`feduq.registry.ledger` looks it
up and generates ``docs/reference/privacy.md``'s "What leaves a site" from it, so the documentation and the enforcement cannot
drift.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Mapping

import numpy as np

MODEL, SCALAR, NAME, NAMES = "model", "scalar", "name", "names"
MAX_NAME_CHARS = 200
MAX_KEY_CHARS = 100  #: a key longer than this is refused (a name, not a payload)
MAX_CASES = 100_000  #: rows a per-case list may hold (cases of one site, never voxels)
MAX_KEYS_PER_PATTERN = 64  #: keys one pattern (``dice_*``) may cover in one result: per class / region, not per pixel


class LedgerViolation(ValueError):
    """A task result would send something its method does not declare; the message names the site, task and key."""


def declare(model: bool = False, metrics: Mapping[str, str] | None = None, meta: Mapping[str, str] | None = None,
          extra_model: Mapping[str, str] | None = None) -> dict:
    """One task's declaration: whether the received model's tensors may go back (``model``), other tensors by name
    (``extra_model``), and the metrics and meta keys with their forms (:data:`SCALAR`, ...)."""
    return {"model": model, "extra_model": dict(extra_model or {}), "metrics": dict(metrics or {}),
            "meta": dict(meta or {})}


#: meta FLARE itself adds to any task's result: ``filter_history``, the class names of the filters a result went
#: through (a FLARE output filter such as PercentilePrivacy records itself there); a short list of short strings
FLARE_META = {"filter_history": NAMES}
SITE_NAME = {"feduq_site": NAME}
TRAIN_META = {"feduq_num_samples": SCALAR, "feduq_num_val_samples": SCALAR, "NUM_STEPS_CURRENT_ROUND": SCALAR,
              **SITE_NAME}
TEST_2D = {"dice": SCALAR, "hd95": SCALAR, "ece": SCALAR, "num_images": SCALAR, "dp_epsilon": SCALAR,
            "dice_*": SCALAR, "hd95_*": SCALAR, "num_cases": SCALAR}  # hd95_mm, num_cases: a volume site's per case


def seg2d_declaration(train_meta: Mapping[str, str] | None = None, **extra_tasks) -> dict:
    """The tasks of a 2D segmentation site (feduq.flare.executor.FedUQExecutor) plus a method's additions."""
    return {
        "train": declare(model=True, metrics={"val_dice": SCALAR, "val_loss": SCALAR, "train_loss": SCALAR},
                       meta={**TRAIN_META, **(train_meta or {})}),
        "validate": declare(metrics={"val_dice": SCALAR, "val_loss": SCALAR}, meta={"feduq_num_val_samples": SCALAR}),
        "test": declare(metrics=TEST_2D, meta=SITE_NAME),
        "submit_model": declare(model=True),
        **extra_tasks,
    }


CT_DECLARATION = {
    "train": declare(model=True, metrics={"train_loss": SCALAR}, meta={"feduq_num_samples": SCALAR, **SITE_NAME}),
    "submit_head": declare(extra_model={"weight": MODEL, "bias": MODEL}, meta={"feduq_head_organs": NAMES, **SITE_NAME}),
    "test": declare(metrics={"num_images": SCALAR, "frac_sum_u_over_1": SCALAR, "dice": SCALAR, "dice_un": SCALAR,
                           "hd95": SCALAR, "ece": SCALAR, "dice_*": SCALAR, "hd95_*": SCALAR}, meta=SITE_NAME),
}

def _pattern(key: str, patterns: Mapping[str, str]) -> str | None:
    """The first declared pattern (a name, or an ``fnmatch`` pattern such as ``dice_*``) ``key`` matches, or None."""
    return next((p for p in patterns if fnmatch.fnmatchcase(key, p)), None)


def _nbytes(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    try:
        return int(np.asarray(value).nbytes)
    except (TypeError, ValueError):
        return 0


def _number(value: Any) -> bool:
    """A plain number: Python bool/int/float, a numpy scalar or 0-d array of a numeric dtype (never an object, a
    container, a string or a 0-d object array). NaN is a number; ±inf is refused by :func:`_fits` (finite only)."""
    if isinstance(value, (bool, int, float, np.bool_, np.integer, np.floating)):
        return True
    return isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "biuf"


def _fits(value: Any, form: str, reference: Any = None) -> str | None:
    """None when ``value`` has ``form``; else what it is instead (its type named)."""
    kind = type(value).__name__
    if form == MODEL:
        if not isinstance(value, np.ndarray) or value.dtype.kind not in "biuf":
            return f"a {kind}{' of dtype ' + str(value.dtype) if isinstance(value, np.ndarray) else ''}, not a numeric tensor"
        if reference is None:
            return "not a tensor of the model the server sent"
        shape, ref = tuple(np.shape(value)), tuple(reference)
        return None if shape == ref else f"shape {shape} != the received model's {ref}"
    if form == SCALAR:
        if value is None:
            return None
        if not _number(value):
            return f"a {kind}, not a plain number"
        return None if not np.isinf(float(value)) else "infinite, not a finite number"
    if form.startswith("vector:"):
        n = int(form.split(":")[1])
        items = list(value) if isinstance(value, (list, tuple)) else value.tolist() if (
            isinstance(value, np.ndarray) and value.dtype.kind in "biuf" and value.ndim == 1) else None
        if items is None or not all(_number(v) for v in items):
            return f"a {kind}, not a list of plain numbers"
        if any(np.isinf(float(v)) for v in items):
            return "not finite"
        return None if len(items) == n else f"{len(items)} numbers, not {n}"
    if form.startswith("per_case:"):
        k = int(form.split(":")[1])
        if not isinstance(value, (list, tuple)) or len(value) > MAX_CASES:
            return f"a {kind}, not a list of at most {MAX_CASES} rows"
        for row in value:
            why = _fits(row, f"vector:{k}")
            if why is not None:
                return f"a row that is {why}"
        return None
    if form == NAME:
        return None if isinstance(value, str) and len(value) <= MAX_NAME_CHARS else f"a {kind}, not a short string"
    if form == NAMES:
        ok = isinstance(value, (list, tuple)) and len(value) <= 64 and all(
            isinstance(v, str) and len(v) <= MAX_NAME_CHARS for v in value)
        return None if ok else f"a {kind}, not a short list of short strings"
    return f"unknown form {form!r}"


def check_declared(decl: Mapping[str, Any], method: str, task: str, site: str, model: Mapping[str, Any],
                   metrics: Mapping[str, Any], meta: Mapping[str, Any],
                   received: Mapping[str, Any] | None = None) -> list[dict]:
    """Check one task result against its task's declaration (:func:`declare`) and list what it sends.

    Args:
        decl: the task's declaration (:func:`feduq.registry.ledger.declaration` of the job's ``method``).
        model: the result's model tensors (key -> array); metrics, meta: its metrics and meta dicts.
        received: key -> shape of the model the server sent with this task (what ``"model"`` entries may be).

    Returns:
        One row per key: ``{"section", "key", "form", "shape", "bytes"}`` (shape as text).

    Raises:
        LedgerViolation: an undeclared key, or a declared key of the wrong form (names site, task, section, key).
    """
    received = received or {}
    rows = []
    for section, values in (("model", model), ("metrics", metrics), ("meta", meta)):
        if not isinstance(values, Mapping):
            raise LedgerViolation(f"site {site!r}: task {task!r} of {method!r}: its {section} is a "
                                  f"{type(values).__name__}, not a mapping; blocked by the privacy ledger (feduq.privacy.ledger)")
        per_pattern: dict[str, int] = {}
        for key, value in values.items():
            if not isinstance(key, str) or len(key) > MAX_KEY_CHARS:
                raise LedgerViolation(f"site {site!r}: task {task!r} of {method!r}: {section} key {str(key)[:60]!r} "
                                      f"({type(key).__name__}) is not a name of <= {MAX_KEY_CHARS} characters; blocked "
                                      "by the privacy ledger (feduq.privacy.ledger)")
            if section == "model":
                named = _pattern(key, decl["extra_model"])  # declared by name: any shape
                form = decl["extra_model"][named] if named else MODEL if decl["model"] else None
                problem = None if form is None else _fits(value, form, np.shape(value) if named else received.get(key))
            else:
                patterns = {**decl[section], **(FLARE_META if section == "meta" else {})}
                pattern = _pattern(key, patterns)
                form = None if pattern is None else patterns[pattern]
                problem = None if form is None else _fits(value, form)
                if form == NAME and problem is None and value != site:  # a site speaks only for itself
                    problem = f"{str(value)[:60]!r}, not the sending site's own name {site!r}"
                if pattern is not None and pattern != key:  # matched by a wildcard (dice_*): a bounded number of keys
                    per_pattern[pattern] = per_pattern.get(pattern, 0) + 1
                    if per_pattern[pattern] > MAX_KEYS_PER_PATTERN:
                        raise LedgerViolation(f"site {site!r}: task {task!r} of {method!r}: more than "
                                              f"{MAX_KEYS_PER_PATTERN} {section} keys match {pattern!r} (e.g. {key!r}); "
                                              "blocked by the privacy ledger (feduq.privacy.ledger)")
            if form is None:
                raise LedgerViolation(f"site {site!r}: task {task!r} of {method!r} would send undeclared {section} key "
                                      f"{key!r} (shape {np.shape(value) if not isinstance(value, str) else 'str'}); "
                                      "blocked by the privacy ledger (feduq.privacy.ledger)")
            if problem:
                raise LedgerViolation(f"site {site!r}: task {task!r} of {method!r}: {section} key {key!r} is {problem} "
                                      f"(declared {form}); blocked by the privacy ledger (feduq.privacy.ledger)")
            shape = "str" if isinstance(value, str) else "x".join(map(str, np.shape(value))) or "scalar"
            rows.append({"section": section, "key": key, "form": form, "shape": shape, "bytes": _nbytes(value)})
    return rows


#: headers a site's result may carry when it reaches the ledger (FLARE's own content type, rounds, return code and
#: routing keys; FedUQ's error reason), each a plain number or a string of at most :data:`MAX_HEADER_CHARS`
ALLOWED_HEADERS = frozenset({
    "__content_type__", "start_round", "current_round", "total_rounds", "__rc__", "__task_name__", "__task_id__",
    "__workflow__", "__audit_event_id__", "__reply_is_late__", "__topic__", "__task_operator__", "__msg_root_id__",
    "__msg_root_ttl__", "feduq_site_error"})
MAX_HEADER_CHARS = 1000
RESULT_KINDS = ("WEIGHTS", "WEIGHT_DIFF", "METRICS")  #: the DXO kinds a FedUQ site sends
_MESSAGE_KEYS = {"DXO", "__headers__"}
_DXO_FIELDS = {"kind", "data", "meta"}


def check_envelope(site: str, task: str, keys, headers: Mapping[str, Any], dxo_fields, kind: str | None,
                   ok: bool) -> None:
    """Check what surrounds a result's DXO (FLARE's Shareable), before :func:`check_result` reads the DXO.

    Args:
        keys: the message's top-level keys (a FLARE Shareable: ``"DXO"`` and ``"__headers__"`` only).
        headers: its headers (:data:`ALLOWED_HEADERS`, plain numbers or short strings).
        dxo_fields: the encoded DXO's fields (``kind``, ``data``, ``meta`` only), or None when it has no DXO.
        kind: the DXO's data kind (one of :data:`RESULT_KINDS`).
        ok: the result's return code is OK. A result without a DXO passes only as an error reply (not OK), which
            carries nothing but its headers (the site's reason, <= :data:`MAX_HEADER_CHARS` characters).

    Raises:
        LedgerViolation: naming the site, task, the key or header and its type.
    """
    where = f"site {site!r}: task {task!r}"
    extra = sorted(map(str, set(keys) - _MESSAGE_KEYS))
    if extra:
        raise LedgerViolation(f"{where}: the result carries {extra} beside its DXO; blocked by the privacy ledger")
    for name, value in (headers or {}).items():
        if name not in ALLOWED_HEADERS:
            raise LedgerViolation(f"{where}: undeclared header {str(name)[:60]!r} ({type(value).__name__}); blocked "
                                  "by the privacy ledger")
        plain = value is None or _number(value) or (isinstance(value, str) and len(value) <= MAX_HEADER_CHARS)
        if not plain:
            raise LedgerViolation(f"{where}: header {name!r} is a {type(value).__name__}"
                                  f"{' of ' + str(len(value)) + ' characters' if isinstance(value, str) else ''}, "
                                  "not a plain number or short string; blocked by the privacy ledger")
    if dxo_fields is None:
        if ok:
            raise LedgerViolation(f"{where}: a result with return code OK and no DXO; blocked by the privacy ledger")
        return
    extra = sorted(map(str, set(dxo_fields) - _DXO_FIELDS))
    if extra:
        raise LedgerViolation(f"{where}: the DXO carries fields {extra}; blocked by the privacy ledger")
    if kind not in RESULT_KINDS:
        raise LedgerViolation(f"{where}: a DXO of kind {str(kind)[:40]!r} (a FedUQ site sends {list(RESULT_KINDS)}); "
                              "blocked by the privacy ledger")
