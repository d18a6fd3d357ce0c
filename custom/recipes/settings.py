"""A job's files configured (image size, rounds, sites, protocol, resources, ...) and checked before anything is
written: every value is checked by the part that owns it, with the job check every FedUQ workflow runs at start-up
(:func:`feduq.jobs.jobcheck.validate_configs`), so a bad setting stops ``feduq configure``, ``feduq.run`` and the
Recipe with one line naming it.
"""

from __future__ import annotations

import difflib
import json
from typing import Any

from ..registry import task_settings
from .jobspec import CLIENT, CUSTOM, META, SERVER, class_at, dump_json, workflow_timeouts, meta, persistor, persistor_model


# -- configuring a job's files ------------------------------------------------------------------------------------------
#: What the selection can use: the sites' mean validation Dice (higher is better) or validation Dice loss (lower).
SELECTION_METRICS = ("val_dice", "val_loss")


#: Executor arguments of the official FedEvi code's protocol (``official_protocol``; jobs/fedevi/README.md): its resize,
#: intensity scaling and test protocol, and float32 training as the official code's (no autocast, on any device).
OFFICIAL_PROTOCOL = {"resize": "stretch_bicubic", "intensity": "max", "amp": False,
                     "test_protocol": {"resolution": "training", "connectivity": 4, "empty_prediction": "empty",
                                       "every_round": True}}


def _keeps_fedavg_loss(executor: dict) -> bool:
    """Whether the 2D executor spec ``executor`` (``{"path", "args"}``) trains with FedAvg's loss, so ``loss`` applies
    to it: its site part (``site_part`` argument or the class's ``SITE_PART``) keeps :meth:`SitePart.loss`."""
    from ..flare.executor import FedUQExecutor
    from ..parts.site import SitePart, job_site_part

    cls = class_at(executor["path"])
    if not (isinstance(cls, type) and issubclass(cls, FedUQExecutor)):
        return False
    cls = cls.job_class(executor.get("args", {}))
    return job_site_part(cls, executor.get("args", {}).get("site_part")).loss is SitePart.loss


def _json(files: dict[str, str], rel: str) -> dict:
    """A job file's JSON object. Raises JobConfigError naming the file and the error (a missing file too)."""
    from ..jobs.jobcheck import JobConfigError

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
    from ..jobs.jobcheck import JobConfigError

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
            if other != value and not (key == "resize" and other == "stretch_bicubic"):  # the authors' own filter
                raise JobConfigError(f"official_protocol sets {key}={value!r}, contradicted by {key}={other!r}; "
                                     f"drop one of them")


