import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Every test here needs WORLD CUDA GPUs (or fewer, shared by the ranks, with
    FUSION_PASS_GPU_SHARE=1: a smoke test of the kernels' logic, no timings)."""
    from gpu_workers import WORLD

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n >= WORLD or (n >= 1 and os.environ.get("FUSION_PASS_GPU_SHARE") == "1"):
        return
    why = (f"needs {WORLD} CUDA GPUs (found none)" if n == 0 else
           f"needs {WORLD} CUDA GPUs (found {n}; FUSION_PASS_GPU_SHARE=1 shares them)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.skip(reason=why))
