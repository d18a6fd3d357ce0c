"""One validation of a FedUQ job's configuration, used before and at start-up.

``feduq configure`` runs :func:`validate_configs` before it writes a job. Every FedUQ
workflow runs the same checks again at start-up (:func:`validate_running_app`) on the app the
server received. So a hand-edited job stops before round 0 with the message ``feduq configure``
would have given. The site's executor also checks its own network and image size when it builds
them (:meth:`feduq.flare.executor.FedUQExecutor.build_network`).

Nothing here is a second list kept by hand:

* **Unknown keys**: the accepted arguments are read from each component's own constructor
  signature. The check follows ``**kwargs`` up the class hierarchy. The closest valid name is
  suggested (``klweight`` → ``kl_weight``).
* **Values out of range**: the executor is constructed. Its constructor and the method's loss
  check their own arguments (e.g. ``kl_weight >= 0``).
* **Network and task**: the task comes from the registry (:data:`feduq.data.TASKS`): its centers,
  channels and classes; a method registered for another number of classes (``MethodSpec.foreground_classes``:
  FedA3I's binary noise estimate) is refused on it, whatever the network. The network is built by the executor itself, and the image size must be one
  the network can take (:func:`feduq.core.networks.check_input_size`). The server's persistor model must
  have the same entries and shapes as the sites' network.
* **Rounds**: a workflow's ``num_rounds`` is an integer >= 1.
* **Sites**: the sites of ``meta.json`` must be centers of the task (unless site names are allowed
  to differ, see ``feduq configure --any-site-names``), and ``min_clients`` must not exceed them.
"""

from __future__ import annotations

import difflib
import inspect
import json
from pathlib import Path

from .. import data as fdata
from ..common.classpath import ClassPathError, resolve_class
from .job_files import CLIENT_CONFIG, SERVER_CONFIG, JobConfigError, read_job  # noqa: F401 (imported from here too)
from ..parts.server import job_server_part, server_part_arguments
from ..parts.site import job_site_part, site_part_arguments

_validated: dict[str, str | None] = {}  # app root -> error message (None: valid); one check per process




#: the FLARE classes FedUQ's jobs and FLARE's add-ons on them use (experiment tracking, privacy filters, widgets);
#: with FedUQ's own classes (``feduq.*``) the only classes the job check imports. Other ``nvflare.*`` classes are
#: imported for their signature only; nothing outside ``feduq`` is ever constructed by the check.
FLARE_CLASSES = frozenset({
    "nvflare.app_common.widgets.convert_to_fed_event.ConvertToFedEvent",
    "nvflare.app_opt.pt.file_model_persistor.PTFileModelPersistor",
    "nvflare.app_opt.tracking.tb.tb_receiver.TBAnalyticsReceiver",
    "nvflare.app_opt.tracking.tb.tb_writer.TBWriter",
    "nvflare.app_opt.tracking.mlflow.mlflow_receiver.MLflowReceiver",
    "nvflare.app_opt.tracking.mlflow.mlflow_writer.MLflowWriter",
    "nvflare.app_opt.tracking.wandb.wandb_receiver.WandBReceiver",
    "nvflare.app_opt.tracking.wandb.wandb_writer.WandBWriter",
    "nvflare.app_common.filters.percentile_privacy.PercentilePrivacy",
    "nvflare.app_common.filters.exclude_vars.ExcludeVars",
    "nvflare.app_common.filters.svt_privacy.SVTPrivacy",
    "nvflare.app_common.widgets.intime_model_selector.IntimeModelSelector",
    "nvflare.app_common.widgets.validation_json_generator.ValidationJsonGenerator",
})


def is_feduq_path(path: str) -> bool:
    return path.startswith("feduq.")


def _import(path: str):
    """The class ``path`` names, imported only when it is FedUQ's (``feduq.*``) or FLARE's (``nvflare.*``); anything
    else is refused by name before any import, so checking a job never runs a module or class it names."""
    if not isinstance(path, str) or not (is_feduq_path(path) or path in FLARE_CLASSES or path.startswith("nvflare.")):
        raise JobConfigError(f"component class {str(path)[:200]!r} is not FedUQ's (feduq.*) or FLARE's (nvflare.*); "
                             "a FedUQ job names nothing else, and the job check imports nothing else")
    try:
        return resolve_class(path, ("feduq.", "nvflare."))
    except ClassPathError as e:
        raise JobConfigError(f"component class {e}") from None


