"""MONAI imported without the optional packages no FedUQ site or server uses, in every FLARE process of FedUQ.

``import monai`` (MONAI 1.x) imports every MONAI submodule, and with them whatever optional package is installed:
MLflow and Ignite (MONAI's training handlers), pandas (its profiling tables), TensorBoard and Matplotlib (its
visualisation), torchvision (its detection backbones) and scikit-learn (an embedding metric). None of these MONAI
features runs in a FedUQ site or server, yet loading them costs each process about 2.5 s of CPU and 160 MB of
proportional memory (PSS) on a 2-core machine, before any image is read (``tools/benchmark_rounds.py``, issue 40).

:func:`import_monai_lean` imports MONAI once with those packages unavailable **only while MONAI loads** (a finder on
``sys.meta_path`` that refuses them, removed afterwards). MONAI's ``optional_import`` then keeps a placeholder for each
(its features that need one raise when used), and FedUQ's own code imports any of them normally later (scikit-learn
for FedUAA's thresholds, Matplotlib for a picture): they are then loaded on first use, not at start-up.
"""

from __future__ import annotations

import importlib.abc
import sys

#: top-level packages refused while MONAI loads
NOT_AT_START = ("mlflow", "ignite", "pandas", "tensorboard", "torchvision", "matplotlib", "sklearn")


class _RefuseWhileMonaiLoads(importlib.abc.MetaPathFinder):
    def __init__(self, names):
        self.names = frozenset(names)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"{fullname} is not loaded with MONAI in a FedUQ process "
                                      "(feduq.flare.lean_monai)", name=fullname)
        return None


def import_monai_lean(names=NOT_AT_START) -> bool:
    """Import MONAI with ``names`` refused while it loads; True when it did so, False when MONAI or one of ``names``
    was already imported in this process (nothing is changed then)."""
    if "monai" in sys.modules or any(name in sys.modules for name in names):
        return False
    finder = _RefuseWhileMonaiLoads(names)
    sys.meta_path.insert(0, finder)
    try:
        import monai  # noqa: F401
    finally:
        sys.meta_path.remove(finder)
    return True
