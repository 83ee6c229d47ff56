"""Backend calls built as the op builds them, for tests and benchmarks that drive a
backend (or the op's routing) without the op's entry points."""

from __future__ import annotations

from typing import Optional, Union

import torch

from ..backends.base import Call
from ..gate import FusionPath
from ..op import spec_of
from ..quant import QuantSpec


def make_call(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
              eps: Union[float, torch.Tensor], group_name: str,
              path: FusionPath = FusionPath.UNFUSED, *, gemma: bool = False,
              out_dtype: Optional[torch.dtype] = None, quant: Optional[QuantSpec] = None,
              scale: Optional[torch.Tensor] = None, emit_y: bool = True,
              round_normed: bool = False,
              multiplier: Union[float, torch.Tensor, None] = None) -> Call:
    """The :class:`~fusion_pass.backends.base.Call` the op hands a backend for these
    arguments of :func:`fusion_pass.op.fused_allreduce_rmsnorm_quant` (a CPU
    tensor scalar stays a tensor here: the op would read it into a float)."""
    spec, eps_t, mult_t = spec_of(eps, multiplier, gemma, round_normed, out_dtype, quant,
                                  emit_y or quant is None)
    return Call(x, residual, weight, spec, group_name, path, eps_t, mult_t, scale)
