"""The fast launch (``backends/triton_symm/launch.py``) on one GPU, under whichever
Triton is installed: its compiled kernels' launcher is of a generation the fast
path knows, the fast path is taken (no fallback line) and computes what
``kernel[grid]`` computes, in eager calls with tensors and with addresses, back
to back with programmatic dependent launch where the GPU has it, and under
CUDA-graph capture; with no generation known it falls back, says so once, and
still computes the same.

A small kernel of the fused kernels' parameter kinds (per-call pointers and a
float, plan-fixed integers and a pointer, constexprs) stands in for them: they
need peers, this needs one GPU.  Run with the GPU tests
(``STEPS=tests bash scripts/gpu_check.sh OUTDIR`` on one GPU or more), or alone:
``python -m pytest -q tests/gpu/test_triton_launch_gpu.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch
import triton
import triton.language as tl

from fusion_pass.backends.triton_symm import launch, ptx
from test_triton_gpu import _record

pytestmark = [pytest.mark.gpu, pytest.mark.one_gpu]

PER_CALL = ("x_ptr", "y_ptr", "a", "out_ptr")
N, BLOCK = 1000, 256
GRID = triton.cdiv(N, BLOCK)


@triton.jit
def axpy_kernel(x_ptr, y_ptr, a, out_ptr, n, w_ptr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    ptx.wait_for_previous_kernel(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    w = tl.load(w_ptr + offs % 4, mask=mask)
    tl.store(out_ptr + offs, a * x + y + w, mask=mask)


def _pdl_choices() -> list[bool]:
    ok = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
    return [False, True] if ok else [False]


def _ints(seed: int) -> torch.Tensor:
    """Small integers as fp32: every result below is exact, fused multiply-add or not."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(-8, 8, (N,), generator=g).float().cuda()


def _launcher(pdl: bool, w: torch.Tensor) -> launch.Launcher:
    return launch.Launcher(axpy_kernel, GRID, PER_CALL, dict(n=N, w_ptr=w, BLOCK=BLOCK, PDL=pdl),
                           dict(num_warps=4, launch_pdl=pdl))


def _want(a: float, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return a * x + y + w[torch.arange(N, device=x.device) % 4]


def _fusion_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "fusion_pass"]


@pytest.fixture(autouse=True)
def _said_cleared(monkeypatch):
    from fusion_pass import log

    monkeypatch.setattr(log, "_said", set())


@pytest.mark.parametrize("pdl", _pdl_choices())
def test_fast_launch_on_the_installed_triton(pdl, caplog):
    dev = torch.cuda.current_device()
    w = torch.arange(4, dtype=torch.float32, device="cuda")
    x, y = _ints(1), _ints(2)
    compiled = axpy_kernel.warmup(x, y, 2.0, x, N, w, BLOCK=BLOCK, PDL=pdl, grid=(GRID,),
                                  num_warps=4, launch_pdl=pdl)
    gen = launch.generation(compiled.run)
    assert gen is not None, f"Triton {triton.__version__}: launcher {type(compiled.run)} unknown"
    assert bool(compiled.run.launch_pdl) is pdl

    lau = _launcher(pdl, w)
    out = torch.full_like(x, float("nan"))
    with caplog.at_level(logging.INFO, logger="fusion_pass"):
        lau(dev, (x, y, 2.0, out), True)
    assert lau.ready, _fusion_lines(caplog)
    assert _fusion_lines(caplog) == []
    torch.testing.assert_close(out, _want(2.0, x, y, w), rtol=0, atol=0)

    # Addresses, and each launch reading the one before it (PDL: the wait in the kernel).
    z = [x] + [torch.full_like(x, float("nan")) for _ in range(16)]
    for k in range(16):
        lau.launch_addresses(dev, (z[k].data_ptr(), y.data_ptr(), 1.0, z[k + 1].data_ptr()))
    torch.testing.assert_close(z[16], x + 16 * _want(0.0, x, y, w), rtol=0, atol=0)

    # Under CUDA-graph capture: the launch goes to the capturing stream.
    g_out = [torch.full_like(x, float("nan")) for _ in range(3)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        lau.launch_addresses(dev, (x.data_ptr(), y.data_ptr(), 1.0, g_out[0].data_ptr()))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for k in range(2):
            lau.launch_addresses(dev, (g_out[k].data_ptr(), y.data_ptr(), 1.0,
                                       g_out[k + 1].data_ptr()))
    g_out[2].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(g_out[2], x + 3 * _want(0.0, x, y, w), rtol=0, atol=0)
    _record("fast_launch", {f"pdl={pdl}": {"triton": triton.__version__, "generation": gen.name,
                                           "ready": lau.ready, "exact": True}}, merge=True)


def test_unknown_generation_falls_back_on_the_gpu(monkeypatch, caplog):
    monkeypatch.setattr(launch, "GENERATIONS", ())
    dev = torch.cuda.current_device()
    w = torch.arange(4, dtype=torch.float32, device="cuda")
    x, y = _ints(3), _ints(4)
    lau = _launcher(False, w)
    outs = [torch.full_like(x, float("nan")) for _ in range(2)]
    with caplog.at_level(logging.INFO, logger="fusion_pass"):
        for out in outs:
            lau(dev, (x, y, 2.0, out), True)
    assert not lau.ready
    (line,) = _fusion_lines(caplog)
    assert f"Triton {triton.__version__}" in line and "kernel[grid]" in line
    for out in outs:
        torch.testing.assert_close(out, _want(2.0, x, y, w), rtol=0, atol=0)
