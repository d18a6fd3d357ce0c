"""tools/run_tests.sh checks FEDUQ_TEST_WORKERS before it installs or runs anything (issue 65: pytest's own error did
not name the variable, and the script went on to the second pass)."""

import os
import subprocess

import pytest

from conftest import REPO


@pytest.mark.parametrize("value", ["abc", "0", "-2", "2.5"])
def test_a_bad_worker_count_is_named_in_one_line_and_nothing_runs(value, tmp_path):
    env = {**os.environ, "FEDUQ_TEST_WORKERS": value, "FEDUQ_VENV": str(tmp_path / "never-made")}
    run = subprocess.run(["bash", str(REPO / "tools" / "run_tests.sh")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2
    assert run.stderr == (f"run_tests.sh: error: FEDUQ_TEST_WORKERS={value}: expected a whole number of test processes "
                          ">= 1\n")
    assert run.stdout == "" and not (tmp_path / "never-made").exists()  # no install, no pass
