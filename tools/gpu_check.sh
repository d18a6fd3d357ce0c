#!/usr/bin/env bash
# FedUQ's prepared GPU check (issue 51): on a bare GPU machine (PyTorch with CUDA, no network, this repository copied
# without its data) it installs the wheels it is given of what the machine lacks, makes synthetic polyp data of the
# real centers' counts at 384 px, and runs in one go, each step's figures as one JSON line (a "check" field names the
# step; everything else goes to $OUT/gpu_check.log):
#   gpu_test     tests/integration/test_gpu.py (float16 training, validation and predict on the device against the CPU)
#   training     tools/benchmark_throughput.py: the site's local training and validation with the executor's defaults
#                against the plain AMP loop and a plain no-grad forward loop (FedEvi and FedAvg, fedevi_unet, 384 px)
#   predict      tools/benchmark_predict.py: the FedEvi job's predict end to end (default outputs; label maps only)
#   round        tools/benchmark_rounds.py: the committed FedEvi job in FLARE's simulator, 4 sites, against the plain
#                loop's time of each round's steps on the same device; first round's start; 200 rounds projected
#   startup      tools/benchmark_startup.py: predict --help, a site's imports, a one-site run's first log lines
#   volumes_3d   tools/benchmark_3d.py: a 3D site's iteration and sliding-window predict against nnU-Net's own on the
#                federated plan of synthetic volumes (nnU-Net's network; --small: the slim plan, 2 cases)
#
#   bash tools/gpu_check.sh                          # on the GPU machine (wheels in .whl/ when that folder exists)
#   bash tools/gpu_check.sh --device cpu --small     # here: the whole script end to end, small and on the CPU
#
# Options: --device cuda|cpu (default cuda), --small (64 px, a tenth of the images, 2 rounds: a CPU's check of the
# script itself, no figure to report), --wheels DIR (default .whl), --rounds N (default 4), --skip STEP[,STEP].
# The wheels the machine lacks are listed, with the pip command that downloads them, in tools/gpu_wheels.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
DEVICE=cuda SMALL=0 WHEELS=.whl ROUNDS=4 SKIP=""
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    --small) SMALL=1; shift ;;
    --wheels) WHEELS=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --skip) SKIP=$2; shift 2 ;;
    *) echo "gpu_check.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-$(mktemp -d /tmp/feduq_gpu_check.XXXX)}
WORK=$(mktemp -d /tmp/feduq_gpu_work.XXXX)
LOG=$OUT/gpu_check.log
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
: >"$LOG"
started=$(date +%s)

emit() {  # emit STEP: the JSON lines of stdin, each with "check": STEP, to stdout; everything to the log
  "$PY" -c '
import json, sys
step = sys.argv[1]
for line in sys.stdin:
    sys.stderr.write(line)
    line = line.strip()
    if line.startswith("{") and line.endswith("}"):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        print(json.dumps({"check": step, **record}), flush=True)
' "$1" 2>>"$LOG"
}

step() {  # step NAME COMMAND...: run it unless skipped; a failure is a JSON line too, and the script goes on
  local name=$1; shift
  case ",$SKIP," in *",$name,"*) return 0 ;; esac
  local t0; t0=$(date +%s)
  echo "=== $name: $*" >>"$LOG"
  "$@" 2>>"$LOG" | emit "$name"
  local rc=${PIPESTATUS[0]}
  echo "{\"check\": \"$name\", \"rc\": $rc, \"seconds\": $(( $(date +%s) - t0 ))}"
  [ "$rc" -eq 0 ] || FAILED="$FAILED $name"
}
FAILED=""

# the packages the machine lacks, and FedUQ itself (the package is the folder custom/, imported as feduq)
if ! "$PY" -c "import feduq, nvflare, monai" 2>/dev/null; then
  if [ -d "$WHEELS" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
      "$WHEELS"/*.whl >>"$LOG" 2>&1 || { echo '{"check": "setup", "error": "installing the wheels failed"}'; exit 1; }
    export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  mkdir -p "$WORK/pkg" && ln -sfn "$REPO/custom" "$WORK/pkg/feduq"
  export PYTHONPATH="$WORK/pkg${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" - <<'PY' | emit setup || { echo '{"check": "setup", "error": "FedUQ does not import"}'; exit 1; }
import json, platform, torch, nvflare, monai, feduq
print(json.dumps({"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.cuda.is_available(),
                  "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                  "nvflare": nvflare.__version__, "monai": monai.__version__}))
PY

# synthetic data: the real polyp counts (train/val/test 70/10/20 %), 384 px; --small: a tenth, 64 px
if [ "$SMALL" = 1 ]; then SIZE=64 COUNTS=Kvasir-SEG=100,CVC-ClinicDB=61,CVC-ColonDB=38,ETIS-LaribPolypDB=10 ROUNDS=2
else SIZE=384 COUNTS=Kvasir-SEG=1000,CVC-ClinicDB=612,CVC-ColonDB=380,ETIS-LaribPolypDB=30; fi
DATA=$WORK/data
step data "$PY" -m feduq synthetic --out "$DATA" --size "$SIZE" --counts "$COUNTS"
export FEDUQ_DATA_ROOT=$DATA

step gpu_test "$PY" -m pytest -q -p no:cacheprovider tests/integration/test_gpu.py
step training "$PY" tools/benchmark_throughput.py --data-root "$DATA" --center Kvasir-SEG --networks fedevi_unet \
  --image-sizes "$SIZE" --methods fedevi fedavg --device "$DEVICE"
IMAGES=$([ "$SMALL" = 1 ] && echo 16 || echo 160)
THREADS=$("$PY" -c "import os; print(len(os.sched_getaffinity(0)))")
step predict "$PY" tools/benchmark_predict.py --data-root "$DATA" --center Kvasir-SEG --images "$IMAGES" \
  --device "$DEVICE" --threads "$THREADS"
step predict_labels "$PY" tools/benchmark_predict.py --data-root "$DATA" --center Kvasir-SEG --images "$IMAGES" \
  --device "$DEVICE" --threads "$THREADS" --outputs label
step round "$PY" tools/benchmark_rounds.py --data-root "$DATA" --image-size "$SIZE" --rounds "$ROUNDS" \
  --methods fedevi --device "$DEVICE" --out "$WORK/rounds"
step startup "$PY" tools/benchmark_startup.py --data-root "$DATA" --repeats 1
if [ "$SMALL" = 1 ]; then V3D="--cases 2 --iterations 2 --warmup 1 --predict-repeats 1"
else V3D="--cases 6 --iterations 20 --warmup 3 --predict-repeats 5 --full-plan"; fi
# shellcheck disable=SC2086
step volumes_3d "$PY" tools/benchmark_3d.py --synthetic --device "$DEVICE" $V3D

echo "{\"check\": \"done\", \"seconds\": $(( $(date +%s) - started )), \"failed\": \"${FAILED# }\", \"log\": \"$LOG\"}"
rm -rf "$WORK"
[ -z "$FAILED" ]
