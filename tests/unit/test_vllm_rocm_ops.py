"""vLLM 0.33's and 0.34's ROCm ops after an all-reduce, on two gloo ranks with vLLM's TP group.

* vLLM 0.33+'s norm + quant fusion (``fuse_norm_quant``, AITER) runs before custom passes and
  leaves ``vllm.rocm_aiter_fused_rms_fp8_per_tensor_static_quant`` and
  ``vllm.rocm_aiter_fused_add_rms_fp8_per_tensor_static_quant`` after the all-reduce: fused,
  with the static FP8 epilogue of AITER's kernel.
* vLLM 0.34's ``MuseSandwichNormFusionPass`` (gfx950) leaves AITER's
  ``fused_rmsnorm_add_rmsnorm`` (norm, residual add, norm): recorded unfused with the op named;
  the same layer without that pass (``vllm_ir`` norms) fuses.

The ops exist only on ROCm: the stand-ins are defined under their real names with the schemas
vLLM 0.33/0.34 register (``vllm/_aiter_ops.py``; AITER's ``torch_compile_guard`` infers the
sandwich op's from ``aiter/ops/triton/normalization/fused_rmsnorm_add_rmsnorm.py``), and their
math transcribes AITER's Triton kernels: the residual added and the norm computed in fp32, the
static quant ``clamp(norm * (1.0 / scale), -max, max)`` with ``max`` the FP8 dtype's finite
max; the sandwich kernel's two fp32 norms with ``1 + w`` weights, its residual sum stored in
bf16.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from fusion_pass.quant import QuantSpec
from fusion_pass.testing.vllm_tp import run_vllm_ranks, vllm_tp_group
from fx_text import calls
from test_fp8_pass import (EPS, FUSED, PLAIN, assert_dequantized_close, compile_graph, inputs,
                           quant_args, reference_y)

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

F32 = torch.float32
FP8 = torch.float8_e4m3fn
FNUZ = torch.float8_e4m3fnuz


def _aiter_norm(x, residual, weight, eps):
    """AITER Triton's _rmsmorm_op on the fp32 input (plus residual): (norm fp32, sum fp32)."""
    s = x.float() + residual.float() if residual is not None else x.float()
    return s * torch.rsqrt((s * s).sum(-1, keepdim=True) / s.shape[-1] + eps) * weight.float(), s


def _aiter_static(norm, scale, dtype):
    """The kernel loads the scale's first element (``tl.load(scale_ptr)``)."""
    qmax = torch.finfo(dtype).max
    return (norm * (1.0 / scale.float().reshape(-1)[0])).clamp(-qmax, qmax).to(dtype)


def _rms_static(x, weight, epsilon, scale, quant_dtype):
    return _aiter_static(_aiter_norm(x, None, weight, epsilon)[0], scale, quant_dtype)


def _add_rms_static(x, residual, weight, epsilon, scale, quant_dtype):
    norm, s = _aiter_norm(x, residual, weight, epsilon)
    return _aiter_static(norm, scale, quant_dtype), s.to(x.dtype)


def _sandwich(x, residual, post_weight, pre_weight, post_eps, pre_eps, residual_out):
    """_fused_rmsnorm_add_rmsnorm_kernel: both norms in fp32 with Gemma's ``1 + w``."""
    post = _aiter_norm(x, None, post_weight.float() + 1.0, post_eps)[0]
    added = post + residual.float()
    residual_out.copy_(added.to(residual_out.dtype))
    return _aiter_norm(added, None, pre_weight.float() + 1.0, pre_eps)[0].to(x.dtype)


STAND_INS: dict[str, tuple[str, Callable, Callable]] = {
    "vllm::rocm_aiter_fused_rms_fp8_per_tensor_static_quant": (
        "(Tensor x, Tensor weight, float epsilon, Tensor scale, ScalarType quant_dtype) -> Tensor",
        _rms_static, lambda x, w, e, s, dt: torch.empty_like(x, dtype=dt)),
    "vllm::rocm_aiter_fused_add_rms_fp8_per_tensor_static_quant": (
        "(Tensor x, Tensor residual, Tensor weight, float epsilon, Tensor scale, "
        "ScalarType quant_dtype) -> (Tensor, Tensor)",
        _add_rms_static,
        lambda x, r, w, e, s, dt: (torch.empty_like(x, dtype=dt), torch.empty_like(r))),
    "aiter::fused_rmsnorm_add_rmsnorm": (
        "(Tensor x, Tensor residual, Tensor post_weight, Tensor pre_weight, float post_eps, "
        "float pre_eps, Tensor(a6!) residual_out) -> Tensor",
        _sandwich, lambda x, r, wp, wq, e1, e2, ro: torch.empty_like(x)),
}
_LIBS: list = []


