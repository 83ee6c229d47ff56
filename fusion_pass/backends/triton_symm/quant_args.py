"""The FP8 epilogue's host side: whether the kernels can compute a
:class:`QuantSpec`, and the constexprs that select its steps in
:func:`norm.finish_row`.  Importing it needs torch alone."""

from __future__ import annotations

from typing import Any, Optional

from ...quant import QuantSpec, fp32, fp32_div


def quant_decline(spec: QuantSpec, hidden: int) -> Optional[str]:
    """Why the kernels' FP8 epilogue cannot compute ``spec`` (the op then
    quantizes the fused ``y`` itself), or None."""
    group = spec.group
    if spec.mode == "per_group" and (group & (group - 1) or group > hidden):
        return f"group {spec.group} is not a power of two within the row"
    if spec.fp8_dtype == "float8_e4m3fnuz" and spec.qmax > 240.0:
        return f"e4m3fnuz with qmax {spec.qmax} above its largest value, 240"
    return None


QUANT_MODE = {"static": 1, "per_token": 2, "per_group": 3}
"""The kernels' ``QUANT`` constexpr per FP8 mode (0: no quantization)."""
# UE8M0 group scales are a QUANT of their own, so that the kernels' signatures need
# no flag that only one mode reads.
QUANT_UE8M0 = 4
GROUP_QUANTS = frozenset({QUANT_MODE["per_group"], QUANT_UE8M0})
"""The ``QUANT`` values whose scales are per group of columns."""
_NO_QUANT = dict(QUANT=0, GROUP=1, QMAX=0.0, INV_QMAX=0.0, FLOOR=0.0, RECIP=False, FNUZ=False)


def quant_constexprs(spec: Optional[QuantSpec]) -> dict[str, Any]:
    if spec is None:
        return dict(_NO_QUANT)
    qmax = fp32(spec.qmax)
    inv = fp32_div(1.0, qmax)
    mode = QUANT_UE8M0 if spec.ue8m0 else QUANT_MODE[spec.mode]
    return dict(QUANT=mode, GROUP=spec.group or 1, QMAX=qmax, INV_QMAX=inv,
                FLOOR=fp32(spec.scale_floor), RECIP=spec.reciprocal,
                FNUZ=spec.fp8_dtype == "float8_e4m3fnuz")
