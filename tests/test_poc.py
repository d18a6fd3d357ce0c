"""A real POC federation on loopback: provision 2 sites, submit a 2-round job through the FLARE
Python API, wait (bounded), download and check the results table; always stop and clean."""

import csv
import os
import sys

import pytest

from conftest import REPO, small_job

sys.path.insert(0, str(REPO / "poc"))
pytestmark = pytest.mark.poc
SITES = ["CVC-ClinicDB", "ETIS-LaribPolypDB"]


@pytest.fixture
def poc(tmp_path, monkeypatch, data_root):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # NVFlare registers the admin kit in ~/.nvflare
    monkeypatch.setenv("NVFLARE_POC_WORKSPACE", str(tmp_path / "poc"))
    monkeypatch.delenv("FEDUQ_DATA_ROOT", raising=False)  # each site must read its own local config
    import feduq_poc

    try:
        feduq_poc.start("polyp", sites=SITES, data_root=str(data_root))
        yield feduq_poc
    finally:
        feduq_poc.stop(clean=True)
        assert not (tmp_path / "poc").exists()


def test_fedevi_job_through_the_flare_api(poc, tmp_path):
    for site in SITES:
        assert (poc.kit_dir(site) / "local" / "feduq_site.json").is_file()
    job = small_job("fedevi", tmp_path / "fedevi_poc", sites=SITES)
    result = poc.submit(job, timeout=240, download=tmp_path / "download")
    assert result["status"] == "FINISHED:COMPLETED"
    table_csv = next(result["result_dir"].rglob("per_client_table.csv"))
    rows = {r["client"]: r for r in csv.DictReader(open(table_csv))}
    assert set(rows) == set(SITES) | {"Avg", "Std"}
    assert all(0.0 <= float(rows[s]["dice"]) <= 1.0 for s in SITES)
    assert "| **Avg** |" in result["table"]
    assert any(result["result_dir"].rglob("FL_global_model.pt"))
    assert set(SITES) <= set(result["peak_mib"])


@pytest.mark.poc
def test_project_yml_provisions_tls_kits_for_every_polyp_center(tmp_path, monkeypatch):
    import subprocess

    from feduq.data import get_task

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    nvflare = os.path.join(os.path.dirname(sys.executable), "nvflare")
    subprocess.run([nvflare, "provision", "-p", str(REPO / "poc" / "project.yml"), "-w", str(tmp_path / "ws"),
                    "--force"], check=True, capture_output=True, timeout=120)
    prod = tmp_path / "ws" / "feduq_polyp" / "prod_00"
    sites = {p.name for p in prod.iterdir() if (p / "startup" / "fed_client.json").is_file()}
    assert sites == set(get_task("polyp").centers)
    assert (prod / "feduq-server.example.org" / "startup" / "server.crt").is_file()
    assert (prod / "Kvasir-SEG" / "startup" / "rootCA.pem").is_file()
