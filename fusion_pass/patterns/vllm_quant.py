"""vLLM's FP8 quantization ops after the norm, and its fused RMSNorm + quant ops.

Quant ops (a quant matcher on the norm output ``y``), as vLLM's ``QuantFP8``
with the custom op enabled puts them in the graph:

* ``auto_functionalized(_C.static_scaled_fp8_quant, result, input=y, scale)``;
* ``auto_functionalized(_C.dynamic_per_token_scaled_fp8_quant, result, input=y,
  scale, scale_ub)``;
* ``auto_functionalized(_C.per_token_group_fp8_quant, input=y, output_q, output_s,
  group_size, eps, fp8_min, fp8_max, scale_ue8m0, ...)``, with ``output_s``
  row-major, column-major or TMA-aligned column-major (what the block-FP8 GEMMs
  read) and UE8M0 scales or not;
* ``vllm.rocm_aiter_group_fp8_quant(y, group_size)`` and
  ``vllm.rocm_aiter_per_token_quant(y, dtype)`` (ROCm): recorded, not taken.

Fused norm + quant ops (a norm matcher on the all-reduce output): vLLM's
``RMSNormQuantFusionPass`` (``pass_config.fuse_norm_quant``, on by default on
CUDA) runs before a custom post-grad pass, so there the graph holds
``all_reduce -> _C.fused_add_rms_norm_static_fp8_quant`` and its kin; on ROCm
``RocmAiterRMSNormQuantFusionPass`` leaves ``vllm.rocm_aiter_rmsnorm_*`` ops, and from
vLLM 0.33 on ``vllm.rocm_aiter_fused_rms_fp8_per_tensor_static_quant(x, weight, epsilon,
scale, quant_dtype) -> q`` and ``vllm.rocm_aiter_fused_add_rms_fp8_per_tensor_static_quant
(x, residual, weight, epsilon, scale, quant_dtype) -> (q, residual_out)`` (AITER's Triton
``fused_rms_fp8_per_tensor_static_quant``: the residual added and the norm computed in fp32,
``clamp(norm * (1.0 / scale), -max, max)`` with ``max`` the FP8 dtype's finite max).

Each spec transcribes the kernel's math (vLLM's csrc, AITER): CUDA's static
kernels multiply by ``1 / scale``, its dynamic ones divide by the scale; their
clamp bound is 448 for ``float8_e4m3fn`` and 224 for ``float8_e4m3fnuz``
(``quant_type_max``), the per-token and per-block scales are floored at
``1 / (qmax * 512)`` in fp32; ``per_token_group_fp8_quant`` floors the amax at
its ``eps`` and takes its bounds as arguments; with ``scale_ue8m0`` it rounds the
scale up to a power of two, ``exp2f(ceilf(log2f(fmaxf(fabsf(y_s), 1e-10f))))``
(csrc/quantization/w8a8/fp8/per_token_group_quant.cu): the ``1e-10f`` joins the
floor, the rounding is :func:`fusion_pass.quant.pow2_ceil`.  Both it and
``rms_norm_per_block_quant`` store a token's group ``g`` scale at
``output_s + g * output_s.stride(1) + token`` when the scales are column-major
(``stride(0) < stride(1)``) and row-major otherwise: the layout is the graph's
allocation (its ``dummy_is_*`` flags are not read), which the match reads from
the scales tensor's strides.  AITER's Triton group kernel and
CK's per-token epilogue quantize the unrounded fp32 norm output (the match
asks the fused op for an fp32 ``y``) with bounds at the dtype's finite max.

Ops are recognised by schema name (``auto_functionalized`` unwrapped; the names are
in :mod:`fusion_pass.vllm_names`): most exist only in CUDA or ROCm builds.  Loaded by
:func:`fusion_pass.patterns.load_vllm_forms` once vLLM is imported.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import torch
from torch import fx
from torch._prims_common import make_contiguous_strides_for
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .. import vllm_names as vn
from ..quant import TMA_ALIGN, QuantSpec, fp32, fp32_div
from .epilogue import QuantMatch, QuantMiss, first_match, register_quant_matcher
from .fp8_quant import FP8_NAMES, Found, amax_floor, quant_match, same_shape
from .fx_utils import dtype_of, is_call, mutated_index, op_name, val
from .rms_norm import (Matched, NormMatch, NormMiss, Reduced, eps_operand,
                       register_norm_matcher, unwrap_weight)

_AF = torch.ops.higher_order.auto_functionalized
# per_token_group_quant.cu's UE8M0 rounding takes log2f(fmaxf(fabsf(y_s), 1e-10f)).
_UE8M0_MIN_SCALE = fp32(1e-10)


def cuda_qmax(dtype: torch.dtype) -> float:
    """vLLM's kernels' ``quant_type_max``: 224 for e4m3fnuz (not its 240) on ROCm."""
    return 224.0 if dtype == torch.float8_e4m3fnuz else 448.0


def cuda_floor(qmax: float) -> float:
    """vLLM's ``min_scaling_factor``: ``1.0f / (qmax * 512.0f)``."""
    return fp32_div(1.0, qmax * 512.0)


