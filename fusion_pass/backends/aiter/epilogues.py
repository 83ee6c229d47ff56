"""When AITER's fused FP8 epilogue computes exactly what the graph's quantization does.

What the kernels compute, read from ``csrc/include/custom_all_reduce.cuh``
(``ar_fusion_epilogue`` and ``ar_fusion_epilogue_per_group``; the same in every
release from 0.1.10.post3, ROCm/aiter#1990, and 0.1.14, #2823, through 0.1.20.post1):

* the value quantized is the norm output in fp32, never rounded to the input
  dtype first (the optional ``emit_bf16`` mirror is rounded, the quantized values
  are not);
* ``scale = amax / FP8_MAX`` over the token row (per token) or over each group of
  ``group_size`` elements, and ``1`` when ``amax`` is 0; no floor;
  ``FP8_MAX`` is the largest finite value of the kernel's FP8 type, the same type
  as the Python ``fp8`` the module allocates (``aiter.utility.dtypes``: e4m3fnuz,
  240, on gfx942; e4m3fn, 448, on gfx950);
* ``q = fp8(y / scale)``: a division, and no clamp beyond the FP8 maximum, which
  ``|y| / scale`` reaches at most;
* scales in float32: ``[..., 1]`` per token, ``[..., hidden / group]`` row-major
  per group (``transpose_scale=False``; the transposed form of 0.1.20 is not
  taken: nothing here reads what it allocates), never rounded to a power of two.

:class:`fusion_pass.quant.QuantSpec` says the same only when the graph
quantizes a float32 norm output (``out_dtype`` float32), divides, clamps at that
FP8 maximum and has no scale floor.  The one remaining difference is a row whose
norm output is all zeros: the spec's formula divides 0 by 0 (NaN), AITER writes
zeros with scale 1, the finite answer.
"""

from __future__ import annotations

import enum
from typing import Optional

import torch

from ...gate import Path, dtype_name, pack_size
from ..base import Call
from .releases import PER_GROUP_QUANT, PER_TOKEN_QUANT, Capabilities, format_version

# The per-group epilogue reduces each group's amax with a butterfly shuffle inside
# one wavefront: a group must be a power of two of 16-byte packs, at most 64 of them.
MAX_PACKS_PER_GROUP = 64


class Epilogue(str, enum.Enum):
    PER_TOKEN = "per_token"
    PER_GROUP = "per_group"


def fused_epilogue(caps: Capabilities, call: Call) -> tuple[Optional[Epilogue], str]:
    """``(the AITER epilogue that computes call.spec.quant exactly, "")``, or ``(None, why not)``."""
    why = _reason(caps, call)
    if why:
        return None, why
    assert call.spec.quant is not None
    return Epilogue(call.spec.quant.mode), ""


def _reason(caps: Capabilities, call: Call) -> str:
    spec = call.spec.quant
    assert spec is not None
    v = caps.version
    if spec.mode == "static":
        return "AITER has no fused static-scale FP8 epilogue"
    if spec.mode == Epilogue.PER_TOKEN and not caps.signature.per_token_quant:
        return (f"AITER {v}'s fused_ar_rms has no post_per_token_quant (ROCm/aiter#1990, "
                f"in {format_version(PER_TOKEN_QUANT)})")
    if spec.mode == Epilogue.PER_GROUP and not caps.signature.per_group_quant:
        return (f"AITER {v} has no fused_ar_rms_per_group_quant (ROCm/aiter#2823, "
                f"in {format_version(PER_GROUP_QUANT)})")
    if caps.fp8 is None:
        return f"AITER {v} has no FP8 dtype for this GPU"
    why = _math_differs(caps.fp8, call)
    if why:
        return f"AITER's FP8 epilogue {why}"
    if call.path is not Path.ONE_STAGE:
        # Its two-stage FP8 kernels are not the two-stage norm kernel: they take rows of
        # at most 1024 packs, need the packs per row to divide by the world size and
        # size their reductions without the one-stage kernel's padding, none of which
        # the gate knows.
        return "AITER's FP8 epilogue is taken on its one-stage kernel only"
    if spec.mode == Epilogue.PER_GROUP:
        return _group_reason(call)
    return ""


def _math_differs(fp8: torch.dtype, call: Call) -> str:
    spec = call.spec.quant
    assert spec is not None
    fp8_max = torch.finfo(fp8).max
    if spec.ue8m0:
        return "has no power-of-two (UE8M0) scales"
    if spec.scale_layout != "row":
        return f"writes row-major scales, the graph {spec.scale_layout}-layout ones"
    if spec.dtype != fp8:
        return f"writes {dtype_name(fp8)}, the graph {spec.fp8_dtype}"
    if spec.qmax != fp8_max:
        return f"scales to {fp8_max:g}, the graph to {spec.qmax:g}"
    if spec.scale_floor:
        return f"has no scale floor, the graph floors the scale at {spec.scale_floor!r}"
    if spec.reciprocal:
        return "divides by the scale, the graph multiplies by its reciprocal"
    if call.out_dtype != torch.float32:
        return (f"quantizes the float32 norm output, the graph the output rounded to "
                f"{dtype_name(call.out_dtype)}")
    if call.spec.emit_y:
        return "has no float32 copy of y, which the graph also uses"
    return ""


def _group_reason(call: Call) -> str:
    spec = call.spec.quant
    assert spec is not None
    if call.spec.gemma:
        return "AITER's fused_ar_rms_per_group_quant has no gemma_norm"
    pack = pack_size(dtype_name(call.x.dtype))
    packs = spec.group // pack
    if spec.group % pack or packs & (packs - 1) or packs > MAX_PACKS_PER_GROUP:
        return (f"AITER's per-group epilogue takes groups of a power of two of {pack}-element "
                f"packs, at most {MAX_PACKS_PER_GROUP}; not {spec.group}")
    return ""
