"""FP8 epilogues fused by the pass in plain torch.compile graphs, on two gloo ranks.

Every quant mode (static per-tensor, dynamic per-token, dynamic per 128-group) x
residual or not x Gemma or plain weight, in vLLM's native ``QuantFP8`` spelling;
torchao's and hand-written spellings; and the forms left separate, each with the
reason the pass records.

Numerics, every element: the fused op's FP8 codes against Inductor's compile of the
same quantization of the same ``y`` (the graph compiled with the norm fused and the
quantization left to Inductor).  Codes may differ only between neighbouring codes
whose fp32 value lies within an fp32 ulp of the tie between them; scales by at most
one fp32 ulp.  The codes also dequantize to the eager (unfused, uncompiled) model's
within one FP8 step, and ``h`` (and ``y`` where the graph uses it) match exactly.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional
import contextlib

import pytest
import torch

from fusion_pass.quant import QuantSpec, quantize
from fusion_pass.testing.spawn import run_ranks

pytestmark = pytest.mark.slow

HIDDEN = 256
TOKENS = 24
ZERO_ROW = 5
EPS = 1e-6
FP8 = torch.float8_e4m3fn
F32 = torch.float32
FUSED = "fusion_pass.allreduce_rmsnorm_quant.default"
PLAIN = "fusion_pass.allreduce_rmsnorm.default"
# vLLM's QuantFP8 floor (input_quant_fp8._FP8_MIN_SCALING_FACTOR), written as it does.
VLLM_FLOOR = 1.0 / (448.0 * 512.0)


def f32(x: float) -> float:
    return float(torch.tensor(x, dtype=F32))


def f32_quotient(a: float, b: float) -> float:
    return float(torch.tensor(a, dtype=F32) / torch.tensor(b, dtype=F32))


# -- the quantizations, as the libraries write them -------------------------------------------
# Each takes the norm output ``y`` and the static scale tensor ``s`` (used or not) and
# returns its outputs, the codes first and then the scales of a dynamic mode.

def vllm_static(y, s):
    """vLLM QuantFP8.forward_native, static per-tensor."""
    return ((y.to(F32) * s.to(F32).reciprocal()).clamp(-448.0, 448.0).to(FP8),)


def div_static(y, s):
    """torchao _quantize_affine_float8."""
    return ((y.to(F32) / s).clamp(min=-448.0, max=448.0).to(FP8),)


def one_over_static(y, s):
    return ((y.float() * (1 / s)).clamp(-448, 448).to(FP8),)


def vllm_token(y, s, dtype=FP8, qmax=448.0):
    """vLLM QuantFP8.forward_native, dynamic per-token."""
    x_max = y.abs().amax(dim=-1).unsqueeze(-1).to(F32)
    scale = (x_max / qmax).clamp(min=1.0 / (qmax * 512.0))
    return (y.to(F32) * scale.reciprocal()).clamp(-qmax, qmax).to(dtype), scale


def fnuz_token(y, s):
    """vLLM on MI300 (float8_e4m3fnuz, bound 224)."""
    return vllm_token(y, s, torch.float8_e4m3fnuz, 224.0)


def torchao_token(y, s):
    """torchao _choose_scale_float8 with hp_value_lb, then _quantize_affine_float8."""
    amax = y.to(F32).abs().amax(-1, keepdim=True).clamp(min=1e-12)
    scale = amax / 448.0
    return (y.to(F32) / scale).clamp(-448.0, 448.0).to(FP8), scale


def vllm_group(y, s):
    """vLLM QuantFP8._quantize_group_native, 128-element groups."""
    groups = y.view(-1, HIDDEN // 128, 128)
    absmax = groups.abs().max(dim=-1, keepdim=True)[0].float()
    scales = (absmax / 448.0).clamp(min=VLLM_FLOOR)
    q = (groups / scales).clamp(-448.0, 448.0).to(FP8).view(-1, HIDDEN).view(y.shape)
    return q, scales.squeeze(-1).reshape(y.shape[:-1] + (HIDDEN // 128,))


def group_column_major(y, s):
    """The same with QuantFP8(column_major_scales=True)."""
    q, scales = vllm_group(y, s)
    return q, scales.transpose(-2, -1).contiguous().transpose(-1, -2)


def group_amax_floor_no_clamp(y, s):
    """A DeepSeek-style group quant: the amax floored before the division, no clamp."""
    groups = y.float().unflatten(-1, (HIDDEN // 128, 128))
    scales = groups.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448.0
    return (groups / scales).to(FP8).flatten(-2), scales.squeeze(-1)


# Not taken: the quantization stays in the graph, the norm still fuses.

def per_tensor_dynamic(y, s):
    x_max = y.abs().max().unsqueeze(-1).to(F32)
    scale = (x_max / 448.0).clamp(min=VLLM_FLOOR)
    return (y.to(F32) * scale.reciprocal()).clamp(-448.0, 448.0).to(FP8), scale


def ue8m0_group(y, s):
    groups = y.view(-1, HIDDEN // 128, 128)
    absmax = groups.abs().max(dim=-1, keepdim=True)[0].float()
    scales = torch.exp2(torch.ceil(torch.log2(absmax / 448.0))).clamp(min=VLLM_FLOOR)
    q = (groups / scales).clamp(-448.0, 448.0).to(FP8).view(y.shape)
    return q, scales.squeeze(-1)


def inverse_scale_input(y, s):
    """torchao float8 training convention: ``s`` multiplies."""
    return ((y.float() * s).clamp(-448.0, 448.0).to(FP8),)


def to_e5m2(y, s):
    return ((y.float() / s).clamp(-57344.0, 57344.0).to(torch.float8_e5m2),)


def asymmetric_clamp(y, s):
    return ((y.float() / s).clamp(-448.0, 400.0).to(FP8),)


def scale_upper_bound(y, s):
    x_max = y.abs().amax(dim=-1).unsqueeze(-1).to(F32).clamp(max=2.0)
    scale = (x_max / 448.0).clamp(min=VLLM_FLOOR)
    return (y.to(F32) * scale.reciprocal()).clamp(-448.0, 448.0).to(FP8), scale


def static_no_clamp(y, s):
    return ((y.float() / s).to(FP8),)


def divisor_not_bound(y, s):
    scale = (y.abs().amax(-1, keepdim=True).float() / 240.0).clamp(min=VLLM_FLOOR)
    return (y.float() / scale).clamp(-448.0, 448.0).to(FP8), scale


def bf16_scaling(y, s):
    return ((y / s.to(y.dtype)).clamp(-448.0, 448.0).to(FP8),)


def scaled_values_used(y, s):
    v = y.to(F32) * s.reciprocal()
    return v.clamp(-448.0, 448.0).to(FP8), v.sum(-1)


# -- cases -------------------------------------------------------------------------------------

TOKEN_SPEC = QuantSpec("per_token", qmax=448.0, scale_floor=f32(VLLM_FLOOR), reciprocal=True)
GROUP_SPEC = QuantSpec("per_group", qmax=448.0, group=128, scale_floor=f32(VLLM_FLOOR))
STATIC_SPEC = QuantSpec("static", qmax=448.0, reciprocal=True)
MODE_FORMS = {"static": (vllm_static, STATIC_SPEC), "per_token": (vllm_token, TOKEN_SPEC),
              "per_group": (vllm_group, GROUP_SPEC)}


class Case:
    def __init__(self, quant: Callable, expect: QuantSpec | str, residual: bool = True,
                 gemma: bool = False, dtype: str = "bfloat16", emit_y: bool = False) -> None:
        self.quant, self.expect, self.residual, self.gemma = quant, expect, residual, gemma
        self.dtype, self.emit_y = dtype, emit_y

    @property
    def fused(self) -> bool:
        return isinstance(self.expect, QuantSpec)


CASES: dict[str, Case] = {
    f"{mode}_{'residual' if res else 'no_residual'}_{'gemma' if gemma else 'plain'}":
        Case(quant, spec, residual=res, gemma=gemma)
    for mode, (quant, spec) in MODE_FORMS.items()
    for res in (True, False) for gemma in (False, True)
}
CASES.update({
    "static_divide": Case(div_static, QuantSpec("static", qmax=448.0)),
    "static_one_over": Case(one_over_static, STATIC_SPEC),
    "per_token_torchao": Case(torchao_token, QuantSpec("per_token", qmax=448.0,
                                                       scale_floor=f32_quotient(1e-12, 448.0))),
    "per_token_e4m3fnuz": Case(fnuz_token, QuantSpec(
        "per_token", fp8_dtype="float8_e4m3fnuz", qmax=224.0,
        scale_floor=f32(1.0 / (224.0 * 512.0)), reciprocal=True)),
    "per_token_fp32_model": Case(vllm_token, TOKEN_SPEC, dtype="float32"),
    "per_token_y_also_used": Case(vllm_token, TOKEN_SPEC, emit_y=True),
    "per_group_column_major_scales": Case(group_column_major, GROUP_SPEC),
    "per_group_amax_floor_no_clamp": Case(group_amax_floor_no_clamp, QuantSpec(
        "per_group", qmax=448.0, group=128, scale_floor=f32_quotient(1e-10, 448.0))),
    # Not taken, with (part of) the reason recorded for the site.
    "miss_per_tensor_dynamic": Case(per_tensor_dynamic, "dynamic per-tensor scale"),
    "miss_ue8m0": Case(ue8m0_group, "power of two (UE8M0"),
    "miss_inverse_scale_input": Case(inverse_scale_input, "precomputed inverse scale"),
    "miss_e5m2": Case(to_e5m2, "quantizes to torch.float8_e5m2"),
    "miss_asymmetric_clamp": Case(asymmetric_clamp, "is not [-qmax, qmax]"),
    "miss_scale_upper_bound": Case(scale_upper_bound, "upper bound"),
    "miss_static_no_clamp": Case(static_no_clamp, "static scale without a clamp"),
    "miss_divisor_not_bound": Case(divisor_not_bound,
                                   "clamp bound 448.0 differs from the scale's divisor 240.0"),
    "miss_bf16_scaling": Case(bf16_scaling, "scales in torch.bfloat16"),
    "miss_scaled_values_used": Case(scaled_values_used, "is also used by"),
})


# -- compiling, on each rank --------------------------------------------------------------------

def count(graph: str, name: str) -> int:
    return graph.count(f"target={name}]") + graph.count(f"target=torch.ops.{name}]")


def compile_graph(fn: Callable, args: tuple, fuse_quant: bool = True,
                  raise_on_alias: bool = True) -> dict[str, Any]:
    """``fn`` compiled with the pass (``fuse_quant=False``: no quantization fused, so the
    norm fuses alone where it can and Inductor compiles the quantization): graphs before
    and after, outputs, site records.  ``raise_on_alias=False`` for graphs that keep
    vLLM's CPU all-reduce, which returns its input."""
    from torch._inductor import config

    from fusion_pass import AllReduceRMSNormFusionPass, records
    from fusion_pass.patterns import epilogue, load_vllm_forms, rms_norm

    load_vllm_forms()  # before the registries are patched, which undoes what is added inside
    seen: dict[str, str] = {}

    class Recording(AllReduceRMSNormFusionPass):
        def __call__(self, graph):
            seen["before"] = str(graph)
            super().__call__(graph)
            seen["after"] = str(graph)

    start = len(records.HISTORY)
    torch._dynamo.reset()
    # vLLM compiles with auto_functionalized v1 (CompilationConfig.__post_init__).
    with config.patch(post_grad_custom_post_pass=Recording(),
                      enable_auto_functionalized_v2=False), \
            torch._functorch.config.patch(error_on_custom_op_aliasing=raise_on_alias), \
            epilogue._matchers.suspended() if not fuse_quant else contextlib.nullcontext(), \
            rms_norm._matchers.suspended("vllm_fused_quant") if not fuse_quant \
            else contextlib.nullcontext():
        for a in args:
            if a.dim() >= 2:
                torch._dynamo.mark_dynamic(a, 0)
        out = torch.compile(fn, fullgraph=True)(*args)
    sites = [(s.norm, s.path, s.reason, s.quant, s.out_dtype)
             for g in records.HISTORY[start:] for s in g.sites]
    return dict(seen, out=out, sites=sites)


