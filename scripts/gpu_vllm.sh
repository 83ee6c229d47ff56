#!/usr/bin/env bash
# vLLM as users run it, on NVIDIA GPUs, in one run of 9 minutes at most:
#   1. setup: the FlashInfer bundle (.flashinfer/, scripts/flashinfer_bundle.sh) unpacked beside
#      vLLM, flashinfer.comm imported, its prebuilt all-reduce module loaded and one of its kernels
#      run: flashinfer.json (vLLM's in-tree fusion needs it; without it that variant is recorded as
#      not run, with the reason); beside it, vLLM's answer about the models' class written once
#      for every engine (each engine would otherwise ask a child process that imports vLLM);
#   2. plan: benchmarks/vllm/wave_plan.py: each engine's memory per GPU against the GPUs' free
#      memory, the waves (one model's engines, every variant and the A/A twin, started, measured and
#      stopped together; split further only where they do not fit), each wave's time, and the
#      steps' limits from them (vllm_plan.json);
#   3. e2e: the demo's random-weight model of hidden 2880, fusion off and on, the plugin's records
#      checked (every site fused, per rank and compiled range), greedy tokens compared,
#      `fusion-pass inspect` on vLLM's graph dumps; it runs while the bench's first wave starts;
#   4. bench: benchmarks/vllm/bench_vllm.py, offline (LLM.generate): TPOT at batch 1, 8, 32, 64 and
#      prefill; fusion off, vLLM's in-tree fusion, the plugin, and the A/A pair (two "off"
#      engines), wave by wave; it measures only once the end-to-end check has ended;
#   5. serve: benchmarks/vllm/bench_serve.py, the same engines as vLLM's OpenAI servers, wave by
#      wave, started where the bench compiled, driven by `vllm bench serve` (input 1000, output 100,
#      concurrency 8 and 32; 8 alone where the plan cannot fit 32 too, and says so).
#   scripts/gpu_vllm.sh OUTDIR [TP]
# Needs: one or two NVIDIA GPUs of 80 GB or more (the fusion applies at TP=2; at TP=1 everything
# runs and shows it inactive), a Python (PYTHON, default python3) where vLLM 0.26 or later
# imports. Installs nothing outside /tmp. TP: the second argument, else $TP, else the number of
# GPUs, at most 2.
# Time: the plan gives each step its limit and each wave its share of it; each benchmark stops
# measuring in time to write its results (--budget-s): the setup 30-70 s (FLASHINFER_TIMEOUT_S
# 45 beside the model-class answers, MODEL_INFO_TIMEOUT_S 70: 28 s on one H200) + the plan
# (15 s at most) + the offline step (BENCH_TIMEOUT_S, planned; engines late may take it to
# BENCH_LATEST_S, the serving step's rounds beyond one a wave) + the serving step, which gets
# the rest of RUN_LIMIT_S 515 less 25 s (at least SERVE_LEAST_S, one round a wave) + 15 for the
# summary: 515 s; 540 s at most (plus a few seconds of untimed commands) where a step runs
# into its limit and its stop the 10 s more its kill allows. Env variables of those names
# override the plan (SERVE_TIMEOUT_S is the serving step's floor only where the plan gives no
# SERVE_LEAST_S). A step stopped by its limit stops its engines and servers first (SIGTERM,
# then SIGKILL 10 s later).
# Both benchmarks pin their engines' processes once up, the engine measured on its CPUs and the
# others of its wave parked, and, in a virtual machine, keep every CPU from halting while they
# measure (--cpu-placement, --cpu-no-halt: benchmarks/vllm/cpu_placement.py).
# STEPS picks the steps (default "flashinfer e2e bench serve"); MODELS ("llama3-8b-like
# gptoss-active-h2880"), BENCH_ARGS and SERVE_ARGS (added to the benchmarks' command lines)
# change what they run. The run ends with the A/A ratios (offline, then serving at each
# concurrency), then FlashInfer's verdict and the comparisons.
# OUTDIR gets: gpu_vllm.log (all output), flashinfer.json, vllm_plan.json, e2e.json, e2e.log,
# inspect_<model>.txt, vllm_gpu_tp<N>.json, serve_gpu_tp<N>.json, gpu_vllm_run.json (each step's
# exit code and seconds, the total). Engines' caches, records and dumps: WORK_DIR (default
# /tmp/gpu_vllm_work).
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: $0 OUTDIR [TP]" >&2; exit 2; }
OUTDIR="$(realpath -m "$1")"
mkdir -p "$OUTDIR"
# The repository root, NVLink multicast off, PYTHONPATH, PY.
source "$(dirname "$0")/gpu_env.sh"
export VLLM_USE_FLASHINFER_SAMPLER=0
STEPS="${STEPS-flashinfer e2e bench serve}"
WORK="${WORK_DIR:-/tmp/gpu_vllm_work}"
MODELS="${MODELS:-llama3-8b-like gptoss-active-h2880}"
exec > >(tee -a "$OUTDIR/gpu_vllm.log") 2>&1
T0=$SECONDS
stamp() { echo "=== [$((SECONDS - T0)) s] $*"; }
has() { [[ " $STEPS " == *" $1 "* ]]; }
# Each step's exit code and seconds, for gpu_vllm_run.json.
TIMES=""
# Written after every step, so that a run cut short still says how far it got.
# done_step NAME RC START [END]
done_step() {
    TIMES="$TIMES${TIMES:+, }\"$1\": {\"rc\": $2, \"seconds\": $((${4:-$SECONDS} - $3))}"
    printf '{"tp": %s, "gpus": %s, "seconds": %s, "rc": %s, "steps": {%s}}\n' \
        "$TP" "$GPUS" "$((SECONDS - T0))" "$rc" "$TIMES" > "$OUTDIR/gpu_vllm_run.json"
}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
TP="${2:-${TP:-$((GPUS < 2 ? GPUS : 2))}}"
stamp "TP=$TP on $GPUS GPU(s); steps: $STEPS"
rc=0
plugin_entry_on_path || exit 2

