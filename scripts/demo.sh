#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the main job: `fusion-pass demo` (extra args go to it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/fusion-pass demo "$@"
