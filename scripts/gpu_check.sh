#!/usr/bin/env bash
# The Triton backend on CUDA: the GPU tests, the op benchmark (crossover table, FlashInfer column)
# and the FP8 op benchmark, on every GPU of the host.
#   bash scripts/gpu_check.sh [OUTDIR [bench_op.py args]]        (OUTDIR defaults to ./out/gpu_check)
# Needs: 2 or more NVIDIA GPUs (Hopper measured; on one GPU only the tests marked one_gpu run),
# torch with symmetric memory (2.11 tested), triton, pytest and hypothesis; no vLLM, no network.
# FlashInfer, for its column, comes from a .flashinfer bundle (scripts/flashinfer_bundle.sh): its
# prebuilt trtllm_comm is loaded, or, where that fails, JIT-built in the background while the tests run.
# STEPS picks the parts (default "tests op fp8"); FP8_ARGS is passed to bench_op_fp8.py.
# OUTDIR gets: gpu_check.log (all output), gpu_summary.json, op_h200x<N>.json, triton_schedule.json
# (copy it to fusion_pass/data/ with the op results), op_fp8_h200x<N>.json.
set -uo pipefail
DIR=./out/gpu_check
if [ $# -gt 0 ] && [[ $1 != -* ]]; then DIR=$1; shift; fi
mkdir -p "$DIR" && DIR=$(cd "$DIR" && pwd)
source "$(dirname "$0")/gpu_env.sh"
STEPS="${STEPS:-tests op fp8}"
exec > >(tee -a "$DIR/gpu_check.log") 2>&1
T0=$SECONDS
stamp() { echo "=== [$((SECONDS - T0)) s] $*"; }

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nvidia-smi topo -m | head -4
"$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
WORLD=$("$PY" -c 'import torch; print(torch.cuda.device_count())')

fi_build=
if [[ " $STEPS " == *" op "* ]] && compgen -G ".flashinfer/flashinfer-*.txz" >/dev/null; then
    FI=/tmp/flashinfer
    rm -rf "$FI" && mkdir -p "$FI/site"
    "$PY" -m tarfile -e .flashinfer/flashinfer-*.txz "$FI"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$FI/site" .flashinfer/apache_tvm_ffi-*.whl
    export PYTHONPATH="$PYTHONPATH:$FI:$FI/site" FLASHINFER_WORKSPACE_BASE="$FI/ws" FLASHINFER_CUDA_ARCH_LIST=9.0a
    LOAD='from flashinfer.comm.trtllm_ar import get_trtllm_comm_module as m; m()'
    if FLASHINFER_DISABLE_JIT=1 "$PY" -c "$LOAD" >"$FI/load.log" 2>&1; then
        stamp "flashinfer: the prebuilt trtllm_comm loads"
    else
        stamp "flashinfer: the prebuilt trtllm_comm does not load ($(tail -1 "$FI/load.log")): JIT build in the background"
        "$PY" -c "$LOAD" >"$FI/jit.log" 2>&1 &
        fi_build=$!
    fi
elif [[ " $STEPS " == *" op "* ]]; then
    stamp "flashinfer: no .flashinfer bundle (scripts/flashinfer_bundle.sh): bench_op runs without its column"
fi

rc=0
if [[ " $STEPS " == *" tests "* ]]; then
    stamp "GPU tests"
    # One GPU: the suite's world stays 2, so that only its one_gpu tests run.
    FUSION_PASS_GPU_WORLD=$((WORLD < 2 ? 2 : WORLD)) FUSION_PASS_GPU_SUMMARY="$DIR/gpu_summary.json" \
        timeout "${TEST_TIMEOUT_S:-170}" "$PY" -m pytest -p no:cacheprovider -q -rA --tb=short tests/gpu
    r=$?; stamp "GPU tests rc=$r"; [ $r -eq 0 ] || rc=1
fi
if [ "$WORLD" -lt 2 ]; then
    stamp "one GPU: only the one_gpu tests ran; benchmarks skipped (they need 2)"
    exit $rc
fi
if [[ " $STEPS " == *" op "* ]]; then
    if [ -n "$fi_build" ]; then
        wait "$fi_build"; stamp "flashinfer JIT build rc=$? ($(tail -1 "$FI/jit.log"))"
    fi
    stamp "bench_op"
    timeout "${OP_TIMEOUT_S:-200}" "$PY" -m torch.distributed.run --nproc-per-node "$WORLD" \
        benchmarks/op/bench_op.py --out-dir "$DIR" --name "op_h200x$WORLD.json" "$@"
    r=$?; stamp "bench_op rc=$r"; [ $r -eq 0 ] || rc=1
fi
if [[ " $STEPS " == *" fp8 "* ]]; then
    stamp "bench_op_fp8"
    # shellcheck disable=SC2086
    timeout "${FP8_TIMEOUT_S:-180}" "$PY" -m torch.distributed.run --nproc-per-node "$WORLD" \
        benchmarks/op/bench_op_fp8.py --out-dir "$DIR" --name "op_fp8_h200x$WORLD.json" ${FP8_ARGS:-}
    r=$?; stamp "bench_op_fp8 rc=$r"; [ $r -eq 0 ] || rc=1
fi
stamp "done rc=$rc"
exit $rc
