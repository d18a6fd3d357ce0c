"""feduq.core.threads: the job's computing site processes share the host's cores, and a site takes the cores others free."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from feduq.core.threads import HostCoreShare, threads_for


@pytest.fixture(autouse=True)
def keep_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_shares_add_up_to_the_cores_and_never_drop_below_one():
    assert [threads_for(2, ["a", "b", "c", "d"], m) for m in "abcd"] == [1, 1, 1, 1]  # 4 sites on 2 cores
    assert [threads_for(8, ["c", "a", "b"], m) for m in "abc"] == [3, 3, 2]  # 8 = 3 + 3 + 2, sorted order
    assert threads_for(2, ["a"], "a") == 2  # alone: every core
    assert sum(threads_for(16, list("abcde"), m) for m in "abcde") == 16
    with pytest.raises(ValueError, match="'z' is not among"):
        threads_for(2, ["a"], "z")
    with pytest.raises(ValueError, match="cores must be >= 1"):
        threads_for(0, ["a"], "a")


def test_a_site_takes_the_cores_the_others_free(tmp_path):
    share = HostCoreShare("Kvasir-SEG", cores=4, folder=tmp_path, refresh_s=0.0)
    other = HostCoreShare("ETIS", cores=4, folder=tmp_path, refresh_s=0.0)
    with share.computing():
        assert share.threads == 4 and torch.get_num_threads() == 4  # alone
        with other.computing():
            assert share.refresh() == 2 and torch.get_num_threads() == 2  # two sites compute: 2 + 2
        assert not list(tmp_path.glob("ETIS.*"))  # the other site's place is given back when its task ends
        assert share.refresh() == 4 and torch.get_num_threads() == 4
    assert not list(tmp_path.iterdir())


def test_places_of_dead_processes_are_ignored_and_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"CVC-ColonDB.{int(dead.stdout)}"
    stale.touch()
    share = HostCoreShare("Kvasir-SEG", cores=2, folder=tmp_path)
    with share.computing():
        assert share.threads == 2
    assert not stale.exists()


def test_refresh_reads_the_folder_at_most_every_refresh_s(tmp_path):
    share = HostCoreShare("a", cores=2, folder=tmp_path, refresh_s=3600.0)
    with share.computing():
        (tmp_path / f"b.{os.getpid()}").touch()  # another live member appears
        assert share.refresh() == 2  # not re-read yet
        assert share.refresh(force=True) == 1


# The sites sharing the host's cores in a real simulator run (num_threads 0, the committed jobs' default) is checked in
# tests/integration/test_fedper.py's simulator run, which runs that way: one simulator run serves both.