def bound_args(node: fx.Node) -> tuple[Optional[Any], dict[str, Any]]:
    """The op ``node`` calls (through ``auto_functionalized``) and its arguments by
    name, defaults filled in."""
    target: Any = node.target
    args, kwargs = node.args, node.kwargs
    if target is _AF:
        target, args = node.args[0], ()
    schema = getattr(target, "_schema", None)
    if schema is None:
        return None, {}
    bound = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    bound.update({a.name: v for a, v in zip(schema.arguments, args)})
    bound.update(kwargs)
    return target, bound


def outputs_by_index(node: fx.Node, names: dict[int, str]) -> Optional[dict[fx.Node, str]]:
    """``{getitem(node, i): names[i]}``; None if ``node`` is used otherwise."""
    outs = {}
    for u in node.users:
        if not (is_call(u, operator.getitem) and u.args[1] in names):
            return None
        outs[u] = names[u.args[1]]
    return outs


def mutated_names(node: fx.Node, names: dict[str, str]) -> dict[int, str]:
    """Output names by ``auto_functionalized`` index, for the mutated arguments in ``names``."""
    schema = node.args[0]._schema
    return {mutated_index(schema, arg): out for arg, out in names.items()}


# -- quant ops after the norm ------------------------------------------------------------------

def _quant_op(y: fx.Node, node: fx.Node) -> Found:
    name = op_name(node)
    target, a = bound_args(node)
    if target is None or a.get("input", a.get("x")) is not y:
        return None
    if name == vn.DYNAMIC_FP8_QUANT:
        return QuantMiss("a dynamic per-tensor scale (_C.dynamic_scaled_fp8_quant): QuantSpec "
                         "has per-token and per-group dynamic scales")
    if name == vn.AITER_GROUP_FP8_QUANT:
        return QuantMiss("AITER's per-1x128 kernel (vllm.rocm_aiter_group_fp8_quant) computes "
                         "the scale as max(amax, 1e-10) * (1 / qmax) with 1 / qmax rounded "
                         "to fp32; QuantSpec divides amax by qmax")
    if name == vn.AITER_PER_TOKEN_QUANT:
        return QuantMiss("AITER's per-token kernel (vllm.rocm_aiter_per_token_quant) scales by "
                         "amax * (1 / qmax) and quantizes with the GPU's approximate reciprocal "
                         "(rcp): not expressible by QuantSpec")
    if name == vn.STATIC_FP8_QUANT:
        outs_by = {"result": "q"}
    elif name == vn.PER_TOKEN_FP8_QUANT:
        outs_by = {"result": "q", "scale": "scales"}
    elif name == vn.PER_GROUP_FP8_QUANT:
        outs_by = {"output_q": "q", "output_s": "scales"}
    else:
        return None
    outputs = outputs_by_index(node, mutated_names(node, outs_by))
    q = next((n for n, o in (outputs or {}).items() if o == "q"), None)
    if q is None or dtype_of(q) not in FP8_NAMES:
        return QuantMiss(f"{node.name} ({name}) has outputs the fused op cannot serve "
                         f"(its codes unused, of dtype {dtype_of(q)}, or used other than by index)")
    spec = _quant_op_spec(name, a, dtype_of(q), val(y).shape[-1])
    if isinstance(spec, QuantSpec) and spec.mode == "per_group":
        spec = _laid_out(spec, a["output_s"], val(y).shape)
    if isinstance(spec, str):
        return QuantMiss(f"{name}: {spec}")
    scales = next((n for n, o in outputs.items() if o == "scales"), None)
    if scales is not None and not same_shape(scales, spec.scales_shape(val(y).shape)):
        return QuantMiss(f"{name}'s scales {tuple(val(scales).shape)} are not "
                         f"{spec.scales_shape(val(y).shape)}")
    return quant_match(name.split("::")[-1], spec, outputs, {node, *outputs}, [node],
                       a["scale"] if spec.mode == "static" else None)


