#!/usr/bin/env bash
# Install FedUQ into a virtual environment (tools/setup_env.sh) and run the whole test suite.
# Real-data tests read ../shared/data (beside the clone); pass pytest options through, e.g. -m "not sim".
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
. "${FEDUQ_VENV:-.venv}/bin/activate"
python -m pytest -q "$@"
