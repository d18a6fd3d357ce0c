"""A volume FedUQ cannot read exactly is refused on the 3D / nnU-Net raw path as the slice-wise path refuses it
(feduq.io.volume_checks): a NIfTI header whose voxel size is 0, NaN or negative with no qform/sform, which
SimpleITK (nnU-Net's reader) reads as 1 mm or as its absolute value, and a case with NaN voxels, which it reads as 0.
Each refusal is one line naming the file, raised where the case is first read: the site's case list, the federated
fingerprint behind ``feduq plan``, the evaluation/calibration cases, and ``feduq predict``'s inputs; end to end
(below), each command and the 3D site in-process: exit 2, the one line, nothing written."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

import nnunet_sites
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

    from feduq.io.volume_checks import check_volume_file, nifti_spacing_problem
    from feduq.io.volumes import VolumeError

    path = _strip_spacing(_write(tmp_path / "v.nii", np.ones((4, 4, 3), np.float32)), z)
    assert sitk.ReadImage(str(path)).GetSpacing()[2] == pytest.approx(abs(z) if z == z and z else 1.0)  # the premise
    problem = nifti_spacing_problem(path)
    assert problem.startswith(f"{path}: the volume has no spacing") and "sform/qform codes (0, 0)" in problem
    with pytest.raises(VolumeError, match="no spacing"):
        check_volume_file(path)
    assert nifti_spacing_problem(_write(tmp_path / "ok.nii", np.ones((4, 4, 3), np.float32))) is None


def test_the_sites_case_list_refuses_a_case_without_a_spacing_naming_site_and_file(tmp_path):
    from feduq.data import DataError, get_task
    from feduq.sites import nnunet_raw as nr

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
    from feduq.predict.declared_cases import find_declared_cases
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


# ==================================================================================================================
# End to end: each command and the 3D site, in-process, on a two-site federation of synthetic volumes with its slim
# federated plan, a fedavg 3D job of it and an untrained model: exit 2, one line naming the file, nothing written.
# ==================================================================================================================

NAME_3D = "Dataset996_GeometryRefusals"
SITES = ("A", "B")
CASES = 4  # per site: 2 training, 1 validation, 1 test
SHAPE, SPACING = (40, 40, 12), (0.8, 0.8, 3.0)
BAD_SPACINGS = {"zero": 0.0, "nan": float("nan"), "negative": -3.0}


def _case(rng, shift: float) -> tuple[np.ndarray, np.ndarray]:
    """A volume of noise with a brighter ellipsoid (TZ core, PZ rim) and its label map."""
    x, y, z = np.meshgrid(*(np.arange(n) for n in SHAPE), indexing="ij")
    r = ((x - 20 - shift) / 11) ** 2 + ((y - 19) / 9) ** 2 + ((z - 6) / 4) ** 2
    label = np.where(r < 0.35, 2, np.where(r < 1.0, 1, 0)).astype(np.uint8)
    image = rng.normal(60, 8, SHAPE) + 50 * (label > 0) + 20 * (label == 2)
    return np.clip(image, 0, None).astype(np.int16), label


def _write_site(site_dir: Path, seed: int) -> list[str]:
    import nibabel as nib

    rng = np.random.default_rng(seed)
    affine = np.diag([-SPACING[0], -SPACING[1], SPACING[2], 1.0])
    (site_dir / "imagesTr").mkdir(parents=True)
    (site_dir / "labelsTr").mkdir()
    names = [f"case{seed}{i}" for i in range(CASES)]
    for i, name in enumerate(names):
        image, label = _case(rng, shift=i - 1.5)
        nib.save(nib.Nifti1Image(image, affine), site_dir / "imagesTr" / f"{name}_0000.nii.gz")
        nib.save(nib.Nifti1Image(label, affine), site_dir / "labelsTr" / f"{name}.nii.gz")
    nnunet_sites.write_site_json(site_dir, ("T2",), nnunet_sites.PROSTATE_LABELS, ".nii.gz", CASES)
    (site_dir / "split.json").write_text(json.dumps({"training": names[:2], "validation": names[2:3],
                                                     "testing": names[3:]}))
    return names


def _files(site_dir: Path) -> list:
    return [([p], site_dir / "labelsTr" / p.name.replace("_0000", "")) for p in sorted((site_dir / "imagesTr").iterdir())]


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    """``{"root", "task", "slim", "job", "model"}``: the good sites, their slim federated plan, a fedavg 3D job of it
    and an untrained model file of the plan's network."""
    import torch
    from nnunetv2.imageio.simpleitk_reader_writer import SimpleITKIO

    from conftest import small_job
    from feduq.nnunet import federated_plans as fpl
    from feduq.nnunet.planned import PlannedNetwork

    tmp = tmp_path_factory.mktemp("geometry")
    root = tmp / "data"
    for seed, site in enumerate(SITES):
        _write_site(root / NAME_3D / site, seed)
    samples = fpl.samples_per_case(len(SITES) * CASES, 2e4)
    fps = {s: fpl.site_fingerprint(_files(root / NAME_3D / s), SimpleITKIO, samples, s) for s in SITES}
    task = nnunet_sites.task_declaration(NAME_3D, list(SITES))
    slim = fpl.slim_plan_3d(fpl.plan_from_fingerprint(task, fpl.merge_fingerprints(fps), "SimpleITKIO"))
    job = small_job("fedavg", tmp / "job", task=task, sites=list(SITES), configuration="3d_fullres", plans=slim)
    net = PlannedNetwork(slim, "3d_fullres", 1, 3)
    torch.save({"model": net.state_dict()}, tmp / "model.pt")
    task_file = tmp / "task.json"
    task_file.write_text(json.dumps(task))
    return {"root": root, "task": task, "task_file": task_file, "slim": slim, "job": job, "model": tmp / "model.pt",
            "fps": fps, "samples": samples}