def accepted_arguments(cls) -> set[str] | None:
    """Keyword arguments ``cls(...)`` accepts, following ``**kwargs`` up the MRO; None if it takes any."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is object:
            return None  # **kwargs reached object: anything goes
        if "__init__" not in vars(klass):
            continue
        params = inspect.signature(vars(klass)["__init__"]).parameters.values()
        names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"}
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            return names
    return None


def _part_arguments(cls, args: dict, where: str, path: str) -> set[str]:
    """The arguments of the method part a FedUQ 2D executor or controller builds from ``args``: its ``site_part`` /
    ``server_part`` argument, or the class's ``SITE_PART`` / ``SERVER_PART`` (none: no more arguments)."""
    try:
        site = job_site_part(cls, args.get("site_part"), default=None)
        server = job_server_part(cls, args.get("server_part"))
    except ValueError as e:
        raise JobConfigError(f"{where} ({path}): {e}") from None
    return (site_part_arguments(site) if site else set()) | (server_part_arguments(server) if server else set())


def job_arguments(path: str, args: dict, where: str) -> tuple[type, set[str] | None]:
    """The class ``path`` names (a FedUQ executor's own site class when ``args`` names one) and the arguments a job may
    give it with ``args``: its constructor's, and its method's site or server part's; None: any.

    Raises:
        JobConfigError: an unknown class or part, or ``args`` not an object (named with ``where``).
    """
    cls = _import(path)
    if not isinstance(args, dict):
        raise JobConfigError(f"{where} ({path}): args must be a JSON object, got {type(args).__name__}")
    if hasattr(cls, "job_class"):  # FedUQ's 2D executor with a method's own site class (FedUAA's classification)
        try:
            cls = cls.job_class(args)
        except ValueError as e:
            raise JobConfigError(f"{where} ({path}): {e}") from None
    if hasattr(cls, "job_arguments"):  # a FedUQ class that says which arguments a job may give it (CT's executor)
        try:
            return cls, set(cls.job_arguments(args))
        except ValueError as e:
            raise JobConfigError(f"{where} ({path}): {e}") from None
    accepted = accepted_arguments(cls)
    if accepted is not None:  # a FedUQ executor or controller: the method's site or server part takes its own
        accepted |= _part_arguments(cls, args, where, path)
    return cls, accepted


def check_arguments(path: str, args: dict, where: str) -> type:
    """Import ``path`` and check that every key of ``args`` is one of its constructor's arguments.

    Nested component specs (``{"path": ..., "args": ...}``, e.g. the persistor's model) are checked too.

    Raises:
        JobConfigError: an unknown class, or an unknown key (with the closest valid key suggested).
    """
    cls, accepted = job_arguments(path, args, where)
    if accepted is not None:
        for key in args:
            if key not in accepted:
                close = difflib.get_close_matches(key, sorted(accepted), n=1, cutoff=0.6)
                hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {sorted(accepted)}"
                raise JobConfigError(f"{where} ({path}): unknown argument {key!r}{hint}")
    for key, value in args.items():
        if isinstance(value, dict) and isinstance(value.get("path"), str):
            check_arguments(value["path"], value.get("args", {}), f"{where} argument {key!r}")
    return cls


def instantiate(spec: dict, where: str):
    """Construct a FedUQ component to let it check its own values; never anything outside ``feduq``."""
    if not is_feduq_path(str(spec.get("path"))):
        raise JobConfigError(f"{where}: {str(spec.get('path'))[:200]!r} is not a FedUQ class (feduq.*); the job "
                             "check constructs FedUQ's executor and network only")
    cls = check_arguments(spec["path"], spec.get("args", {}), where)
    try:
        return cls(**spec.get("args", {}))
    except (TypeError, ValueError) as e:
        raise JobConfigError(f"{where} ({spec['path']}): {e}") from None


def _components(cfg: dict, kinds: tuple[str, ...]) -> list[tuple[str, dict]]:
    found = []
    for kind in kinds:
        for item in cfg.get(kind, []) or []:
            spec = item.get("executor", item) if kind == "executors" else item
            if isinstance(spec, dict) and isinstance(spec.get("path"), str):
                found.append((f"{kind[:-1]} {spec.get('id', '?')!r}", spec))
    return found


def _state_shapes(model) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def validate_configs(client: dict, server: dict, meta: dict | None = None, *, any_site_names: bool = False) -> None:
    """Validate a job's client and server configs (and ``meta.json`` when given).

    Raises:
        JobConfigError: the first problem found, naming the component, key, value, site or file.
    """
    for where, spec in _components(server, ("workflows", "components")):
        check_arguments(spec["path"], spec.get("args", {}), f"server {where}")
    for where, spec in _components(server, ("workflows",)):
        _check_rounds(spec, f"server {where}")
        if is_feduq_path(spec["path"]):  # a FedUQ workflow checks its own values (and its method's: FedEvi's δ, GraphFedSeg's λ)
            instantiate(spec, f"server {where}")
    executors = _components(client, ("executors",))
    if not executors:
        raise JobConfigError(f"{CLIENT_CONFIG}: no executor")
    for where, spec in _components(client, ("components",)):
        check_arguments(spec["path"], spec.get("args", {}), f"client {where}")
    _check_ledger(client)
    for where, spec in executors:
        executor = instantiate(spec, f"client {where}")
        if not hasattr(executor, "build_network"):
            continue  # not a FedUQ executor: nothing more to check
        spec_task = fdata.get_task(executor.task_name)
        check_method_task(client, spec, spec_task, where)
        try:
            network = executor.build_network(spec_task)
        except (TypeError, ValueError) as e:
            raise JobConfigError(f"client {where} ({spec['path']}), task {executor.task_name!r}: {e}") from None
        _check_persistor(server, network, executor.task_name)
        if meta is not None:
            _check_sites(meta, server, spec_task, any_site_names)


