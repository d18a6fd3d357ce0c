#!/usr/bin/env bash
# One command from a fresh clone: install FedUQ, then train a method across the four polyp sites
# in the NVFlare simulator and print the per-client test table.
#
#   bash tools/quickstart.sh [METHOD]          METHOD: fedevi (default) or fedavg
#
#   FEDUQ_DATA_ROOT  folder holding polyp/<center>/{images,masks} (absolute or relative to the current folder);
#                    unset -> a small SYNTHETIC sample
#   IMAGE_SIZE, ROUNDS, LOCAL_EPOCHS, NETWORK  override the run. Defaults: the paper's job
#                    (jobs/METHOD: 384 px, 200 rounds, fedevi_unet) on a GPU; 128 px, 20 rounds and the
#                    light network on a CPU.
set -euo pipefail
if [ -n "${FEDUQ_DATA_ROOT:-}" ]; then  # relative to where the user is, not to the sites' workspaces: make it absolute
  if [ ! -d "$FEDUQ_DATA_ROOT" ]; then
    echo "quickstart: FEDUQ_DATA_ROOT=$FEDUQ_DATA_ROOT is not a folder (seen from $PWD)" >&2
    exit 1
  fi
  FEDUQ_DATA_ROOT="$(cd "$FEDUQ_DATA_ROOT" && pwd)"
  export FEDUQ_DATA_ROOT
fi
cd "$(dirname "$0")/.."
METHOD="${1:-fedevi}"
bash tools/setup_env.sh
. "${FEDUQ_VENV:-.venv}/bin/activate"

if [ -z "${FEDUQ_DATA_ROOT:-}" ]; then
  export FEDUQ_DATA_ROOT="$PWD/workspaces/synthetic_data"
  feduq synthetic --out "$FEDUQ_DATA_ROOT" --task polyp
  echo "*** FEDUQ_DATA_ROOT is not set: using a SYNTHETIC sample in $FEDUQ_DATA_ROOT (not real images) ***"
fi

NAME="$METHOD"
ARGS=()
GPU=$(python -c "import torch; print(int(torch.cuda.is_available()))")
# NETWORK overrides the network: on a GPU the job's own (fedevi_unet, the paper's); on a CPU the light one
NET="${NETWORK:-$([ "$GPU" = 1 ] && echo fedevi_unet || echo light)}"
if [ "$GPU" = 0 ] || [ -n "${IMAGE_SIZE:-}${ROUNDS:-}${LOCAL_EPOCHS:-}${NETWORK:-}" ]; then
  SIZE="${IMAGE_SIZE:-$([ "$GPU" = 1 ] && echo 384 || echo 128)}"
  R="${ROUNDS:-$([ "$GPU" = 1 ] && echo 200 || echo 20)}"
  NAME="$METHOD-${SIZE}px-${R}r-$NET"
  ARGS=(--name "$NAME" --image-size "$SIZE" --num-rounds "$R" --network "$NET" ${LOCAL_EPOCHS:+--local-epochs "$LOCAL_EPOCHS"})
  echo "Running $NAME (jobs/$METHOD at ${SIZE} px, $R rounds, network $NET)"
  if [ "$NET" = light ]; then
    echo "*** network 'light' (660,570 parameters) is FedUQ's CPU demo network, not the paper's U-Net (fedevi_unet, 3,179,890):"
    echo "*** its numbers are not comparable with the paper's tables. NETWORK=fedevi_unet trains the paper's (slow on a CPU). ***"
  fi
fi
# the method's FLARE Recipe in SimEnv (feduq.run): checks the job and that FEDUQ_DATA_ROOT holds its centers, makes
# workspaces/$NAME afresh, prints one line per round and the per-client table, or (exit code 1) why the job failed
feduq run "$METHOD" "${ARGS[@]}" -w workspaces
echo "Run folder: workspaces/$NAME (models: server/simulate_job/app_server/, logs: server/log.txt, <site>/log.txt)"