def define_stand_ins() -> None:
    for qualname, (schema, impl, fake) in STAND_INS.items():
        ns, name = qualname.split("::")
        if hasattr(getattr(torch.ops, ns), name):  # a ROCm build's own op
            continue
        lib = torch.library.Library(ns, "FRAGMENT")
        lib.define(name + schema)
        lib.impl(name, impl, "CPU")
        torch.library.register_fake(qualname, fake, lib=lib)
        _LIBS.append(lib)


AITER_STATIC = QuantSpec("static", qmax=448.0, reciprocal=True)
CASES = {
    "rms_static": (False, FP8, AITER_STATIC),
    "add_rms_static": (True, FP8, AITER_STATIC),
    "add_rms_static_e4m3fnuz": (True, FNUZ, QuantSpec("static", fp8_dtype="float8_e4m3fnuz",
                                                      qmax=240.0, reciprocal=True)),
    # A scale of more than one value (not what vLLM emits): the fused op takes one.
    "miss_two_scales": (True, FP8, "the static scale is not one value"),
}


def _fresh(d: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Copies of the inputs for one call: vLLM's CPU all-reduce sums in place."""
    return d["x"].clone(), d["r"].clone(), d["s"].clone()


def _rocm_cases(rank: int, world_size: int) -> dict:
    results: dict = {}
    with vllm_tp_group(rank, world_size) as (tp, c10d_group):
        define_stand_ins()
        for name, (residual, dtype, expect) in CASES.items():
            d = inputs(rank, torch.bfloat16, False)
            if name == "miss_two_scales":
                d["s"] = torch.tensor([0.005, 0.004])

            def fn(x, r, s, residual=residual, dtype=dtype, w=d["w"]):
                ar = torch.ops.vllm.all_reduce(x, tp)
                if residual:
                    q, h = torch.ops.vllm.rocm_aiter_fused_add_rms_fp8_per_tensor_static_quant(
                        x=ar, residual=r, weight=w, epsilon=EPS, scale=s, quant_dtype=dtype)
                    return q, h
                return torch.ops.vllm.rocm_aiter_fused_rms_fp8_per_tensor_static_quant(
                    x=ar, weight=w, epsilon=EPS, scale=s, quant_dtype=dtype), ar

            res = compile_graph(fn, _fresh(d), raise_on_alias=isinstance(expect, QuantSpec))
            res["eager"] = fn(*_fresh(d))
            res["s"] = d["s"]
            if isinstance(expect, QuantSpec):
                res["y"] = reference_y(d, residual, False, c10d_group, F32)
            results[name] = res

        g = torch.Generator().manual_seed(5)
        wp, wq = (0.1 * torch.randn(2, 256, generator=g)).to(torch.bfloat16)

        def sandwich(x, r, s):
            ar = torch.ops.vllm.all_reduce(x, tp)
            out = torch.empty_like(ar)
            return torch.ops.aiter.fused_rmsnorm_add_rmsnorm(ar, r, wp, wq, 1e-6, 1e-5, out), out

        def unfused_sandwich(x, r, s):
            """The same layer where vLLM's sandwich pass does not run (vllm_ir norms)."""
            post = torch.ops.vllm_ir.rms_norm(torch.ops.vllm.all_reduce(x, tp), wp.float() + 1.0,
                                              1e-6, None)
            out = r + post
            return torch.ops.vllm_ir.rms_norm(out, wq.float() + 1.0, 1e-5, None), out

        for name, fn in (("sandwich", sandwich), ("unfused_sandwich", unfused_sandwich)):
            d = inputs(rank, torch.bfloat16, False)
            res = compile_graph(fn, _fresh(d), raise_on_alias=name != "sandwich")
            res["eager"] = fn(*_fresh(d))
            results[name] = res
    return results


@pytest.fixture(scope="module")
def rocm_results():
    return run_vllm_ranks(_rocm_cases)


FUSED_CASES = sorted(n for n, c in CASES.items() if isinstance(c[2], QuantSpec))


@pytest.mark.parametrize("name", FUSED_CASES)
def test_aiter_static_quant_ops_fuse_with_the_kernels_epilogue(rocm_results, name) -> None:
    residual, dtype, spec = CASES[name]
    op = ("rocm_aiter_fused_add_rms_fp8_per_tensor_static_quant" if residual
          else "rocm_aiter_fused_rms_fp8_per_tensor_static_quant")
    for res in rocm_results:
        r = res[name]
        assert calls(r["before"], "vllm.all_reduce") == 1 and calls(r["before"], f"vllm.{op}") == 1
        assert calls(r["after"], FUSED) == 1 and calls(r["after"], PLAIN) == 0
        assert calls(r["after"], "vllm.") == 0
        assert quant_args(r["after"]) == (spec.encode(), "False")
        (norm, path, reason, quant, out_dtype), = r["sites"]
        # AITER quantizes the unrounded fp32 norm: the fused op is asked for an fp32 y.
        assert (norm, path, quant, out_dtype) == (op, "runtime", "static", "float32")


@pytest.mark.parametrize("name", FUSED_CASES)
def test_aiter_static_codes_match_the_kernel(rocm_results, name) -> None:
    residual, dtype, spec = CASES[name]
    for res in rocm_results:
        r = res[name]
        (q, h), (q_e, h_e) = r["out"], r["eager"]
        assert q.dtype == dtype and torch.equal(h, h_e)
        # The kernel's quantization of the fused op's own y: the same codes, bit for bit.
        assert torch.equal(q.view(torch.uint8), _aiter_static(r["y"], r["s"], dtype).view(
            torch.uint8))
        # Against the stand-in, whose norm reads the unrounded fp32 sum: within one FP8 step.
        assert_dequantized_close(spec, (q,), (q_e,), r["s"])
        # The static scale clamps some codes at the dtype's finite max.
        assert q.float().abs().max() == torch.finfo(dtype).max


def test_a_static_scale_of_more_values_is_left_alone_with_its_reason(rocm_results) -> None:
    for res in rocm_results:
        r = res["miss_two_scales"]
        assert r["after"] == r["before"]
        (norm, path, reason, quant, _), = r["sites"]
        assert path == "unfused" and quant is None
        assert "rocm_aiter_fused_add_rms_fp8_per_tensor_static_quant" in reason
        assert "the static scale is not one value" in reason


def test_sandwich_norm_is_recorded_with_the_op_named(rocm_results) -> None:
    for res in rocm_results:
        r = res["sandwich"]
        assert r["after"] == r["before"]
        assert calls(r["after"], FUSED) == 0 and calls(r["after"], PLAIN) == 0
        (norm, path, reason, quant, _), = r["sites"]
        assert path == "unfused"
        assert "aiter::fused_rmsnorm_add_rmsnorm" in reason
        assert "MuseSandwichNormFusionPass" in reason
        for got, want in zip(r["out"], r["eager"]):
            assert torch.equal(got, want)


def test_the_same_layer_without_the_sandwich_pass_fuses(rocm_results) -> None:
    for res in rocm_results:
        r = res["unfused_sandwich"]
        assert calls(r["after"], PLAIN) == 1 and calls(r["after"], "vllm.all_reduce") == 0
        (norm, path, reason, quant, _), = r["sites"]
        assert norm == "vllm_ir_rms_norm" and path == "runtime"
        for got, want in zip(r["out"], r["eager"]):
            torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)


