#!/usr/bin/env bash
# The TP=2 decoder step with and without the pass (benchmarks/model/bench_model.py): the bf16 models, then
# the FP8 ones, one model per process (each model's result survives a later one running out of
# time), merged at the end.
#   bash scripts/gpu_model.sh [OUTDIR [bench_model.py args]]     (OUTDIR defaults to ./out/gpu_model)
# Needs: 2 NVIDIA GPUs (Hopper measured), torch with symmetric memory (2.11 tested), triton; no vLLM.
# MODELS / FP8_MODELS choose the models (default: the three bf16 ones / the two FP8 ones).
# OUTDIR gets: model.log (all output), model_h200x2.json + .md, model_fp8_h200x2.json + .md.
set -uo pipefail
DIR=./out/gpu_model
if [ $# -gt 0 ] && [[ $1 != -* ]]; then DIR=$1; shift; fi
mkdir -p "$DIR" && DIR=$(cd "$DIR" && pwd)
source "$(dirname "$0")/gpu_env.sh"
exec > >(tee -a "$DIR/model.log") 2>&1
PARTS=$(mktemp -d)
T0=$SECONDS
rc=0
run() {  # $1: the merged result's name, then the models
    local name=$1 model parts=()
    shift
    for model in "$@"; do
        echo "=== [$((SECONDS - T0)) s] $model"
        timeout "${MODEL_TIMEOUT_S:-100}" "$PY" -m torch.distributed.run --nproc-per-node 2 \
            benchmarks/model/bench_model.py --models "$model" --name "$model" --out "$PARTS" "${ARGS[@]}"
        [ $? -eq 0 ] || rc=1
        [ -f "$PARTS/$model.json" ] && parts+=("$PARTS/$model.json")
    done
    [ ${#parts[@]} -gt 0 ] && "$PY" benchmarks/model/bench_model.py --merge "${parts[@]}" --out "$DIR" --name "$name"
}
ARGS=("$@")
# shellcheck disable=SC2086
run model_h200x2 ${MODELS:-gpt-oss-like llama3-70b-like llama3-8b-like}
# shellcheck disable=SC2086
run model_fp8_h200x2 ${FP8_MODELS:-llama3-70b-fp8 deepseek-like-fp8}
echo "=== [$((SECONDS - T0)) s] done rc=$rc"
exit $rc
