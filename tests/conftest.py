"""Shared fixtures: where the real data is, and how to run a configured job in the simulator."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
sys.path.insert(0, str(REPO / "tools"))


@pytest.fixture(scope="session")
def data_root() -> Path:
    if not (SHARED_DATA / "polyp").is_dir():
        pytest.skip(f"real data not found at {SHARED_DATA}")
    return SHARED_DATA


def run_simulator(method: str, workspace: Path, data_root: Path, timeout: int = 600, **overrides) -> subprocess.CompletedProcess:
    """Configure ``jobs/<method>`` small (64 px, 2 rounds, 8 images per split), prepare the
    workspace's site policy, and run ``nvflare simulator`` with one thread per site."""
    from configure_job import configure
    from prepare_site import allow_feduq

    settings = dict(image_size=64, num_rounds=2, local_epochs=1, max_items=8, executor_args={"num_threads": 1})
    settings.update(overrides)
    job = configure(REPO / "jobs" / method, workspace.parent / f"job_{method}", **settings)
    allow_feduq(workspace)
    n_sites = len(json.loads((job / "meta.json").read_text())["deploy_map"]["app"]) - 1
    env = {**os.environ, "FEDUQ_DATA_ROOT": str(data_root), "PYTHONUNBUFFERED": "1"}
    nvflare = Path(sys.executable).with_name("nvflare")  # the CLI of the environment running the tests
    env["PATH"] = f"{nvflare.parent}{os.pathsep}{env.get('PATH', '')}"
    cmd = [str(nvflare), "simulator", str(job), "-w", str(workspace), "-t", str(n_sites)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def read_table(workspace: Path) -> dict[str, dict[str, str]]:
    path = workspace / "server" / "simulate_job" / "results" / "per_client_table.csv"
    with open(path) as f:
        return {row["client"]: row for row in csv.DictReader(f)}