def _norm(x, r, w, group, residual: bool, gemma: bool):
    import torch.distributed._functional_collectives as fc

    h = fc.all_reduce(x, "sum", group)
    if residual:
        h = h + r
    v = h.to(F32)
    v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS)
    y = (v * (1.0 + w.float())).to(h.dtype) if gemma else w * v.to(h.dtype)
    return y, h


def inputs(rank: int, dtype: torch.dtype, gemma: bool) -> dict[str, torch.Tensor]:
    """Random activations with one all-zero row (a dynamic scale at its floor), a weight
    whose first 128-group is tiny (a group scale at its floor), a static scale that clamps."""
    g = torch.Generator().manual_seed(11)
    w = 1 + 0.1 * torch.randn(HIDDEN, generator=g)
    w[:128] *= 1e-4
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(100 + rank))
    r = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(7))
    x[ZERO_ROW] = 0
    r[ZERO_ROW] = 0
    return dict(x=x.to(dtype), r=r.to(dtype), w=(w - 1 if gemma else w).to(dtype),
                s=torch.tensor([0.005]))


def reference_y(d: dict[str, torch.Tensor], residual: bool, gemma: bool, group_name: str,
                out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The norm output the fused op quantizes, from the op itself (its unfused path)."""
    from fusion_pass import fused_allreduce_rmsnorm

    y, _ = fused_allreduce_rmsnorm(d["x"], d["w"], EPS, group_name,
                                   residual=d["r"] if residual else None, path="unfused",
                                   gemma=gemma, out_dtype=out_dtype)
    return y


def _fp8_cases(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    group = dist.group.WORLD
    results = {}
    for name, case in CASES.items():
        d = inputs(rank, getattr(torch, case.dtype), case.gemma)

        def fn(x, r, s, case=case, w=d["w"]):
            y, h = _norm(x, r, w, group, case.residual, case.gemma)
            return (*case.quant(y, s), h) + ((y,) if case.emit_y else ())

        args = (d["x"], d["r"], d["s"])
        res = compile_graph(fn, args)
        res["eager"] = fn(*args)
        if case.fused:
            res["baseline"] = compile_graph(fn, args, fuse_quant=False)["out"]
            out_dtype = res["sites"][0][4]
            res["y"] = reference_y(d, case.residual, case.gemma, group.group_name,
                                   out_dtype and getattr(torch, out_dtype))
            res["s"] = d["s"]
        results[name] = res
    return results


_RESULTS: list = []


def results() -> list:
    """Both ranks' results, compiled once per test session."""
    if not _RESULTS:
        _RESULTS.extend(run_ranks(_fp8_cases, 2))
    return _RESULTS


# -- numerics -------------------------------------------------------------------------------------

def applied_scale(spec: QuantSpec, scales: torch.Tensor, static: torch.Tensor,
                  like: torch.Tensor) -> torch.Tensor:
    """The scale each element of ``like`` was divided by."""
    if spec.mode == "static":
        return static.float().reshape(())
    if spec.mode == "per_token":
        return scales
    return scales.repeat_interleave(spec.group, dim=-1)


def assert_codes_match(q: torch.Tensor, q_ref: torch.Tensor, values: list[torch.Tensor]) -> None:
    """``q`` equals ``q_ref`` code for code, except neighbouring codes whose fp32 value
    (``values``: the unfused graph's, by each way it may have computed it) is within
    one fp32 ulp of the tie between them."""
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape
    bits, bits_ref = q.view(torch.uint8).int(), q_ref.view(torch.uint8).int()
    differ = bits != bits_ref
    if not differ.any():
        return
    a, b = q.float()[differ], q_ref.float()[differ]
    sign = (bits[differ] >> 7) == (bits_ref[differ] >> 7)
    neighbours = sign & ((bits[differ] - bits_ref[differ]).abs() == 1)
    tie = (a + b) / 2
    ulp = torch.nextafter(tie.abs(), torch.tensor(math.inf)) - tie.abs()
    gap = torch.stack([(v[differ] - tie).abs() for v in values]).amin(0)
    bad = ~(neighbours & (gap <= ulp))
    assert not bad.any(), (
        f"{int(bad.sum())} of {q.numel()} FP8 codes differ beyond a rounding tie: fused "
        f"{a[bad][:5].tolist()} vs unfused {b[bad][:5].tolist()}, "
        f"value {values[0][differ][bad][:5].tolist()}")


def assert_scales_match(s: torch.Tensor, s_ref: torch.Tensor) -> None:
    """Within one fp32 ulp, every element (scales are positive)."""
    assert s.shape == s_ref.shape and s.dtype == s_ref.dtype == F32
    ulps = (s.contiguous().view(torch.int32) - s_ref.contiguous().view(torch.int32)).abs()
    assert int(ulps.max()) <= 1, f"scales differ by {int(ulps.max())} fp32 ulps"


def assert_quant_matches(spec: QuantSpec, out: tuple, ref: tuple, y: torch.Tensor,
                         static: Optional[torch.Tensor]) -> None:
    """The fused codes and scales (``out``) against the unfused graph's (``ref``)."""
    q, q_ref = out[0], ref[0]
    scales_ref = ref[1] if spec.dynamic else None
    if spec.dynamic:
        assert_scales_match(out[1], scales_ref)
    s = applied_scale(spec, scales_ref, static, y)
    yf = y.float()
    assert_codes_match(q, q_ref, [yf / s, yf * s.reciprocal()])


def assert_dequantized_close(spec: QuantSpec, out: tuple, eager: tuple,
                             static: torch.Tensor) -> None:
    """Against the eager model (whose ``y`` may round differently): every dequantized value
    within one FP8 step of the eager one."""
    q, q_e = out[0].float(), eager[0].float()
    s = applied_scale(spec, out[1] if spec.dynamic else None, static, q)
    s_e = applied_scale(spec, eager[1] if spec.dynamic else None, static, q_e)
    step = torch.maximum(q.abs(), q_e.abs()) * 2.0 ** -3 + 2.0 ** -9
    assert ((q * s - q_e * s_e).abs() <= step * torch.maximum(s, s_e) * 1.01).all()


# -- tests --------------------------------------------------------------------------------------

FUSED_CASES = sorted(n for n, c in CASES.items() if c.fused)
MISS_CASES = sorted(n for n, c in CASES.items() if not c.fused)


def quant_args(graph: str) -> tuple[str, str]:
    """The fused op's quant spec and ``emit_y``, read from its spec as the graph prints it."""
    from fusion_pass import op
    from fusion_pass.spec import NormSpec

    line = next(l for l in graph.splitlines() if FUSED in l)
    args = line.split("args = (")[1].split("), kwargs")[0].split(", ")
    spec = NormSpec.decode(args[[n for n, _ in op.ARGS].index("spec")].strip("'"))
    return spec.quant.encode(), str(spec.emit_y)


def _fp8_casts(graph: str) -> int:
    return sum(graph.count(f", torch.{dt})") for dt in ("float8_e4m3fn", "float8_e4m3fnuz",
                                                         "float8_e5m2"))


@pytest.mark.parametrize("name", FUSED_CASES)
def test_quantization_fuses_with_the_spec_of_its_math(name) -> None:
    case = CASES[name]
    for res in results():
        before, after = res[name]["before"], res[name]["after"]
        assert count(after, FUSED) == 1 and count(after, PLAIN) == 0
        assert count(before, "_c10d_functional.all_reduce.default") == 1
        assert count(after, "_c10d_functional.all_reduce.default") == 0
        assert _fp8_casts(before) == 1 and _fp8_casts(after) == 0
        assert count(after, "aten.amax.default") + count(after, "aten.max.dim") == 0
        assert quant_args(after) == (case.expect.encode(), str(case.emit_y))
        (norm, path, reason, quant, out_dtype), = res[name]["sites"]
        assert path == "runtime" and quant == case.expect.mode
        assert norm.startswith("native_") and "FP8" not in reason


@pytest.mark.parametrize("name", FUSED_CASES)
def test_codes_and_scales_match_the_unfused_quantization(name) -> None:
    case = CASES[name]
    spec = case.expect
    for res in results():
        out, base = res[name]["out"], res[name]["baseline"]
        assert_quant_matches(spec, out, base, res[name]["y"], res[name]["s"])
        if spec.dynamic:
            # The all-zero row and the tiny group sit at the scale floor.
            assert (out[1][ZERO_ROW] == spec.scale_floor).all()
            if spec.mode == "per_group" and spec.scale_floor == f32(VLLM_FLOOR):
                assert (out[1][:, 0] == spec.scale_floor).all()
        for a, b in zip(out[-2 if case.emit_y else -1:], base[-2 if case.emit_y else -1:]):
            assert torch.equal(a, b)  # h (and y): the same op's outputs
        assert_dequantized_close(spec, out, res[name]["eager"], res[name]["s"])
        torch.testing.assert_close(out[-2 if case.emit_y else -1].float(),
                                   res[name]["eager"][-2 if case.emit_y else -1].float())


@pytest.mark.parametrize("name", MISS_CASES)
def test_quantization_left_separate_says_why(name) -> None:
    case = CASES[name]
    for res in results():
        before, after = res[name]["before"], res[name]["after"]
        assert count(after, PLAIN) == 1 and count(after, FUSED) == 0
        assert _fp8_casts(after) == _fp8_casts(before) == 1
        (norm, path, reason, quant, _), = res[name]["sites"]
        assert path == "runtime" and quant is None
        assert "the FP8 quantization after it stays separate" in reason, reason
        assert case.expect in reason, reason
        for a, b in zip(res[name]["out"], res[name]["eager"]):
            assert a.dtype == b.dtype and a.shape == b.shape
            floating = a.dtype in (torch.bfloat16, F32)
            a, b = a.float(), b.float()
            if floating:
                torch.testing.assert_close(a, b, rtol=2e-2, atol=4e-2 * float(b.abs().max()))
            else:  # codes of a slightly different y: within one FP8 step
                assert ((a - b).abs() <= 0.25 * torch.maximum(a.abs(), b.abs()) + 2.0 ** -9).all()


# -- the spec's scale layouts and UE8M0, on the CPU -----------------------------------------------

def test_spec_encoding_round_trips_and_reads_older_strings() -> None:
    new = QuantSpec("per_group", group=128, scale_floor=f32(1e-10), scale_layout="col_tma",
                    ue8m0=True)
    assert QuantSpec.decode(new.encode()) == new
    assert new.encode().endswith(",layout=col_tma,ue8m0=1")
    # A spec with the defaults encodes as before the keys existed, and such a string
    # (a graph compiled earlier carries it) decodes to row-major, unrounded scales.
    old = "mode=per_group,fp8=float8_e4m3fn,qmax=448.0,group=128,scale_floor=0.0,reciprocal=0"
    assert QuantSpec("per_group", group=128).encode() == old
    assert QuantSpec.decode(old) == QuantSpec("per_group", group=128)
    decoded = QuantSpec.decode(old)
    assert decoded.scale_layout == "row" and not decoded.ue8m0


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(mode="per_token", ue8m0=True), "per_group quantization only"),
    (dict(mode="static", scale_layout="col"), "per_group quantization only"),
    (dict(mode="per_group", group=128, scale_layout="transposed"), "scale layout"),
])
def test_spec_rejects_layouts_and_ue8m0_outside_per_group(kwargs, fragment) -> None:
    with pytest.raises(ValueError, match=fragment):
        QuantSpec(**kwargs)


