"""Build hook only (all metadata is in setup.cfg): the wheel and the sdist carry ``feduq/_build.json``, the commit
they were built from, so an installed FedUQ states its provenance without git (:mod:`feduq.common.provenance`)."""

import json
import os
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD_FILE = "_build.json"


def _git(*args):
    try:
        out = subprocess.run(["git", "-C", HERE, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def build_info():
    """The commit of this source tree (``+dirty`` when its package code differs from it); None outside a clone."""
    if _git("rev-parse", "--show-toplevel") != HERE:  # only this repository's own checkout, never one around it
        return None
    commit = _git("rev-parse", "--short=12", "HEAD")
    if not commit:
        return None
    dirty = _git("status", "--porcelain", "--", "custom", "setup.cfg", "setup.py")
    return {"commit": commit + ("+dirty" if dirty else "")}


def _write(path, info):
    with open(path, "w") as f:
        json.dump(info, f)
        f.write("\n")


class BuildPy(build_py):
    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "feduq", BUILD_FILE)
        shipped = os.path.join(HERE, "custom", BUILD_FILE)  # a build from an sdist: the sdist's own record
        if os.path.isfile(shipped):
            self.copy_file(shipped, target)
        else:
            info = build_info()
            if info:
                _write(target, info)


class Sdist(sdist):
    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        info = build_info()
        if info:
            _write(os.path.join(base_dir, "custom", BUILD_FILE), info)


setup(cmdclass={"build_py": BuildPy, "sdist": Sdist})
