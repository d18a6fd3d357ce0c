#!/usr/bin/env bash
# Create (or reuse) the virtual environment and install FedUQ exactly as the README says.
#   FEDUQ_VENV   where the environment lives (default: .venv in the repository)
# torch is installed first and on its own, so nothing later can swap it for another build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${FEDUQ_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --disable-pip-version-check torch==2.13.0
python -m pip install -q --disable-pip-version-check -c tools/constraints.txt -r requirements.txt
python - <<'PY'
import torch, nvflare, monai, nnunetv2, feduq
assert torch.__version__.startswith("2.13.0"), f"torch was replaced: {torch.__version__}"
print(f"FedUQ {feduq.__version__}: torch {torch.__version__} (CUDA: {torch.cuda.is_available()}), "
      f"nvflare {nvflare.__version__}, monai {monai.__version__}, nnunetv2 2.8.1")
PY
