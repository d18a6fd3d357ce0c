"""A site's privacy policy (``feduq prepare-site``, ``local/privacy.json``) in a FLARE simulator workspace, whose one
``local/`` the server reads too (issue 65, item 7).

FLARE's privacy configurator gives a filter without its own ``"direction"`` the server's direction when the server
reads it (``nvflare/private/fed/app/fl_conf.py``, ``PrivacyConfiger``): the site's result filter then ran on every
result the server received, under the server's name, after FLARE's client runner had added its ``__cookie_jar__``
header, and blocked the first one. The policy now names its site direction, and the filter passes a message through
on a server.
"""

import csv
import json
import subprocess

import numpy as np
import pytest

from conftest import FakeEngine, load_tool, read_table, simulator_process, small_job

SITES = ["Kvasir-SEG", "CVC-ColonDB"]


def test_a_server_reading_the_site_policy_runs_none_of_its_filters(tmp_path):
    """Read by FLARE as a server, the policy feduq prepare-site writes has no filter in the directions a server filters
    (task data out, results in); read as a site, the ledger on task data in and results out. A policy written before
    (no direction) is replaced, not doubled. A filter that finds itself on a server passes the message through; on a
    site, a real undeclared header (FLARE's cookie jar among them) is still blocked."""
    from nvflare.apis.fl_constant import FilterKey, FLContextKey, ReturnCode
    from nvflare.apis.fl_context import FLContext
    from nvflare.apis.server_engine_spec import ServerEngineSpec
    from nvflare.apis.workspace import Workspace
    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
    from nvflare.app_common.utils.fl_model_utils import FLModelUtils
    from nvflare.private.fed.app.fl_conf import create_privacy_manager

    from feduq.flare.ledger import PrivacyLedgerFilter
    from feduq.flare.quorum import site_error

    ws = tmp_path / "ws"
    assert load_tool("prepare_site").main([str(ws)]) == 0
    (ws / "startup").mkdir()  # what FLARE's Workspace requires of a folder

    def scope(is_server):
        mgr = create_privacy_manager(Workspace(str(ws), site_name="server" if is_server else "site-a"),
                                     names_only=False, is_server=is_server)
        return mgr.get_scope("")

    server = scope(is_server=True)
    assert not server.task_data_filters.get(FilterKey.OUT) and not server.task_result_filters.get(FilterKey.IN)
    site = scope(is_server=False)
    for chain, direction in ((site.task_data_filters, FilterKey.IN), (site.task_result_filters, FilterKey.OUT)):
        (f,) = chain[direction]
        assert isinstance(f, PrivacyLedgerFilter) and (f.method, f.direction) == ("*", direction)

    path = ws / "local" / "privacy.json"
    policy = json.loads(path.read_text())
    for chain in ("task_data_filters", "task_result_filters"):  # as FedUQ wrote it before: no direction
        for f in policy["scopes"][0][chain]:
            f.pop("direction")
    path.write_text(json.dumps(policy))
    assert load_tool("prepare_site").main([str(ws)]) == 0
    assert [len(f) for f in (scope(False).task_data_filters[FilterKey.IN], scope(False).task_result_filters[
        FilterKey.OUT])] == [1, 1]

    class ServerEngine(FakeEngine):
        pass

    ServerEngineSpec.register(ServerEngine)

    def ctx(engine, name):
        class Ctx(FLContext):
            def get_identity_name(self, default=""):
                return name

            def get_engine(self):
                return engine

            def get_job_id(self):
                return "job1"

        c = Ctx()
        c.set_prop(FLContextKey.TASK_NAME, "train", private=True, sticky=False)
        return c

    result = FLModelUtils.to_shareable(FLModel(params={"w": np.zeros((2, 3), np.float32)}, params_type=ParamsType.FULL,
                                               meta={"feduq_num_samples": 10}))
    result.set_cookie_jar({"__workflow__": "fedevi"})  # as FLARE's client runner adds it, after the site's filters
    out = PrivacyLedgerFilter("*", "out")
    assert out.process(result, ctx(ServerEngine(tmp_path / "server"), "simulator_server")) is result
    reply = out.process(result, ctx(FakeEngine(tmp_path / "site"), "site-a"))
    assert reply.get_return_code() == ReturnCode.TASK_RESULT_FILTER_ERROR
    assert "site 'site-a': task 'train': undeclared header '__cookie_jar__' (dict)" in site_error(reply)


@pytest.mark.sim
def test_flare_simulator_runs_on_a_workspace_prepare_site_prepared(tmp_path, data_root):
    """feduq prepare-site on a fresh simulator workspace, then FLARE's simulator on a small FedEvi job: it finishes, the
    table is written, and each site's results went through the job's privacy ledger under the site's own name,
    nothing blocked."""
    ws = tmp_path / "ws"
    assert load_tool("prepare_site").main([str(ws)]) == 0
    assert (ws / "local" / "privacy.json").is_file()
    job = small_job("fedevi", tmp_path / "job", sites=SITES)
    proc = simulator_process(job, ws, data_root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    assert "FEDUQ_LEDGER_BLOCKED" not in out and "__cookie_jar__" not in out, out[-4000:]
    table = read_table(ws)
    assert set(SITES) <= set(table), table
    for site in SITES:
        rows = list(csv.DictReader(open(ws / site / "simulate_job" / "privacy_ledger.csv")))
        assert {r["task"] for r in rows} >= {"train", "test"} and not [r for r in rows if r["section"] == "BLOCKED"]
        assert "FEDUQ_LEDGER_BLOCKED" not in (ws / site / "log.txt").read_text()
    assert "FEDUQ_LEDGER_BLOCKED" not in (ws / "server" / "log.txt").read_text()