def job_method(client: dict, executor: dict) -> str | None:
    """The registered method a job's executor runs: the method its privacy ledger filters name (the job's own
    statement of it), else the first registered with the executor's class, site part and site class; None: neither."""
    from ..registry import SPECS, registered_method

    named = {(f.get("args") or {}).get("method") for chain_key in ("task_data_filters", "task_result_filters")
             for chain in client.get(chain_key) or [] for f in chain.get("filters") or []
             if isinstance(f, dict) and f.get("path") == LEDGER_FILTER} & set(SPECS)
    if len(named) == 1:
        return named.pop()
    args = executor.get("args") or {}
    return registered_method(executor.get("path"), args.get("site_part"), args.get("site_class"))


def check_method_task(client: dict, executor: dict, task: "fdata.TaskSpec", where: str | None = None) -> str | None:
    """The job's method (:func:`job_method`), having checked that it can serve ``task``
    (:func:`feduq.registry.method_task_error`: FedA3I needs a binary task and 2D images; the executor's
    ``configuration`` ``3d_fullres`` needs a volume task) before any network is built, so no network
    makes a wrong pair run; None when the executor runs no registered method.

    Raises:
        JobConfigError: the method cannot serve the task (prefixed with ``client <where> (<executor path>)``).
    """
    from ..registry import method_task_error

    method = job_method(client, executor)
    configuration = (executor.get("args") or {}).get("configuration", "2d")
    why = method_task_error(method, task, configuration) if method is not None else None
    if why:
        raise JobConfigError(why if where is None else f"client {where} ({executor['path']}): {why}")
    return method


def _check_rounds(spec: dict, where: str) -> None:
    """A workflow's ``num_rounds`` (FedUQ's or FLARE's) is an integer >= 1 when given: FLARE's round loop takes 0 or
    a negative count as no round, and the job then ended at its final test with "no global model to evaluate"."""
    args = spec.get("args")
    value = args.get("num_rounds") if isinstance(args, dict) else None
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise JobConfigError(f"{SERVER_CONFIG}: {where} ({spec['path']}): num_rounds={value!r} must be an integer "
                             ">= 1 (the rounds the job trains)")


LEDGER_FILTER = "feduq.flare.ledger.PrivacyLedgerFilter"


def _check_ledger(client: dict) -> None:
    """Every task of every executor has the privacy ledger on its data (``in``) and results (``out``), for a method
    the ledger declares (:mod:`feduq.flare.ledger`)."""
    from ..registry.ledger import LEDGER

    for item in client.get("executors") or []:
        for task in item.get("tasks") or []:
            for chain_key, direction in (("task_data_filters", "in"), ("task_result_filters", "out")):
                found = [f for chain in client.get(chain_key) or [] if task in (chain.get("tasks") or [])
                         for f in chain.get("filters") or [] if isinstance(f, dict) and f.get("path") == LEDGER_FILTER
                         and (f.get("args") or {}).get("direction", "out") == direction]
                if not found:
                    raise JobConfigError(f"{CLIENT_CONFIG} {chain_key}: task {task!r} has no privacy ledger filter "
                                         f"({LEDGER_FILTER}, direction {direction!r}); a FedUQ job does not run "
                                         "without it")
                method = (found[0].get("args") or {}).get("method")
                if method not in LEDGER:
                    raise JobConfigError(f"{CLIENT_CONFIG} {chain_key}: task {task!r}: the privacy ledger's method "
                                         f"{method!r} is not one it declares ({sorted(LEDGER)})")


