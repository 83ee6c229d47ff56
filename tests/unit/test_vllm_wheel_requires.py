"""``scripts/vllm_wheel_requires.py``: what ``scripts/setup.sh`` installs beside vLLM's GPU
wheel on a CPU machine (vLLM 0.33+ have no CPU build)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "vllm_wheel_requires.py"

# Requires-Dist lines as each release's METADATA writes them (a selection): every GPU-kernel and
# media package, the torch pin, lines with environment markers and an extra's line.
WHEELS = {
    "0.34.0": [
        "regex", "transformers<5.23.0,>=5.16.1",
        'protobuf!=6.30.*,>=5.29.6; platform_machine != "s390x"',
        'xgrammar==0.2.8; platform_machine == "x86_64" or platform_machine == "aarch64"',
        "depyf==0.20.0", "numba==0.65.0", "torch==2.14.0", "torchaudio==2.11.0",
        "torchvision==0.29.0", "torchcodec>=0.14", "PyNvVideoCodec==2.0.4",
        "flashinfer-python==0.7.3", "apache-tvm-ffi==0.1.11", "tilelang==0.1.12",
        "nvidia-cudnn-frontend>=1.31.0", "nvtx==0.2.15", "fastsafetensors>=0.3.3",
        "instanttensor>=0.2.2", "nvidia-cutlass-dsl[cu13]==4.8.0", "quack-kernels==0.6.5",
        'tokenspeed-mla==2.0.3; platform_system == "Linux"', "humming-kernels[cu13]==0.1.19",
        'pytest; extra == "test"', "mistral_common[image]>=1.13.0",
    ],
    "0.33.0": [
        "regex", "transformers<5.21.0,>=5.16.1", 'protobuf==7.36.1; platform_machine == "s390x"',
        "depyf==0.20.0", "torch==2.14.0", "torchaudio==2.11.0", "torchvision==0.29.0",
        "torchcodec>=0.14", "PyNvVideoCodec==2.0.4", "flashinfer-python==0.7.2.post1",
        "apache-tvm-ffi==0.1.11", "tilelang==0.1.12", "nvidia-cudnn-frontend>=1.31.0",
        "nvtx==0.2.15", "fastsafetensors>=0.3.3", "instanttensor>=0.2.2",
        "nvidia-cutlass-dsl[cu13]==4.8.0", "quack-kernels==0.6.5",
        'tokenspeed-mla==2.0.3; platform_system == "Linux"', "humming-kernels[cu13]==0.1.19",
        'zentorch==2.14.0.1; extra == "zen"', 'nvidia-deepstream-videodecode-cu13>=9.0.2; '
        'extra == "deepstream"', "mistral_common[image]>=1.11.6",
    ],
}
KEPT = {
    "0.34.0": [
        "regex", "transformers<5.23.0,>=5.16.1",
        'protobuf!=6.30.*,>=5.29.6; platform_machine != "s390x"',
        'xgrammar==0.2.8; platform_machine == "x86_64" or platform_machine == "aarch64"',
        "depyf==0.20.0", "numba==0.65.0", "torch==2.14.0", "mistral_common[image]>=1.13.0",
    ],
    "0.33.0": [
        "regex", "transformers<5.21.0,>=5.16.1", 'protobuf==7.36.1; platform_machine == "s390x"',
        "depyf==0.20.0", "torch==2.14.0", "mistral_common[image]>=1.11.6",
    ],
}


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("vllm_wheel_requires", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("release", sorted(WHEELS))
def test_keeps_what_imports_vllm_and_the_torch_pin(script, release):
    assert script.wanted(WHEELS[release]) == KEPT[release]


def test_a_wheel_without_a_torch_pin_is_refused(script):
    with pytest.raises(SystemExit, match="pins no torch"):
        script.wanted(["regex", "torchvision==0.29.0"])
