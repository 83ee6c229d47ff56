"""The Triton backend without a GPU: import, limits, size classes, decline rules, fallback."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusion_pass.spawn import run_ranks
from fusion_pass import backends, gate
from fusion_pass.backends import triton_symm
from fusion_pass.backends.triton_symm import buffers

MiB = 1 << 20


def test_imports_without_cuda_or_triton_kernels():
    code = ("import sys, fusion_pass.backends.triton_symm as t; b = t.TritonBackend(); "
            "print(b.name, 'fusion_pass.backends.triton_symm.one_stage' in sys.modules, "
            "'fusion_pass.backends.triton_symm.two_stage' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}, check=True)
    assert out.stdout.split() == ["triton", "False", "False"]


def test_registry_builds_the_backend_with_its_limits():
    be = backends.get("triton")
    assert isinstance(be, triton_symm.TritonBackend)
    assert be.name == "triton" and be.limits is triton_symm.LIMITS
    assert be.limits.world_sizes == {2, 4, 8}
    assert be.limits.dtypes == {"bfloat16", "float16", "float32"}
    assert be.limits.max_bytes == 32 * MiB


def test_empty_marker_is_each_dtypes_negative_zero():
    for dtype, bits in ((torch.bfloat16, 16), (torch.float16, 16), (torch.float32, 32)):
        neg0 = torch.tensor([-0.0], dtype=dtype).view(buffers.int_dtype(bits))
        assert int(neg0) == buffers.negative_zero_bits(bits)
        assert int(torch.tensor([0.0], dtype=dtype).view(buffers.int_dtype(bits))) == 0


@pytest.mark.parametrize("hidden,dtype,world,tokens,path,fragment", [
    (4096, torch.float64, 2, 8, gate.Path.ONE_STAGE, "dtype"),
    (4096, torch.bfloat16, 3, 8, gate.Path.ONE_STAGE, "world size 3"),
    (4096, torch.bfloat16, 2, 8, gate.Path.UNFUSED, "not a kernel path"),
    (100, torch.bfloat16, 2, 8, gate.Path.TWO_STAGE, "16-byte"),
    (20000, torch.bfloat16, 2, 8, gate.Path.TWO_STAGE, "16384-element"),
    (8192, torch.bfloat16, 2, 2049, gate.Path.TWO_STAGE, "exceeds"),
    (8192, torch.float32, 2, 2048, gate.Path.TWO_STAGE, "exceeds"),
])
def test_decline_reasons(hidden, dtype, world, tokens, path, fragment):
    why = triton_symm.decline_reason(hidden, dtype, world, tokens, path)
    assert why is not None and fragment in why


@pytest.mark.parametrize("hidden,dtype,tokens", [
    (128, torch.bfloat16, 1), (2880, torch.float16, 81), (8192, torch.bfloat16, 2048),
    (4096, torch.float32, 2048), (16384, torch.bfloat16, 1024)])
def test_kernel_shapes_are_taken(hidden, dtype, tokens):
    for world in (2, 4, 8):
        for path in (gate.Path.ONE_STAGE, gate.Path.TWO_STAGE):
            assert triton_symm.decline_reason(hidden, dtype, world, tokens, path) is None


def test_run_declines_cpu_tensors():
    x = torch.randn(4, 128)
    assert triton_symm.TritonBackend().run(x, None, torch.ones(128), 1e-6, "0",
                                           gate.Path.ONE_STAGE, False) is None


def test_gate_with_the_backend_limits():
    lim = triton_symm.LIMITS
    assert gate.decide(8192, torch.bfloat16, 2, 8, limits=lim).path is gate.Path.ONE_STAGE
    assert gate.decide(8192, torch.bfloat16, 2, 2048, limits=lim).path is gate.Path.TWO_STAGE
    assert gate.decide(8192, torch.bfloat16, 2, 4096, limits=lim).path is gate.Path.UNFUSED
    assert gate.decide(4096, torch.bfloat16, 3, 8, limits=lim).path is gate.Path.UNFUSED


def test_slot_needs():
    row = 4096 * 2
    assert buffers.one_stage_need(80, row, 2) == 2 * 80 * row
    # 7 tokens on 4 ranks: chunks of 2 rows (the last rank owns 1), 4 mailbox chunks + 7 rows.
    assert buffers.two_stage_need(7, row, 4) == (4 * 2 + 7) * row
    assert buffers.two_stage_need(1, row, 8) == (8 + 1) * row  # ranks 1..7 own nothing


def test_size_classes():
    cap = buffers.max_slot_bytes(triton_symm.MAX_INPUT_BYTES)
    assert buffers.size_class(1, triton_symm.MAX_INPUT_BYTES) == MiB
    assert buffers.size_class(MiB + 1, triton_symm.MAX_INPUT_BYTES) == 2 * MiB
    assert buffers.size_class(64 * MiB, triton_symm.MAX_INPUT_BYTES) == 64 * MiB
    assert buffers.size_class(64 * MiB + 1, triton_symm.MAX_INPUT_BYTES) == cap
    assert buffers.size_class(cap + 1, triton_symm.MAX_INPUT_BYTES) is None


@settings(max_examples=300, deadline=None)
@given(hidden_packs=st.integers(1, 2048), tokens=st.integers(1, 4096),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       world=st.sampled_from([2, 4, 8]),
       path=st.sampled_from([gate.Path.ONE_STAGE, gate.Path.TWO_STAGE]))
def test_every_taken_call_fits_a_slot(hidden_packs, tokens, dtype, world, path):
    """Whatever passes the decline rules gets a buffer (the two-stage path always;
    one-stage wherever the gate could send it by default)."""
    hidden = hidden_packs * (16 // torch.tensor([], dtype=dtype).element_size())
    if triton_symm.decline_reason(hidden, dtype, world, tokens, path) is not None:
        return
    if path is gate.Path.ONE_STAGE and tokens > gate.DEFAULT_TOKEN_THRESHOLD:
        return
    need = triton_symm.slot_need(path, tokens, hidden, dtype, world)
    cls = buffers.size_class(need, triton_symm.MAX_INPUT_BYTES)
    assert cls is not None and need <= cls
    assert cls % (16 * 4) == 0  # whole 16-byte vectors of either element width


def test_num_warps_and_timeout(monkeypatch):
    assert triton_symm.num_warps(128, 2) == 4
    assert triton_symm.num_warps(4096, 2) == 16
    assert triton_symm.num_warps(8192, 2) == 32
    assert triton_symm.num_warps(8192, 4) == 32
    monkeypatch.setenv("FUSION_PASS_TIMEOUT_S", "1.5")
    assert triton_symm.TritonBackend().timeout_ns == 1_500_000_000
    monkeypatch.delenv("FUSION_PASS_TIMEOUT_S")
    assert triton_symm.TritonBackend().timeout_ns == 5_000_000_000


def _forced_triton_on_cpu(rank: int, world: int):
    import logging

    import torch.distributed as dist

    import fusion_pass
    from fusion_pass.backends import reference

    fusion_pass.backends.set_backend("triton")
    records = []
    handler = logging.Handler()
    handler.emit = lambda rec: records.append(rec.getMessage())
    logging.getLogger("fusion_pass").addHandler(handler)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(3, 64, generator=g)
    r = torch.randn(3, 64, generator=torch.Generator().manual_seed(9))
    w = torch.randn(64, generator=torch.Generator().manual_seed(8))
    gname = dist.group.WORLD.group_name
    y, h = fusion_pass.fused_allreduce_rmsnorm(x, w, 1e-6, gname, residual=r, path="one_stage")
    ry, rh = reference.add_rms_norm(reference.all_reduce(x, gname), r, w, 1e-6, False)
    return torch.equal(y, ry) and torch.equal(h, rh), records


def test_op_falls_back_once_when_triton_declines():
    for ok, logs in run_ranks(_forced_triton_on_cpu, 2):
        assert ok
        assert len([m for m in logs if "triton backend falls back" in m]) == 1, logs
