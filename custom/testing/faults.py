"""Test-only executors that inject the faults a real federation has (never used by jobs/).

``faults`` is a list of ``{"site": ..., "round": r, "kind": "error" | "nan" | "shape" | "sleep" | "leak",
"seconds": s}``; the named site misbehaves in that round's ``train`` task ("leak": it also tries to send a per-image
Dice list, which the privacy ledger must block). ``{"site": ..., "kind": "setup"}``
makes the site fail at start-up (as a site whose data is missing does). ``{"site": ..., "round": r, "kind": "smuggle",
"route": name}`` tampers with the site's ``train`` result after the executor built it (before FLARE's result filters,
where the privacy ledger runs) to carry a training image by one of :data:`ROUTES`.
"""

import time

import numpy as np

from nvflare.apis.dxo import DXO, DataKind

from feduq.flare.executor import FedUQExecutor


def _image():
    """Stand-in for a training image: 64 x 64 x 3 uint8 (12,288 bytes)."""
    return np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)


def _meta(result, key, value):
    result["DXO"]["meta"][key] = value


#: route -> how the result is made to carry the image (each once passed the name-only ledger)
ROUTES = {
    "dict_as_scalar": lambda r: _meta(r, "feduq_num_val_samples", {"pixels": _image().ravel()[:3000].tolist()}),
    "set_as_scalar": lambda r: _meta(r, "feduq_num_val_samples", set(_image().ravel()[:3000].tolist())),
    "object_0d_array": lambda r: _meta(r, "feduq_num_val_samples", np.array({"image": _image()}, dtype=object)),
    "nested_dxo": lambda r: _meta(r, "feduq_num_val_samples", DXO(DataKind.WEIGHTS, {"image": _image()})),
    "initial_metrics": lambda r: r["DXO"]["meta"]["initial_metrics"].update(val_dice=_image()),
    "header": lambda r: r.set_header("current_round", _image()),
    "beside_the_dxo": lambda r: r.__setitem__("image", _image()),
    "dxo_field": lambda r: r["DXO"].__setitem__("image", _image()),
    "ok_without_dxo": lambda r: (r.pop("DXO"), r.__setitem__("image", _image())),
}


class FaultMixin:
    def __init__(self, faults=(), **kwargs):
        super().__init__(**kwargs)
        self.faults = list(faults)

    def _setup(self, fl_ctx):
        if any(f["site"] == self.site and f["kind"] == "setup" for f in self.faults):
            raise RuntimeError(f"site {self.site!r}: injected setup failure")
        super()._setup(fl_ctx)

    def execute(self, task_name, shareable, fl_ctx, abort_signal):
        result = super().execute(task_name, shareable, fl_ctx, abort_signal)
        r = shareable.get_header("current_round")
        for f in self.faults:
            if f["kind"] == "smuggle" and f["site"] == self.site and f["round"] == r and task_name == "train":
                ROUTES[f["route"]](result)
        return result

    def train(self, received):
        r = int(received.current_round or 0)
        mine = [f for f in self.faults if f["site"] == self.site and f.get("round") == r]
        for f in mine:
            if f["kind"] == "error":
                raise RuntimeError(f"injected failure at round {r}")
            if f["kind"] == "sleep":
                time.sleep(f["seconds"])
        out = super().train(received)
        for f in mine:
            name = sorted(out.params)[0]
            if f["kind"] == "nan":
                out.params[name] = np.full_like(out.params[name], np.nan)
            elif f["kind"] == "shape":
                out.params[name] = np.zeros((3, 3), dtype=np.float32)
            elif f["kind"] == "leak":
                out.meta["per_image_dice"] = [0.91, 0.42, 0.77]
        return out


class FaultyExecutor(FaultMixin, FedUQExecutor):
    """FedUQ's 2D executor with the faults of its ``faults`` argument (the job's site part and arguments kept)."""