def _copy_root(federation, tmp_path: Path) -> Path:
    root = tmp_path / "data"
    shutil.copytree(federation["root"], root)
    return root


def _first_image(root: Path, site: str = "B", split: str = "training") -> Path:
    case = json.loads((root / NAME_3D / site / "split.json").read_text())[split][0]
    return root / NAME_3D / site / "imagesTr" / f"{case}_0000.nii.gz"


def _unset_spacing(path: Path, z: float) -> None:
    """Rewrite ``path`` with voxel size ``z`` along its third axis in the header and no qform or sform (as a
    converter that lost the geometry writes it), the voxels unchanged."""
    import nibabel as nib

    data = np.asarray(nib.load(str(path)).dataobj)
    img = nib.Nifti1Image(data, None)
    img.header["pixdim"][1:4] = [SPACING[0], SPACING[1], z]
    img.to_filename(str(path))


def _put_nan(path: Path) -> None:
    """Rewrite ``path`` as float32 with its foreground centre NaN (geometry unchanged)."""
    import nibabel as nib

    img = nib.load(str(path))
    data = np.asarray(img.dataobj).astype(np.float32)
    data[17:23, 16:22, 5:7] = np.nan
    header = img.header.copy()
    header.set_data_dtype(np.float32)
    nib.save(nib.Nifti1Image(data, img.affine, header), str(path))


def _one_line(err: str, path: Path) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert str(path) in lines[0], lines[0]
    return lines[0]


# -- item 3 end to end: a volume without a spacing --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(BAD_SPACINGS))
def test_feduq_plan_refuses_a_volume_without_a_spacing_before_flare_starts(federation, tmp_path, capsys, kind):
    from feduq.commands.consortium.plan import main as plan

    root = _copy_root(federation, tmp_path)
    bad = _first_image(root)
    _unset_spacing(bad, BAD_SPACINGS[kind])
    out = tmp_path / "out" / "plans.json"
    assert plan(["--task", str(federation["task_file"]), "--data-root", str(root), "--out", str(out), "-w",
                 str(tmp_path / "ws")]) == 2
    line = _one_line(capsys.readouterr().err, bad)
    assert line.startswith("feduq plan: error: site 'B': ") and "the volume has no spacing" in line
    assert "sform/qform codes (0, 0)" in line and "1 mm" in line
    assert not (tmp_path / "out").exists() and not (tmp_path / "ws").exists()  # nothing written


