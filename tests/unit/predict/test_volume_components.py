"""A 3D job's class maps reduced to their largest components, as its 2D sites reduce theirs
(feduq.nnunet.volume_inference.keep_largest_components; the job's keep_largest_component and connectivity)."""

import numpy as np
import pytest
from scipy import ndimage

from feduq.nnunet.volume_inference import keep_largest_components


def test_each_class_keeps_its_largest_component():
    seg = np.zeros((10, 10, 10), np.uint8)
    seg[0:3, 0:3, 0:3] = 1      # 27 voxels
    seg[6:8, 6:8, 6:8] = 1      # 8 voxels: removed
    seg[0:2, 7:9, 0:2] = 2      # 8 voxels
    seg[5, 0, 9] = 2            # 1 voxel: removed
    out = keep_largest_components(seg, 3)
    assert out.dtype == seg.dtype and (out == 1).sum() == 27 and (out == 2).sum() == 8
    assert out[6, 6, 6] == 0 and out[5, 0, 9] == 0 and out[0, 7, 0] == 2


@pytest.mark.parametrize("full, kept", [(True, 2), (False, 1)])
def test_full_connectivity_joins_diagonal_neighbours_and_faces_do_not(full, kept):
    seg = np.zeros((4, 4, 4), np.uint8)
    seg[1, 1, 1] = seg[2, 2, 2] = 1  # corner to corner: one of 26 neighbours, not one of 6
    assert (keep_largest_components(seg, 2, full=full) == 1).sum() == kept


def test_a_nested_regions_largest_component_is_kept_whole_and_painted_widest_first():
    regions = {"gland": (1, 2), "TZ": (2,)}
    seg = np.zeros((12, 12, 12), np.uint8)
    seg[1:8, 1:8, 1:8] = 1                  # the gland, 343 voxels ...
    seg[3:6, 3:6, 3:6] = 2                  # ... with its TZ, 27 voxels, inside
    seg[10:12, 10:12, 10:12] = 1            # a stray gland piece: removed
    seg[10, 0, 0] = 2                       # a stray TZ voxel outside the gland: a gland piece too, removed
    out = keep_largest_components(seg, 3, regions)
    assert (np.isin(out, (1, 2))).sum() == 343 and (out == 2).sum() == 27
    assert out[10, 0, 0] == 0 and not out[10:, 10:, 10:].any()
    # by class instead, class 1 would lose nothing here but class 2 keeps only the larger of its two pieces
    assert ndimage.label(np.isin(out, (1, 2)), structure=np.ones((3, 3, 3)))[1] == 1


def test_the_jobs_setting_decides_the_reduction():
    from types import SimpleNamespace

    from feduq.data import get_task
    from feduq.site.site3d import largest_components

    spec = get_task("fundus")  # disc = {1, 2}, cup = {2}
    site = SimpleNamespace(keep_largest_component=True, test_protocol=SimpleNamespace(connectivity=4))
    assert largest_components(site, spec) == {"num_classes": 3, "regions": {"disc": [1, 2], "cup": [2]},
                                              "full": False}
    site.keep_largest_component = False
    assert largest_components(site, spec) is None
