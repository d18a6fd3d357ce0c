"""FLARE's Recipe add-ons on a FedUQ job: what ``nvflare.recipe.utils`` and ``Recipe.add_*`` place, written into the
job's files, or refused with one line. Used by :class:`feduq.recipes.recipe.FedUQJob` (FLARE's job API ``to``,
``to_server``, ``to_clients``) and :meth:`feduq.recipes.recipe.FedUQRecipe.set_per_site_config`.

What a FedUQ job accepts:

* **components** (an experiment-tracking receiver of ``add_experiment_tracking``: MLflow, TensorBoard, Weights &
  Biases; any FLARE component): added to the server's or the sites' ``components``, serialised as FLARE's own job
  export does. A TensorBoard receiver replaces the job's own (``tb_receiver``) instead of writing the same events
  twice.
* **filters**: a site's *outgoing* filters run **before** FedUQ's privacy ledger filter, so the ledger checks the
  result that really leaves (a filter adding an undeclared key is still refused); a site's *incoming* filters run
  after it. Server filters are appended.
* **top-level config** (``add_client_config``, ``add_server_config``): new keys only.
* **per-site settings** (``set_per_site_config``): the settings a site owns (:data:`PER_SITE_SETTINGS`) go into the
  executor's ``per_site`` argument, which each site applies to itself at start (and logs).

Refused with a ValueError naming what and why: FLARE workflows and executors (FedUQ's round loop and site executor are
the job's own; ``add_cross_site_evaluation``: every site already tests the best global model, and
``feduq evaluate`` scores any model on any site), components for some sites only (FedUQ jobs deploy one client app
to every site), a data root in a job (a site keeps its own, ``feduq prepare-site``), and classes that are not in an
installed package (a job would have to carry their code).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from . import jobspec

#: settings a site may own (``set_per_site_config``), with their checks; the site executors apply them at start
PER_SITE_SETTINGS = {
    # as the job-wide --set device: auto, cpu, cuda or cuda:N (feduq.site.settings.check_common_args)
    "device": lambda v: isinstance(v, str) and (v in ("auto", "cpu") or v.startswith("cuda")),
    "batch_size": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
    "num_threads": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
    "num_workers": lambda v: v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 0),
}
_FIXED_KEYS = ("format_version", "components", "workflows", "executors", "task_data_filters", "task_result_filters",
               "server")


def serialise(obj) -> dict:
    """A FLARE component object -> ``{"path", "args"}`` as FLARE's job export writes it (its ``FedJobConfig``).

    Raises:
        ValueError: the class is not importable from an installed package (defined in ``__main__`` or a script).
    """
    from nvflare.job_config.fed_job_config import FedJobConfig

    if type(obj).__module__ == "__main__":
        raise ValueError(f"{type(obj).__name__} is defined in a script; a FedUQ job names installed classes only")
    cfg = FedJobConfig(job_name="feduq", min_clients=1)
    with tempfile.TemporaryDirectory() as custom:
        path = cfg._get_class_path(obj, custom)
        args = cfg._get_args(obj, custom)
        if any(Path(custom).iterdir()):
            raise ValueError(f"{path} is not in an installed package; a FedUQ job names installed classes only")
    return {"path": path, "args": args}


def _kind(obj) -> str:
    from nvflare.apis.executor import Executor
    from nvflare.apis.filter import Filter
    from nvflare.apis.impl.controller import Controller

    if isinstance(obj, dict):
        return "config"
    if isinstance(obj, Filter):
        return "filter"
    if isinstance(obj, (Controller, Executor)):
        return "workflow"
    return "component"


def add(files: dict[str, str], target: str, obj, id: str | None = None, filter_type=None, tasks=None) -> dict[str, str]:
    """``files`` with ``obj`` added to the server (``target == "server"``) or every site (``"clients"``).

    Raises:
        ValueError: what FedUQ refuses (module doc), a duplicate component id or config key.
    """
    from nvflare.job_config.defs import FilterType

    name = jobspec.SERVER if target == "server" else jobspec.CLIENT
    cfg = json.loads(files[name])
    kind = _kind(obj)
    where = "the server" if target == "server" else "the sites"
    if kind == "workflow":
        raise ValueError(f"{type(obj).__name__} cannot be added to a FedUQ job: its round loop and site executor are "
                         "the job's own (FLARE's cross-site evaluation: every site already tests the best global model "
                         "at the end, and feduq evaluate scores any model on any site)")
    if kind == "config":
        clash = sorted(set(obj) & (set(cfg) | set(_FIXED_KEYS)))
        if clash:
            raise ValueError(f"config keys {clash} of {where} are FedUQ's own; add new keys only")
        cfg.update(obj)
    elif kind == "filter":
        if filter_type not in (FilterType.TASK_DATA, FilterType.TASK_RESULT):
            raise ValueError(f"filter {type(obj).__name__}: filter_type must be TASK_DATA or TASK_RESULT")
        key = "task_data_filters" if filter_type == FilterType.TASK_DATA else "task_result_filters"
        client = json.loads(files[jobspec.CLIENT])
        known = [t for g in client["task_result_filters"] + client["task_data_filters"] for t in g["tasks"]]
        # a site's outgoing filters before the ledger: it checks what really leaves
        cfg[key] = _place_filter(cfg[key], serialise(obj), list(tasks) if tasks else list(dict.fromkeys(known)),
                                 first=target != "server" and key == "task_result_filters")
    else:
        comp = serialise(obj)
        same = [c for c in cfg["components"] if c["path"] == comp["path"]]
        if comp["path"].endswith("TBAnalyticsReceiver") and same:  # one TensorBoard receiver: the user's settings
            same[0]["args"] = comp["args"]
        else:
            cid = id or type(obj).__name__
            if any(c["id"] == cid for c in cfg["components"]):
                raise ValueError(f"{where} already have a component with id {cid!r}")
            cfg["components"].append({"id": cid, **comp})
    return {**files, name: json.dumps(cfg, indent=2) + "\n"}


def _place_filter(groups: list[dict], filt: dict, tasks: list[str], first: bool) -> list[dict]:
    """Filter groups with ``filt`` on ``tasks``: FLARE allows one chain per task, so a group sharing tasks is split and
    ``filt`` goes first (``first``) or last in the chain of each of them."""
    out, remaining = [], list(tasks)
    for g in groups:
        inside = [t for t in g["tasks"] if t in remaining]
        outside = [t for t in g["tasks"] if t not in remaining]
        if inside:
            out.append({"tasks": inside, "filters": [filt, *g["filters"]] if first else [*g["filters"], filt]})
            remaining = [t for t in remaining if t not in inside]
        if outside:
            out.append({"tasks": outside, "filters": g["filters"]})
    if remaining:
        out.append({"tasks": remaining, "filters": [filt]})
    return out


def per_site(files: dict[str, str], settings: dict[str, dict]) -> dict[str, str]:
    """``files`` whose site executor applies ``settings`` (site -> {setting: value}) on the named sites.

    Raises:
        ValueError: a site that is not the job's, a setting a site does not own (a data root: names the way a site
            sets it), or a value out of range (names site, setting and value).
    """
    meta = json.loads(files[jobspec.META])
    sites = [s for targets in meta["deploy_map"].values() for s in targets if s != "server"]
    for site, values in settings.items():
        if site not in sites:
            raise ValueError(f"set_per_site_config: {site!r} is not a site of this job {sites}")
        for key, value in values.items():
            if key == "data_root":
                raise ValueError(f"set_per_site_config: site {site!r}: a FedUQ job never carries a data path; the "
                                 "site sets its own (feduq prepare-site --data-root, or FEDUQ_DATA_ROOT)")
            if key not in PER_SITE_SETTINGS:
                raise ValueError(f"set_per_site_config: site {site!r}: {key!r} is not a setting a site owns "
                                 f"({sorted(PER_SITE_SETTINGS)}); the method's settings are the same on every site")
            if not PER_SITE_SETTINGS[key](value):
                raise ValueError(f"set_per_site_config: site {site!r}: {key}={value!r} is out of range")
    client = json.loads(files[jobspec.CLIENT])
    executor = client["executors"][0]["executor"]
    executor["args"]["per_site"] = {s: dict(v) for s, v in settings.items()}
    return {**files, jobspec.CLIENT: json.dumps(client, indent=2) + "\n"}


def initial_checkpoint(files: dict[str, str], path: str, what: str = "initial_ckpt") -> tuple[dict[str, str], str | None]:
    """``files`` whose server persistor starts from the checkpoint ``path`` (FLARE's ``initial_ckpt``): a FedUQ
    checkpoint (``{"model": state_dict}``, what the persistor saves) or a bare state dict of the job's network, such
    as a pretrained network. Checked here against the persistor's model: every key, every shape.

    As FLARE's recipes: a **relative** path is a file on this machine, bundled into the job (``app/custom/``; the
    second value returned is the file to bundle) and named by its file name; an **absolute** path is read by the
    server at run time (checked here when this machine has it).

    Raises:
        ValueError: the file is missing (relative path), not a weights-only torch file, or does not fit the network
            (names the first missing, unexpected or mis-shaped keys); the message starts with ``what``.
    """
    import torch

    from ..core.checkpoints import CheckpointError, check_finite, load_checkpoint
    from ..jobs.jobcheck import instantiate

    local = Path(path)
    bundle = None if local.is_absolute() else str(local)
    if bundle is not None and not local.is_file():
        raise ValueError(f"{what} {path}: no such file (a relative path is a file on this machine, bundled "
                         "into the job; an absolute path is read by the server at run time)")
    server = json.loads(files[jobspec.SERVER])
    persistor = next((c for c in server["components"] if c["id"] == "persistor"), None)
    if persistor is None or not isinstance(persistor.get("args", {}).get("model"), dict):
        raise ValueError(f"{what}: this job's server has no model persistor to start from a checkpoint")
    if local.is_file():
        try:
            state = load_checkpoint(local, what=what)
        except CheckpointError as e:
            raise ValueError(f"{what}: {e}") from None
        state = state.get("model", state) if isinstance(state, dict) else state
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ValueError(f"{what} {path}: not a state dict (or {{'model': state_dict}})")
        check_finite(state, path, what)  # a diverged model is no start (CheckpointError is a ValueError)
        model = instantiate(persistor["args"]["model"], "server persistor model")
        want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        got = {k: tuple(v.shape) for k, v in state.items()}
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        shapes = [k for k in want if k in got and want[k] != got[k]]
        if missing or extra or shapes:
            detail = (f"missing keys {missing[:3]}" if missing else f"unexpected keys {extra[:3]}" if extra
                      else f"{shapes[0]!r} is {list(got[shapes[0]])} in the file, {list(want[shapes[0]])} in the job")
            raise ValueError(f"{what} {path} does not fit the job's network "
                             f"({persistor['args']['model']['path'].rsplit('.', 1)[1]}): {detail}")
    persistor["args"]["source_ckpt_file_full_name"] = local.name if bundle else str(local)
    return {**files, jobspec.SERVER: json.dumps(server, indent=2) + "\n"}, bundle
