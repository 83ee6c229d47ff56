#!/usr/bin/env bash
# Development timings of the Triton backend (tests/gpu/dev_timing.py): kernel variants (programmatic
# dependent launch on/off, warps), inputs above one launch, the eager host path, broken down.
#   bash scripts/gpu_dev.sh [OUTDIR [dev_timing.py args]]        (OUTDIR defaults to ./out/gpu_dev)
# Needs: 2 or more NVIDIA GPUs (Hopper measured), torch with symmetric memory (2.11 tested), triton.
# OUTDIR gets gpu_dev.log and dev_timing.py's JSON.
set -uo pipefail
DIR=./out/gpu_dev
if [ $# -gt 0 ] && [[ $1 != -* ]]; then DIR=$1; shift; fi
mkdir -p "$DIR" && DIR=$(cd "$DIR" && pwd)
source "$(dirname "$0")/gpu_env.sh"
exec > >(tee -a "$DIR/gpu_dev.log") 2>&1
WORLD=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
timeout "${DEV_TIMEOUT_S:-400}" "$PY" -m torch.distributed.run --nproc-per-node "$WORLD" \
    tests/gpu/dev_timing.py --out "$DIR" "$@"
