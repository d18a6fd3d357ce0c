"""The suite's scheduling (tests/conftest.py): the second pass's two streams keep every federation that binds FLARE's
fixed ports on one worker and never run two timed tests side by side; the first pass keeps a module that shares one
costly fixture on one worker."""

import re

from conftest import FEDERATION_MODULES, ONE_WORKER_MODULES, REPO, xdist_scope


def test_the_second_pass_has_two_streams_and_the_first_keeps_shared_fixtures_on_one_worker():
    poc = "tests/integration/test_poc.py::test_feduq_run_env_poc_beside_a_running_poc"
    wheel = "tests/integration/test_wheel.py::test_a_sites_day_from_the_wheel"
    timed = ["tests/integration/test_faults.py::test_fedevi_resumes_after_the_server_is_killed",
             "tests/unit/recipes/test_runs.py::test_simulate_interrupted_keeps_a_resumable_workspace",
             "tests/integration/test_quorum.py::test_every_site_failing_at_setup_stops_the_job_with_their_errors[x]"]
    assert {xdist_scope(n, "loadscope") for n in (poc, wheel)} == {"federations"}
    assert {xdist_scope(n, "loadscope") for n in timed} == {"timed"}
    assert xdist_scope(timed[0], "load") == "tests/integration/test_faults.py"  # its tests read one faulty run
    assert xdist_scope(timed[1], "load") == timed[1]  # balanced test by test


def test_every_module_with_a_poc_test_is_in_the_federation_stream():
    """A POC or provisioned federation binds FLARE's fixed ports: in the timed stream it could run beside another."""
    marked = {p.name for p in (REPO / "tests").rglob("test_*.py")
              if re.search(r"pytest\.mark\.poc\b", p.read_text())}
    assert marked and marked <= FEDERATION_MODULES, marked - FEDERATION_MODULES
    modules = {p.name for p in (REPO / "tests").rglob("test_*.py")}
    assert (FEDERATION_MODULES | ONE_WORKER_MODULES) <= modules  # no name of a module that is gone
