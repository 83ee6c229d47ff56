import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Most tests here need WORLD CUDA GPUs, one per rank: torch's symmetric memory
    refuses two ranks on one GPU.  Those marked ``one_gpu`` run on any CUDA machine."""
    from gpu_workers import WORLD

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "tests/gpu/" not in str(item.fspath).replace("\\", "/"):
            continue
        need = 1 if item.get_closest_marker("one_gpu") else WORLD
        if n < need:
            gpus = "a CUDA GPU" if need == 1 else f"{need} CUDA GPUs"
            item.add_marker(pytest.mark.skip(reason=f"needs {gpus} (found {n})"))
