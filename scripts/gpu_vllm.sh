#!/usr/bin/env bash
# vLLM as users run it, on NVIDIA GPUs: (a) the demo's models through vLLM with the fusion off and
# on, checking the plugin's records (every site fused, per rank and compiled range) and the greedy
# tokens, and `fusion-pass inspect` on vLLM's debug_dump_path; (b) benchmarks/bench_vllm.py.
#   scripts/gpu_vllm.sh OUTDIR [TP]
# Needs: one or two NVIDIA GPUs (the fusion applies at TP=2; at TP=1 both parts run and show it
# inactive), a Python (PYTHON, default python3) where vLLM 0.26 or later imports, and, for the
# bench's in-tree variant at TP=2, the FlashInfer that vLLM's in-tree pass calls (vLLM 0.26 pins
# flashinfer-python 0.6.14; `scripts/flashinfer_bundle.sh 0.6.14` bundles it with its all-reduce
# module prebuilt, to unpack onto PYTHONPATH); without it that variant is recorded as not run.
# Installs nothing.
# TP: the second argument, else $TP, else the number of GPUs, at most 2.
# STEPS picks the parts (default "e2e bench"). Each part has a time limit, E2E_TIMEOUT_S (default
# 200) and BENCH_TIMEOUT_S (330): under 9 minutes in all. The bench writes its file after each
# model, so a model that ran out of time leaves the ones before it ("complete": false). Each
# engine compiles and captures CUDA graphs first (a minute or two for the 8B-like model).
# Shrinking the bench: MODELS (default "llama3-8b-like dense-h2880"), BATCHES ("1 8 32 64"),
# REPEATS (3), DECODE_STEPS (32), PREFILL_LEN (2048); BENCH_ARGS are added to its command line.
# OUTDIR gets: gpu_vllm.log (all output), e2e.json and inspect_<model>.txt, vllm_gpu_tp<N>.json,
# and work/ (the plugin's records and vLLM's graph dumps).
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: $0 OUTDIR [TP]" >&2; exit 2; }
OUTDIR="$(realpath -m "$1")"
# The repository root, NVLink multicast off, PYTHONPATH, PY (gpu_env.sh creates the folder).
mkdir -p "$OUTDIR"
source "$(dirname "$0")/gpu_env.sh"
export VLLM_USE_FLASHINFER_SAMPLER=0
STEPS="${STEPS-e2e bench}"
exec > >(tee -a "$OUTDIR/gpu_vllm.log") 2>&1
T0=$SECONDS
stamp() { echo "=== [$((SECONDS - T0)) s] $*"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
TP="${2:-${TP:-$((GPUS < 2 ? GPUS : 2))}}"
"$PY" - <<'EOF' || { echo "vLLM does not import: nothing to run"; exit 2; }
import importlib.metadata as md
import sys

import torch
import vllm

sys.path.insert(0, "benchmarks")
import bench_vllm


def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "not installed"


print("torch", torch.__version__, "| vllm", vllm.__version__, "| flashinfer-python",
      version("flashinfer-python"), "| triton", version("triton"))
print("attention backend: %s (%s)" % bench_vllm.attention_backend("auto"))
EOF
stamp "TP=$TP on $GPUS GPU(s)"

rc=0
if [[ " $STEPS " == *" e2e "* ]]; then
    stamp "end-to-end check: the demo's models, fusion off and on, bf16"
    rm -rf "$OUTDIR/work/e2e"
    mark=$(wc -l < "$OUTDIR/gpu_vllm.log")
    timeout "${E2E_TIMEOUT_S:-200}" "$PY" benchmarks/bench_vllm.py --tp "$TP" \
        --models llama-h256 llama-h2880 --weights random --variants off plugin --batches 2 \
        --decode-steps 8 --input-len 8 --prefill-len 0 --repeats 1 --warmup 0 --dtype bfloat16 \
        --max-num-seqs 8 \
        --alternate sequential --dump --check records --work-dir "$OUTDIR/work/e2e" \
        --out-dir "$OUTDIR" --name e2e.json
    r=$?; stamp "end-to-end check rc=$r"; [ $r -eq 0 ] || rc=1
    # The op says so in the worker's log when a fused site falls back at run time.
    n=$(tail -n +"$mark" "$OUTDIR/gpu_vllm.log" | grep -c "falls back to the reference")
    stamp "run-time fallbacks logged: $n"; [ "$n" -eq 0 ] || rc=1
    rm -rf "$OUTDIR"/work/e2e/*/model   # the random-weight checkpoints
    # The plugin engine's folder: vLLM's dumps and the pass's records, read together.
    for d in "$OUTDIR"/work/e2e/*/plugin; do
        [ -d "$d/dumps" ] || continue
        m=$(basename "$(dirname "$d")")
        "$PY" -m fusion_pass.tools.cli inspect "$d" > "$OUTDIR/inspect_$m.txt" 2>&1
        r=$?; stamp "fusion-pass inspect $m rc=$r"; head -20 "$OUTDIR/inspect_$m.txt"
        [ $r -eq 0 ] || rc=1
    done
fi
if [[ " $STEPS " == *" bench "* ]]; then
    stamp "bench_vllm"
    # shellcheck disable=SC2086
    timeout "${BENCH_TIMEOUT_S:-330}" "$PY" benchmarks/bench_vllm.py --tp "$TP" \
        --models ${MODELS:-llama3-8b-like dense-h2880} --batches ${BATCHES:-1 8 32 64} \
        --repeats "${REPEATS:-3}" --decode-steps "${DECODE_STEPS:-32}" \
        --prefill-len "${PREFILL_LEN:-2048}" --work-dir "$OUTDIR/work/bench" --out-dir "$OUTDIR" \
        ${BENCH_ARGS:-}
    r=$?; stamp "bench_vllm rc=$r"; [ $r -eq 0 ] || rc=1
fi
stamp "done rc=$rc"
exit $rc
