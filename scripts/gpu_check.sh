#!/usr/bin/env bash
# The Triton backend on the 2-GPU machine: GPU tests first, then the benchmark.
#   scripts/gpu_check.sh            (logs and JSON under $OUT, or ./out if unset)
# Needs 2 CUDA GPUs, torch with symmetric memory, triton; no network, no vLLM.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"

{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nvidia-smi topo -m | head -4
  "$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
} 2>&1 | tee "$OUT/env.txt"

# All the GPUs there are: world size 2 on 2 x H200, 4 or 8 on the larger kinds.
WORLD=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
export FUSION_PASS_GPU_WORLD=$WORLD
FUSION_PASS_GPU_SUMMARY="$OUT/gpu_summary.json" timeout "${TEST_TIMEOUT_S:-360}" "$PY" -m pytest -p no:cacheprovider -q -rA --tb=short \
    tests/gpu 2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}

if [ "$WORLD" -ge 2 ]; then
    timeout "${BENCH_TIMEOUT_S:-300}" "$PY" -m torch.distributed.run --nproc-per-node "$WORLD" \
        benchmarks/bench_op.py --out-dir "$OUT" --name "op_h200x$WORLD.json" "$@" 2>&1 | tee "$OUT/bench.log"
    bench_rc=${PIPESTATUS[0]}
else
    echo "one GPU: benchmark skipped (it needs 2)"; bench_rc=0
fi

echo "gpu tests rc=$tests_rc bench rc=$bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