@pytest.mark.parametrize("kind", list(BAD_SPACINGS))
def test_a_sites_fingerprint_refuses_a_volume_without_a_spacing(federation, tmp_path, kind):
    """The site's side of the plan job (and its FLARE executor's list of training cases)."""
    from nnunetv2.imageio.simpleitk_reader_writer import SimpleITKIO

    from feduq.data import DataError
    from feduq.sites.nnunet_raw import training_case_files
    from feduq.nnunet import federated_plans as fpl

    root = _copy_root(federation, tmp_path)
    bad = _first_image(root)
    _unset_spacing(bad, BAD_SPACINGS[kind])
    with pytest.raises(fpl.FingerprintError) as e:
        fpl.site_fingerprint(_files(root / NAME_3D / "B"), SimpleITKIO, federation["samples"], "B")
    assert str(e.value).startswith(f"site 'B': {bad}: the volume has no spacing") and "\n" not in str(e.value)
    with pytest.raises(DataError, match=f"site 'B': {bad}: the volume has no spacing"):
        training_case_files(NAME_3D, root, "B")


def test_a_label_without_a_spacing_is_refused_too(federation, tmp_path):
    from nnunetv2.imageio.simpleitk_reader_writer import SimpleITKIO

    from feduq.nnunet import federated_plans as fpl

    root = _copy_root(federation, tmp_path)
    label = root / NAME_3D / "A" / "labelsTr" / _first_image(root, "A").name.replace("_0000", "")
    _unset_spacing(label, float("nan"))
    with pytest.raises(fpl.FingerprintError, match=f"site 'A': {label}: the volume has no spacing"):
        fpl.site_fingerprint(_files(root / NAME_3D / "A"), SimpleITKIO, federation["samples"], "A")


def test_the_3d_site_refuses_a_volume_without_a_spacing_before_preprocessing(federation, tmp_path):
    from feduq.data import DataError
    from feduq.site.site3d import PREPROCESSED, Site3D

    root = _copy_root(federation, tmp_path)
    bad = _first_image(root, split="testing")  # the last case it would preprocess
    _unset_spacing(bad, 0.0)
    site = Site3D(federation["slim"], iterations=1, task=federation["task"], num_threads=1, device="cpu", amp=False)
    with pytest.raises(DataError) as e:
        site.start("B", {"data_root": str(root)}, tmp_path / "run")
    assert str(e.value).startswith(f"site 'B': {bad}: the volume has no spacing") and "\n" not in str(e.value)
    assert not site.ready() and not (tmp_path / "run" / PREPROCESSED).exists()  # before any case was preprocessed


def test_feduq_evaluate_refuses_a_volume_without_a_spacing(federation, tmp_path, capsys):
    from feduq.commands.site.evaluate import main as evaluate

    root = _copy_root(federation, tmp_path)
    bad = _first_image(root, split="testing")
    _unset_spacing(bad, -3.0)
    assert evaluate(["--job", str(federation["job"]), "--model", str(federation["model"]), "--site", "B",
                     "--data-root", str(root), "--split", "test", "--out", str(tmp_path / "ev")]) == 2
    line = _one_line(capsys.readouterr().err, bad)
    assert "feduq evaluate" in line and "the volume has no spacing (voxel sizes [0.8" in line and "-3.0]" in line
    assert not (tmp_path / "ev").exists()