def _quant_op_spec(name: str, a: dict[str, Any], dtype: torch.dtype,
                   hidden: int) -> Union[QuantSpec, str]:
    """The QuantSpec of a vLLM ``_C`` quant op with arguments ``a``, or why there is none."""
    fp8 = FP8_NAMES[dtype]
    if name == vn.STATIC_FP8_QUANT:
        scale = val(a["scale"])
        if scale is None or scale.numel() != 1:
            return (f"the static scale has shape {None if scale is None else tuple(scale.shape)} "
                    "(per-channel or grouped static scales): QuantSpec takes one per-tensor scale")
        return QuantSpec("static", fp8_dtype=fp8, qmax=cuda_qmax(dtype), reciprocal=True)
    if name == vn.PER_TOKEN_FP8_QUANT:
        if a.get("scale_ub") is not None:
            return "the per-token scale has an upper bound (scale_ub): not expressible by QuantSpec"
        qmax = cuda_qmax(dtype)
        return QuantSpec("per_token", fp8_dtype=fp8, qmax=qmax, scale_floor=cuda_floor(qmax))
    if a["fp8_min"] != -a["fp8_max"] or hidden % a["group_size"]:
        return (f"bounds [{a['fp8_min']}, {a['fp8_max']}] or group {a['group_size']} for hidden "
                f"{hidden}: not expressible by QuantSpec")
    qmax = float(a["fp8_max"])
    floor = amax_floor(a["eps"], qmax)
    if a["scale_ue8m0"]:
        # The kernel rounds max(y_s, 1e-10f): that bound is part of the floor.
        floor = max(floor, _UE8M0_MIN_SCALE)
    return QuantSpec("per_group", fp8_dtype=fp8, qmax=qmax, group=a["group_size"],
                     scale_floor=floor, ue8m0=bool(a["scale_ue8m0"]))


