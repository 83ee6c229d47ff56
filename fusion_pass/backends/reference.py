"""The unfused reference: a c10d all-reduce, then residual add, RMSNorm and quantization in torch.

Runs on any device and process group (gloo on the CPU included) and is what
the op falls back to.  Tests compare the fused backends against unfused graphs
and float64 math of their own, never against this module alone.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ..gate import UNLIMITED, BackendLimits
from ..quant import quantize
from ..spec import NormSpec
from .base import Call, Outputs


def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Functional (out-of-place) sum over the c10d group ``group_name``."""
    out = torch.ops._c10d_functional.all_reduce(x, "sum", group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def scaled_sum(reduced: torch.Tensor, m: Union[float, torch.Tensor],
               residual: Optional[torch.Tensor], fma: bool) -> torch.Tensor:
    """``reduced * m (+ residual)`` in fp32 as the compiled graph's kernel of the
    multiply and the add computes it: on GPUs one FMA, a single rounding (Triton
    contracts the two, and the fused kernels call ``tl.fma``); on the CPU an fp32
    product, then an fp32 sum (Inductor's C++ kernel).  The FMA is taken in float64,
    where the product of a 16-bit value and an fp32 one is exact and so is its sum with
    the residual unless the two are more than 18 binades apart (fp32 rows: 5), and is
    rounded once to fp32 (twice only where float64 rounded too and landed on an fp32
    tie)."""
    if residual is None:
        return reduced.float() * m
    if fma:
        md = m.double() if isinstance(m, torch.Tensor) else float(torch.tensor(m).float())
        return (reduced.double() * md + residual.double()).float()
    return reduced.float() * m + residual.float()


def add_rms_norm(reduced: torch.Tensor, residual: Optional[torch.Tensor],
                 weight: torch.Tensor, spec: NormSpec,
                 eps: Union[float, torch.Tensor, None] = None,
                 multiplier: Union[float, torch.Tensor, None] = None,
                 fma: Optional[bool] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, h)`` of the reduced value as ``spec`` says (:class:`~fusion_pass.spec.NormSpec`):
    ``h = reduced [* multiplier] [+ residual]`` in fp32 with one rounding to the input
    dtype (the multiply and add as :func:`scaled_sum` says; ``fma``: as on a GPU, by
    default where ``reduced`` is), ``y = rmsnorm(h)`` in fp32 rounded to the spec's
    output dtype.  ``eps`` and ``multiplier`` are the tensors of the scalars the spec
    says are tensors (its literals otherwise); a tensor ``eps`` is added in fp32, as a
    graph that computes epsilon adds it."""
    eps = spec.eps if eps is None else eps
    multiplier = spec.multiplier if multiplier is None else multiplier
    dtype = reduced.dtype
    if multiplier is None:
        h = reduced if residual is None else reduced + residual
    else:
        m = multiplier.float().reshape(()) if isinstance(multiplier, torch.Tensor) else multiplier
        h = scaled_sum(reduced, m, residual, reduced.is_cuda if fma is None else fma).to(dtype)
    hf = h.float()
    w = weight.float() + 1.0 if spec.gemma else weight.float()
    e = eps.float() if isinstance(eps, torch.Tensor) else eps
    n = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + e)
    if spec.round_normed:
        n = n.to(dtype).float()
    return (n * w).to(spec.y_dtype(dtype)), h


class ReferenceBackend:
    name = "reference"
    limits: BackendLimits = UNLIMITED

    def run(self, call: Call) -> Union[Outputs, str]:
        spec = call.spec
        y, h = add_rms_norm(all_reduce(call.x, call.group_name), call.residual, call.weight,
                            spec, call.eps, call.multiplier)
        if spec.quant is None:
            return Outputs(y, h)
        q, scales = quantize(y, spec.quant, call.scale)
        return Outputs(y if spec.emit_y else None, h, q, scales)
