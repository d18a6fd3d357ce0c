"""A site's intensity fingerprint for FLARE's federated statistics (``nvflare.recipe.fedstats.FedStatsRecipe``).

nnU-Net normalises a CT channel with its dataset fingerprint: the intensities of foreground voxels, clipped to their
0.5 and 99.5 percentiles, then z-scored with their mean and standard deviation (``CTNormalization``). In a federation
no site sees the others' voxels, so each site sends only the declared summary numbers of its own foreground samples
(count, sum, mean, standard deviation and a t-digest for the two quantiles) through FLARE's statistics workflow and its
privacy filter (minimum count), and the server combines them into the global numbers, as nnU-Net federations on FLARE
and Flower share fingerprints. ``tools/intensity_fingerprint.py`` runs it and writes the window into the task file.

:class:`IntensityFingerprint` is FLARE's ``Statistics`` spec over :func:`feduq.data.nnunet_raw.foreground_intensities`:
one dataset ``"train"``, one feature per ``CT`` channel without a window (named after the channel). It answers only
the statistics the job asks for (no histogram, minimum or maximum).

What it sends is FLARE's statistics result, not a DXO, so FedUQ's privacy ledger (which declares DXOs) does not
describe it: a site whose own privacy policy enforces the ledger on every job (``tools/prepare_site.py``) refuses
this job's results. Declaring FLARE's statistics results in the ledger is not built yet.
"""

from __future__ import annotations

from typing import Dict, List

import numpy as np
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.statistics_spec import DataType, Feature, Statistics
from nvflare.app_common.app_constant import StatisticsConstants

from ..data import get_task, resolve_data_root
from ..data.nnunet_raw import foreground_intensities
from ..data.sites import site_center
from .site_config import read_site_config

__all__ = ["DATASET", "IntensityFingerprint", "fingerprint_channels"]

DATASET = "train"


def fingerprint_channels(task) -> dict[str, int]:
    """Feature name (``"<index>_<channel name>"``: two CT phases may share a name) -> channel index of the task's
    ``CT`` channels still without a window."""
    d = get_task(task).declaration
    return {f"{i}_{d.channel_names[i]}": i for i in d.missing_windows}


class IntensityFingerprint(Statistics):
    """A site's foreground intensity samples of its CT channels, as FLARE's federated statistics read them.

    Args:
        task: the task's declaration (the JSON object of its task file; the job carries it).
        voxels_per_case: foreground voxels sampled per case (nnU-Net's fingerprint takes 10,000).
        seed: the sampling seed.
    """

    def __init__(self, task: dict, voxels_per_case: int = 10000, seed: int = 0):
        super().__init__()
        self.task, self.voxels_per_case, self.seed = task, int(voxels_per_case), int(seed)
        self.samples: Dict[str, np.ndarray] = {}

    def initialize(self, fl_ctx: FLContext):
        """Read this site's samples (its data root and center from ``local/feduq_site.json`` or
        ``$FEDUQ_DATA_ROOT``). Raises DataError naming the site and file."""
        spec = get_task(self.task)
        site = fl_ctx.get_identity_name()
        cfg = read_site_config(fl_ctx)
        center = site_center(spec.name, cfg.get("center", site))
        root = resolve_data_root(cfg.get("data_root"), site=site)
        values = foreground_intensities(spec.name, root, center, site, self.voxels_per_case, self.seed)
        self.samples = {name: values[c] for name, c in fingerprint_channels(spec.name).items()}

    def features(self) -> Dict[str, List[Feature]]:
        return {DATASET: [Feature(name, DataType.FLOAT) for name in self.samples]}

    def count(self, dataset_name: str, feature_name: str) -> int:
        return int(self.samples[feature_name].size)

    def sum(self, dataset_name: str, feature_name: str) -> float:
        return float(self.samples[feature_name].sum())

    def mean(self, dataset_name: str, feature_name: str) -> float:
        return float(self.samples[feature_name].mean())

    def stddev(self, dataset_name: str, feature_name: str) -> float:
        return float(self.samples[feature_name].std(ddof=1))

    def variance_with_mean(self, dataset_name: str, feature_name: str, global_mean: float,
                           global_count: float) -> float:
        x = self.samples[feature_name]
        return float(((x - global_mean) ** 2).sum() / (global_count - 1))

    def failure_count(self, dataset_name: str, feature_name: str) -> int:
        return 0

    def quantiles(self, dataset_name: str, feature_name: str, percents: List) -> Dict:
        from fastdigest import TDigest

        digest = TDigest.from_values(self.samples[feature_name])  # fastdigest 0.12 (FLARE's server merges its dict)
        return {StatisticsConstants.STATS_QUANTILE: {p: float(digest.quantile(p)) for p in percents},
                StatisticsConstants.STATS_DIGEST_COORD: digest.to_dict()}