def _check_persistor(server: dict, network, task: str) -> None:
    for where, spec in _components(server, ("components",)):
        model_spec = spec.get("args", {}).get("model")
        if not (isinstance(model_spec, dict) and isinstance(model_spec.get("path"), str)):
            continue
        model = instantiate(model_spec, f"server {where} model")
        server_shapes, site_shapes = _state_shapes(model), _state_shapes(network)
        if server_shapes == site_shapes:
            continue
        missing = sorted(set(site_shapes) - set(server_shapes))
        extra = sorted(set(server_shapes) - set(site_shapes))
        diff = [k for k in site_shapes if k in server_shapes and site_shapes[k] != server_shapes[k]]
        detail = (
            f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}" if extra
            else f"{diff[0]!r} is {list(server_shapes[diff[0]])} on the server, {list(site_shapes[diff[0]])} at the sites"
        )
        raise JobConfigError(
            f"server {where} model ({model_spec['path']} {model_spec.get('args', {})}) does not fit the sites' "
            f"network for task {task!r}: {detail} (in_channels/out_channels must be the task's channels and classes)"
        )


def _check_sites(meta: dict, server: dict, spec: "fdata.TaskSpec", any_site_names: bool) -> None:
    deploy = meta.get("deploy_map", {})
    sites = [s for targets in deploy.values() for s in targets if s not in ("server", "@ALL")]
    held_out = [s for s in sites if s in spec.held_out]
    if held_out:
        raise JobConfigError(f"site {held_out[0]!r} is held out in task {spec.name!r} (its declaration's "
                             "feduq.held_out): it never trains; score it with feduq evaluate")
    if not any_site_names:
        from ..sites.centers import site_center

        for site in sites:
            try:
                site_center(spec.name, site)  # a center or a virtual site <center>-p<k>of<K>
                continue
            except fdata.DataError:
                pass
            if site not in spec.centers:
                close = difflib.get_close_matches(site, spec.centers, n=1, cutoff=0.5)
                raise JobConfigError(
                    f"site {site!r} is not a center of task {spec.name!r} (centers: {list(spec.centers)})"
                    + (f"; did you mean {close[0]!r}?" if close else "")
                    + ". A site named otherwise maps itself to its center in its local/feduq_site.json "
                    "(feduq prepare-site --center); allow such names with --any-site-names"
                )
    if not sites:
        return
    check_test_sites(server, sites)
    for where, spec_ in [("meta.json", {"args": meta})] + _components(server, ("workflows",)):
        value = spec_.get("args", {}).get("min_clients")
        if value is not None and (not isinstance(value, int) or not 1 <= value <= len(sites)):
            raise JobConfigError(f"{where}: min_clients={value!r} must be an integer in [1, {len(sites)}] "
                                 f"(the job has {len(sites)} sites)")


def check_test_sites(server: dict, sites: list[str]) -> None:
    """A workflow's ``test_sites`` (the final test's, :class:`feduq.flare.workflows.FinalTestEvaluation`) names only
    sites of the job, each once.

    Raises:
        JobConfigError: names the workflow, the repeated or unknown sites and (up to 8 of) the job's sites.
    """
    for where, spec in _components(server, ("workflows",)):
        names = spec.get("args", {}).get("test_sites")
        if not isinstance(names, list):
            continue  # None (every site) or a wrong type, which the workflow's own check names
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise JobConfigError(f"server {where}: test_sites {repeated} are listed more than once")
        unknown = [n for n in names if n not in sites]
        if unknown:
            listed = ", ".join(sites[:8]) + (f", ... ({len(sites)} sites)" if len(sites) > 8 else "")
            raise JobConfigError(f"server {where}: test_sites {unknown[:8]} are not sites of this job (sites: {listed})")


def validate_job(job_dir: str | Path, *, any_site_names: bool = False) -> None:
    """Validate a job folder (``meta.json`` + ``app/config``); see :func:`validate_configs`."""
    client, server, meta = read_job(job_dir)
    validate_configs(client, server, meta, any_site_names=any_site_names)


def validate_running_app(fl_ctx, clients: list[str] | None = None) -> None:
    """At start-up on the server: validate the app FLARE deployed (once per app and process).

    The app folder holds both config files, so the sites' executor arguments are checked on the
    server before any task is sent. Site names are not checked against the task's centers here: a deployed site may
    map itself to its center (its executor checks that at start-up); ``clients`` (the job's connected sites) are
    checked against the workflows' ``test_sites`` (:func:`check_test_sites`), so a wrong name stops the job before
    its first round rather than at its final test.

    Raises:
        JobConfigError: as :func:`validate_configs`.
    """
    from nvflare.apis.fl_constant import FLContextKey

    app_root = fl_ctx.get_prop(FLContextKey.APP_ROOT)
    if not app_root or not (Path(app_root) / "config" / CLIENT_CONFIG).is_file():
        return  # a server-only app (no client config shipped with it): nothing to check here
    key = str(Path(app_root).resolve())
    if key not in _validated:
        try:
            client, server, _ = read_job(app_root)
            validate_configs(client, server, None)
            _validated[key] = None
        except JobConfigError as e:
            _validated[key] = str(e)
    if _validated[key] is not None:
        raise JobConfigError(_validated[key])
    if clients:
        check_test_sites(read_job(app_root)[1], list(clients))
