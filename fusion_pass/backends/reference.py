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
from .base import Call, Outputs


def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Functional (out-of-place) sum over the c10d group ``group_name``."""
    out = torch.ops._c10d_functional.all_reduce(x, "sum", group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def add_rms_norm(reduced: torch.Tensor, residual: Optional[torch.Tensor],
                 weight: torch.Tensor, eps: Union[float, torch.Tensor], gemma: bool,
                 out_dtype: Optional[torch.dtype] = None,
                 round_normed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = reduced (+ residual)`` rounded to the input dtype, ``y = rmsnorm(h)`` in fp32,
    rounded to ``out_dtype`` (default: the input dtype); with ``round_normed`` the
    normalised row is rounded to the input dtype before the weight multiplies it.  A
    tensor ``eps`` is added in fp32, as a graph that computes epsilon adds it."""
    h = reduced if residual is None else reduced + residual
    hf = h.float()
    w = weight.float() + 1.0 if gemma else weight.float()
    e = eps.float() if isinstance(eps, torch.Tensor) else eps
    n = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + e)
    if round_normed:
        n = n.to(h.dtype).float()
    return (n * w).to(h.dtype if out_dtype is None else out_dtype), h


class ReferenceBackend:
    name = "reference"
    limits: BackendLimits = UNLIMITED

    def run(self, call: Call) -> Union[Outputs, str]:
        y, h = add_rms_norm(all_reduce(call.x, call.group_name), call.residual, call.weight,
                            call.eps, call.gemma, call.out_dtype, call.round_normed)
        if call.quant is None:
            return Outputs(y, h)
        q, scales = quantize(y, call.quant, call.scale)
        return Outputs(y if call.emit_y else None, h, q, scales)
