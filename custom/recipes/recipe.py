"""FedUQ jobs as FLARE 2.9 Recipes: ``FedUQRecipe("fedevi", image_size=128).run(SimEnv(...))``.

FLARE 2.9 builds jobs as Recipes (:class:`nvflare.recipe.spec.Recipe`) run in an execution environment: ``SimEnv``
(the simulator on this machine), ``PocEnv`` (a local proof-of-concept federation) or ``ProdEnv`` (a provisioned
project, through the admin's startup kit). :class:`FedUQRecipe` is that Recipe for every registered FedUQ method
(:mod:`feduq.registry`): its job is the method's registration rendered and configured by :mod:`feduq.recipes.jobspec`, so the
committed ``jobs/<method>/`` folders are exactly this Recipe's exports (``tools/make_jobs.py``, checked by
``tests/integration/test_recipe.py``).

What FLARE's Recipes do not give and FedUQ keeps: the job check before round 0 (unknown keys with the closest valid
one, values out of range, sites that are not centers of the task: :func:`feduq.jobs.jobcheck.validate_configs`, run
when the Recipe is made), a data root checked before the simulator starts, and an outcome read from the workspace,
so a failed run raises instead of passing for a finished one (:func:`feduq.recipes.simulation.simulate`).

    from nvflare.recipe import SimEnv
    from feduq.recipes.recipe import FedUQRecipe

    recipe = FedUQRecipe("fedevi", image_size=128, num_rounds=3, data_root="/data/feduq")
    recipe.run(SimEnv(clients=recipe.sites, workspace_root="workspaces"))   # or: recipe.export("exported_jobs")

The command line is ``python -m feduq.run`` (:mod:`feduq.run`).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from nvflare.job_config.api import FedJob
from nvflare.recipe.spec import ExecEnv, Recipe

from . import jobspec
from .settings import configure
from ..registry import all_methods


class FedUQJob(FedJob):
    """A FLARE ``FedJob`` whose configuration is a FedUQ job's files (:mod:`feduq.recipes.jobspec`), already checked.

    FLARE's environments call :meth:`export_job` (``PocEnv``, ``ProdEnv``: export, then submit) or
    :meth:`simulator_run` (``SimEnv``). Components cannot be added through FLARE's job API (``to``, ``to_server``,
    ``to_clients``): a FedUQ job's components are its registration's, and one silently left out of the export
    would be worse than this error.
    """

    def __init__(self, name: str, files: dict[str, str], data_root: str | None = None, byoc: bool = False):
        meta = json.loads(files[jobspec.META])
        super().__init__(name=name, min_clients=int(meta["min_clients"]))
        self.files = files
        self.sites = [s for s in meta["deploy_map"]["app"] if s != "server"]
        self.data_root = data_root
        self.byoc = byoc
        self.bundled: dict[str, Path] = {}  # job-relative path -> a local file shipped in the job (initial_ckpt)
        self.outcome = None  # the last simulator run's feduq.recipes.outcome.RunOutcome

    def to_server(self, obj, id=None, filter_type=None, tasks=None, **kwargs):
        """Add a component, filter or config to the server's app (:func:`feduq.recipes.addons.add`), re-checked."""
        self._add("server", obj, id, filter_type, tasks, kwargs)

    def to_clients(self, obj, id=None, filter_type=None, tasks=None, **kwargs):
        """Add a component, filter or config to every site's app (:func:`feduq.recipes.addons.add`), re-checked."""
        self._add("clients", obj, id, filter_type, tasks, kwargs)

    def to(self, obj, target, id=None, filter_type=None, tasks=None, **kwargs):
        """``target`` "server" or every site; FedUQ jobs deploy one client app to all sites, so one site alone is
        refused (ValueError)."""
        from nvflare.apis.job_def import ALL_SITES, SERVER_SITE_NAME

        if target == SERVER_SITE_NAME:
            return self.to_server(obj, id, filter_type, tasks, **kwargs)
        if target == ALL_SITES:
            return self.to_clients(obj, id, filter_type, tasks, **kwargs)
        raise ValueError(f"job {self.name!r}: FedUQ jobs deploy one client app to every site; {type(obj).__name__} "
                         f"for site {target!r} alone is not supported (leave clients unset; per-site settings: "
                         "recipe.set_per_site_config)")

    def _add(self, target: str, obj, id, filter_type, tasks, kwargs: dict) -> None:
        from . import addons as recipe_addons
        from ..jobs.jobcheck import validate_configs

        if kwargs:
            raise TypeError(f"job {self.name!r}: unsupported arguments {sorted(kwargs)}")
        files = recipe_addons.add(self.files, target, obj, id=id, filter_type=filter_type, tasks=tasks)
        validate_configs(json.loads(files[jobspec.CLIENT]), json.loads(files[jobspec.SERVER]),
                         json.loads(files[jobspec.META]), any_site_names=True)
        self.files = files

    def export_job(self, job_root: str) -> None:
        """Write the job folder ``<job_root>/<name>/``."""
        out = jobspec.write_job(self.files, Path(job_root) / self.name, byoc=self.byoc)
        for rel, source in self.bundled.items():
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, out / rel)

    def simulator_run(self, workspace: str, n_clients: int | None = None, clients: list[str] | None = None,
                      threads: int | None = None, gpu: str | None = None, log_config: str | None = None) -> int:
        """Run the job in FLARE's simulator in ``workspace`` (:func:`feduq.recipes.simulation.simulate`): 0 when the job
        finished and wrote its results table, else 1 (the outcome's summary is printed either way).

        Raises:
            ValueError: ``clients``/``n_clients`` do not match the job's sites, or ``gpu``/``log_config`` is given.
            feduq.data.DataError: no data root, or a center's folder is missing (before FLARE starts).
        """
        from .simulation import simulate

        if clients and sorted(clients) != sorted(self.sites):
            raise ValueError(f"job {self.name!r}: SimEnv clients {sorted(clients)} are not the job's sites "
                             f"{sorted(self.sites)}; use SimEnv(clients=recipe.sites)")
        if n_clients and not clients and n_clients != len(self.sites):
            raise ValueError(f"job {self.name!r}: SimEnv num_clients={n_clients}, but the job has "
                             f"{len(self.sites)} sites {self.sites}")
        if gpu or log_config:
            raise ValueError(f"job {self.name!r}: gpu/log_config are not FedUQ simulator settings; FedUQ's executor "
                             "takes device (e.g. FedUQRecipe(..., executor_args={'device': 'cuda:0'}))")
        ws = Path(workspace)
        default_policy = ws / "local" / "resources.json.default"  # what SimEnv wrote there just now
        if default_policy.is_file() and sorted(p for p in ws.rglob("*") if p.is_file()) == [default_policy]:
            default_policy.unlink()
            shutil.rmtree(ws)
        with tempfile.TemporaryDirectory(prefix="feduq-job-") as root:
            self.export_job(root)
            self.outcome = simulate(Path(root) / self.name, ws, self.data_root, threads=threads)
        if self.outcome.ok and self.outcome.table is not None and self.outcome.table.with_suffix(".md").is_file():
            print(self.outcome.table.with_suffix(".md").read_text().rstrip() + "\n")
        print(self.outcome.summary())
        return 0 if self.outcome.ok else 1


