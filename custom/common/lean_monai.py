"""MONAI imported without the optional packages no FedUQ site, server or ``predict`` uses, in every FLARE process of
FedUQ and in ``feduq predict``.

``import monai`` (MONAI 1.x) imports every MONAI submodule, and with them whatever optional package is installed:
MLflow and Ignite (MONAI's training handlers), pandas (its profiling tables), TensorBoard and Matplotlib (its
visualisation), torchvision (its detection backbones), scikit-learn (an embedding metric), and SciPy's signal, stats,
optimisation, interpolation and sparse solvers (its ultrasound confidence map, signal transforms, panoptic quality and
DiNTS search; ``scipy.signal`` alone imports ``scipy.stats``: 1.0 s of a 2-core CPU). None of these MONAI
features runs in a FedUQ site or server, yet loading them costs each process about 2.5 s of CPU and 160 MB of
proportional memory (PSS) on a 2-core machine, before any image is read (``tools/benchmark_rounds.py``);
SciPy's parts another 0.6-0.8 s (``python -X importtime``). SciPy's ``ndimage`` and ``spatial`` and
scikit-image stay: MONAI's HD95 and largest-component transform use them.

:func:`import_monai_lean` imports MONAI once with those packages unavailable **only while MONAI loads** (a finder on
``sys.meta_path`` that refuses them, removed afterwards). MONAI's ``optional_import`` then keeps a placeholder for each
(its features that need one raise when used), and FedUQ's own code imports any of them normally later (scikit-learn
for FedUAA's thresholds, Matplotlib for a picture): they are then loaded on first use, not at start-up.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

#: packages (and their sub-packages) refused while MONAI loads
NOT_AT_START = ("mlflow", "ignite", "pandas", "tensorboard", "torchvision", "matplotlib", "sklearn", "scipy.signal",
                "scipy.stats", "scipy.optimize", "scipy.interpolate", "scipy.sparse.linalg")


class _RefuseWhileMonaiLoads(importlib.abc.MetaPathFinder):
    def __init__(self, names):
        self.names = frozenset(names)

    def find_spec(self, fullname, path=None, target=None):
        if any(fullname == name or fullname.startswith(name + ".") for name in self.names):
            raise ModuleNotFoundError(f"{fullname} is not loaded with MONAI in a FedUQ process "
                                      "(feduq.common.lean_monai)", name=fullname)
        return None


def quiet_monai_notices() -> None:
    """Silence three notices MONAI prints on every run that say nothing about the user's data: nvImageCodec's absence
    (a GPU DICOM decoder; the pydicom one is used), twice, when MONAI's image loader tries its readers, and the
    deprecation of ``get_mask_edges``' ``always_return_as_numpy`` that MONAI's own Hausdorff distance passes. Only
    these exact messages; every other warning still shows."""
    import logging
    import warnings

    logging.getLogger("monai.data.nvimgcodec_pydicom_plugin").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="NvImgCodecPydicomReader: nvImageCodec decoder plugin did not register",
                            category=UserWarning)
    warnings.filterwarnings("ignore", message=".*get_mask_edges:always_return_as_numpy", category=FutureWarning)


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


class _LeanOnFirstImport(importlib.abc.MetaPathFinder):
    """Finds MONAI's own spec on the first ``import monai`` (then takes itself off ``sys.meta_path``) with a loader
    that executes MONAI's ``__init__`` while ``names`` are refused, as :func:`import_monai_lean` does. (Importing MONAI
    inside ``find_spec`` instead would make the import system execute it a second time from its own spec.)"""

    def __init__(self, names):
        self.names = names

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "monai":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        if any(name in sys.modules for name in self.names):
            return None  # one of them is loaded already: MONAI loads as usual
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _LeanLoader(spec.loader, self.names)
        return spec


class _LeanLoader(importlib.abc.Loader):
    """MONAI's own loader, executing its module with :class:`_RefuseWhileMonaiLoads` on ``sys.meta_path``; anything
    else is the wrapped loader's."""

    def __init__(self, loader, names):
        self._loader, self._names = loader, names

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        finder = _RefuseWhileMonaiLoads(self._names)
        sys.meta_path.insert(0, finder)
        try:
            self._loader.exec_module(module)
        finally:
            sys.meta_path.remove(finder)


def defer_monai_lean(names=NOT_AT_START) -> bool:
    """Import MONAI as :func:`import_monai_lean` does, but only when something first imports it; True when the
    deferral was set up, False when MONAI is already imported (or the deferral already waits)."""
    if "monai" in sys.modules or any(isinstance(f, _LeanOnFirstImport) for f in sys.meta_path):
        return False
    sys.meta_path.insert(0, _LeanOnFirstImport(names))
    return True
