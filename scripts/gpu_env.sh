# Sourced by the scripts/gpu_*.sh scripts: the environment every GPU run needs.
cd "$(dirname "${BASH_SOURCE[1]}")/.."
# NVLink multicast stays off: it can take the host's GPUs down.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# FlashInfer's mnnvl all-reduce (vLLM's default backend for its fusion) uses multicast too.
export VLLM_FLASHINFER_ALLREDUCE_BACKEND="${VLLM_FLASHINFER_ALLREDUCE_BACKEND:-trtllm}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"

# vLLM loads the plugin through its entry point in every process it starts (servers' too); a
# checkout that is not pip-installed gets one on PYTHONPATH (benchmarks/vllm/plugin_entry.py).
plugin_entry_on_path() {
    local ep
    ep=$("$PY" benchmarks/vllm/plugin_entry.py /tmp/fusion_pass_entry) || return 1
    [ -z "$ep" ] || { export PYTHONPATH="$PYTHONPATH:$ep"; echo "the plugin's entry point: $ep"; }
}