def configure(files: dict[str, str], name: str | None = None, *, task=None, image_size=None, num_rounds=None,
              local_epochs=None, batch_size=None, max_items=None, seed=None, sites=None, min_clients=None,
              train_timeout=None, executor_args=None, any_site_names=False, network=None, workflow_args=None,
              select_on=None, official_protocol=False, allow_listed=False, resource_spec=None,
              test_sites=None, record: list | None = None, configuration=None, plans=None) -> dict[str, str]:
    """A job's files with changed settings, checked before they are returned (``feduq configure`` documents
    every option; None keeps the job's value).

    ``train_timeout`` sets every task timeout the workflows declare (their classes' ``timeout_args``: the training
    round's exchanges and the final test), so a site that died ends each task after it, named;
    ``min_clients`` the quorum of every workflow that takes one; ``allow_listed`` drops ``app/custom/`` (sites that
    refuse custom code and allow-list FedUQ's classes). ``resource_spec`` (site -> ``{"num_of_gpus": int >= 0,
    "mem_per_gpu_in_GiB": number > 0}``) goes to ``meta.json`` for FLARE's resource manager, which deploys the job
    only when each named site has what it asks (a CPU-only site: ``{"num_of_gpus": 0}``). ``test_sites`` names the
    sites that run the final test (a list of the job's sites, or ``"per-center"``: every real site and the first
    virtual site of each ``<center>-p<k>of<K>`` group, which share the center's test list; see
    :func:`per_center_test_sites`); new ``sites`` without ``test_sites`` reset it to every site. ``task`` brings the
    settings the task makes for the job's method (:func:`task_method_settings`), after the method's and before
    ``executor_args``; ``record`` (a list) receives them as ``(key, value, source)``, what ``--set`` replaced said
    (``python -m feduq.run`` prints it, :func:`settings_line`). ``configuration`` (``"2d"`` or ``"3d_fullres"``;
    default the job's, else the task file's ``feduq.configuration``) with ``plans`` (an nnU-Net plans file or dict,
    carried in the job): a volume task's sites train nnU-Net's 3D network of the plan (:func:`volume_settings`).

    Raises:
        feduq.jobs.jobcheck.JobConfigError: the configured job would not run (message names the key or value).
    """
    from ..jobs.jobcheck import JobConfigError, is_feduq_path, validate_configs

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
        from ..data import job_task, task_reference

        spec_t = job_task(task)  # a built-in name, a task file or a declaration (DataError naming the key)
        if spec_t.missing_windows:
            raise JobConfigError(f"task {spec_t.name!r}: channel_names.{spec_t.missing_windows[0]} is CT "
                                 "without a window: declare it, or compute it from the sites' intensity fingerprints "
                                 "(feduq fingerprint writes the task file with it)")
        settings = task_settings(spec_t.name)
        if configuration is None and "configuration" not in (executor_args or {}):
            configuration = spec_t.configuration if spec_t.configuration != "2d" else None
        if configuration is not None:
            exe_args["configuration"] = configuration
        # a declared task travels in the job itself (self-contained: the sites and the server need no task file)
        exe_args["task"] = task_reference(spec_t)
        from ..jobs.jobcheck import check_method_task

        method = check_method_task(client, executor, spec_t)  # before any network is built: whatever the network
        applied = task_method_settings(spec_t, method, exe_args)
        exe_args.update({key: value for key, value, _ in applied})
        if record is not None:
            record.extend((key, executor_args[key], f"--set, over {source}") if key in (executor_args or {})
                          else (key, value, source) for key, value, source in applied)
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
    if configuration is not None:
        exe_args["configuration"] = configuration
    if plans is not None:
        exe_args["plans"] = plans
    if exe_args.get("configuration", "2d") != "2d":
        volume_settings(exe_args, executor_args or {})

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
            for key in workflow_timeouts(wf):
                args[key] = train_timeout
    if min_clients is not None:
        meta_["min_clients"] = min_clients
    if workflow_args:
        for key, value in workflow_args.items():  # the round loop's own numbers: what would fail or mean nothing
            low = {"num_rounds": 1, "min_clients": 1, "start_round": 0}.get(key, 0 if key.endswith("timeout") else None)
            if low is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
                raise JobConfigError(f"workflow argument {key} must be an integer >= {low}, got {value!r}")
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
        if comp.get("id") == "persistor" and not is_feduq_path(model_path):
            raise JobConfigError(f"server component 'persistor' model: {model_path[:200]!r} is not a FedUQ class "
                                 "(feduq.*); the server's model is the sites' network")
        if comp["id"] == "persistor" and exe_args.get("configuration", "2d") != "2d":  # the sites' planned network
            from ..data import job_task

            spec_v = job_task(exe_args["task"])
            comp["args"]["model"] = {"path": PLANNED_NETWORK, "args": {
                "plans": exe_args["plans"], "configuration": exe_args["configuration"],
                "in_channels": len(spec_v.channel_names), "out_channels": len(spec_v.class_names),
                "init_seed": exe_args.get("seed", 0)}}
        elif comp["id"] == "persistor" and comp["args"]["model"]["path"].endswith("BackboneModel"):
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

    if test_sites is not None or sites:  # new sites reset the test sites to all of them unless named again
        _set_test_sites(server, [t for ts in meta_.get("deploy_map", {}).values() for t in ts if t != "server"],
                        test_sites)
    if resource_spec is not None:
        meta_["resource_spec"] = check_resource_spec(resource_spec, [t for ts in meta_["deploy_map"].values()
                                                                     for t in ts if t != "server"])
    validate_configs(client, server, meta_, any_site_names=any_site_names)  # a job that cannot run is never written
    if name is not None:
        meta_["name"] = name
    out = {META: dump_json(meta_), SERVER: dump_json(server), CLIENT: dump_json(client)}
    if CUSTOM in files and not allow_listed:
        out[CUSTOM] = files[CUSTOM]
    return out


