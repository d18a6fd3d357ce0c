"""FedUQ job folders as data: a registered method (:mod:`feduq.registry`) rendered to FLARE's job files, read
and written.

A job is ``{relative path: text}`` for ``meta.json``, ``app/config/config_fed_server.json``,
``app/config/config_fed_client.json`` and ``app/custom/README.md``. :func:`render` makes a registered method's files
(the committed ``jobs/<method>/`` are these, exported by :class:`feduq.recipes.recipe.FedUQRecipe`);
:func:`feduq.recipes.settings.configure` changes them and checks the result; :func:`write_job` writes them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..registry import COMMON_CLIENT_ARGS, all_methods, CT_ITERATIONS, CT_ROUNDS, method_sites, network_args, spec_of, task_settings


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
#: a few minutes; ``feduq configure --train-timeout`` sets another.
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
    train["args"].update({k: TASK_TIMEOUT for k in workflow_timeouts(train)})
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
FLARE's own Job API exports. This folder makes the job BYOC, so `nvflare simulator <this job folder> -w ws -t 4`
and a POC federation run it with no site preparation.

It holds no code: every site runs the `feduq` package installed on it (`pip install feduq`, the version the
server runs: `feduq --version`).

- For sites whose authorization policy refuses custom code, make the job without this folder:
  `feduq configure <method> -o OUT --allow-listed`; each such site then allow-lists
  FedUQ's classes once: `feduq prepare-site <site kit> --data-root DIR`.
- To ship FedUQ's code inside the job instead of installing it on the sites: `--byoc`.
"""


def class_at(path: str):
    """The class a config's ``path`` names (None when it does not import)."""
    from ..common.classpath import ClassPathError, resolve_class

    try:
        return resolve_class(path, ("feduq.", "nvflare."))
    except ClassPathError:
        return None


def workflow_timeouts(workflow: dict) -> tuple[str, ...]:
    """The task timeouts a workflow spec (``{"path", "args"}``) declares: its ``server_part`` argument's, else its
    class's ``timeout_args``."""
    from ..parts.server import job_server_part

    cls = class_at(workflow["path"])
    part = job_server_part(cls, workflow.get("args", {}).get("server_part"))
    return tuple(part.timeout_args if part is not None else getattr(cls, "timeout_args", ()))


def dump_json(obj) -> str:
    return json.dumps(obj, indent=2) + "\n"


def render(method: str) -> dict[str, str]:
    """The job files of a registered method (relative path -> text), as committed in ``jobs/<method>/``.

    Raises:
        ValueError: ``method`` is not registered (:func:`feduq.registry.spec_of`).
    """
    if spec_of(method).kind == "ct":
        return _render_ct(method)
    return {META: dump_json(meta(method)), SERVER: dump_json(server_config(method)), CLIENT: dump_json(client_config(method)),
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
    ct_workflow["args"].update({k: CT_TASK_TIMEOUT for k in workflow_timeouts(ct_workflow)})
    server = {"format_version": 2, "server": dict(SERVER_SETTINGS), "workflows": [ct_workflow],
        "components": [{"id": "persistor", "path": "nvflare.app_opt.pt.file_model_persistor.PTFileModelPersistor",
                        "args": {"model": {"path": "feduq.flare.ct.BackboneModel",
                                           "args": {"plans": "ct_2d", "dropout": dropout, "variance": variance}}}},
                       tensorboard_receiver()],
        "task_data_filters": [], "task_result_filters": []}
    return {META: dump_json({"name": method, "resource_spec": {}, "min_clients": len(sites),
                         "deploy_map": {"app": ["server", *sites]}}),
            SERVER: dump_json(server), CLIENT: dump_json(client), CUSTOM: CUSTOM_README}


def read_job_files(job_dir: str | Path) -> dict[str, str]:
    """A job folder's files as :func:`render` gives them (``app/custom/README.md`` only when present).

    Raises:
        FileNotFoundError: ``job_dir`` is not a job folder (no meta.json / app/config).
    """
    job_dir = Path(job_dir)
    if not (job_dir / META).is_file() or not (job_dir / "app" / "config").is_dir():
        raise FileNotFoundError(f"{job_dir} is not a FedUQ job folder (meta.json and app/config/ expected)")
    return {rel: (job_dir / rel).read_text() for rel in (META, SERVER, CLIENT, CUSTOM) if (job_dir / rel).is_file()}


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


_METHOD_JOBS: dict[str, Path] = {}


def method_job(method: str) -> Path:
    """A registered method's job folder as :func:`render` writes it (``jobs/<method>/`` of a clone, without its
    README), in a temporary folder of this process: what a tool configures when it is given a method's name, so the
    installed package needs no clone. Written once per method and process.

    Raises:
        ValueError: ``method`` is not registered.
    """
    if method not in _METHOD_JOBS:
        import atexit
        import tempfile

        files = render(method)  # ValueError first: nothing is written for an unknown name
        root = Path(tempfile.mkdtemp(prefix=f"feduq-job-{method}-"))
        atexit.register(shutil.rmtree, root, True)
        _METHOD_JOBS[method] = write_job(files, root / method)
    return _METHOD_JOBS[method]


def job_folder(job: str | Path) -> Path:
    """``job`` as a folder: a registered method's name that is no folder in the working folder gives its job as
    FedUQ exports it (:func:`method_job`); anything else is taken as a path (checked by the caller)."""
    if isinstance(job, str) and job in all_methods() and not Path(job).is_dir():
        return method_job(job)
    return Path(job)
