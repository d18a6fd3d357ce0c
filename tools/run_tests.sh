#!/usr/bin/env bash
# Install FedUQ into a virtual environment (tools/setup_env.sh) and run the whole test suite.
# Real-data tests read ../shared/data (beside the clone).
#
# Without arguments the suite runs in two passes: first every test but the `timed` and `poc` ones, two at a time
# (pytest-xdist; FEDUQ_TEST_WORKERS changes the count: most simulator tests wait on FLARE's start-up, polling and
# shut-down, so two of them share 2 cores well), then in a second pass two streams side by side, each one test after
# another: the `timed` tests (wall-clock bounds, task timeouts tuned for a 2-core machine; never two at once) on one
# worker, the POC and provisioned federations (fixed ports) and the wheel's install on the other (tests/conftest.py,
# FEDERATION_MODULES). The exit status is non-zero if either pass failed. With arguments, one pytest run gets them as
# they are, e.g. -m "not sim and not poc".
set -euo pipefail
cd "$(dirname "$0")/.."
workers="${FEDUQ_TEST_WORKERS:-2}"
if ! [[ "$workers" =~ ^[1-9][0-9]*$ ]]; then  # checked before anything is installed or run
    echo "run_tests.sh: error: FEDUQ_TEST_WORKERS=$workers: expected a whole number of test processes >= 1" >&2
    exit 2
fi
bash tools/setup_env.sh
. "${FEDUQ_VENV:-.venv}/bin/activate"
if [ "$#" -gt 0 ]; then
    exec python -m pytest -q "$@"
fi
rc=0
python -m pytest -q -n "$workers" -m "not timed and not poc" --durations=25 || rc=$?
streams=(-n 2 --dist loadscope)  # the second pass's two streams; one after another with FEDUQ_TEST_WORKERS=1
[ "$workers" -ge 2 ] || streams=()
python -m pytest -q "${streams[@]}" -m "timed or poc" --durations=25 || rc=$((rc ? rc : $?))
exit "$rc"
