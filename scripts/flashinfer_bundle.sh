#!/usr/bin/env bash
# FlashInfer for a GPU host without network, built on a host with it:
#   .flashinfer/flashinfer-<version>-sm90a.txz   FlashInfer's Python package, pruned to the .py files,
#        the CUDA sources of its trtllm_comm module (for a JIT fallback), and that module prebuilt
#        for sm_90a (H100/H200) where FlashInfer looks for an ahead-of-time build
#        (flashinfer/data/aot/trtllm_comm/trtllm_comm.so), so that the GPU host loads it
#        instead of compiling it for minutes; the JIT fallback's headers are FlashInfer's own,
#        spdlog's and the vendored CCCL libcudacxx (ahead of the CUDA toolkit's on FlashInfer's
#        include path); cutlass, cub and thrust are not reached from these sources;
#   .flashinfer/apache_tvm_ffi-*-cp312-*.whl    what FlashInfer's modules link against.
# scripts/gpu_check.sh (FlashInfer's column of the op benchmark) and scripts/gpu_vllm.sh (vLLM's
# in-tree fusion) unpack and use it when present (copy `.flashinfer` with the repository; 9 MB
# for 0.6.14).
#   bash scripts/flashinfer_bundle.sh [VERSION]   (default 0.7.4; 0.6.14 is the version vLLM 0.26
#        pins, the one scripts/gpu_vllm.sh needs; one version at a time; re-runnable; the build
#        takes 15-25 minutes on 2 cores)
# Needs here: network to PyPI, nvcc >= 12.9 (CUDA_HOME, default /usr/local/cuda), a C++ compiler,
# ninja, and a Python with torch (PYTHON, default .venv/bin/python).
# There: cuda-bindings, nvidia-ml-py, einops and a CUDA 13 runtime (torch's), which
# `import flashinfer.comm` needs; FLASHINFER_CUDA_ARCH_LIST=9.0a, so that FlashInfer looks for the
# sm_90a build.
set -euo pipefail
cd "$(dirname "$0")/.."
FI_VERSION="${1:-0.7.4}"
# Inside what both 0.6.14 (>=0.1.6,<0.2, not 0.1.8) and 0.7.4 (>=0.1.11,<0.2) require.
TVM_FFI_VERSION=0.1.15.post2
BUNDLE=.flashinfer
WORK="${FLASHINFER_BUILD_DIR:-/tmp/flashinfer_build}"
PY="${PYTHON:-.venv/bin/python}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
ARCHIVE="$BUNDLE/flashinfer-$FI_VERSION-sm90a.txz"
FULL="$WORK/full-$FI_VERSION"

EXCLUDE="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$EXCLUDE")"
grep -qxF "/$BUNDLE/" "$EXCLUDE" 2>/dev/null || echo "/$BUNDLE/" >> "$EXCLUDE"
mkdir -p "$WORK/dl" "$BUNDLE"
WHEEL="$WORK/dl/flashinfer_python-$FI_VERSION-py3-none-any.whl"
[ -f "$WHEEL" ] || "$PY" -m pip download -q --no-deps -d "$WORK/dl" "flashinfer-python==$FI_VERSION"
rm -f "$BUNDLE"/apache_tvm_ffi-*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$BUNDLE" "apache-tvm-ffi==$TVM_FFI_VERSION"
# For the build here, in this Python: tvm-ffi's headers, and pynvml, which importing FlashInfer needs.
SITE="$WORK/site$("$PY" -c 'import sys; print("%d%d" % sys.version_info[:2])')"
[ -d "$SITE/tvm_ffi" ] || "$PY" -m pip install -q --no-deps --target "$SITE" \
    "apache-tvm-ffi==$TVM_FFI_VERSION" nvidia-ml-py

# Unpacked once: fresh files would make ninja rebuild everything on a re-run.
[ -f "$FULL/flashinfer/__init__.py" ] || "$PY" -m zipfile -e "$WHEEL" "$FULL"
"$PY" - "$FULL" <<'EOF'
import os, sys

