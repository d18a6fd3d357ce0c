#!/usr/bin/env bash
# FedA3I (Table 2, SKIN) against FedAvg-CE on ISIC-2017 as the paper's 50 IID virtual sites with the paper's CEM
# noise N_S and N_E, at a 2-core CPU budget, two training seeds each. Resumable: a run whose archive folder holds its
# evaluation is skipped, and a run cut off mid-way continues after its last finished round (feduq virtual
# --resume from the run's checkpoint), so the same command continues an interrupted sweep.
#
#   bash benchmarks/feda3i-isic50/run.sh ../shared/data workspaces/feda3i-isic50
#
# Per run: feduq configure (jobs/feda3i or jobs/fedavg_ce, 50 sites, the budget below), the one-process
# runner feduq virtual (the job's own site and server code), then feduq evaluate of the last-round
# model on ISIC-2017's clean test masks (per-image Dice for the paired test). The archive keeps the small files.
set -euo pipefail
ME=benchmarks/feda3i-isic50/run.sh
usage() { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; }
for arg in "$@"; do
  case "$arg" in
    -h|--help) usage; exit 0 ;;
    -*) echo "$ME: error: unknown option '$arg'; usage: bash $ME DATA_ROOT WORK_FOLDER (--help)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/../.."
# the arguments are checked before anything is made (relative paths are taken from the repository root, $PWD now)
if [ $# -lt 2 ] || [ -z "$1" ] || [ -z "$2" ]; then
  echo "$ME: error: expected 2 arguments, the clean data root and a work folder outside the repository (got $#);" \
       "usage: bash $ME ../shared/data workspaces/feda3i-isic50" >&2
  exit 2
fi
DATA=$1
WORK=$2
from=""
case "$DATA" in /*) ;; *) from=" (relative to the repository root $PWD)" ;; esac
if [ ! -d "$DATA" ]; then
  echo "$ME: error: data root '$DATA' is not a folder$from: expected the clean data root holding" \
       "skin_lesion/ISIC-2017/, e.g. ../shared/data; nothing was made" >&2
  exit 2
fi
if [ ! -d "$DATA/skin_lesion/ISIC-2017" ]; then
  echo "$ME: error: data root '$DATA' has no skin_lesion/ISIC-2017/$from: expected the clean data root" \
       "holding skin_lesion/ISIC-2017/, e.g. ../shared/data; nothing was made" >&2
  exit 2
fi
if [ -e "$WORK" ] && [ ! -d "$WORK" ]; then
  echo "$ME: error: work folder '$WORK' is a file, expected a folder; nothing was made" >&2
  exit 2
fi
SIZE=${FEDA3I_SIZE:-64}
ROUNDS=${FEDA3I_ROUNDS:-30}
WARMUP=${FEDA3I_WARMUP:-3}     # the paper's T1 = 10 of 100 rounds, kept at the same share
NOISES=${FEDA3I_NOISES:-"ns ne"}
SEEDS=${FEDA3I_SEEDS:-"0 1"}
METHODS=${FEDA3I_METHODS:-"fedavg_ce feda3i"}
ARCHIVE=${FEDA3I_ARCHIVE:-benchmarks/feda3i-isic50/runs}
SITES=$(python -c "print(','.join(f'ISIC-2017-p{k:02d}of50' for k in range(50)))")
mkdir -p "$WORK" "$ARCHIVE"
for noise in $NOISES; do
  noisy="$WORK/data_$noise"
  if [ ! -f "$noisy/.done" ]; then
    feduq noisy-labels --data-root "$DATA" --task skin --preset "skin_$noise" --mode paper --seed 0 \
        --sites "$SITES" --out "$noisy" --force
    touch "$noisy/.done"
  fi
  for seed in $SEEDS; do
    for method in $METHODS; do
      name="${method}_${noise}_s${seed}"
      if [ -f "$ARCHIVE/$name/eval/per_image.csv" ]; then echo "$name: archived, skipped"; continue; fi
      # an interrupted run's folders are FedUQ's (their markers): each tool's output guard clears what it wrote there
      job="$WORK/jobs/$name"; run="$WORK/runs/$name"; eval_out="$WORK/evals/$name"
      resume=()
      # FedA3I's warm-up T1 only: FedAvg-CE is FedA3I's job with a warm-up longer than any run (it never estimates
      # the noise), so giving it T1 made it FedA3I (the first archived run, see README)
      warmup=()
      if [ "$method" = feda3i ]; then warmup=(--set-workflow "warmup_rounds=$WARMUP"); fi
      if [ -f "$run/checkpoint.pt" ] && [ -f "$job/meta.json" ]; then
        resume=(--resume)  # a run cut off mid-way continues after its last finished round
      else
        feduq configure "jobs/$method" -o "$job" --image-size "$SIZE" --num-rounds "$ROUNDS" \
            --seed "$seed" --sites "$SITES" --test-sites per-center "${warmup[@]}" > /dev/null
      fi
      python -c "import json, sys; a = json.load(open(sys.argv[1]))['workflows'][0]['args']; t1 = a.get('warmup_rounds', 0)
sys.exit(f'{sys.argv[2]}: warmup_rounds {t1} in {sys.argv[1]}' if (t1 > int(sys.argv[3])) != (sys.argv[2] == 'fedavg_ce') else 0)" \
          "$job/app/config/config_fed_server.json" "$method" "$ROUNDS"  # FedAvg-CE never leaves its warm-up
      start=$(date +%s)
      feduq virtual "$job" --data-root "$noisy" --out "$run" "${resume[@]}"
      seconds=$(( $(date +%s) - start ))  # this call's; a resumed run's rounds are timed in its log.txt
      feduq evaluate --job "$job" --model "$run/FL_global_model.pt" --site ISIC-2017 --split test \
          --data-root "$DATA" --maps 0 --out "$eval_out"
      mkdir -p "$ARCHIVE/$name"
      cp "$run/log.txt" "$run/per_client_table.csv" "$run/per_client_table.md" "$run/state.json" "$ARCHIVE/$name/"
      cp -r "$eval_out" "$ARCHIVE/$name/eval"
      echo "{\"run\": \"$name\", \"seconds\": $seconds, \"image_size\": $SIZE, \"rounds\": $ROUNDS, \"warmup_rounds\": $([ "$method" = feda3i ] && echo "$WARMUP" || echo null), \"seed\": $seed, \"noise\": \"skin_$noise\", \"resumed\": $([ ${#resume[@]} -gt 0 ] && echo true || echo false), \"commit\": \"$(git rev-parse --short HEAD)\"}" > "$ARCHIVE/$name/run.json"
      echo "$name: done in $seconds s"
    done
  done
done
