"""The reference backend's ``h`` with a multiplier, as the compiled graph rounds it on
each device: one FMA on GPUs (where the fused kernels call ``tl.fma``), an fp32 product
then an fp32 sum on the CPU.  The oracle rounds the exact rational value once to fp32."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from fusion_pass.backends.reference import add_rms_norm, scaled_sum
from fusion_pass.spec import NormSpec


def _round_f32(v: Fraction) -> np.float32:
    """``v`` rounded to the nearest fp32, ties to even, compared exactly."""
    near = np.float32(float(v))
    cands = [np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf))]
    best = min(cands, key=lambda c: (abs(Fraction(float(c)) - v),
                                     int(np.frombuffer(c.tobytes(), np.uint32)[0]) & 1))
    return best


def _values(dtype, n=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    reduced = (torch.randn(n, generator=g) * 3).to(dtype)
    residual = torch.randn(n, generator=g).to(dtype)
    return reduced, residual


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [0.22, "tensor"])
def test_fma_rounds_the_exact_value_once(dtype, m) -> None:
    reduced, residual = _values(dtype)
    mult = torch.tensor(0.7071) if m == "tensor" else m
    m32 = float(torch.tensor(0.7071 if m == "tensor" else m, dtype=torch.float32))
    got = scaled_sum(reduced, mult, residual, fma=True)
    want = np.array([_round_f32(Fraction(float(a)) * Fraction(m32) + Fraction(float(b)))
                     for a, b in zip(reduced.tolist(), residual.tolist())], np.float32)
    np.testing.assert_array_equal(got.numpy(), want)
    two_roundings = (reduced.float() * m32 + residual.float()).numpy()
    if dtype == torch.float32:  # the two differ, or this test could not tell them apart
        assert (two_roundings != want).sum() > 0


def test_the_cpu_keeps_two_roundings_and_a_gpu_tensor_takes_the_fma() -> None:
    reduced, residual = _values(torch.float32)
    spec = NormSpec(eps=1e-6, multiplier=0.22)
    w = torch.ones(reduced.shape[-1])
    _, h_cpu = add_rms_norm(reduced[None], residual[None], w, spec)
    np.testing.assert_array_equal(h_cpu[0].numpy(), (reduced * 0.22 + residual).numpy())
    _, h_fma = add_rms_norm(reduced[None], residual[None], w, spec, fma=True)
    assert not torch.equal(h_cpu, h_fma)
    np.testing.assert_array_equal(h_fma[0].numpy(),
                                  scaled_sum(reduced, 0.22, residual, fma=True).numpy())
