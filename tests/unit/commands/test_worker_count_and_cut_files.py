"""tools/run_tests.sh checks FEDUQ_TEST_WORKERS before it installs or runs anything (pytest's own error did
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


def test_a_torch_file_cut_by_a_file_size_limit_is_named_and_not_left_half_written(tmp_path):
    """Issue 65: under a file-size limit a site showed torch's "[enforce fail at inline_container.cc:672]", naming
    neither the file nor the cause; feduq.common.saving.save_torch (a site's state, its local entries) names both and
    leaves no partial file."""
    import sys

    code = ("import resource, torch\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))\n"
            "from feduq.common.saving import save_torch\n"
            f"save_torch({{'a': torch.zeros(100000)}}, {str(tmp_path / 'state.pt')!r})\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("OSError: [Errno ") and (f"] cannot write {tmp_path / 'state.pt'}: a file-size limit "
                                                    "(ulimit -f) or a full disk stopped the write") in last, last
    assert list(tmp_path.iterdir()) == []  # neither the file nor its partial copy