#: the server's model of a volume job: the sites' nnU-Net network of the plan
PLANNED_NETWORK = "feduq.nnunet.planned.PlannedNetwork"
#: nnU-Net's trainer's SGD (lr, weight decay) and FedUQ's iterations per round for a volume job, unless ``--set``
VOLUME_DEFAULTS = {"lr": 0.01, "weight_decay": 3e-5, "iterations": 250}


def volume_settings(exe_args: dict, given: dict) -> None:
    """A volume job's executor arguments (``configuration`` ``3d_fullres``), in place: the ``plans`` read (a path
    or a dict) and carried as a dict, so the job folder is self-contained and every site builds the same network;
    nnU-Net's SGD settings and the iterations per round (:data:`VOLUME_DEFAULTS`) unless ``given`` sets them.

    Raises:
        feduq.jobs.jobcheck.JobConfigError: no ``plans``; a plans file that cannot be read or has no such
            configuration (one line naming the file and the configuration).
    """
    from ..jobs.jobcheck import JobConfigError
    from ..nnunet.pipeline import load_plans

    configuration = exe_args["configuration"]
    plans = exe_args.get("plans")
    if plans is None:
        raise JobConfigError(f"configuration {configuration!r} needs the federation's nnU-Net plans: give --plans FILE "
                             "(feduq plan makes it from the sites' fingerprints)")
    try:
        exe_args["plans"] = load_plans(plans, configuration)
    except ValueError as e:
        raise JobConfigError(f"plans: {e}") from None
    for key, value in VOLUME_DEFAULTS.items():
        if key not in given:
            exe_args[key] = value


def task_method_settings(task, method: str | None, job_args: dict) -> list[tuple[str, Any, str]]:
    """The executor arguments ``task`` (a :class:`feduq.data.TaskSpec`) sets for ``method``, each ``(key, value,
    source)``: its task file's ``feduq.hyperparameters.<method>`` (a built-in task's shipped file too: fundus sets
    FedEvi's λ = 1e-5, FedEvi paper, "Implemental Details"). An argument some built-in task file sets for the method
    and this task leaves is listed at the job's value (``job_args``, the method's default) with that said (FedEvi on a
    new task: the polyp λ 0.01). Every method and argument the task file names is checked, whatever the job's method.

    Raises:
        feduq.jobs.jobcheck.JobConfigError: ``feduq.hyperparameters`` names a method that is not registered, an
            argument its executor does not take, or ``task`` (one line naming the task file and key).
    """
    from ..data import TASKS
    from ..jobs.jobcheck import JobConfigError, job_arguments
    from ..registry import SPECS

    source = task.source
    given = task.hyperparameters  # the task file's
    for name, args in given.items():
        key = f"{source}: feduq.hyperparameters.{name}"
        if name not in SPECS:
            close = difflib.get_close_matches(name, list(SPECS), n=1)
            raise JobConfigError(f"{key}: {name!r} is not a registered method"
                                 + (f"; did you mean {close[0]!r}?" if close else f" ({list(SPECS)})"))
        spec = SPECS[name]
        _, accepted = job_arguments(spec.executor_path, spec.executor_args, key)
        for arg in args:
            if arg == "task" or (accepted is not None and arg not in accepted):
                close = difflib.get_close_matches(arg, sorted(accepted or ()), n=1, cutoff=0.6)
                raise JobConfigError(f"{key}.{arg}: {name}'s executor takes no argument {arg!r}" + (
                    "; the task is the file itself" if arg == "task" else
                    f"; did you mean {close[0]!r}?" if close else ""))
    if method is None:
        return []
    out = [(k, v, f"{source}: feduq.hyperparameters.{method}.{k}") for k, v in given.get(method, {}).items()]
    per_task: dict[str, dict] = {}  # argument -> built-in task -> value, from the shipped task files
    for name, spec_t in TASKS.items():
        for k, v in spec_t.hyperparameters.get(method, {}).items():
            per_task.setdefault(k, {})[name] = v
    for k, by_task in per_task.items():
        if k not in given.get(method, {}):
            shown = ", ".join(f"{t} {v!r}" for t, v in by_task.items())
            out.append((k, job_args.get(k), f"{method}'s default; the task file sets no "
                        f"feduq.hyperparameters.{method}.{k} (built-in tasks: {shown})"))
    return out


