"""Shared fixtures: where the real data is, and how to run a configured job in the simulator."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: the real multi-center data: $FEDUQ_DATA_ROOT when it is set (an installed FedUQ's data root), else ../shared/data
#: beside the clone
SHARED_DATA = Path(os.environ.get("FEDUQ_DATA_ROOT") or REPO.parent / "shared" / "data").resolve()
sys.path.insert(0, str(REPO / "tools"))


#: the tools that became verbs of the ``feduq`` command: their old script name -> the module that runs the verb
VERB_MODULES = {
    "evaluate": "feduq.commands.site.evaluate", "prepare_site": "feduq.commands.site.prepare_site",
    "intensity_fingerprint": "feduq.commands.site.fingerprint", "simulate": "feduq.commands.consortium.simulate",
    "configure_job": "feduq.commands.consortium.configure", "plan_federation": "feduq.commands.consortium.plan",
    "resume_job": "feduq.commands.consortium.resume", "feduq_poc": "feduq.commands.consortium.poc",
    "compare": "feduq.commands.research.compare", "report": "feduq.commands.research.compare_report",
    "train_reference": "feduq.commands.research.reference", "virtual_federation": "feduq.commands.research.virtual",
    "make_splits": "feduq.commands.research.split", "make_noisy_labels": "feduq.commands.research.noisy_labels",
    "make_synthetic": "feduq.commands.research.synthetic", "site_acceptance": "feduq.commands.research.acceptance_study",
    "convert_ct": "feduq.data.convert.ct", "convert_fundus": "feduq.data.convert.fundus",
    "convert_polyp": "feduq.data.convert.polyp", "convert_prostate": "feduq.data.convert.prostate",
    "convert_skin_breast": "feduq.data.convert.skin_breast", "make_nnunet_sites": "feduq.data.convert.nnunet_raw",
}


def load_tool(name: str):
    """A command's module: a ``feduq`` verb's (:data:`VERB_MODULES`, by the script name it had), else a developer
    tool ``tools/<name>.py`` imported as a module (the tools are scripts, not part of the package)."""
    import importlib
    import importlib.util

    if name in VERB_MODULES:
        return importlib.import_module(VERB_MODULES[name])
    spec = importlib.util.spec_from_file_location(f"feduq_tool_{name}", REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class FakeWorkspace:
    """The two NVFlare workspace folders an executor uses, under ``root``."""

    def __init__(self, root: Path):
        self.root = root

    def get_site_config_dir(self):
        (self.root / "local").mkdir(parents=True, exist_ok=True)
        return str(self.root / "local")

    def get_run_dir(self, job_id):
        (self.root / "run" / job_id).mkdir(parents=True, exist_ok=True)
        return str(self.root / "run" / job_id)


class FakeEngine:
    """Just enough of a FLARE client engine to drive an executor in a unit test (no TBWriter)."""

    def __init__(self, root: Path):
        self.ws = FakeWorkspace(root)

    def get_workspace(self):
        return self.ws

    def get_component(self, component_id):
        return None

    def fire_event(self, event_type, fl_ctx):  # an executor's log_error fires one; nobody listens here
        return None


def pytest_configure(config):
    """Under pytest-xdist each worker's torch takes an equal share of the cores (two workers on 2 cores: one thread
    each), so in-process tests of two workers do not oversubscribe the machine."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        import torch

        from feduq.core.threads import host_cores

        torch.set_num_threads(max(1, host_cores() // workers))


@pytest.fixture(scope="session")
def data_root() -> Path:
    if not (SHARED_DATA / "polyp").is_dir():
        pytest.skip(f"real data not found at {SHARED_DATA}")
    return SHARED_DATA


SMALL = dict(image_size=32, num_rounds=2, local_epochs=1, max_items=6)


def small_job(method: str, out: Path, executor: str | None = None, **overrides) -> Path:
    """``jobs/<method>`` configured small (32 px, 2 rounds, 6 images per split, 1 torch thread)."""
    from feduq.recipes.job_folders import configure

    settings = {**SMALL, **overrides}
    extra = settings.pop("executor_args", {})
    # a test executor's own arguments (e.g. faults) are added after configure() validated the job
    settings["executor_args"] = {"num_threads": 1, **({} if executor else extra)}
    job = configure(REPO / "jobs" / method, out, **settings)
    if executor:  # swap in a test executor (e.g. feduq.testing.faults), keeping the arguments
        path = job / "app" / "config" / "config_fed_client.json"
        cfg = json.loads(path.read_text())
        cfg["executors"][0]["executor"]["path"] = executor
        cfg["executors"][0]["executor"]["args"].update(extra)
        path.write_text(json.dumps(cfg, indent=2))
    return job


def simulator_process(job: Path, workspace: Path, data_root: Path, env_extra: dict | None = None, **popen_args):
    """Start FLARE's simulator on ``job`` with one process per site (returns the Popen); ``env_extra``: more
    environment variables for it."""
    from feduq.recipes.simulation import allow_feduq

    allow_feduq(workspace)  # feduq.* (the test executors of feduq.testing too)
    n_sites = len(json.loads((job / "meta.json").read_text())["deploy_map"]["app"]) - 1
    env = {**os.environ, "FEDUQ_DATA_ROOT": str(data_root), "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "tests"), env.get("PYTHONPATH")]))
    env.update(env_extra or {})
    from feduq.recipes.simulation import simulator_command  # FLARE 2.9's entry point, as SimEnv runs it

    cmd = simulator_command(job, workspace, n_sites)
    return subprocess.Popen(cmd, env=env, text=True, **popen_args)


def run_simulator(method: str, workspace: Path, data_root: Path, timeout: int = 600, executor: str | None = None,
                  **overrides) -> subprocess.CompletedProcess:
    """Run ``jobs/<method>`` configured small in the simulator and wait for it."""
    job = small_job(method, workspace.parent / f"job_{method}", executor=executor, **overrides)
    proc = simulator_process(job, workspace, data_root, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def read_table(workspace: Path) -> dict[str, dict[str, str]]:
    path = workspace / "server" / "simulate_job" / "results" / "per_client_table.csv"
    with open(path) as f:
        return {row["client"]: row for row in csv.DictReader(f)}


def one_image_site(data_root: Path, folder: Path, center: str = "ETIS-LaribPolypDB") -> tuple[Path, str]:
    """A site folder (images/, masks/, labels.json) holding the first image/mask pair of a real center; returns
    ``(folder, stem)``."""
    import shutil

    src = data_root / "polyp" / center
    (folder / "images").mkdir(parents=True)
    (folder / "masks").mkdir()
    shutil.copy(src / "labels.json", folder / "labels.json")
    stem = sorted(p.stem for p in (src / "images").iterdir())[0]
    shutil.copy(next((src / "images").glob(f"{stem}.*")), folder / "images")
    shutil.copy(src / "masks" / f"{stem}.png", folder / "masks")
    return folder, stem


class FakeServerEngine:
    """A FLARE server engine for a controller run without FLARE: its clients, and the events the controller fires
    (its experiment-tracking records, checked to be federation-scoped as FLARE delivers a site's)."""

    def __init__(self, clients=()):
        self.clients = list(clients)
        self.tracked = []  # (event type, origin site, tag, value, step)

    def get_clients(self):
        return [type("Client", (), {"name": n})() for n in self.clients]

    def new_context(self):
        from nvflare.apis.fl_context import FLContext

        return FLContext()

    def fire_event(self, event_type, fl_ctx):
        from nvflare.apis.analytix import AnalyticsData
        from nvflare.apis.dxo import from_shareable
        from nvflare.apis.fl_constant import EventScope, FedEventHeader, FLContextKey, ReservedKey

        data = fl_ctx.get_prop(FLContextKey.EVENT_DATA)
        assert fl_ctx.get_prop(FLContextKey.EVENT_SCOPE) == EventScope.FEDERATION
        # marked received ("in"), as FLARE's FedEventRunner marks a site's event: an "out" one its server runner
        # would send to every site
        assert data.get_header(FedEventHeader.DIRECTION) == "in"
        record = AnalyticsData.from_dxo(from_shareable(data))
        self.tracked.append((event_type, data.get_peer_prop(ReservedKey.IDENTITY_NAME, None), record.tag, record.value,
                             record.step))


#: test modules whose tests share a costly module fixture (nnU-Net sites and a plan built at test time from
#: ../shared/data; one FLARE run that several tests read): under pytest-xdist one worker runs each of them whole, so
#: the fixture is built once; every other test is balanced test by test as ``--dist load`` balances it. (xdist's own
#: ``--dist loadgroup`` does not group under pytest 9.2: pytest-dev/pytest-xdist#1386.)
ONE_WORKER_MODULES = frozenset({"test_site3d.py", "test_federated_plans.py", "test_faults.py"})

#: the second pass (``-m "timed or poc" -n 2 --dist loadscope``, tools/run_tests.sh) runs as two streams, each one
#: test after another: these modules (the POC and provisioned federations, which bind FLARE's fixed ports, and the
#: wheel's pip install and run) on one worker, the timed tests on the other. The federations wait on FLARE's
#: start-up and polling most of their time (the pass used 38 % of 2 cores when it ran one test at a time), so each
#: timed test still has about a core to itself; two timed tests never run side by side.
FEDERATION_MODULES = frozenset({"test_poc.py", "test_provisioned.py", "test_wheel.py"})


def xdist_scope(nodeid: str, dist: str) -> str:
    """The scope a test is scheduled in: under ``--dist load`` its module (:data:`ONE_WORKER_MODULES`) or itself;
    under ``--dist loadscope`` (the second pass) ``"federations"`` (:data:`FEDERATION_MODULES`) or ``"timed"``."""
    module = nodeid.split("::", 1)[0]
    if dist == "loadscope":
        return "federations" if Path(module).name in FEDERATION_MODULES else "timed"
    return module if Path(module).name in ONE_WORKER_MODULES else nodeid


def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling with the scopes of :func:`xdist_scope` (for ``--dist load``, ``-n N``'s default, and
    ``--dist loadscope``)."""
    dist = config.getvalue("dist")
    if dist not in ("load", "loadscope"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Scopes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid, dist)

    return Scopes(config, log)
