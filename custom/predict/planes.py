"""A loaded 2D model applied to planes at the device's pace: :class:`Predictor` (the network, the mapping back onto
each plane's grid, the class map, the method's uncertainty and each case's numbers, all on the model's device; to
the host only what is written) and :func:`predict_planes`, the pipeline :func:`feduq.predict.pipeline.predict` runs over a
folder of 2D images: decoding the next batch and writing the last one's files in a pool of worker threads while the
device computes.

What is written per case is chosen from :data:`OUTPUTS` (``--outputs``); the CSV row is always made. Axis
convention as :mod:`feduq.predict.files`: planes ``[C, W, H]`` (width first), files ``[H, W]`` rows.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from ..scores.case_scores import BottleneckTap, array_stats, plane_stats  # noqa: F401  (re-exported)
from ..scores.metrics import region_label_map
from ..scores.scoring import segment, to_stored_grid
from ..core.training import to_device
from .files import DEFAULT_OUTPUTS, OUTPUTS, parse_outputs  # noqa: F401  (re-exported: what predict writes)

__all__ = ["OUTPUTS", "DEFAULT_OUTPUTS", "parse_outputs", "Predictor", "plane_stats", "array_stats", "predict_planes",
           "writer_threads"]

def writer_threads() -> int:
    """Worker threads of a prediction's pool: up to 4, at most the CPUs this process may use (PNG encoding and
    decoding release Python's lock)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


class Predictor:
    """A loaded model (:class:`feduq.site.evaluation.LoadedModel`) applied plane by plane, batched.

    Args:
        loaded: the job's site and network (:func:`feduq.site.evaluation.load_model`).
        batch_size: planes per forward pass.
    """

    def __init__(self, loaded, batch_size: int = 8):
        from ..data import get_task
        from ..io.transforms import make_image_transforms

        self.loaded, self.site, self.batch_size = loaded, loaded.site, int(batch_size)
        self.spec = get_task(loaded.task)
        self.num_classes = len(self.spec.class_names)
        # nested regions paint the label map region by region; a declared task's plain labels are scored by name but
        # post-processed class by class over all its classes (an unscored structure is still written)
        plain = not self.spec.regions
        self.regions = None if plain else self.spec.eval_regions or None
        normalised = self.spec.normalised_at_read  # read as the sites read
        self.transform = make_image_transforms(self.site.image_size, self.spec.in_channels, self.site.resize,
                                               "raw" if normalised else self.site.intensity, load=False)
        from .rows import structures

        # the reported structures (classes, nnU-Net's nested regions) by name: with more than one, ``probability``
        # gives one map each (a region's: the sum of its classes' probabilities)
        self.parts = structures(self.spec.class_names, self.spec.eval_regions)
        self.uncertainty = self.site.uncertainty_fn()
        self.primary = self.site.primary_uncertainty
        self.device = torch.device(self.site.device)
        self.tap: BottleneckTap | None = None

    def take_features(self) -> None:
        """From now on each plane's result has ``"features"``: the network's pooled bottleneck features ``[C]``
        float64 (:class:`feduq.scores.case_scores.BottleneckTap`; the review rule's familiarity)."""
        if self.tap is None:
            self.tap = BottleneckTap(self.loaded.model, self.spec.in_channels, self.site.image_size)

    def inputs(self, arrays: Sequence[np.ndarray]) -> torch.Tensor:
        """Planes ``float32 [in_channels, W, H]`` -> the network's batch ``[B, in_channels, S, S]`` (host, the job's
        test-stage transforms)."""
        from monai.data import MetaTensor

        return torch.stack([torch.as_tensor(self.transform({"image": MetaTensor(torch.from_numpy(a))})["image"])
                            .as_subclass(torch.Tensor) for a in arrays])

    @torch.no_grad()
    def planes(self, arrays: list[np.ndarray], outputs: Sequence[str] = OUTPUTS,
               inputs: Sequence[torch.Tensor] | None = None) -> list[dict]:
        """Planes ``float32 [in_channels, W, H]`` (stored values) -> per plane ``{"label": uint8 [W, H],
        "probability": float32 [W, H] (foreground = 1 - background; with ``"probability"`` in ``outputs``),
        "probabilities": {structure: float32 [W, H]} (with ``"probability"`` and more than one structure, :attr:`parts`:
        each class's probability, a region's the sum of its classes'), "maps":
        {name: float32 [W, H]} (every map with ``"uncertainty_maps"``, the method's own with ``"uncertainty"`` or
        ``"overlay"``), "stats": :func:`plane_stats` as floats, "features" (after :meth:`take_features`)}`` on the
        plane's own grid. Everything but the
        connected components runs on the model's device; a batch's numbers reach the host in one transfer.
        ``inputs``: each plane's network input ``[in_channels, S, S]`` (:meth:`inputs`), when already made (by
        :func:`predict_planes`' worker threads)."""
        site, out = self.site, []
        proto = site.test_protocol
        keep = [k for k in self._map_names() if "uncertainty_maps" in outputs or
                (k == self.primary and ("uncertainty" in outputs or "overlay" in outputs))]
        for start in range(0, len(arrays), self.batch_size):
            chunk = arrays[start:start + self.batch_size]
            batch = (torch.stack(list(inputs[start:start + self.batch_size])) if inputs is not None
                     else self.inputs(chunk))
            logits = self.loaded.model(to_device(batch, self.device)).float()
            features = self.tap.take().double().cpu().numpy() if self.tap is not None else None
            results, stats = [], []
            for i, a in enumerate(chunk):
                grid = to_stored_grid(logits[i:i + 1], tuple(a.shape[1:]), site.resize == "letterbox")
                probs, pred = segment(grid, site.prob_fn, self.num_classes,
                                      site.keep_largest_component and not self.regions, proto.connectivity,
                                      proto.empty_prediction)
                if self.regions:
                    pred = region_label_map(pred, self.regions, site.keep_largest_component, proto.connectivity)
                maps = {k: v[0] for k, v in self.uncertainty(grid).items()}
                stats.append(plane_stats(pred[0, 0], maps, self.primary, self.num_classes))
                results.append({"label": pred[0, 0].to(torch.uint8).cpu().numpy(),
                                "maps": {k: maps[k].float().cpu().numpy() for k in keep},
                                **({"probability": (1.0 - probs[0, 0]).float().cpu().numpy()}
                                   if "probability" in outputs else {}),
                                **({"probabilities": {name: probs[0, list(classes)].sum(0).float().cpu().numpy()
                                                      for name, classes in self.parts.items()}}
                                   if "probability" in outputs and len(self.parts) > 1 else {})})
            names = list(stats[0])
            table = torch.stack([torch.stack([s[k] for k in names]) for s in stats]).cpu().numpy()
            for i, (res, row) in enumerate(zip(results, table)):
                res["stats"] = dict(zip(names, map(float, row)))
                if features is not None:
                    res["features"] = features[i]
            out += results
        return out

    def _map_names(self) -> list[str]:
        if not hasattr(self, "_names"):
            self._names = list(self.uncertainty(torch.zeros(1, self.num_classes, 1, 1)))
        return self._names


