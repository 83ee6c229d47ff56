# Sourced by the scripts/gpu_*.sh scripts: the environment every GPU run needs.
cd "$(dirname "${BASH_SOURCE[1]}")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
# NVLink multicast stays off: it can take the host's GPUs down.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
