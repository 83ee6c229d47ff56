#!/usr/bin/env bash
# Issue 5 on the 2-GPU machine: the TP decoder with and without the pass, one model
# per process so that each model's JSON survives a later model running out of time.
#   scripts/gpu_model.sh [extra bench_model.py args]     (results under $OUT or ./out)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
rc=0
for model in ${MODELS:-gpt-oss-like llama3-70b-like llama3-8b-like}; do
    timeout "${MODEL_TIMEOUT_S:-190}" "$PY" -m torch.distributed.run --nproc-per-node 2 \
        benchmarks/bench_model.py --models "$model" --name "model_$model" --out "$OUT" "$@" \
        2>&1 | tee "$OUT/model_$model.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
done
exit $rc