def _laid_out(spec: QuantSpec, scales: Any, x_shape: torch.Size) -> Union[QuantSpec, str]:
    """``spec`` with the layout of ``scales`` (the graph's allocation, for an input of
    ``x_shape``), or why the fused op cannot write it: row-major (contiguous), or for
    a 2-D input column-major or TMA-aligned column-major, the layouts vLLM allocates."""
    v = val(scales)
    if v is None:
        return "the scales tensor has no shape to read its layout from"

    def strides_are(*want: Any) -> bool:
        return v.dim() == len(want) and all(
            statically_known_true(a == b) for a, b in zip(v.stride(), want))

    if strides_are(*make_contiguous_strides_for(v.shape)):
        return spec
    if len(x_shape) == 2:
        tokens = x_shape[0]
        for layout in ("col", "col_tma"):
            laid = replace(spec, scale_layout=layout)
            if strides_are(*laid.scale_strides(x_shape)):
                return laid
        # vLLM's _custom_ops.rms_norm_per_block_quant spells the TMA size
        # (m + 3) // 4 * 4: the same for every m, not provably so symbolically.
        if strides_are(1, (tokens + TMA_ALIGN - 1) // TMA_ALIGN * TMA_ALIGN):
            return replace(spec, scale_layout="col_tma")
    return (f"group scales with strides {tuple(v.stride())} for an input of shape "
            f"{tuple(x_shape)}: the fused op writes row-major scales, and for a 2-D input "
            "column-major or TMA-aligned column-major ones")


def match_vllm_quant(norm: NormMatch, y: fx.Node) -> Found:
    return first_match(_quant_op(y, node) for node in list(y.users))


# -- fused norm + quant ops ----------------------------------------------------------------------

@dataclass(frozen=True)
class _Fused:
    """How a fused norm+quant op names its pieces."""

    mode: str
    x: str
    weight: str
    eps: str
    outputs: dict[Union[str, int], str]
    """Output name by mutated argument (``auto_functionalized``) or by index of the
    returned tuple (functional ops)."""
    residual: Optional[str] = None
    aiter: bool = False
    """AITER's kernels: bounds at the dtype's finite max, the fp32 norm quantized."""


_C_OUTS = {"result": "q", "residual": "h"}
_C_DYNAMIC_OUTS = {**_C_OUTS, "scale": "scales"}
_AITER_OUTS: dict[Union[str, int], str] = {0: "q", 1: "scales"}
_AITER_ADD_OUTS: dict[Union[str, int], str] = {0: "q", 1: "h", 2: "scales"}
_FUSED = {
    vn.RMS_NORM_STATIC_FP8: _Fused("static", "input", "weight", "epsilon", _C_OUTS),
    vn.ADD_RMS_NORM_STATIC_FP8:
        _Fused("static", "input", "weight", "epsilon", _C_OUTS, "residual"),
    vn.RMS_NORM_PER_TOKEN:
        _Fused("per_token", "input", "weight", "epsilon", _C_DYNAMIC_OUTS, "residual"),
    vn.RMS_NORM_PER_BLOCK:
        _Fused("per_group", "input", "weight", "epsilon", _C_DYNAMIC_OUTS, "residual"),
    vn.AITER_RMS_NORM_GROUP_FP8:
        _Fused("per_group", "x", "weight", "variance_epsilon", _AITER_OUTS, aiter=True),
    vn.AITER_ADD_RMS_NORM_GROUP_FP8:
        _Fused("per_group", "x", "weight", "variance_epsilon", _AITER_ADD_OUTS, "residual",
               aiter=True),
    vn.AITER_RMS_NORM_PER_TOKEN:
        _Fused("per_token", "x", "weight", "epsilon", _AITER_OUTS, aiter=True),
    vn.AITER_ADD_RMS_NORM_PER_TOKEN:
        _Fused("per_token", "x", "weight", "epsilon", _AITER_ADD_OUTS, "residual", aiter=True),
    # vLLM 0.33+: AITER's Triton fused_rms_fp8_per_tensor_static_quant; the first returns
    # the codes alone, the second (codes, residual_out).
    vn.AITER_RMS_NORM_STATIC_FP8:
        _Fused("static", "x", "weight", "epsilon", {0: "q"}, aiter=True),
    vn.AITER_ADD_RMS_NORM_STATIC_FP8:
        _Fused("static", "x", "weight", "epsilon", {0: "q", 1: "h"}, "residual", aiter=True),
}
# AITER's Triton group kernel floors the amax at this before dividing.
_AITER_AMAX_FLOOR = 1e-10


def _one_static_scale(scale: Any) -> Optional[str]:
    """Why a fused op's static scale is not one the fused op takes; None if it is."""
    v = val(scale)
    if v is None or v.numel() != 1:
        return "the static scale is not one value: QuantSpec takes a per-tensor scale"
    return None


def _fused_spec(kind: _Fused, a: dict[str, Any], dtype: torch.dtype,
                x_shape: torch.Size) -> Union[QuantSpec, str]:
    fp8 = FP8_NAMES[dtype]
    hidden = x_shape[-1]
    if a.get("scale_ub") is not None:
        return "the scale has an upper bound (scale_ub): not expressible by QuantSpec"
    if kind.aiter:
        qmax = float(torch.finfo(dtype).max)
        if kind.mode == "static":
            # fused_rms_fp8_per_tensor_static_quant: clamp(norm * (1.0 / scale)) to the
            # dtype's finite max, the fp32 norm unrounded (rmsnorm_convert_to_inp1_type off).
            return _one_static_scale(a["scale"]) or QuantSpec(
                "static", fp8_dtype=fp8, qmax=qmax, reciprocal=True)
        if kind.mode == "per_token":
            return QuantSpec("per_token", fp8_dtype=fp8, qmax=qmax)
        return QuantSpec("per_group", fp8_dtype=fp8, qmax=qmax, group=a["group_size"],
                         scale_floor=amax_floor(_AITER_AMAX_FLOOR, qmax), reciprocal=True)
    qmax = cuda_qmax(dtype)
    if kind.mode == "static":
        return _one_static_scale(a["scale"]) or QuantSpec(
            "static", fp8_dtype=fp8, qmax=qmax, reciprocal=True)
    group = a["group_size"] if kind.mode == "per_group" else 0
    if group and hidden % group:
        return f"hidden {hidden} is not a whole number of {group}-element groups"
    spec = QuantSpec(kind.mode, fp8_dtype=fp8, qmax=qmax, group=group,
                     scale_floor=cuda_floor(qmax))
    if not group:
        return spec
    # The kernel stores by the flag: column-major with the scales' stride(1) when
    # is_scale_transposed, row-major otherwise; scales laid out the other way would
    # be written wrong (or refused).
    laid = _laid_out(spec, a["scale"], x_shape)
    if isinstance(laid, QuantSpec) and (laid.scale_layout != "row") != a["is_scale_transposed"]:
        return (f"is_scale_transposed={a['is_scale_transposed']} disagrees with its "
                f"{laid.scale_layout}-layout scales")
    return laid


def _fused_norm(ar: fx.Node, node: fx.Node) -> Optional[Matched]:
    name = op_name(node)
    kind = _FUSED.get(name)
    if kind is None:
        return None
    target, a = bound_args(node)
    if a.get(kind.x) is not ar:
        return None
    hidden = val(ar).shape[-1]
    residual = a.get(kind.residual) if kind.residual else None
    if node.target is _AF:
        wanted = {k: v for k, v in kind.outputs.items() if isinstance(k, str)}
        if residual is None:
            wanted.pop("residual", None)
        outputs = outputs_by_index(node, mutated_names(node, wanted))
    elif len(target._schema.returns) == 1:  # one tensor returned: the node is that output
        outputs = {node: kind.outputs[0]}
    else:
        outputs = outputs_by_index(
            node, {k: v for k, v in kind.outputs.items() if isinstance(k, int)})
    if outputs is None:
        return NormMiss(f"{node.name} ({name})'s outputs are used other than by indexing",
                        node)
    q = next((n for n, o in outputs.items() if o == "q"), None)
    found = unwrap_weight(a[kind.weight], hidden)
    eps = eps_operand(a[kind.eps])
    if q is None or dtype_of(q) not in FP8_NAMES or found is None or isinstance(eps, str):
        return NormMiss(f"{node.name} ({name}): no FP8 codes used, or a weight or eps the fused "
                        "op cannot take", node)
    spec = _fused_spec(kind, a, dtype_of(q), val(ar).shape)
    if isinstance(spec, str):
        return NormMiss(f"{node.name} ({name}): {spec}", node)
    scales = next((n for n, o in outputs.items() if o == "scales"), None)
    if scales is not None and not same_shape(scales, spec.scales_shape(val(ar).shape)):
        return NormMiss(f"{node.name} ({name}): scales {tuple(val(scales).shape)} are not "
                        f"{spec.scales_shape(val(ar).shape)}", node)
    quant_outs = {n: o for n, o in outputs.items() if o in ("q", "scales")}
    # The op's node is an intermediate unless it is itself an output (one tensor returned).
    inner = {node} - set(outputs)
    quant = QuantMatch(form=name.split("::")[-1], spec=spec,
                       scale=a["scale"] if spec.mode == "static" else None,
                       outputs=quant_outs, nodes={node, *quant_outs}, private=inner)
    if residual is None:
        outputs[ar] = "h"
    return NormMatch(form=name.split("::")[-1], weight=found[0], eps=eps,
                     out_dtype=torch.float32 if kind.aiter else dtype_of(ar),
                     residual=residual, gemma=found[1], outputs=outputs,
                     nodes={node, ar, *outputs},
                     private=inner | ({ar} if residual is not None else set()),
                     quant=quant)


def match_fused_norm_quant(red: Reduced) -> Optional[Matched]:
    """A vLLM fused RMSNorm + FP8 quant op fed by the reduced value; None when it feeds none."""
    ar = red.value
    v = val(ar)
    if v is None or v.dim() < 1:
        return None
    miss = None
    for node in ar.users:
        found = _fused_norm(ar, node)
        if isinstance(found, NormMatch):
            return found
        miss = miss or found
    return miss


register_quant_matcher("vllm", match_vllm_quant, priority=10)
register_norm_matcher("vllm_fused_quant", match_fused_norm_quant, priority=20)
