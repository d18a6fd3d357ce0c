"""A site folder that is not one of the task's layout is named in one line saying what it lacks (``feduq evaluate
--site-dir`` on a task whose sites are nnU-Net raw datasets: was "folder .../images is missing", a layout the
consortium never used, and a FileNotFoundError traceback for a 3D job)."""

import shutil

from conftest import load_tool, small_job
from helpers import light_model


def test_evaluate_names_the_missing_dataset_json_of_an_nnunet_site(tmp_path, data_root, capsys):
    from nnunet_sites import polyp_task

    # a name of its own: a declared task's name holds one declaration per process (other tests declare 902)
    task = polyp_task(data_root, tmp_path / "sites", ["Kvasir-SEG", "CVC-ClinicDB"], max_items=2,
                      name="Dataset976_PolypNoJson")
    job = small_job("fedavg", tmp_path / "job", task=str(task), network="light", image_size=32)
    site = tmp_path / "Hospital-X"
    shutil.copytree(next((tmp_path / "sites").glob("*/Kvasir-SEG")), site)
    (site / "dataset.json").unlink()
    code = load_tool("evaluate").main(["--job", str(job), "--model", str(light_model(tmp_path / "m.pt")),
                                       "--site-dir", str(site), "--out", str(tmp_path / "eval")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"{site} has imagesTr/ but no dataset.json" in err[0] and "images is missing" not in err[0]
    assert not (tmp_path / "eval" / "per_image.csv").exists()