def predict_planes(predictor: Predictor, items: Sequence, read: Callable, write: Callable, outputs: Sequence[str],
                   threads: int | None = None) -> list[dict]:
    """Run ``predictor`` over ``items`` in batches, as a pipeline: a pool of worker threads decodes and transforms
    batch b+1 (``read(item) -> (plane float32 [C, W, H], anything write needs)``, then :meth:`Predictor.inputs`) and
    writes batch b-1's files (``write(item, extra, result)``) while the device computes batch b. At most three
    batches are held; a failed read or write stops the run at the next batch with its own error (the case it was
    writing is never half-written: :func:`feduq.predict.files.write_case` stages each case).

    Returns:
        The results of :meth:`Predictor.planes`, in ``items``' order.
    """
    n = predictor.batch_size
    batches = [list(items[i:i + n]) for i in range(0, len(items), n)]

    def prepare(item):
        plane, extra = read(item)
        return plane, extra, predictor.inputs([plane])[0]

    results: list[dict] = []
    with ThreadPoolExecutor(max_workers=threads or writer_threads(), thread_name_prefix="feduq-predict") as pool:
        reading = [pool.submit(prepare, item) for item in batches[0]] if batches else []
        writing: list[Future] = []
        for b, batch in enumerate(batches):
            decoded = [f.result() for f in reading]
            if b + 1 < len(batches):  # the next batch decodes while this one computes
                reading = [pool.submit(prepare, item) for item in batches[b + 1]]
            res = predictor.planes([plane for plane, _, _ in decoded], outputs, inputs=[x for _, _, x in decoded])
            for future in writing:  # the batch before this one is written by now, or its error is raised
                future.result()
            writing = [pool.submit(write, item, extra, r) for item, (_, extra, _), r in zip(batch, decoded, res)]
            results += res
        for future in writing:
            future.result()
    return results
