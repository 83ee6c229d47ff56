#!/usr/bin/env bash
# The regression run for the buffer defect of docs/triton_backend.md (v8 session): dev_timing.py's
# shapes in sequence (each new size grows the symmetric buffer), with its protocol checks, RUNS
# times under each condition (lazy CUDA module loading, the default; eager loading; no
# programmatic dependent launch), with the watchdog so that both ranks report where a hang waits.
#   scripts/gpu_hang.sh [dev_timing.py args]       (results under $OUT, or ./out if unset)
# RUNS (default 3) rounds of the conditions CONDS (default "lazy eager nopdl") while BUDGET_S
# (default 500) seconds last.
# $OUT gets gpu_hang.log: every run's rows, growths, failed checks ("CHECK FAILED"), and the
# watchdog's dumps where a run stopped.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
exec > >(tee -a "$OUT/gpu_hang.log") 2>&1
WORLD=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
T0=$SECONDS
for i in $(seq "${RUNS:-3}"); do
    for cond in ${CONDS:-lazy eager nopdl}; do
        [ $((SECONDS - T0)) -lt "${BUDGET_S:-500}" ] || break 2
        case $cond in
            lazy) env=(CUDA_MODULE_LOADING=LAZY) ;;
            eager) env=(CUDA_MODULE_LOADING=EAGER) ;;
            nopdl) env=(CUDA_MODULE_LOADING=LAZY FUSION_PASS_PDL=0) ;;
        esac
        echo "=== [$((SECONDS - T0)) s] run $i, $cond"
        env "${env[@]}" timeout "${DEV_TIMEOUT_S:-120}" "$PY" -m torch.distributed.run \
            --nproc-per-node "$WORLD" tests/gpu/dev_timing.py --out "$(mktemp -d)" --skip-eager \
            --watchdog 30 "$@"
        echo "=== [$((SECONDS - T0)) s] run $i, $cond: rc=$?"
    done
done
