"""A provisioned federation on loopback (poc/provisioned.py): `nvflare provision`, server and two sites started from
their startup kits with mutual TLS, jobs submitted, monitored and downloaded with the admin kit; a site with another
project's certificate is refused; a site whose policy forbids custom code refuses a BYOC job. Everything started is
killed at the end, also on failure."""

import csv
import json
import re
import os
import subprocess
import sys
import time

import pytest

from conftest import REPO
pytestmark = pytest.mark.poc
SITES = ["CVC-ClinicDB", "ETIS-LaribPolypDB"]
STRICT = "ETIS-LaribPolypDB"


@pytest.fixture
def federation(tmp_path, monkeypatch, data_root):
    import provisioned

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FEDUQ_DATA_ROOT", raising=False)  # each site reads its own local/feduq_site.json
    kits, procs = provisioned.up(tmp_path / "prov", SITES, str(data_root), strict=[STRICT])
    started = list(procs)
    try:
        yield provisioned, kits, started
    finally:
        provisioned.stop(started, tmp_path / "prov")


def test_provisioned_tls_federation(federation, tmp_path):
    from nvflare.fuel.flare_api.flare_api import new_secure_session

    from feduq.recipes.job_folders import configure

    provisioned, kits, started = federation
    assert (kits / STRICT / "local" / "authorization.json").is_file()
    for kit in [kits / "localhost", *(kits / s for s in SITES)]:  # mutual TLS material of one project
        assert {"rootCA.pem"} <= {p.name for p in (kit / "startup").iterdir()}
    # the job through FLARE's ProdEnv and the admin's kit: feduq run waits and prints the table
    env = {k: v for k, v in os.environ.items() if k != "FEDUQ_DATA_ROOT"}
    proc = subprocess.run([sys.executable, "-m", "feduq.run", "fedavg", "--env", "prod", "--startup-kit",
                           str(kits / provisioned.ADMIN), "--username", provisioned.ADMIN, "--sites", ",".join(SITES),
                           "--image-size", "32", "--num-rounds", "1", "--max-items", "6", "--allow-listed",
                           "--timeout", "240"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "| **Avg** |" in proc.stdout and all(f"| {site} |" in proc.stdout for site in SITES)
    assert re.search(r"^round 1/1 \| weights .*CVC-ClinicDB 0\.\d\d", proc.stdout, re.M), proc.stdout[-3000:]
    table = next((kits / provisioned.ADMIN).rglob("per_client_table.csv"))  # downloaded through the admin session
    assert set(r["client"] for r in csv.DictReader(open(table))) == set(SITES) | {"Avg", "Std"}
    byoc = configure(REPO / "jobs" / "fedavg", tmp_path / "job_byoc", sites=SITES, image_size=32, num_rounds=1,
                     max_items=6, byoc=True)
    session = new_secure_session(provisioned.ADMIN, str(kits / provisioned.ADMIN))
    try:
        byoc_id = session.submit_job(str(byoc))  # ships FedUQ's code: the strict site must refuse it
        session.monitor_job(byoc_id, timeout=120, poll_interval=2.0)
        assert session.get_job_meta(byoc_id)["status"] != "FINISHED:COMPLETED"
    finally:
        session.close()
    server_log = (kits / "localhost" / "log.txt").read_text()
    assert f"{STRICT}: NVFLARE_ERROR: BYOC not permitted" in server_log
    ledger = next((kits / "CVC-ClinicDB").rglob("privacy_ledger.csv"))  # the ledger runs in production too
    assert {"val_dice", "dice"} <= {r["key"] for r in csv.DictReader(open(ledger))}
    # and the site's own privacy policy (local/privacy.json, written by prepare_site/provisioned) ran before it
    site_logs = " ".join(p.read_text() for p in (kits / "CVC-ClinicDB").rglob("log.txt"))
    assert "FEDUQ_SITE_POLICY the site's privacy policy checked task 'train'" in site_logs

    # another project's site (its own root CA) dials this server: TLS refuses it, it never joins
    port = json.loads((kits / SITES[0] / "startup" / "fed_client.json").read_text())["servers"][0]["service"]["target"]
    other = provisioned.provision(tmp_path / "other", "other_project", ["Intruder"], int(port.split(":")[1]))
    started.append(provisioned.start(other / "Intruder", server=False))
    log, deadline = other / "Intruder" / "console.log", time.time() + 60
    while time.time() < deadline and "CERTIFICATE_VERIFY_FAILED" not in log.read_text():
        time.sleep(1.0)
    assert "CERTIFICATE_VERIFY_FAILED" in log.read_text()
    assert provisioned.connected_clients(kits / provisioned.ADMIN) == sorted(SITES)