jit = os.path.join(sys.argv[1], "flashinfer", "jit", "comm.py")
if "def gen_trtllm_comm_module" not in open(jit).read():
    sys.exit(f"{jit} has no gen_trtllm_comm_module: this FlashInfer builds its all-reduce "
             "module another way")
EOF

# FlashInfer links its modules with -lcuda from $CUDA_HOME/lib64/stubs; a machine without a driver
# may have neither. The objects call no driver function: a stub that only carries the soname gives
# the module the same dependency on the real driver that FlashInfer's own build gives it.
mkdir -p "$WORK/stubs"
echo "" | "${CXX:-c++}" -x c++ -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$WORK/stubs/libcuda.so" -

echo "building trtllm_comm for sm_90a (nvcc $("$CUDA_HOME/bin/nvcc" --version | grep -o 'release [0-9.]*'))"
LIBRARY_PATH="$WORK/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}" FLASHINFER_CUDA_ARCH_LIST=9.0a \
FLASHINFER_WORKSPACE_BASE="$WORK/ws" PYTHONPATH="$FULL:$SITE" "$PY" - "$FULL" <<'EOF'
import inspect, os, shutil, sys
from flashinfer.jit.comm import gen_trtllm_comm_module

spec = gen_trtllm_comm_module()
# 0.6.x: build(verbose, need_lock=True); 0.7.x: build().
spec.build(**({"verbose": False} if "verbose" in inspect.signature(spec.build).parameters else {}))
aot = os.path.join(sys.argv[1], "flashinfer", "data", "aot", spec.name)
os.makedirs(aot, exist_ok=True)
shutil.copy(spec.jit_library_path, os.path.join(aot, spec.name + ".so"))
print("built", spec.jit_library_path)
EOF

rm -f "$BUNDLE"/flashinfer-*.t?z   # one version at a time: gpu_check.sh unpacks the one there
"$PY" - "$FULL" "$ARCHIVE" "$FI_VERSION" <<'EOF'
import os, sys, tarfile

root, out, version = sys.argv[1:4]
SOURCES = {"trtllm_allreduce.cu", "trtllm_allreduce_fusion.cu", "trtllm_moe_allreduce_fusion.cu",
           "tvm_ffi_utils.h"}


def keep(rel: str) -> bool:
    if rel.startswith("flashinfer/data/"):
        sub = rel[len("flashinfer/data/"):]
        return (sub.startswith(("include/", "spdlog/", "aot/", "cccl/libcudacxx/include/"))
                or (sub.startswith("csrc/") and sub[len("csrc/"):] in SOURCES))
    return rel.startswith("flashinfer/") and rel.endswith(".py") \
        or rel == f"flashinfer_python-{version}.dist-info/METADATA"


# xz: 17 MB where gzip makes 28 (smaller archives move faster to an offline host).
with tarfile.open(out, "w:xz") as tar:
    for d, _, files in sorted(os.walk(root)):
        for f in sorted(files):
            rel = os.path.relpath(os.path.join(d, f), root)
            if keep(rel):
                tar.add(os.path.join(root, rel), rel)
EOF

SO="$FULL/flashinfer/data/aot/trtllm_comm/trtllm_comm.so"
echo "--- $SO"
readelf -d "$SO" | grep -E 'NEEDED|SONAME' || true
echo "undefined TVM-FFI symbols (resolved by the tvm_ffi package's libtvm_ffi.so at load): $(nm -D --undefined-only "$SO" | grep -c TVMFFI)"
if command -v cuobjdump >/dev/null; then echo "sm_90a cubins: $(cuobjdump --list-elf "$SO" | grep -c sm_90a)"; fi
echo "exported: $(nm -D --defined-only "$SO" | grep -c __tvm_ffi_) tvm-ffi functions"
ls -la "$BUNDLE"
du -sh "$BUNDLE"
