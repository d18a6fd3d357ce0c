"""The 3D review rule's familiarity part judged where it is used (a measurement, not a test; CPU, slim plan).

Trains a slim 3D nnU-Net on 16 RUNMC volumes (3T), fits the familiarity part on 10 other RUNMC volumes (the rule's
calibration: probabilistic PCA, threshold = the largest cross-fitted distance) and prints the flag rate on RUNMC's
own last 3 volumes against BMC's 9 volumes (1.5T, a scanner no model trained on) and PROMISE12's Case00::

    python tools/measure_familiarity_3d.py ROUNDS ITERATIONS OUT   # e.g. 4 25 /tmp/meas; reads ../shared/data
"""
import sys, time, json, shutil
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import numpy as np, torch
torch.set_num_threads(2)
import nnunet_sites
from feduq.nnunet import federated_plans as fpl
from nnunetv2.imageio.simpleitk_reader_writer import SimpleITKIO
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from feduq.outputs import check_output_folder, write_marker
DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
root = check_output_folder(sys.argv[3], {"data root": DATA}, "measure_familiarity_3d.py"); NAME = "Dataset993_Prostate3D"
SITES = {"RUNMC": 30, "BMC": 9}
ROUNDS, ITERS = int(sys.argv[1]), int(sys.argv[2])
t0 = time.time()
names = {}
for c, n in SITES.items():
    d = root / NAME / c
    if not d.exists():
        nnunet_sites.prostate_site(DATA, c, d, max_cases=n)
    names[c] = sorted(p.name[:-len("_0000.nii.gz")] for p in (d / "imagesTr").iterdir())
r = names["RUNMC"]
(root / NAME / "RUNMC" / "split.json").write_text(json.dumps({"training": r[:16], "validation": r[16:17], "testing": r[17:]}))
b = names["BMC"]
(root / NAME / "BMC" / "split.json").write_text(json.dumps({"training": b[:1], "validation": b[1:2], "testing": b[2:]}))
fps = {}
for c in SITES:
    d = root / NAME / c
    files = [([p], d / "labelsTr" / p.name.replace("_0000", "")) for p in sorted((d / "imagesTr").iterdir())]
    fps[c] = fpl.site_fingerprint(files, SimpleITKIO, fpl.samples_per_case(39, 5e4), c)
task = nnunet_sites.task_declaration(NAME, list(SITES))
slim = fpl.slim_plan_3d(fpl.plan_from_fingerprint(task, fpl.merge_fingerprints(fps), "SimpleITKIO"))
print("sites ready", round(time.time() - t0), flush=True)
from feduq.site.site3d import Site3D
from feduq.data import get_task
site = Site3D(slim, iterations=ITERS, task=task, num_threads=2, device="cpu", amp=False)
site.start("RUNMC", {"data_root": str(root)}, root / "run")
params = site.trainer.get_params()
for k in range(ROUNDS):
    out = site.train(FLModel(params=params, params_type=ParamsType.FULL, current_round=k, total_rounds=ROUNDS))
    params = out.params
    print("round", k, round(time.time() - t0), flush=True)
tested = site.test(FLModel(params=params, params_type=ParamsType.FULL))
print("RUNMC test dice", tested.metrics["dice"], flush=True)
net = site.build_network(get_task(site.task_name))
net.load_state_dict({k: torch.as_tensor(v) for k, v in params.items()})
net.eval()
torch.save({"model": net.state_dict()}, root / "model.pt")
from feduq.nnunet.volume_inference import volume_features
from feduq.review.rule import Familiarity
pipe = site.make_pipeline(get_task(site.task_name))
def feats(path):
    data, _, _ = pipe.preprocess_files([str(path)], None)
    return volume_features(net.bottleneck, data, pipe.patch_size, torch.device("cpu"))
img = lambda c, n: root / NAME / c / "imagesTr" / f"{n}_0000.nii.gz"
calib = np.stack([feats(img("RUNMC", n)) for n in r[17:27]])
fam = Familiarity.fit(calib)
own = fam.distance(np.stack([feats(img("RUNMC", n)) for n in r[27:]]))
bmc = fam.distance(np.stack([feats(img("BMC", n)) for n in b]))
p12 = root / "Case00_0000.nii.gz"
shutil.copy(DATA / "prostate" / "PROMISE12-Case00_volume" / "Case00.nii.gz", p12)
pro = fam.distance(feats(p12)[None])
res = {"threshold": fam.threshold, "calibration": fam.distance(calib).tolist(), "runmc_held_out": own.tolist(),
       "bmc": bmc.tolist(), "promise12": pro.tolist(),
       "flag_rate": {"runmc_held_out": float((own > fam.threshold).mean()), "bmc": float((bmc > fam.threshold).mean()),
                     "promise12": float((pro > fam.threshold).mean())}, "seconds": round(time.time() - t0)}
print(json.dumps(res, indent=1))
(root / "result.json").write_text(json.dumps(res, indent=1))
write_marker(root, "measure_familiarity_3d.py")