def test_sandwich_kernel_launched_directly_is_named() -> None:
    """AITER releases that launch the Triton kernel from Python leave a Triton-kernel call
    in the graph: the site is recorded with the kernel named; other kernels are not taken."""
    triton = pytest.importorskip("triton")
    from torch._higher_order_ops.triton_kernel_wrap import (kernel_side_table,
                                                            triton_kernel_wrapper_functional)

    from fusion_pass.patterns import vllm_sandwich
    from fusion_pass.patterns.rms_norm import NormMiss, Reduced

    def graph_with(kernel) -> tuple[torch.fx.Node, torch.fx.Node]:
        g = torch.fx.Graph()
        ar, r = g.placeholder("ar"), g.placeholder("r")
        call = g.call_function(triton_kernel_wrapper_functional, kwargs=dict(
            kernel_idx=kernel_side_table.add_kernel(kernel), constant_args_idx=0,
            grid=[(1, 1, 1)], tma_descriptor_metadata={},
            kwargs={"x_ptr": ar, "residual_ptr": r}, tensors_to_clone=[]))
        return ar, call

    ar, call = graph_with(triton.jit(_fused_rmsnorm_add_rmsnorm_kernel))
    miss = vllm_sandwich.match_sandwich(Reduced(ar, ar))  # the reduced value as it stands
    assert isinstance(miss, NormMiss) and miss.at is call
    assert "Triton kernel _fused_rmsnorm_add_rmsnorm_kernel" in miss.reason
    assert "MuseSandwichNormFusionPass" in miss.reason
    other, _ = graph_with(triton.jit(_another_kernel))
    assert vllm_sandwich.match_sandwich(Reduced(other, other)) is None


def _fused_rmsnorm_add_rmsnorm_kernel(x_ptr, residual_ptr):  # AITER's kernel's name
    pass


def _another_kernel(x_ptr, residual_ptr):
    pass
