"""A FedUQ site's settings: the site-local config file, and the range checks of the 2D site's arguments.

Where a site's data lives is the site's business, never the job's: the data root comes from the site-local file
``<site workspace>/local/feduq_site.json`` (``{"data_root": ..., "center": ..., "on_bad_file": ...}``, written by
``feduq prepare-site``) or, failing that, the environment variable ``FEDUQ_DATA_ROOT``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from .. import data as fdata
from ..common.wire import SITE_CONFIG_FILE
from ..privacy.dp_sgd import DPConfig
from ..core.training import AMP_MODES
from ..io.resize import RESIZE_MODES
from ..io.transforms import INTENSITY_MODES


def read_site_config_file(local_dir: str | Path) -> dict:
    """The site-local FedUQ settings ``<local_dir>/feduq_site.json`` (FLARE: the site workspace's ``local/``), or ``{}``.

    Raises:
        ValueError: the file exists but is not a JSON object (message names the file).
    """
    path = Path(local_dir) / SITE_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"site-local FedUQ config {path} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"site-local FedUQ config {path} must be a JSON object")
    return cfg




def check_common_args(*, task, image_size, batch_size, local_epochs, lr, betas, weight_decay, lr_gamma, network,
                      resize, max_items, save_maps, num_threads, device, intensity="minmax", amp="auto",
                      channels_last=False, num_workers="auto", dp=None, seed=0) -> None:
    """Range checks of :class:`feduq.site.site2d.Site2D`'s arguments (run by its constructor, so by every job check).

    Raises:
        ValueError: the first argument out of range, named with its value and the accepted range.
    """
    def need(ok: bool, name: str, value, expected: str) -> None:
        if not ok:
            raise ValueError(f"executor argument {name}={value!r} is out of range: expected {expected}")

    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def is_num(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v)

    fdata.job_task(task)  # DataError (a ValueError) naming the known tasks
    need(is_int(image_size) and image_size >= 16, "image_size", image_size, "an integer >= 16 (pixels)")
    need(is_int(batch_size) and batch_size >= 1, "batch_size", batch_size, "an integer >= 1")
    need(is_int(local_epochs) and local_epochs >= 1, "local_epochs", local_epochs, "an integer >= 1")
    need(is_int(seed) and 0 <= seed < 2**32, "seed", seed, "an integer in [0, 2**32) (numpy's and torch's seeds)")
    need(is_num(lr) and lr > 0, "lr", lr, "a finite number > 0")
    need(isinstance(betas, (list, tuple)) and len(betas) == 2 and all(is_num(b) and 0 <= b < 1 for b in betas),
         "betas", betas, "two numbers in [0, 1)")
    need(is_num(weight_decay) and weight_decay >= 0, "weight_decay", weight_decay, "a finite number >= 0")
    need(is_num(lr_gamma) and 0 < lr_gamma <= 1, "lr_gamma", lr_gamma, "a number in (0, 1]")
    need(network is None or isinstance(network, dict), "network", network, "a JSON object of network options")
    need(resize in RESIZE_MODES, "resize", resize, f"one of {RESIZE_MODES}")
    need(intensity in INTENSITY_MODES, "intensity", intensity, f"one of {INTENSITY_MODES}")
    need(amp in AMP_MODES, "amp", amp, '"auto" (float16 on CUDA, bfloat16 on a CPU with it), true, false or "bf16"')
    need(isinstance(channels_last, bool), "channels_last", channels_last, "true or false")
    need(max_items is None or (is_int(max_items) and max_items >= 1), "max_items", max_items, "null or an integer >= 1")
    need(is_int(save_maps) and save_maps >= 0, "save_maps", save_maps, "an integer >= 0")
    need((is_int(num_threads) and num_threads >= 0) or (isinstance(num_threads, dict) and num_threads and all(
        is_int(v) and v >= 0 for v in num_threads.values())), "num_threads", num_threads,
         'an integer >= 0 (0 = torch default) or {site: integer, "default": integer}')
    need(num_workers == "auto" or (is_int(num_workers) and num_workers >= 0), "num_workers", num_workers,
         '"auto" (0 on CPU, up to 4 on CUDA) or an integer >= 0')
    DPConfig.from_json(dp)  # ValueError naming dp.<key>
    need(isinstance(device, str) and (device in ("auto", "cpu") or device.startswith("cuda")), "device", device,
         '"auto", "cpu" or "cuda[:N]"')


def loader_workers(num_workers: int | str, device: torch.device) -> int:
    """Training-loader worker count: ``"auto"`` -> 0 on CPU, ``min(4, CPU count // 2)`` on CUDA; else as given."""
    if num_workers != "auto":
        return int(num_workers)
    return min(4, (os.cpu_count() or 1) // 2) if device.type == "cuda" else 0


def training_loader(dataset, batch_size: int, seed: int, device: torch.device, num_workers: int | str = "auto"):
    """A site's training loader: shuffled with a generator seeded by ``seed``; the last incomplete batch is dropped
    unless the split is smaller than one batch (then the one short batch is the epoch's step); workers as
    :func:`loader_workers`, pinned memory on CUDA."""
    from monai.data import DataLoader

    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        drop_last=len(dataset) > batch_size,
        generator=torch.Generator().manual_seed(seed),
        num_workers=loader_workers(num_workers, device),
        # not persistent: persistent workers with a pin-memory thread kept a CUDA site process
        # alive after the simulator's end (H100, nvflare 2.9); re-forking them per epoch costs
        # about the same throughput (benchmark_throughput: 194/178 vs 185/200 images/s)
        pin_memory=device.type == "cuda",
    )


def track_scalars(writer, record: dict, round_index: int) -> None:
    """Stream a round record's numbers to the server's TensorBoard through the site's TBWriter (None: no-op).

    Numbers only (bools, ``round`` and ``steps`` left out); one scalar per key at step ``round_index``.
    """
    if writer is None:
        return
    for key, value in record.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("round", "steps"):
            writer.add_scalar(key, float(value), global_step=round_index)
