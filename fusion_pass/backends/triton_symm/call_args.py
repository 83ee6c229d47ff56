"""A call's host side: what the kernels compute for it, as their constexprs and
per-call scalars, all read from its :class:`~fusion_pass.spec.NormSpec`, and the
key of the plan that serves it.  Importing it needs torch alone.

The constexprs that select a kernel's steps (:func:`constexprs`): ``HAS_RES``,
``GEMMA``, ``ROUND_N`` and ``EMIT_Y`` from the spec's flags, ``EPS_PTR`` and
``MUL`` from whether a scalar is a kernel argument or a pointer to it, and the
FP8 epilogue's (:func:`quant_constexprs`).  The codes they take are named
here, and :mod:`.norm` reads the names.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from ...quant import QuantSpec, fp32, fp32_div
from ..base import Call

QUANT_NONE = 0
QUANT_MODE = {"static": 1, "per_token": 2, "per_group": 3}
"""The kernels' ``QUANT`` constexpr per FP8 mode (:data:`QUANT_NONE`: no quantization)."""
# UE8M0 group scales are a QUANT of their own, so that the kernels' signatures need
# no flag that only one mode reads.
QUANT_UE8M0 = 4
GROUP_QUANTS = frozenset({QUANT_MODE["per_group"], QUANT_UE8M0})
"""The ``QUANT`` values whose scales are per group of columns."""
_NO_QUANT = dict(QUANT=QUANT_NONE, GROUP=1, QMAX=0.0, INV_QMAX=0.0, FLOOR=0.0, RECIP=False, FNUZ=False)

MUL_NONE, MUL_ARG, MUL_PTR = 0, 1, 2
"""The kernels' ``MUL`` constexpr: no multiplier, a float argument, a pointer to one
(the spec's scalar on the device, loaded in the kernel as epsilon's is)."""


def quant_decline(spec: QuantSpec, hidden: int) -> Optional[str]:
    """Why the kernels' FP8 epilogue cannot compute ``spec`` (the op then
    quantizes the fused ``y`` itself), or None."""
    group = spec.group
    if spec.mode == "per_group" and (group & (group - 1) or group > hidden):
        return f"group {spec.group} is not a power of two within the row"
    if spec.fp8_dtype == "float8_e4m3fnuz" and spec.qmax > 240.0:
        return f"e4m3fnuz with qmax {spec.qmax} above its largest value, 240"
    return None


def quant_constexprs(spec: Optional[QuantSpec]) -> dict[str, Any]:
    if spec is None:
        return dict(_NO_QUANT)
    qmax = fp32(spec.qmax)
    inv = fp32_div(1.0, qmax)
    mode = QUANT_UE8M0 if spec.ue8m0 else QUANT_MODE[spec.mode]
    return dict(QUANT=mode, GROUP=spec.group or 1, QMAX=qmax, INV_QMAX=inv,
                FLOOR=fp32(spec.scale_floor), RECIP=spec.reciprocal,
                FNUZ=spec.fp8_dtype == "float8_e4m3fnuz")


def constexprs(call: Call, epilogue: Optional[QuantSpec]) -> dict[str, Any]:
    """The constexprs of ``call``'s kernels; ``epilogue``: the FP8 quantization the
    kernels compute (None also where the op quantizes the fused ``y`` itself)."""
    spec = call.spec
    return dict(HAS_RES=call.residual is not None, GEMMA=spec.gemma, ROUND_N=spec.round_normed,
                EPS_PTR=isinstance(call.eps, torch.Tensor),
                MUL=(MUL_NONE if call.multiplier is None else
                     MUL_PTR if isinstance(call.multiplier, torch.Tensor) else MUL_ARG),
                EMIT_Y=epilogue is None or spec.emit_y, **quant_constexprs(epilogue))


def _kind(v: object) -> object:
    return v.dtype if isinstance(v, torch.Tensor) else type(v)


def plan_key(call: Call, device: int) -> tuple:
    """What fixes a plan: the path, the spec (every fact of the call but its tensors),
    and what its tensors are (shape, dtypes, device, scalars given as tensors)."""
    x = call.x
    return (call.path, x.shape, x.dtype, device, call.residual is None, call.weight.dtype,
            call.spec, _kind(call.eps), _kind(call.multiplier), call.group_name)


def scalar_arg(v: Union[float, torch.Tensor, None]) -> Union[float, torch.Tensor]:
    """A scalar as a kernel argument: the float, or the tensor the kernel loads (1.0, unread,
    where the call has none)."""
    return 1.0 if v is None else v