def test_3d_predict_refuses_a_volume_without_a_spacing(federation, tmp_path, capsys):
    from feduq.commands.site.predict import main as predict

    (tmp_path / "in").mkdir()
    good, bad = (tmp_path / "in" / f"c{i}_0000.nii.gz" for i in (1, 2))
    shutil.copy(_first_image(federation["root"], "A"), good)
    shutil.copy(_first_image(federation["root"], "B"), bad)
    _unset_spacing(bad, float("nan"))
    assert predict(["--job", str(federation["job"]), "--model", str(federation["model"]), "--input",
                    str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    line = _one_line(capsys.readouterr().err, bad)
    assert line.startswith("feduq predict: error: ") and "the volume has no spacing" in line
    assert not (tmp_path / "out").exists()


def test_the_slice_wise_path_gives_the_same_refusal(federation, tmp_path):
    """One rule for both paths: :func:`feduq.io.volumes.read_volume` reads the header as written too (nibabel's
    loader mends pixdim 0 to 1, which a valid sform would then have let pass)."""
    import nibabel as nib

    from feduq.io.volumes import VolumeError, read_volume

    path = tmp_path / "x.nii.gz"
    img = nib.load(str(_first_image(federation["root"])))
    img.header["pixdim"][3] = 0.0  # the sform still says 3 mm: the file contradicts itself
    img.to_filename(str(path))
    with pytest.raises(VolumeError, match=r"the volume has no spacing \(voxel sizes \[0.8"):
        read_volume(path)


@pytest.mark.parametrize("ending", [".mha", ".nrrd"])
def test_a_simpleitk_volume_with_a_negative_or_nan_spacing_is_refused(tmp_path, ending):
    import SimpleITK as sitk

    from feduq.io.volume_checks import check_volume_file
    from feduq.io.volumes import VolumeError

    image = sitk.GetImageFromArray(np.ones((4, 5, 6), np.float32))
    image.SetSpacing((0.5, 0.5, 3.0))
    path = tmp_path / f"x{ending}"
    sitk.WriteImage(image, str(path))
    check_volume_file(path)  # a good one passes
    if ending == ".mha":  # MetaImage writes the spacing as given: SimpleITK's abs() would hide the sign
        path.write_bytes(path.read_bytes().replace(b"ElementSpacing = 0.5 0.5 3", b"ElementSpacing = 0.5 0.5 -3"))
        with pytest.raises(VolumeError, match=r"the volume has no spacing \(voxel sizes \[0.5, 0.5, -3.0\]"):
            check_volume_file(path)
    array = np.ones((4, 5, 6), np.float32)
    array[1, 2, 3] = np.nan
    nan = sitk.GetImageFromArray(array)
    nan.SetSpacing((0.5, 0.5, 3.0))
    sitk.WriteImage(nan, str(path))
    with pytest.raises(VolumeError, match=f"{path}: 1 of its 120 voxels are NaN or infinite"):
        check_volume_file(path)


# -- item 4 end to end: NaN voxels ------------------------------------------------------------------------------------------

def test_simpleitk_reads_nan_voxels_as_zero(federation, tmp_path):
    """Why the voxels are read with nibabel: nnU-Net's reader gives 0 where the file holds NaN."""
    from nnunetv2.imageio.simpleitk_reader_writer import SimpleITKIO

    path = tmp_path / "x.nii.gz"
    shutil.copy(_first_image(federation["root"]), path)
    _put_nan(path)
    data, _ = SimpleITKIO().read_images([str(path)])
    assert np.isfinite(data).all() and (data == 0).sum() >= 72


def test_a_sites_fingerprint_refuses_nan_voxels_and_its_plan_job_reply_names_the_file(federation, tmp_path):
    """The plan's intensity properties moved (NaN read as 0: the foreground minimum 0); now the site's fingerprint
    is refused, and its FLARE executor answers the job with that one line (the server's FEDUQ_JOB_FAILED reason,
    which ``feduq plan`` prints as the site's error)."""
    from nnunetv2.imageio.simpleitk_reader_writer import SimpleITKIO
    from nvflare.apis.dxo import DXO, DataKind
    from nvflare.apis.fl_constant import ReservedKey, ReturnCode
    from nvflare.apis.fl_context import FLContext
    from nvflare.apis.signal import Signal

    from conftest import FakeEngine
    from feduq.flare.planning import FINGERPRINT_TASK, PlanFingerprintExecutor
    from feduq.flare.quorum import site_error
    from feduq.nnunet import federated_plans as fpl

    assert federation["fps"]["B"]["channels"]["0"]["min"] > 0  # the good site's foreground
    root = _copy_root(federation, tmp_path)
    bad = _first_image(root)
    _put_nan(bad)
    with pytest.raises(fpl.FingerprintError) as e:
        fpl.site_fingerprint(_files(root / NAME_3D / "B"), SimpleITKIO, federation["samples"], "B")
    assert str(e.value) == (f"site 'B': {bad}: 72 of its 19,200 voxels are NaN or infinite; FedUQ reads no volume "
                            "with undefined intensities (nnU-Net's reader would take them as 0): fill them or leave "
                            "the case out")

    engine = FakeEngine(tmp_path / "site")
    (tmp_path / "site" / "local").mkdir(parents=True)
    (tmp_path / "site" / "local" / "feduq_site.json").write_text(json.dumps({"data_root": str(root)}))
    ctx = FLContext()
    ctx.set_prop(ReservedKey.ENGINE, engine, private=True, sticky=False)
    ctx.set_prop(ReservedKey.IDENTITY_NAME, "B", private=True, sticky=False)
    ex = PlanFingerprintExecutor(federation["task"])
    task = DXO(data_kind=DataKind.METRICS, data={"num_samples": federation["samples"]}).to_shareable()
    reply = ex.execute(FINGERPRINT_TASK, task, ctx, Signal())
    assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION
    assert site_error(reply) == str(e.value)


def test_the_3d_site_refuses_a_case_with_nan_voxels(federation, tmp_path):
    from feduq.data import DataError
    from feduq.site.site3d import Site3D

    root = _copy_root(federation, tmp_path)
    bad = _first_image(root)
    _put_nan(bad)
    site = Site3D(federation["slim"], iterations=1, task=federation["task"], num_threads=1, device="cpu", amp=False)
    with pytest.raises(DataError) as e:
        site.start("B", {"data_root": str(root)}, tmp_path / "run")
    assert str(e.value).startswith(f"{bad}: 72 of its 19,200 voxels are NaN or infinite") and "\n" not in str(e.value)
    assert not site.ready()


def test_feduq_evaluate_refuses_a_case_with_nan_voxels_before_scoring(federation, tmp_path, capsys):
    from feduq.commands.site.evaluate import main as evaluate

    root = _copy_root(federation, tmp_path)
    bad = _first_image(root, split="validation")
    _put_nan(bad)
    assert evaluate(["--job", str(federation["job"]), "--model", str(federation["model"]), "--site", "B",
                     "--data-root", str(root), "--split", "all", "--out", str(tmp_path / "ev")]) == 2
    line = _one_line(capsys.readouterr().err, bad)
    assert f"site 'B': {bad}: 72 of its 19,200 voxels are NaN or infinite" in line
    assert "scored" not in capsys.readouterr().out and not (tmp_path / "ev").exists()


def test_3d_predict_refuses_a_case_with_nan_voxels_with_nothing_written(federation, tmp_path, capsys):
    from feduq.commands.site.predict import main as predict

    (tmp_path / "in").mkdir()
    good, bad = (tmp_path / "in" / f"c{i}_0000.nii.gz" for i in (1, 2))
    shutil.copy(_first_image(federation["root"], "A"), good)  # predicted first, were the NaN case not refused
    shutil.copy(_first_image(federation["root"], "B"), bad)
    _put_nan(bad)
    assert predict(["--job", str(federation["job"]), "--model", str(federation["model"]), "--input",
                    str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    line = _one_line(capsys.readouterr().err, bad)
    assert line == (f"feduq predict: error: {bad}: 72 of its 19,200 voxels are NaN or infinite; FedUQ reads no volume "
                    "with undefined intensities (nnU-Net's reader would take them as 0): fill them or leave the case "
                    "out")
    assert not (tmp_path / "out").exists()

def test_a_3d_site_folder_without_its_dataset_json_is_named_not_a_traceback(tmp_path):
    from feduq.data import DataError
    from feduq.site.evaluation_3d import volume_cases

    folder = _site(tmp_path)
    (folder / "dataset.json").unlink()
    with pytest.raises(DataError) as e:  # was FileNotFoundError from deep inside the site's label reading
        volume_cases(str(tmp_path / "task.json"), folder, "A", "all")
    assert str(e.value) == (f"site 'A': {folder} has imagesTr/ but no dataset.json: an nnU-Net raw dataset needs the "
                            "site's own dataset.json (channel_names, labels, file_ending)")
