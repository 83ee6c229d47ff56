import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Every test here needs two CUDA GPUs; skip them with the reason elsewhere."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n >= 2:
        return
    why = "needs 2 CUDA GPUs (found none)" if n == 0 else f"needs 2 CUDA GPUs (found {n})"
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.skip(reason=why))