# Every engine of every step reads vLLM's answer about the models' class from one folder
# (vllm_setup.share_model_info), written here once, beside the FlashInfer check; and the
# Python files of vLLM's install compiled once, rather than by each engine that imports them.
INFO="$WORK/modelinfos"
rm -rf "$INFO" "$WORK/e2e" "$WORK/bench" "$WORK/inspect.rc" "$WORK/e2e.end" && mkdir -p "$WORK"
t=$SECONDS
# Past its limit every engine asks vLLM itself, a child process each: 20-30 s more to start.
timeout "${MODEL_INFO_TIMEOUT_S:-70}" "$PY" benchmarks/vllm/vllm_setup.py warm-model-info "$INFO" \
    > "$WORK/warm.log" 2>&1 &
WARM_PID=$!
# Only an install under /tmp that came without byte code (a bundle unpacked there).
VLLM_DIR=$("$PY" -c "import importlib.util as u
print(list(u.find_spec('vllm').submodule_search_locations)[0])" 2>/dev/null)
[[ $VLLM_DIR == /tmp/* ]] && [ -w "$VLLM_DIR" ] &&
    { timeout 40 "$PY" -m compileall -q -j 4 "$VLLM_DIR" >/dev/null 2>&1 & }

if has flashinfer; then
    t=$SECONDS
    FI=/tmp/flashinfer
    if compgen -G ".flashinfer/flashinfer-*.txz" >/dev/null; then
        rm -rf "$FI" && mkdir -p "$FI"
        # FlashInfer and the TVM-FFI it was built against go first on the path, ahead of any other
        # TVM-FFI (vLLM's dense models do not use it); the prebuilt module or nothing: a JIT build
        # of it takes minutes.
        timeout 10 bash -c "'$PY' -m tarfile -e .flashinfer/flashinfer-*.txz '$FI' &&
            '$PY' -m pip install -q --no-index --no-deps --no-compile --target '$FI/site' \
                .flashinfer/apache_tvm_ffi-*.whl"
        FI_ENV=(PYTHONPATH="$FI:$FI/site:$PYTHONPATH" FLASHINFER_WORKSPACE_BASE="$FI/ws"
                FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_DISABLE_JIT=1)
    else
        FI_ENV=()
    fi
    timeout -k 5 $((${FLASHINFER_TIMEOUT_S:-45} - 10)) env "${FI_ENV[@]}" "$PY" \
        benchmarks/vllm/flashinfer_probe.py "$OUTDIR/flashinfer.json"
    r=$?; stamp "flashinfer probe rc=$r"; done_step flashinfer $r $t
    # Only vLLM's in-tree fusion needs FlashInfer, and only at TP=2; elsewhere every engine
    # would import it (vLLM's pass manager does) and tune its kernels at start for nothing.
    if [ "$r" -eq 0 ] && [ "$TP" -ge 2 ] && [ ${#FI_ENV[@]} -gt 0 ]; then
        export "${FI_ENV[@]}"
        FI_USABLE=1
        stamp "FlashInfer on the path of the engines"
    fi
else
    "$PY" -c "import torch, vllm; print('torch', torch.__version__, '| vllm', vllm.__version__)" \
        || { echo "vLLM does not import: nothing to run"; exit 2; }
fi
wait "$WARM_PID"; r=$?
stamp "model-class answers for the engines rc=$r: $(tail -1 "$WORK/warm.log")"
done_step model_info $r $t

# The waves and the steps' limits, from the GPUs' free memory and the time left; the
# end-to-end check's two engines (E2E_MODEL, E2E_KV_TOKENS, E2E_STEP_TOKENS a step) run beside
# the first wave.
E2E_MODEL=llama-h2880 E2E_KV_TOKENS=4096 E2E_STEP_TOKENS=256
t=$SECONDS
IN_TREE=""
{ [ "$TP" -lt 2 ] || [ -z "${FI_USABLE:-}" ]; } && IN_TREE="--variants off plugin"
# The serving workload, where the environment sets it, is the one planned.
# $MODELS, $IN_TREE and the workload's numbers are lists of words.
# shellcheck disable=SC2086
timeout 15 "$PY" benchmarks/vllm/wave_plan.py --tp "$TP" --models $MODELS $IN_TREE \
    ${SERVE_CONCURRENCY:+--concurrency $SERVE_CONCURRENCY} \
    ${SERVE_PROMPTS:+--prompts $SERVE_PROMPTS} \
    --beside "$E2E_MODEL" 2 "$E2E_KV_TOKENS" "$E2E_STEP_TOKENS" --elapsed-s $((SECONDS - T0)) \
    --json "$OUTDIR/vllm_plan.json" --shell "$WORK/limits.sh"
r=$?; stamp "plan rc=$r"; done_step plan $r $t
# The plan's limits, where the environment does not set them.
while IFS="=" read -r k v; do
    [ -n "${!k:-}" ] || declare "$k=${v//\'/}"
done < <(cat "$WORK/limits.sh" 2>/dev/null)
BENCH_S=${BENCH_TIMEOUT_S:-245} RUN_LIMIT=${RUN_LIMIT_S:-515}
# Offline engines that come up late may take the serving step's rounds beyond its least.
BENCH_LATEST=${BENCH_LATEST_S:-$BENCH_S}
[ "$BENCH_LATEST" -ge "$BENCH_S" ] || BENCH_LATEST=$BENCH_S

E2E_PID=""
if has e2e; then
    stamp "end-to-end check (beside the bench's start): the demo's random-weight model of" \
        "hidden 2880, fusion off and on, bf16"
    E2E=${E2E_TIMEOUT_S:-150}
    # It measures little: the engines get most of the time to start, the results 10 s.
    t_e2e=$SECONDS
    # Its exit code and end, for when the bench that runs beside it has ended.
    ( timeout -k 10 $((E2E - 10)) "$PY" benchmarks/vllm/bench_vllm.py --tp "$TP" \
        --models "$E2E_MODEL" --weights random --variants off plugin --aa none \
        --batches 2 --decode-steps 8 --input-len 8 --prefill-len 0 --repeats 1 --max-repeats 1 \
        --warmup 0 --max-model-len 256 --max-num-seqs 8 \
        --max-num-batched-tokens "$E2E_STEP_TOKENS" \
        --kv-tokens "$E2E_KV_TOKENS" --dump --check records --budget-s $((E2E - 15)) \
        --reserve-s 10 --model-info-dir "$INFO" \
        --cpu-placement scheduler --cpu-no-halt off --gpu-shared \
        --work-dir "$WORK/e2e" --out-dir "$OUTDIR" --name e2e.json > "$OUTDIR/e2e.log" 2>&1
      echo "$? $SECONDS" > "$WORK/e2e.end" ) &
    E2E_PID=$!
fi

if has bench; then
    t=$SECONDS
    stamp "bench_vllm (offline): $MODELS"
    # $MODELS and the *_ARGS are lists of words.
    # shellcheck disable=SC2086
    timeout -k 10 $((BENCH_LATEST + 10)) "$PY" benchmarks/vllm/bench_vllm.py --tp "$TP" \
        --models $MODELS --budget-s "$BENCH_S" --latest-s "$BENCH_LATEST" --reserve-s 5 \
        --check records --keep-caches \
        --model-info-dir "$INFO" \
        ${E2E_PID:+--after-pid "$E2E_PID" --beside-gib "${BESIDE_GIB:-0}"} \
        --work-dir "$WORK/bench" --out-dir "$OUTDIR" ${BENCH_ARGS:-}
    r=$?; stamp "bench_vllm rc=$r"; [ $r -eq 0 ] || rc=1; done_step bench $r $t
fi

INSPECT_PID=""
if [ -n "$E2E_PID" ]; then
    wait "$E2E_PID"
    read -r e2e_rc e2e_end < "$WORK/e2e.end" || { e2e_rc=1; e2e_end=$SECONDS; }
    stamp "end-to-end check rc=$e2e_rc (it ended at $((e2e_end - T0)) s, after" \
        "$((e2e_end - t_e2e)) s; its output: e2e.log)"
    grep -v "^\[llama-h2880/" "$OUTDIR/e2e.log" | tail -15
    [ $e2e_rc -eq 0 ] || rc=1
    # The op says so in the worker's log when a fused site falls back at run time.
    n=$(grep -c "falls back to the reference" "$OUTDIR/e2e.log")
    stamp "run-time fallbacks logged: $n"; [ "$n" -eq 0 ] || rc=1
    done_step e2e "$e2e_rc" "$t_e2e" "$e2e_end"
    # The plugin engine's folder: vLLM's dumps and the pass's records, read together while
    # the servers start.
    ( for d in "$WORK"/e2e/*/plugin; do
        [ -d "$d/dumps" ] || continue
        m=$(basename "$(dirname "$d")")
        timeout 30 "$PY" -m fusion_pass.tools.cli inspect "$d" > "$OUTDIR/inspect_$m.txt" 2>&1
        echo "$m $?" >> "$WORK/inspect.rc"
      done ) &
    INSPECT_PID=$!
fi

if has serve; then
    t=$SECONDS
    # The rest of the run's time (RUN_LIMIT_S, less the summary's 15 s and the 10 s the
    # stop may take), at least its least (SERVE_LEAST_S: every wave up for one round).
    SERVE=$(( RUN_LIMIT - (SECONDS - T0) - 25 ))
    [ "$SERVE" -ge "${SERVE_LEAST_S:-${SERVE_TIMEOUT_S:-190}}" ] ||
        SERVE=${SERVE_LEAST_S:-${SERVE_TIMEOUT_S:-190}}
    stamp "bench_serve (vllm bench serve): $MODELS, concurrency ${SERVE_CONCURRENCY:-8 32}," \
        "$SERVE s"
    # $MODELS, the concurrencies, the prompts and the *_ARGS are lists of words.
    # shellcheck disable=SC2086
    timeout -k 10 $((SERVE + 10)) "$PY" benchmarks/vllm/bench_serve.py --tp "$TP" \
        --models $MODELS --budget-s "$SERVE" --reserve-s 5 --check records \
        --concurrency ${SERVE_CONCURRENCY:-8 32} ${SERVE_PROMPTS:+--num-prompts $SERVE_PROMPTS} \
        --model-info-dir "$INFO" --work-dir "$WORK/bench" --out-dir "$OUTDIR" ${SERVE_ARGS:-}
    r=$?; stamp "bench_serve rc=$r"; [ $r -eq 0 ] || rc=1; done_step serve $r $t
fi
if [ -n "$INSPECT_PID" ]; then
    wait "$INSPECT_PID"
    while read -r m r; do
        stamp "fusion-pass inspect $m rc=$r"; head -12 "$OUTDIR/inspect_$m.txt"
        [ "$r" -eq 0 ] || rc=1
    done < <(cat "$WORK/inspect.rc" 2>/dev/null)
    [ -s "$WORK/inspect.rc" ] || { stamp "fusion-pass inspect: no dumps of the plugin engine"; rc=1; }
fi
rm -rf "$WORK/bench" "$WORK/e2e"

# The A/A ratios first, then what they vouch for.
t=$SECONDS
timeout 15 "$PY" benchmarks/vllm/vllm_summary.py "$OUTDIR/flashinfer.json" \
    "$OUTDIR/vllm_gpu_tp$TP.json" "$OUTDIR/serve_gpu_tp$TP.json"
done_step summary $? $t
stamp "done rc=$rc ($((SECONDS - T0)) s in all; steps: {$TIMES})"
exit $rc
