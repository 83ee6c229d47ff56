#!/usr/bin/env bash
# Development run of the Triton backend on the 2-GPU machine: its timings (row
# splits, eager host cost), then the GPU suite.  Logs and JSON under $OUT (./out).
#   scripts/gpu_dev.sh                       everything
#   FUSION_PASS_GPU_QUICK=1 scripts/gpu_dev.sh -k "not compiled"   fewer sweep shapes
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"

{ nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
  "$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
} 2>&1 | tee "$OUT/env.txt"

timeout "${TIMING_TIMEOUT_S:-150}" "$PY" -m torch.distributed.run --nproc-per-node 2 \
    tests/gpu/dev_timing.py --out "$OUT" ${TIMING_ARGS:-} 2>&1 | tee "$OUT/timing.log"
timing_rc=${PIPESTATUS[0]}

FUSION_PASS_GPU_SUMMARY="$OUT/gpu_summary.json" timeout "${TEST_TIMEOUT_S:-300}" \
    "$PY" -m pytest -p no:cacheprovider -q -rA --tb=short tests/gpu "$@" 2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
echo "timing rc=$timing_rc gpu tests rc=$tests_rc"
[ "$timing_rc" -eq 0 ] && [ "$tests_rc" -eq 0 ]
