"""The unfused reference: a c10d all-reduce, then residual add and RMSNorm in torch.

Runs on any device and process group (gloo on the CPU included) and is the
oracle the fused backends are tested against.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..gate import UNLIMITED, BackendLimits, Path


def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Functional (out-of-place) sum over the c10d group ``group_name``."""
    out = torch.ops._c10d_functional.all_reduce(x, "sum", group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def add_rms_norm(reduced: torch.Tensor, residual: Optional[torch.Tensor],
                 weight: torch.Tensor, eps: float, gemma: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = reduced (+ residual)`` rounded to the input dtype, ``y = rmsnorm(h)`` in fp32."""
    h = reduced if residual is None else reduced + residual
    hf = h.float()
    w = weight.float() + 1.0 if gemma else weight.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * w
    return y.to(h.dtype), h


class ReferenceBackend:
    name = "reference"
    limits: BackendLimits = UNLIMITED

    def run(self, x: torch.Tensor, residual: Optional[torch.Tensor],
            weight: torch.Tensor, eps: float, group_name: str, path: Path,
            gemma: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(all_reduce(x, group_name), residual, weight, eps, gemma)