def settings_line(method: str, task: str, record: list) -> str:
    """One line of what the task set in the job and where each came from (``python -m feduq.run`` prints it); '' when
    nothing."""
    if not record:
        return ""
    return f"{method} on task {task}: " + "; ".join(f"{k}={v!r} ({source})" for k, v, source in record)


def per_center_test_sites(sites: list[str]) -> list[str]:
    """The sites that score each distinct test set once: every real site, and of each group of virtual sites
    ``<center>-p<k>of<K>`` (one center, one K; they test on the center's common test list,
    :func:`feduq.sites.centers.virtual_split`) the first in ``sites`` order.

    ``["A-p0of3", "A-p1of3", "B", "A-p2of3"] -> ["A-p0of3", "B"]``. A virtual site whose split a site-local file
    overrides (``<center>/splits/<site>.json``) may test on other images: name its sites explicitly then.

    Raises:
        feduq.data.DataError: a virtual name whose part is not below its number of sites (``A-p5of3``).
    """
    from ..sites.centers import parse_site

    chosen, groups = [], set()
    for site in sites:
        center, part, num = parse_site(site)
        if part is None:
            chosen.append(site)
        elif (center, num) not in groups:
            groups.add((center, num))
            chosen.append(site)
    return chosen


def _set_test_sites(server: dict, sites: list[str], test_sites) -> None:
    """Write ``test_sites`` into the final test's arguments (``"per-center"`` resolved; None removes them: every site
    tests). The names are checked with the whole job (:func:`feduq.jobs.jobcheck.check_test_sites`)."""
    from ..data import DataError
    from ..jobs.jobcheck import JobConfigError

    final = [wf for wf in server["workflows"] if wf.get("id") == "final_test"]
    if not final:
        if test_sites is None:
            return
        raise JobConfigError("test_sites: the job has no final_test workflow")
    if test_sites == "per-center":
        try:
            test_sites = per_center_test_sites(sites)
        except DataError as e:
            raise JobConfigError(f"test_sites per-center: {e}") from None
        if test_sites == sites:  # no virtual sites share a test list: every site tests, as by default
            test_sites = None
    if test_sites is None:
        final[0]["args"].pop("test_sites", None)
        return
    if isinstance(test_sites, str) or not isinstance(test_sites, (list, tuple)) or not test_sites:
        raise JobConfigError(f"test_sites must be 'per-center' or a non-empty list of the job's sites, got {test_sites!r}")
    final[0]["args"]["test_sites"] = list(test_sites)


RESOURCE_KEYS = {"num_of_gpus": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                 "mem_per_gpu_in_GiB": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0}


def check_resource_spec(spec, sites: list[str]) -> dict:
    """``spec`` (site -> FLARE resource requirements) checked against the job's ``sites``.

    Raises:
        JobConfigError: not a mapping of known sites to ``num_of_gpus`` / ``mem_per_gpu_in_GiB`` in range (named).
    """
    from ..jobs.jobcheck import JobConfigError

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
    from ..jobs.jobcheck import JobConfigError

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
        gib = spec[site].get("mem_per_gpu_in_GiB", 1.0)
        if not 0 <= spec[site]["num_of_gpus"] <= MAX_GPUS_PER_SITE or not 0 < gib <= MAX_GIB_PER_GPU:
            raise JobConfigError(f"--resources {item}: expected 0..{MAX_GPUS_PER_SITE} GPUs and 0 < GiB per GPU <= "
                                 f"{MAX_GIB_PER_GPU:g} (no GPU holds more; FLARE would wait for it forever)")
    return spec


#: the most a --resources item may ask for: a site's FLARE resource manager never deploys a job asking for more than
#: its GPUs hold, so the job would wait forever (the largest GPUs hold under 300 GiB)
MAX_GPUS_PER_SITE, MAX_GIB_PER_GPU = 64, 512.0
