#!/usr/bin/env bash
# The Triton kernels' correctness suite at N = 2, 4 and 8 ranks simulated on one GPU: the
# self-test, `fusion-pass selftest` (fusion_pass/tools/selftest.py running
# fusion_pass/selftest/suite.py; what it proves and what it does not: docs/testing.md).
#   bash scripts/gpu_check_1gpu.sh OUTDIR [selftest args, e.g. --quick or --worlds 2 8]
# Needs: one NVIDIA GPU (H100 or H200), torch with CUDA (2.11 tested) and Triton (3.6 tested; a
# Triton put first on PYTHONPATH is the one that runs and is recorded), no vLLM, no network.
# Takes 3-6 minutes (--quick: under one): the kernels compile first, in parallel on the host's
# cores; the suite stops starting groups after 420 s (--deadline-s) and records what did not run.
# OUTDIR gets: gpu_tests_1gpu_sim.json (commit, torch and Triton versions, device, every case with
# its N, path, shape, layout, max error, outcome and pass, a summary line), gpu_check_1gpu.log
# (the progress lines and the verdict), sim_groups/ (each group's own output) and doctor.json
# (`fusion-pass doctor --json` of the same machine and Python: what the plugin would do there).
# Exit status 0 when every case passed.
set -uo pipefail
if [ $# -lt 1 ] || [[ $1 == -* ]]; then echo "usage: $0 OUTDIR [selftest args]" >&2; exit 2; fi
DIR=$1; shift
mkdir -p "$DIR" && DIR=$(cd "$DIR" && pwd)
source "$(dirname "$0")/gpu_env.sh"
# One hardware queue per simulated rank's stream, or a spinning rank blocks a peer queued behind it.
export CUDA_DEVICE_MAX_CONNECTIONS=32
exec > >(tee -a "$DIR/gpu_check_1gpu.log") 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
"$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "from", triton.__file__)'
# The machine's facts beside the results (the doctor never fails; its exit status is not the run's).
timeout 120 "$PY" -m fusion_pass.tools.cli doctor --json > "$DIR/doctor.json" || true
# The checkout is run in place (gpu_env.sh puts it on PYTHONPATH): the command through its module.
timeout "${SIM_TIMEOUT_S:-470}" "$PY" -m fusion_pass.tools.cli selftest \
  --json "$DIR/gpu_tests_1gpu_sim.json" --deadline-s 420 "$@"
rc=$?
echo "=== simulated-group suite rc=$rc"
exit $rc