class FedUQRecipe(Recipe):
    """The FLARE 2.9 Recipe of a registered FedUQ method, optionally configured.

    Args:
        method: a registered method (:func:`feduq.registry.all_methods`), e.g. ``"fedevi"``.
        name: the job's name (default: the method).
        data_root: for ``SimEnv`` runs, the folder holding ``<task>/<center>/`` (default ``$FEDUQ_DATA_ROOT``;
            ``SimEnv(extra={"data_root": ...})`` also sets it). POC and provisioned sites keep their own
            (``feduq prepare-site --data-root``); a job never carries a data path.
        byoc: ship FedUQ's code inside the job (``app/custom/feduq``) for sites without an installed ``feduq``.
        initial_ckpt: the global model's starting weights, as FLARE's recipes take them (a FedUQ checkpoint or a
            state dict of the job's network; relative path: bundled into the job; absolute: read by the server),
            checked against the network before anything runs (:func:`feduq.recipes.addons.initial_checkpoint`).
        **options: the settings of :func:`feduq.recipes.settings.configure` (``task``, ``image_size``, ``num_rounds``,
            ``local_epochs``, ``batch_size``, ``max_items``, ``seed``, ``sites``, ``min_clients``, ``train_timeout``,
            ``executor_args``, ``network``, ``workflow_args``, ``select_on``, ``official_protocol``,
            ``any_site_names``, ``allow_listed``, ``resource_spec``, ``test_sites``); none given: the committed job
            as it is.

    Raises:
        ValueError: ``method`` is not registered.
        TypeError: an unknown option.
        feduq.jobs.jobcheck.JobConfigError: the configured job would not run (message names the key or value).
    """

    def __init__(self, method: str, *, name: str | None = None, data_root: str | None = None, byoc: bool = False,
                 initial_ckpt: str | None = None, **options):
        if method not in all_methods():
            raise ValueError(f"unknown method {method!r}; registered: {all_methods()}")
        files = jobspec.render(method)
        if options or (name and name != method):
            files = configure(files, name or method, **options)
        bundle = None
        if initial_ckpt is not None:
            from .addons import initial_checkpoint

            files, bundle = initial_checkpoint(files, str(initial_ckpt))
        self.method = method
        super().__init__(FedUQJob(name or method, files, data_root=data_root, byoc=byoc))
        if bundle:
            self._job.bundled = {f"app/custom/{Path(bundle).name}": Path(bundle).resolve()}

    @property
    def framework(self):
        """Refused: FLARE's framework-specific add-ons (``add_cross_site_evaluation``, ``add_final_global_evaluation``)
        plug a training script's model into FLARE's workflows; a FedUQ job's sites run FedUQ's executor and already
        test the best global model on every site at the end."""
        raise ValueError(f"FedUQ recipe {self.method!r}: FLARE's cross-site and final global evaluation are not added "
                         "to FedUQ jobs: every site already tests the best global model at the end "
                         "(per_client_table.csv), and feduq evaluate scores any model on any site")

    @property
    def sites(self) -> list[str]:
        """The job's site names (for ``SimEnv(clients=...)`` and ``PocEnv(clients=...)``)."""
        return list(self._job.sites)

    @property
    def files(self) -> dict[str, str]:
        """The job's files, relative path -> text (``meta.json``, ``app/config/*.json``, ``app/custom/README.md``)."""
        return dict(self._job.files)

    @property
    def outcome(self):
        """The last ``SimEnv`` run's :class:`feduq.recipes.outcome.RunOutcome` (None before one)."""
        return self._job.outcome

    def _apply_per_site_config(self, config: dict) -> None:
        """FLARE's ``set_per_site_config``: the settings a site owns (device, batch_size, num_threads, num_workers),
        applied by that site at start (:func:`feduq.recipes.addons.per_site`); anything else raises ValueError."""
        from . import addons as recipe_addons

        self._job.files = recipe_addons.per_site(self._job.files, config)

    def process_env(self, env: ExecEnv) -> None:
        """``SimEnv(extra={"data_root": ...})`` sets the data root of the simulated sites."""
        root = env.get_extra_prop("data_root")
        if root is not None:
            self._job.data_root = str(root)
