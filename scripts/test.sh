#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the CPU test suite; extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TORCHINDUCTOR_FX_GRAPH_CACHE=0 TORCHINDUCTOR_AUTOGRAD_CACHE=0
# torch (custom-op aliasing raises instead of warning) and hypothesis (derandomized
# profile) behave differently under CI; run the suite the same way everywhere.
export CI="${CI:-1}"
exec .venv/bin/python -m pytest -q -rs "$@"
