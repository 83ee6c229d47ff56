#!/usr/bin/env bash
# Where an offset that lasts as long as an engine comes from (docs/vllm_benchmark.md, section 8):
# the offline benchmark twice, one model, `off`, its A/A twin and the plugin, each time on a new
# set of engines, launched in the other order the second time (all are launched within a
# second and set up side by side):
#   1. --variants off plugin   (engines launched as off, off_aa, plugin)
#   2. --variants plugin off   (plugin, off, off_aa)
# An offset that stays with the variant in both (plugin/off the same) belongs to the variant;
# one that moves to another engine or goes away belongs to the engine, and only more engines
# per variant average it out.
#   scripts/gpu_vllm_offsets.sh OUTDIR [MODEL] [TP]    (MODEL default llama3-8b-like, TP 1)
# Needs: TP NVIDIA GPUs and a Python (PYTHON, default python3) where vLLM 0.26 or later
# imports. About 7 minutes at TP=1 (BUDGET_S per order, default 190 s, and the model-class
# answers), about 9 at TP>1 (default 220 s: engines of several ranks start slower). Each order
# is one wave of three engines (22.5 GiB each at TP=1: one H100 80 GB holds them). At TP=2 it is a
# second look at a plugin/off ratio of gpu_vllm.sh within the engines' own offsets
# (docs/vllm_benchmark.md, section 8).
# OUTDIR gets order_off_plugin.json, order_plugin_off.json (bench_vllm.py's results) and
# gpu_vllm_offsets.log.
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: $0 OUTDIR [MODEL] [TP]" >&2; exit 2; }
OUTDIR="$(realpath -m "$1")"
MODEL="${2:-llama3-8b-like}"
TP="${3:-1}"
mkdir -p "$OUTDIR"
source "$(dirname "$0")/gpu_env.sh"
export VLLM_USE_FLASHINFER_SAMPLER=0
exec > >(tee -a "$OUTDIR/gpu_vllm_offsets.log") 2>&1
WORK="${WORK_DIR:-/tmp/gpu_vllm_offsets}"
if [ "$TP" -gt 1 ]; then BUDGET="${BUDGET_S:-220}"; else BUDGET="${BUDGET_S:-190}"; fi
rm -rf "$WORK" && mkdir -p "$WORK"
plugin_entry_on_path || exit 2
# One model-class answer for every engine (vllm_setup.share_model_info).
timeout "${MODEL_INFO_TIMEOUT_S:-70}" "$PY" benchmarks/vllm/vllm_setup.py warm-model-info \
    "$WORK/modelinfos" || echo "model-class answers not written: each engine asks vLLM itself"
rc=0
for order in "off plugin" "plugin off"; do
    name="order_${order// /_}.json"
    echo "=== $MODEL, TP=$TP, --variants $order"
    # $order is two words, the variants in the order their engines are launched.
    # shellcheck disable=SC2086
    timeout -k 10 $((BUDGET + 10)) "$PY" benchmarks/vllm/bench_vllm.py --tp "$TP" --models "$MODEL" \
        --variants $order --aa off --launch-order given --budget-s "$BUDGET" --reserve-s 15 \
        --model-info-dir "$WORK/modelinfos" --work-dir "$WORK/bench" --out-dir "$OUTDIR" \
        --name "$name" || rc=1
done
rm -rf "$WORK"
for order in off_plugin plugin_off; do
    echo "=== order $order"
    timeout 15 "$PY" benchmarks/vllm/vllm_summary.py none "$OUTDIR/order_$order.json" none
done
exit $rc
