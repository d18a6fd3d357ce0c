"""The exported MONAI Bundle's volume inference for a declared task of 3D volumes, with NumPy, nibabel, PyTorch and
MONAI only (no FedUQ import): the bundle carries this very file as ``scripts/bundle_volumes.py`` and
``scripts/channel_io.py`` beside it (:mod:`feduq.bundle.export`).

A case's channel files (NIfTI) are stacked, reoriented to LPS and normalised as the sites read them
(:func:`read_case`); :class:`PlaneInferer` runs the 2D network slice by slice with the bundle's own per-plane
preprocessing (the 2D export's, so a slice is seen as ``feduq.predict`` sees it), maps the logits back onto the slice
with MONAI's ``Invertd``, takes the method's probabilities and uncertainty (``head.ts``), the argmax and the largest
connected component per slice (per class, or per nested region painted back by ``scripts/bundle_regions.py``: as
``predict``); :func:`save_case` writes ``<case>.nii.gz`` of the task's label values
and ``<case>_uncertainty_<map>.nii.gz`` in the input's shape and affine.
"""

from __future__ import annotations

import os

import numpy as np
import torch

LPS = ("L", "P", "S")


def read_case(files, normalization, file_ending: str = ".nii.gz"):
    """A case's channel files -> ``MetaTensor [C, X, Y, Z]`` on the LPS grid, each channel normalised (the sites'
    ``channel_io.normalise_channel``), with ``filename_or_obj`` the case's name and the first file as the geometry."""
    import importlib

    import nibabel as nib
    from monai.data import MetaTensor

    channel_io = importlib.import_module(f"{__package__}.channel_io" if __package__ else "channel_io")
    chans = []
    for f in files:
        img = nib.load(str(f))
        ornt = nib.orientations.ornt_transform(nib.orientations.io_orientation(img.affine),
                                               nib.orientations.axcodes2ornt(LPS))
        chans.append(np.asanyarray(img.as_reoriented(ornt).dataobj).astype(np.float32))
    image = np.stack([channel_io.normalise_channel(c, n) for c, n in zip(chans, normalization)])
    case = channel_io.case_of(files[0], file_ending)
    return MetaTensor(torch.as_tensor(image), meta={
        "filename_or_obj": os.path.join(os.path.dirname(str(files[0])), case + file_ending),
        "geometry_file": str(files[0])})


class PlaneInferer:
    """``(inputs [1, C, X, Y, Z], network) -> [1, 2, X, Y, Z]``: per slice the class map (argmax of the method's
    probabilities, largest connected component per foreground class, or per nested region painted back widest first)
    and the method's own uncertainty map.

    Args:
        plane_transform: the 2D export's preprocessing of an ``{"image": MetaTensor [C, X, Y]}`` (without loading).
        head: ``logits -> [probabilities (C), uncertainty maps (K)]`` (``head.ts``).
        num_classes: C.
        keep_largest_component / connectivity: as the job's test (8 full, 4).
        regions: each nested region's class indices (``[[1, 2], [2]]``), or None: the slice's class map is then
            :func:`bundle_regions.paint_regions`'s (``feduq.scores.metrics.region_label_map``, as ``predict``).
    """

    def __init__(self, plane_transform, head, num_classes: int, keep_largest_component: bool, connectivity: int,
                 regions=None):
        self.pre, self.head, self.C = plane_transform, head, int(num_classes)
        self.lcc = keep_largest_component
        self.connectivity = 1 if int(connectivity) == 4 else 2
        self.regions, self.neighbours = (regions or None) if keep_largest_component else None, int(connectivity)

    @torch.no_grad()
    def __call__(self, inputs, network):
        from monai.data import MetaTensor
        from monai.transforms import Invertd, KeepLargestConnectedComponent

        volume = inputs[0]
        try:
            device = next(network.parameters()).device
        except (StopIteration, AttributeError):
            device = torch.device("cpu")
        invert = Invertd(keys="pred", transform=self.pre, orig_keys="image", nearest_interp=False)
        post = KeepLargestConnectedComponent(applied_labels=list(range(1, self.C)), is_onehot=False,
                                             connectivity=self.connectivity) if self.lcc and self.C > 1 else None
        if self.regions:  # each region's largest component, painted back (the bundle's copy beside this file)
            import importlib

            paint = importlib.import_module(f"{__package__}.bundle_regions" if __package__ else "bundle_regions")
            post = lambda x: paint.paint_regions(x, self.regions, self.neighbours)  # noqa: E731
        out = []
        for z in range(volume.shape[-1]):
            plane = {"image": MetaTensor(volume[..., z].as_tensor().cpu().clone())}
            x = self.pre(plane)["image"]
            logits = network(x.as_tensor()[None].float().to(device))[0].float().cpu()
            grid = invert({"image": x, "pred": MetaTensor(logits, meta=x.meta,
                                                          applied_operations=x.applied_operations)})["pred"]
            both = self.head(grid.as_tensor()[None].float())[0]
            label = both[: self.C].argmax(0, keepdim=True)
            if post is not None:
                label = torch.as_tensor(post(label)).as_subclass(torch.Tensor)
            out.append(torch.cat([label.float(), both[self.C:self.C + 1]], 0))  # the method's own map
        return torch.stack(out, -1)[None]


def save_case(pred, meta, output_dir: str, label_values, map_name: str) -> None:
    """Write a case's class map (``pred[0]``, as the task's label values) and uncertainty map (``pred[1]``) in its
    input's geometry: ``<case>.nii.gz`` (uint8, or uint16 above 255) and ``<case>_uncertainty_<map>.nii.gz``
    (float32, the map's own unit)."""
    import nibabel as nib

    geometry = nib.load(str(meta["geometry_file"]))
    back = nib.orientations.ornt_transform(nib.orientations.axcodes2ornt(LPS),
                                           nib.orientations.io_orientation(geometry.affine))
    base = os.path.basename(str(meta["filename_or_obj"]))
    case = base[:-7] if base.endswith(".nii.gz") else os.path.splitext(base)[0]
    pred = np.asarray(pred.cpu() if hasattr(pred, "cpu") else pred)
    values = np.asarray(label_values)[pred[0].astype(np.int64)]
    dtype = np.uint8 if values.max(initial=0) < 256 else np.uint16

    def write(array, name, kind):
        data = np.ascontiguousarray(nib.orientations.apply_orientation(array, back)).astype(kind)
        img = nib.Nifti1Image(data, geometry.affine, header=geometry.header.copy())
        img.set_data_dtype(kind)
        img.header["scl_slope"], img.header["scl_inter"] = 1.0, 0.0
        nib.save(img, os.path.join(output_dir, name))

    os.makedirs(output_dir, exist_ok=True)
    write(values, case + ".nii.gz", dtype)
    write(pred[1], f"{case}_uncertainty_{map_name}.nii.gz", np.float32)
