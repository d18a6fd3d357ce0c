"""FedUQ job folders as data: a registered method (:mod:`feduq.registry`) rendered to FLARE's job files, and a job's
files configured (image size, rounds, sites, ...) and checked before anything is written.

A job is ``{relative path: text}`` for ``meta.json``, ``app/config/config_fed_server.json``,
``app/config/config_fed_client.json`` and ``app/custom/README.md``. :func:`render` makes a registered method's files
(the committed ``jobs/<method>/`` are these, exported by :class:`feduq.recipes.recipe.FedUQRecipe`); :func:`configure`
changes them and validates the result with the job check every FedUQ workflow runs at start-up
(:func:`feduq.flare.jobcheck.validate_configs`); :func:`write_job` writes them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..registry import (
    COMMON_CLIENT_ARGS,
    CT_ITERATIONS,
    CT_ROUNDS,
    method_sites,
    network_args,
    spec_of,
    task_executor_defaults,
    task_settings,
)

#: FLARE server settings of every job (``config_fed_server.json``'s ``server`` section). ``task_request_interval``:
#: how long a site that asked for a task while none was ready waits before it asks again; FLARE's 2 s default
#: idles the last site to finish for up to 2 s at every exchange of a round (FedEvi has two a round).
SERVER_SETTINGS = {"task_request_interval": 0.25}

META, SERVER, CLIENT, CUSTOM = ("meta.json", "app/config/config_fed_server.json", "app/config/config_fed_client.json",
                                "app/custom/README.md")

def persistor_model(network: dict, in_channels: int, out_channels: int, seed: int) -> dict:
    """The server's model spec for the sites' ``network``: the registered class with the same options."""
    from ..core.networks import DEFAULT_NETWORK, network_class_path

    options = {k: v for k, v in network.items() if k != "name"}
    return {
        "path": network_class_path(network.get("name", DEFAULT_NETWORK)),
        "args": {"in_channels": in_channels, "out_channels": out_channels, **options, "init_seed": seed},
    }


#: every committed 2D job's task timeouts (s): a site that dies or hangs ends its task after this, named by the
#: quorum rule, instead of the run waiting forever (FLARE's 0 = no limit). A CPU round of the papers' settings takes
#: a few minutes; ``configure_job.py --train-timeout`` sets another.
TASK_TIMEOUT = 3600
#: the CT jobs' task timeouts (s): one nnU-Net round of 250 iterations, on a CPU if need be
CT_TASK_TIMEOUT = 4 * 3600


def persistor(task: dict, network: dict, seed: int) -> dict:
    return {
        "id": "persistor",
        "path": "nvflare.app_opt.pt.file_model_persistor.PTFileModelPersistor",
        "args": {"model": persistor_model(network, task["in_channels"], task["num_classes"], seed)},
    }


def server_config(method: str) -> dict:
    spec = spec_of(method)
    task = task_settings(spec.task)
    train = {  # FedUQ's round with the method's server part
        "id": "controller",
        "path": spec.workflow_path,
        "args": {"num_rounds": spec.num_rounds, "persistor_id": "persistor", **spec.workflow_args},
    }
    train["args"].update({k: TASK_TIMEOUT for k in _timeout_args(train)})
    return {
        "format_version": 2,
        "server": dict(SERVER_SETTINGS),
        "workflows": [
            train,
            {"id": "final_test", "path": "feduq.flare.workflows.FinalTestEvaluation",
             "args": {"method": method, "timeout": TASK_TIMEOUT, **spec.final_test_args}},
        ],
        "components": [
            persistor(task, network_args(method), COMMON_CLIENT_ARGS["seed"]),
            {
                "id": "model_selector",
                "path": "feduq.flare.selection.BestModelSelector",  # IntimeModelSelector + a record that survives resume
                "args": {"key_metric": spec.key_metric},
            },
            tensorboard_receiver(),
        ],
        "task_data_filters": [],
        "task_result_filters": [],
    }


def tensorboard_client_components() -> list[dict]:
    """A site's TBWriter and the widget that forwards its records to the server (FLARE's experiment tracking)."""
    return [
        {"id": "tb_writer", "path": "nvflare.app_opt.tracking.tb.tb_writer.TBWriter", "args": {}},
        {
            "id": "event_to_fed",
            "path": "nvflare.app_common.widgets.convert_to_fed_event.ConvertToFedEvent",
            "args": {"events_to_convert": ["analytix_log_stats"], "fed_event_prefix": "fed."},
        },
    ]


def tensorboard_receiver() -> dict:
    """The server's receiver of the sites' per-round metrics -> ``<run dir>/tb_events/<site>/``."""
    return {
        "id": "tb_receiver",
        "path": "nvflare.app_opt.tracking.tb.tb_receiver.TBAnalyticsReceiver",
        "args": {"tb_folder": "tb_events", "events": ["fed.analytix_log_stats"]},
    }


def ledger_filters(method: str, tasks: list[str]) -> dict:
    """The client's privacy-ledger filters (feduq.flare.ledger) on every task of the job: the data filter notes the
    model the server sent, the result filter records and enforces what the site sends (the method's declaration, feduq.registry.ledger)."""
    path = "feduq.flare.ledger.PrivacyLedgerFilter"
    return {
        "task_data_filters": [{"tasks": list(tasks), "filters": [{"path": path, "args": {"method": method, "direction": "in"}}]}],
        "task_result_filters": [{"tasks": list(tasks), "filters": [{"path": path, "args": {"method": method, "direction": "out"}}]}],
    }


def client_config(method: str) -> dict:
    spec = spec_of(method)
    return {
        "format_version": 2,
        "executors": [
            {
                "tasks": list(spec.tasks),
                "executor": {
                    "id": "executor",
                    "path": spec.executor_path,
                    "args": {
                        **COMMON_CLIENT_ARGS,
                        **spec.client_args,
                        "task": spec.task,
                        "network": network_args(method),
                        **spec.executor_args,
                    },
                },
            }
        ],
        "components": tensorboard_client_components(),
        **ledger_filters(method, list(spec.tasks)),
    }


def meta(method: str) -> dict:
    sites = method_sites(method)
    return {
        "name": method,
        "resource_spec": {},
        "min_clients": len(sites),
        "deploy_map": {"app": ["server", *sites]},
    }


#: ``app/custom/README.md`` of every job. FLARE 2.9 builds a job's components only from the site's
#: ``class_allow_list`` unless the job brings its own code; an app with a ``custom/`` folder is bring-your-own-code
#: (BYOC) and is admitted by the site's ``byoc`` right instead, as FLARE's own exported jobs are. So the committed
#: jobs run in ``nvflare simulator`` and POC with no site preparation.
CUSTOM_README = """# Why this job has a `custom/` folder

FedUQ's components (`feduq.flare.*`, `feduq.core.networks.*`) are not NVIDIA FLARE classes. FLARE 2.9 builds
a job's components only from the site's `class_allow_list`, unless the job brings its own code (BYOC): an
app with a `custom/` folder is BYOC, and a site admits it by its `byoc` right instead, as it admits the jobs
FLARE's own Job API exports. This folder makes the job BYOC, so `nvflare simulator jobs/<method> -w ws -t 4`
and a POC federation run it with no site preparation.

It holds no code: every site runs the `feduq` package installed on it, the version of this checkout.

- For sites whose authorization policy refuses custom code, make the job without this folder:
  `python tools/configure_job.py jobs/<method> -o OUT --allow-listed`; each such site then allow-lists
  FedUQ's classes once: `python tools/prepare_site.py <site kit> --data-root DIR`.
- To ship FedUQ's code inside the job instead of installing it on the sites: `--byoc`.
"""


def _dump(obj) -> str:
    return json.dumps(obj, indent=2) + "\n"


def render(method: str) -> dict[str, str]:
    """The job files of a registered method (relative path -> text), as committed in ``jobs/<method>/``.

    Raises:
        ValueError: ``method`` is not registered (:func:`feduq.registry.spec_of`).
    """
    if spec_of(method).kind == "ct":
        return _render_ct(method)
    return {META: _dump(meta(method)), SERVER: _dump(server_config(method)), CLIENT: _dump(client_config(method)),
            CUSTOM: CUSTOM_README}


def _render_ct(method: str) -> dict[str, str]:
    """Job files of a multi-head CT method: nnU-Net's full 2D plan, FIVA's schedule (FIVA Table 2)."""
    from ..data.ct import HELD_OUT, training_centers

    spec = spec_of(method)
    executor, ex_args, workflow, wf_args = spec.executor_path, spec.executor_args, spec.workflow_path, spec.workflow_args
    variance = spec.ct_variance
    sites = [*training_centers(), *HELD_OUT]
    dropout = ex_args.get("dropout", 0.0)
    client = {"format_version": 2, "executors": [{"tasks": list(spec.tasks), "executor": {
        "id": "executor", "path": executor, "args": {
            "plans": "ct_2d", "intensity": "site", "iterations": CT_ITERATIONS, "batch_size": None, "lr": 0.01,
            "weight_decay": 3e-5, "num_rounds": CT_ROUNDS, "inference_samples": 10, "seed": 0, "device": "auto",
            "amp": "auto", **ex_args}}}], "components": tensorboard_client_components(),
        **ledger_filters(method, list(spec.tasks))}
    ct_workflow = {"id": "ct_controller", "path": workflow, "args": {
        "num_rounds": CT_ROUNDS, "persistor_id": "persistor", "method": method, **wf_args}}
    ct_workflow["args"].update({k: CT_TASK_TIMEOUT for k in _timeout_args(ct_workflow)})
    server = {"format_version": 2, "server": dict(SERVER_SETTINGS), "workflows": [ct_workflow],
        "components": [{"id": "persistor", "path": "nvflare.app_opt.pt.file_model_persistor.PTFileModelPersistor",
                        "args": {"model": {"path": "feduq.flare.ct.BackboneModel",
                                           "args": {"plans": "ct_2d", "dropout": dropout, "variance": variance}}}},
                       tensorboard_receiver()],
        "task_data_filters": [], "task_result_filters": []}
    return {META: _dump({"name": method, "resource_spec": {}, "min_clients": len(sites),
                         "deploy_map": {"app": ["server", *sites]}}),
            SERVER: _dump(server), CLIENT: _dump(client), CUSTOM: CUSTOM_README}


# -- configuring a job's files ------------------------------------------------------------------------------------------
#: What the selection can use: the sites' mean validation Dice (higher is better) or validation Dice loss (lower).
SELECTION_METRICS = ("val_dice", "val_loss")
#: Executor arguments of the official FedEvi code's protocol (``official_protocol``; jobs/fedevi/README.md).
OFFICIAL_PROTOCOL = {"resize": "stretch", "intensity": "max",
                     "test_protocol": {"resolution": "training", "connectivity": 4, "empty_prediction": "empty",
                                       "every_round": True}}


def _class_at(path: str):
    """The class a config's ``path`` names (None when it does not import)."""
    from ..common.classpath import ClassPathError, resolve_class

    try:
        return resolve_class(path, ("feduq.", "nvflare."))
    except ClassPathError:
        return None


def _timeout_args(workflow: dict) -> tuple[str, ...]:
    """The task timeouts a workflow spec (``{"path", "args"}``) declares: its ``server_part`` argument's, else its
    class's ``timeout_args``."""
    from ..parts.server import job_server_part

    cls = _class_at(workflow["path"])
    part = job_server_part(cls, workflow.get("args", {}).get("server_part"))
    return tuple(part.timeout_args if part is not None else getattr(cls, "timeout_args", ()))


def _keeps_fedavg_loss(executor: dict) -> bool:
    """Whether the 2D executor spec ``executor`` (``{"path", "args"}``) trains with FedAvg's loss, so ``loss`` applies
    to it: its site part (``site_part`` argument or the class's ``SITE_PART``) keeps :meth:`SitePart.loss`."""
    from ..flare.executor import FedUQExecutor
    from ..parts.site import SitePart, job_site_part

    cls = _class_at(executor["path"])
    if not (isinstance(cls, type) and issubclass(cls, FedUQExecutor)):
        return False
    cls = cls.job_class(executor.get("args", {}))
    return job_site_part(cls, executor.get("args", {}).get("site_part")).loss is SitePart.loss


def read_job_files(job_dir: str | Path) -> dict[str, str]:
    """A job folder's files as :func:`render` gives them (``app/custom/README.md`` only when present).

    Raises:
        FileNotFoundError: ``job_dir`` is not a job folder (no meta.json / app/config).
    """
    job_dir = Path(job_dir)
    if not (job_dir / META).is_file() or not (job_dir / "app" / "config").is_dir():
        raise FileNotFoundError(f"{job_dir} is not a FedUQ job folder (meta.json and app/config/ expected)")
    return {rel: (job_dir / rel).read_text() for rel in (META, SERVER, CLIENT, CUSTOM) if (job_dir / rel).is_file()}


def _json(files: dict[str, str], rel: str) -> dict:
    """A job file's JSON object. Raises JobConfigError naming the file and the error (a missing file too)."""
    from ..flare.jobcheck import JobConfigError

    if rel not in files:
        raise JobConfigError(f"the job has no {rel}")
    try:
        value = json.loads(files[rel])
    except ValueError as e:
        raise JobConfigError(f"{rel} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise JobConfigError(f"{rel} must hold a JSON object, not a {type(value).__name__}")
    return value


def _refuse_contradictions(executor_args: dict, workflow_args: dict, official_protocol: bool, select_on,
                           **named) -> None:
    """Refuse a setting given twice with different values (a named option and ``executor_args``/``workflow_args``, or
    ``official_protocol`` and a value it sets), instead of letting one silently win.

    Raises:
        JobConfigError: naming the setting and both values.
    """
    from ..flare.jobcheck import JobConfigError

    def name_of(network):
        return network.get("name") if isinstance(network, dict) else network

    for key, value in named.items():
        args = workflow_args if key in ("num_rounds", "min_clients") else executor_args
        if value is None or key not in args:
            continue
        other = args[key]
        if (name_of(other) if key == "network" else other) != value:
            where = "--set-workflow" if args is workflow_args else "--set"
            raise JobConfigError(f"{key} is given twice: {value!r} and {where} {key}={other!r}; give it once")
    if official_protocol:
        for key, value in {**OFFICIAL_PROTOCOL, **({"select_on": "val_loss"} if select_on else {})}.items():
            other = select_on if key == "select_on" else executor_args.get(key, value)
            if other != value:
                raise JobConfigError(f"official_protocol sets {key}={value!r}, contradicted by {key}={other!r}; "
                                     f"drop one of them")


def configure(files: dict[str, str], name: str | None = None, *, task=None, image_size=None, num_rounds=None,
              local_epochs=None, batch_size=None, max_items=None, seed=None, sites=None, min_clients=None,
              train_timeout=None, executor_args=None, any_site_names=False, network=None, workflow_args=None,
              select_on=None, official_protocol=False, allow_listed=False, resource_spec=None) -> dict[str, str]:
    """A job's files with changed settings, checked before they are returned (``tools/configure_job.py`` documents
    every option; None keeps the job's value).

    ``train_timeout`` sets every task timeout the workflows declare (their classes' ``timeout_args``: the training
    round's exchanges and the final test), so a site that died ends each task after it, named;
    ``min_clients`` the quorum of every workflow that takes one; ``allow_listed`` drops ``app/custom/`` (sites that
    refuse custom code and allow-list FedUQ's classes). ``resource_spec`` (site -> ``{"num_of_gpus": int >= 0,
    "mem_per_gpu_in_GiB": number > 0}``) goes to ``meta.json`` for FLARE's resource manager, which deploys the job
    only when each named site has what it asks (a CPU-only site: ``{"num_of_gpus": 0}``).

    Raises:
        feduq.flare.jobcheck.JobConfigError: the configured job would not run (message names the key or value).
    """
    from ..flare.jobcheck import JobConfigError, _ours, validate_configs

    for key, value in {"num_rounds": num_rounds, "local_epochs": local_epochs, "image_size": image_size,
                       "batch_size": batch_size, "max_items": max_items}.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise JobConfigError(f"{key} must be an integer >= 1, got {value!r}")
    _refuse_contradictions(executor_args or {}, workflow_args or {}, official_protocol, select_on,
                           image_size=image_size, local_epochs=local_epochs, batch_size=batch_size,
                           max_items=max_items, seed=seed, network=network, num_rounds=num_rounds,
                           min_clients=min_clients)
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32):
        raise JobConfigError(f"seed must be an integer in [0, 2**32), got {seed!r}")
    if train_timeout is not None and (not isinstance(train_timeout, int) or isinstance(train_timeout, bool)
                                      or train_timeout < 0):
        raise JobConfigError(f"train_timeout must be an integer number of seconds >= 0 (0: no limit), got "
                             f"{train_timeout!r}")
    if sites is not None:
        repeated = sorted({s for s in sites if list(sites).count(s) > 1})
        if repeated:
            raise JobConfigError(f"sites {repeated} are listed more than once; each site is one FLARE client")
    network_arg = (executor_args or {}).get("network")
    if isinstance(network_arg, str):  # --set network=light: the name
        executor_args = {**executor_args, "network": {"name": network_arg}}
    elif network_arg is not None and not isinstance(network_arg, dict):
        raise JobConfigError(f"executor argument network must be a name or a JSON object such as "
                             f'\'{{"name": "light"}}\', got {network_arg!r}')
    if select_on not in (None, *SELECTION_METRICS):
        raise JobConfigError(f"select_on must be one of {SELECTION_METRICS}, got {select_on!r}")
    meta_, server, client = (_json(files, rel) for rel in (META, SERVER, CLIENT))

    executor = client["executors"][0]["executor"]
    exe_args = executor["args"]
    if official_protocol:
        select_on = select_on or "val_loss"
        exe_args.update(OFFICIAL_PROTOCOL)
        if _keeps_fedavg_loss(executor):
            exe_args["loss"] = "dice"
    if task is not None:  # another task: its centers become the sites, and the network's in/out channels follow
        settings = task_settings(task)
        exe_args["task"] = task
        exe_args.update(task_executor_defaults(task, executor["path"], exe_args.get("site_part"),
                                                  exe_args.get("site_class")))
        sites = sites or settings["sites"]
        for comp in server["components"]:
            if comp["id"] == "persistor":
                comp["args"]["model"]["args"].update(in_channels=settings["in_channels"],
                                                     out_channels=settings["num_classes"])
    for key, value in {"image_size": image_size, "local_epochs": local_epochs, "batch_size": batch_size,
                       "max_items": max_items, "seed": seed}.items():
        if value is not None:
            exe_args[key] = value
    exe_args.update(executor_args or {})

    if sites:
        meta_["deploy_map"] = {"app": ["server", *sites]}
        meta_["min_clients"] = len(sites)
    for wf in server["workflows"]:
        args = wf["args"]
        if num_rounds is not None and "num_rounds" in args:
            args["num_rounds"] = num_rounds
            if "num_rounds" in exe_args:  # the sites' schedule spans the job's rounds (CT's poly schedule)
                exe_args["num_rounds"] = num_rounds
        if min_clients is not None or (sites and "min_clients" in args):
            args["min_clients"] = min_clients if min_clients is not None else len(sites)
        if train_timeout is not None:
            for key in _timeout_args(wf):
                args[key] = train_timeout
    if min_clients is not None:
        meta_["min_clients"] = min_clients
    if workflow_args:
        server["workflows"][0]["args"].update(workflow_args)
    if select_on is not None:
        selector = next((c for c in server["components"] if c["id"] == "model_selector"), None)
        if selector is None:
            raise JobConfigError(f"select_on={select_on!r}: the job has no model_selector component to configure")
        selector["args"].update(key_metric=select_on, negate_key_metric=select_on == "val_loss")
    if network is not None:
        exe_args["network"] = {**(exe_args.get("network") or {}), "name": network}
    for comp in server["components"]:
        model_path = str((comp.get("args", {}).get("model") or {}).get("path", "")) if comp.get("id") == "persistor" else ""
        if comp.get("id") == "persistor" and not _ours(model_path):
            raise JobConfigError(f"server component 'persistor' model: {model_path[:200]!r} is not a FedUQ class "
                                 "(feduq.*); the server's model is the sites' network")
        if comp["id"] == "persistor" and comp["args"]["model"]["path"].endswith("BackboneModel"):
            # multi-head CT: the server's backbone follows the sites' nnU-Net plans and dropout
            comp["args"]["model"]["args"].update(plans=exe_args.get("plans", "ct_2d"),
                                                 dropout=exe_args.get("dropout", 0.0))
        elif comp["id"] == "persistor":  # the server's model is the sites' network, with the task's channels
            model_args = comp["args"]["model"]["args"]
            try:
                comp["args"]["model"] = persistor_model(
                    exe_args.get("network") or {}, model_args["in_channels"], model_args["out_channels"],
                    model_args.get("init_seed", 0) if seed is None else seed)
            except ValueError as e:  # an unknown network name
                raise JobConfigError(f"client executor network {exe_args.get('network')}: {e}") from None

    if resource_spec is not None:
        meta_["resource_spec"] = check_resource_spec(resource_spec, [t for ts in meta_["deploy_map"].values()
                                                                     for t in ts if t != "server"])
    validate_configs(client, server, meta_, any_site_names=any_site_names)  # a job that cannot run is never written
    if name is not None:
        meta_["name"] = name
    out = {META: _dump(meta_), SERVER: _dump(server), CLIENT: _dump(client)}
    if CUSTOM in files and not allow_listed:
        out[CUSTOM] = files[CUSTOM]
    return out


RESOURCE_KEYS = {"num_of_gpus": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                 "mem_per_gpu_in_GiB": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0}


def check_resource_spec(spec, sites: list[str]) -> dict:
    """``spec`` (site -> FLARE resource requirements) checked against the job's ``sites``.

    Raises:
        JobConfigError: not a mapping of known sites to ``num_of_gpus`` / ``mem_per_gpu_in_GiB`` in range (named).
    """
    from ..flare.jobcheck import JobConfigError

    if not isinstance(spec, dict):
        raise JobConfigError(f"resource_spec must map sites to requirements, got {spec!r}")
    for site, need in spec.items():
        if site not in sites:
            raise JobConfigError(f"resource_spec: {site!r} is not a site of this job {sites}")
        if not isinstance(need, dict) or not need:
            raise JobConfigError(f"resource_spec: site {site!r} needs a non-empty object, got {need!r}")
        for key, value in need.items():
            if key not in RESOURCE_KEYS:
                raise JobConfigError(f"resource_spec: site {site!r}: unknown key {key!r} (known: {sorted(RESOURCE_KEYS)})")
            if not RESOURCE_KEYS[key](value):
                raise JobConfigError(f"resource_spec: site {site!r}: {key}={value!r} is out of range")
    return {site: dict(need) for site, need in spec.items()}


def parse_resources(items: list[str]) -> dict:
    """Command-line ``SITE=GPUS[:GiB]`` items -> a resource_spec (``Kvasir-SEG=1:16``, ``ETIS-LaribPolypDB=0``).

    Raises:
        JobConfigError: an item not of that form (named).
    """
    from ..flare.jobcheck import JobConfigError

    spec = {}
    for item in items:
        site, sep, value = item.partition("=")
        gpus, _, mem = value.partition(":")
        try:
            if not sep or not site:
                raise ValueError
            spec[site] = {"num_of_gpus": int(gpus), **({"mem_per_gpu_in_GiB": float(mem)} if mem else {})}
        except ValueError:
            raise JobConfigError(f"--resources expects SITE=GPUS[:GiB], got {item!r}") from None
    return spec


def write_job(files: dict[str, str], out_dir: str | Path, byoc: bool = False) -> Path:
    """Write a job's files into ``out_dir`` (made if needed); ``byoc`` also ships FedUQ's code in ``app/custom/feduq``
    (for sites without an installed ``feduq`` whose policy admits custom code). Returns ``out_dir``."""
    out_dir = Path(out_dir)
    for rel, text in files.items():
        path = out_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if byoc:
        shutil.copytree(Path(__file__).resolve().parents[1], out_dir / "app" / "custom" / "feduq",
                        ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    return out_dir
