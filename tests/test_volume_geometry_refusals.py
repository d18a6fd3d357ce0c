"""A volume FedUQ cannot read exactly is refused on the 3D / nnU-Net raw path as the slice-wise path refuses it
(feduq.data.volume_checks): a NIfTI header whose voxel size is 0, NaN or negative with no qform/sform, which
SimpleITK (nnU-Net's reader) reads as 1 mm or as its absolute value, and a case with NaN voxels, which it reads as 0.
Each refusal is one line naming the file, raised where the case is first read: the site's case list, the federated
fingerprint behind ``feduq plan``, the evaluation/calibration cases, and ``feduq predict``'s inputs."""

from __future__ import annotations

import json
import struct

import nibabel as nib
import numpy as np
import pytest

from nnunet_sites import task_declaration, write_site_json

NAME = "Dataset974_Geometry"
LABELS = {"background": 0, "gland": 1}


def _write(path, data, spacing=(0.5, 0.5, 3.0)):
    img = nib.Nifti1Image(data, np.diag([*spacing, 1.0]))
    img.to_filename(str(path))
    return path


def _strip_spacing(path, z):
    """Write voxel size ``z`` into the header's pixdim[3] and zero both qform and sform codes, byte by byte (nibabel
    would mend the header on save)."""
    raw = bytearray(path.read_bytes())
    raw[76 + 3 * 4:76 + 4 * 4] = struct.pack("<f", z)   # pixdim[3]
    raw[252:256] = struct.pack("<hh", 0, 0)               # qform_code, sform_code
    path.write_bytes(bytes(raw))
    return path


def _site(tmp_path, site="A", cases=2):
    folder = tmp_path / NAME / site
    (folder / "imagesTr").mkdir(parents=True)
    (folder / "labelsTr").mkdir()
    write_site_json(folder, ["T2"], LABELS, ".nii", cases)
    rng = np.random.default_rng(0)
    for i in range(cases):
        image = rng.normal(100, 20, (16, 16, 6)).astype(np.float32)
        label = np.zeros((16, 16, 6), np.uint8)
        label[4:12, 4:12, 1:5] = 1
        _write(folder / "imagesTr" / f"c{i}_0000.nii", image)
        _write(folder / "labelsTr" / f"c{i}.nii", label)
    (tmp_path / "task.json").write_text(json.dumps(task_declaration(NAME, [site], labels=LABELS, file_ending=".nii")))
    return folder


@pytest.mark.parametrize("z", [0.0, float("nan"), -3.0])
def test_a_header_without_a_spacing_is_refused_where_simpleitk_would_read_1_mm(z, tmp_path):
    import SimpleITK as sitk

    from feduq.data.volume_checks import check_volume_file, nifti_spacing_problem
    from feduq.data.volumes import VolumeError

    path = _strip_spacing(_write(tmp_path / "v.nii", np.ones((4, 4, 3), np.float32)), z)
    assert sitk.ReadImage(str(path)).GetSpacing()[2] == pytest.approx(abs(z) if z == z and z else 1.0)  # the premise
    problem = nifti_spacing_problem(path)
    assert problem.startswith(f"{path}: the volume has no spacing") and "sform/qform codes (0, 0)" in problem
    with pytest.raises(VolumeError, match="no spacing"):
        check_volume_file(path)
    assert nifti_spacing_problem(_write(tmp_path / "ok.nii", np.ones((4, 4, 3), np.float32))) is None


def test_the_sites_case_list_refuses_a_case_without_a_spacing_naming_site_and_file(tmp_path):
    from feduq.data import DataError, get_task
    from feduq.data import nnunet_raw as nr

    folder = _site(tmp_path)
    bad = _strip_spacing(folder / "imagesTr" / "c1_0000.nii", 0.0)
    spec = get_task(str(tmp_path / "task.json"))
    labels = nr.read_site_labels(folder, spec, "A")
    with pytest.raises(DataError) as e:
        nr.list_cases(folder, spec, "A", labels)
    assert str(e.value).startswith("site 'A': ") and str(bad) in str(e.value) and "no spacing" in str(e.value)


def _nan_case(folder):
    path = folder / "imagesTr" / "c1_0000.nii"
    data = np.asarray(nib.load(str(path)).dataobj).copy()
    data[4:12, 4:12, 2] = np.nan  # the foreground of one slice
    _write(path, data)
    return path


def test_the_federated_fingerprint_refuses_nan_voxels_before_the_plan_moves(tmp_path):
    from nnunetv2.imageio.simpleitk_reader_writer import SimpleITKIO

    from feduq.nnunet import federated_plans as fpl

    folder = _site(tmp_path)
    files = [([p], folder / "labelsTr" / p.name.replace("_0000", "")) for p in sorted((folder / "imagesTr").iterdir())]
    clean = fpl.site_fingerprint(files, SimpleITKIO, 200, "A")
    assert clean["n_cases"] == 2 and clean["spacings"] == [[3.0, 0.5, 0.5]] * 2  # the header's, z first
    bad = _nan_case(folder)
    with pytest.raises(fpl.FingerprintError) as e:
        fpl.site_fingerprint(files, SimpleITKIO, 200, "A")
    assert str(e.value).startswith("site 'A': ") and str(bad) in str(e.value) and "NaN or infinite" in str(e.value)
    assert "64 of its 1,536 voxels" in str(e.value)  # 8 x 8 voxels of one slice of 16 x 16 x 6


def test_evaluation_cases_and_predict_inputs_refuse_nan_voxels_naming_the_file(tmp_path):
    from feduq.data import DataError
    from feduq.inference.declared_cases import find_declared_cases
    from feduq.site.evaluation_3d import volume_cases

    folder = _site(tmp_path)
    task = str(tmp_path / "task.json")
    assert len(volume_cases(task, folder, "A", "all")) == 2
    bad = _nan_case(folder)
    with pytest.raises(DataError) as e:
        volume_cases(task, folder, "A", "all")
    assert str(bad) in str(e.value) and "NaN or infinite" in str(e.value)
    with pytest.raises(DataError) as e:  # predict's inputs: before the model runs, nothing written
        find_declared_cases(folder / "imagesTr", task)
    assert str(bad) in str(e.value) and "NaN or infinite" in str(e.value)


def test_a_3d_site_folder_without_its_dataset_json_is_named_not_a_traceback(tmp_path):
    from feduq.data import DataError
    from feduq.site.evaluation_3d import volume_cases

    folder = _site(tmp_path)
    (folder / "dataset.json").unlink()
    with pytest.raises(DataError) as e:  # was FileNotFoundError from deep inside the site's label reading
        volume_cases(str(tmp_path / "task.json"), folder, "A", "all")
    assert str(e.value) == (f"site 'A': {folder} has imagesTr/ but no dataset.json: an nnU-Net raw dataset needs the "
                            "site's own dataset.json (channel_names, labels, file_ending)")