def test_column_layouts_take_2d_inputs_only() -> None:
    spec = QuantSpec("per_group", group=128, scale_layout="col")
    with pytest.raises(ValueError, match="2-D input"):
        spec.empty_scales(torch.empty(2, 3, 256))
    # Row-major scales of any rank, as before.
    assert QuantSpec("per_group", group=128).empty_scales(torch.empty(2, 3, 256)).shape == (2, 3, 2)


@pytest.mark.parametrize("layout, tokens, strides", [
    ("row", 7, (2, 1)), ("col", 7, (1, 7)), ("col_tma", 7, (1, 8)), ("col_tma", 8, (1, 8)),
    ("col_tma", 1, (1, 4))])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_quantize_writes_the_layout_and_ue8m0_against_float64(layout, tokens, strides,
                                                              ue8m0) -> None:
    """``quantize`` (the reference backend's epilogue) against float64 math written here:
    vLLM's per_token_group_fp8_quant, max(amax, eps) / 448, rounded up to a power of
    two for UE8M0, codes of y / scale clamped to 448."""
    floor = f32(1e-10) if ue8m0 else f32_quotient(1e-10, 448.0)
    spec = QuantSpec("per_group", group=128, scale_floor=floor, scale_layout=layout,
                     ue8m0=ue8m0)
    g = torch.Generator().manual_seed(tokens)
    y = (torch.randn(tokens, 256, generator=g) * 3).to(torch.bfloat16)
    y[0, :128] = 0  # a group at the floor
    q, s = quantize(y, spec)
    assert s.shape == (tokens, 2) and s.stride() == strides and s.dtype == F32
    amax = y.double().unflatten(-1, (2, 128)).abs().amax(-1)
    want = amax.clamp(min=1e-10) / 448.0
    if ue8m0:
        want = torch.exp2(torch.ceil(torch.log2(want.clamp(min=1e-10))))
        assert torch.equal(s.double(), want)
    else:
        assert ((s.double() - want).abs() <= want * 2.0 ** -24).all()
    v = (y.double().unflatten(-1, (2, 128)) / s.double().unsqueeze(-1)).clamp(-448.0, 448.0)
    q_want = v.flatten(-2).float().to(FP8)
    assert torch.equal(q.view(torch.uint8), q_want.view(torch.uint8))
