"""``feduq export-bundle``: write a trained model as a MONAI Bundle (TorchScript network, inference config, README,
the review rule when one is stored) and print the ``monai.bundle run`` line that runs it.

    feduq export-bundle --job workspaces/fedevi --out bundles/fedevi_polyp
"""

from __future__ import annotations

from ...cli import verb_parser
from .predict import main as predict_main


def main(argv=None) -> int:
    """Parse the bundle's options and run ``feduq predict --export-bundle OUT`` with them."""
    p = verb_parser("feduq export-bundle", description=__doc__)
    p.add_argument("--job", required=True, help="workspace, server run folder, job folder or config_fed_client.json")
    p.add_argument("--model", help="model file (default: the workspace's global model)")
    p.add_argument("--which", choices=["best", "last"], default="best", help="which global model of a workspace")
    p.add_argument("--out", required=True, help="the bundle's folder (made; refused if it holds a user's files)")
    p.add_argument("--force", action="store_true", help="replace an output folder that FedUQ did not make")
    p.add_argument("--device", default="cpu", help="where the model is traced: cpu, cuda or cuda:N")
    a = p.parse_args(argv)
    args = ["--job", a.job, "--which", a.which, "--export-bundle", a.out, "--device", a.device]
    args += ["--model", a.model] if a.model else []
    args += ["--force"] if a.force else []
    return predict_main(args, prog="feduq export-bundle")
