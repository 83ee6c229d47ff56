"""Prints, one per line, what an installed vLLM GPU wheel needs to import on a CPU machine.

vLLM 0.33 and later publish no CPU build.  Their GPU wheel imports without a GPU (its C++
kernels absent), but its pins cannot all be installed there: some GPU-kernel packages are not
on the package index at the pinned versions, and none of them is needed to import vLLM, read
its configs or trace its graphs.  ``scripts/setup.sh`` installs the wheel with ``--no-deps``,
then what this prints: the wheel's own ``Requires-Dist`` without extras, without the GPU-kernel
and media packages below, and with torch at the wheel's pin (it brings its Triton).

    python scripts/vllm_wheel_requires.py [DIST]     # DIST: the distribution name, default vllm
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import requires

# Normalised names (PEP 503) left out: CUDA/ROCm kernel libraries and the media decoders.
LEFT_OUT = {"torchaudio", "torchvision", "torchcodec", "pynvvideocodec", "nvtx", "tilelang",
            "fastsafetensors", "instanttensor", "quack-kernels", "tokenspeed-mla",
            "humming-kernels", "apache-tvm-ffi"}
LEFT_OUT_PREFIXES = ("flashinfer", "nvidia-")


def _name(req: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    if m is None:
        raise ValueError(f"unreadable requirement {req!r}")
    return re.sub(r"[-_.]+", "-", m[1]).lower()


def wanted(reqs: list[str]) -> list[str]:
    out = []
    for req in reqs:
        if "extra ==" in req.replace('"', "").replace("'", ""):
            continue
        name = _name(req)
        if name in LEFT_OUT or name.startswith(LEFT_OUT_PREFIXES):
            continue
        out.append(req)
    if not any(_name(r) == "torch" for r in out):
        raise SystemExit("the wheel pins no torch: cannot tell which torch it was built for")
    return out


def main() -> None:
    dist = sys.argv[1] if len(sys.argv) > 1 else "vllm"
    for req in wanted(requires(dist) or []):
        print(req)


if __name__ == "__main__":
    main()
