#!/usr/bin/env bash
# Development timings on the GPU machine (tests/gpu/dev_timing.py): kernel variants (programmatic
# dependent launch on/off, warps), inputs above one launch, the eager host path, broken down.
#   scripts/gpu_dev.sh [dev_timing.py args]        (results under $OUT, or ./out if unset)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
exec > >(tee -a "$OUT/gpu_dev.log") 2>&1
WORLD=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
timeout "${DEV_TIMEOUT_S:-400}" "$PY" -m torch.distributed.run --nproc-per-node "$WORLD" \
    tests/gpu/dev_timing.py --out "$OUT" "$@"
