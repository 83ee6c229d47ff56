import logging
import os

import pytest

# Inductor's FX graph cache would skip the pass on a hit, and tests count what the
# pass does; the kernel caches stay on (they only save C++ compile time).
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")


@pytest.fixture
def fusion_log(monkeypatch):
    """What the package logs (the vLLM plugin routes it to vLLM's handlers, not to the
    root), with the across-process "said once" memory cleared for this test."""
    monkeypatch.setenv("FUSION_PASS_VLLM_SAID", "")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(level=logging.INFO)
    log = logging.getLogger("fusion_pass")
    log.addHandler(handler)
    yield records
    log.removeHandler(handler)
