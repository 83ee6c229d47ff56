"""The pass at compile level on two gloo ranks: what it matches, what it leaves, numerics."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from fusion_pass.testing.spawn import run_ranks
from fx_text import calls, fused_fields

HIDDEN = 64
FUSED = "fusion_pass.allreduce_rmsnorm.default"


def _ar(x, group):
    import torch.distributed._functional_collectives as fc

    return fc.all_reduce(x, "sum", group)


def _hf_norm(h, w, eps, weight_left=True):
    dtype = h.dtype
    v = h.to(torch.float32)
    v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    return w * v.to(dtype) if weight_left else v.to(dtype) * w


def _models(w, w2, group):
    """name -> (fn(x, r) -> outputs, expected fusions, reason recorded for an unfused site)."""
    wf = w.float() if w is not None else None

    def hf_residual(x, r):
        h = _ar(x, group) + r
        return _hf_norm(h, w, 1e-6), h

    def hf_weight_right(x, r):
        h = r + _ar(x, group)
        return _hf_norm(h, w, 1e-5, weight_left=False), h

    def hf_no_residual(x, r):
        return _hf_norm(_ar(x, group), w, 1e-6) + r

    def functional_rms_norm(x, r):
        return torch.nn.functional.rms_norm(_ar(x, group), (HIDDEN,), w, 1e-5) * r

    def functional_rms_norm_default_eps(x, r):
        return torch.nn.functional.rms_norm(_ar(x, group) + r, (HIDDEN,), w)

    def vllm_native(x, r):
        # vLLM's RMSNorm.forward_native with a residual: the add happens in fp32.
        s = _ar(x, group).to(torch.float32) + r.to(torch.float32)
        h = s.to(x.dtype)
        s = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (s.to(w.dtype) * w).to(x.dtype), h

    def square_by_mul(x, r):
        h = _ar(x, group) + r
        v = h.float()
        v = v * torch.rsqrt((v * v).mean(-1, keepdim=True) + 1e-6)
        return w * v.to(h.dtype), h

    def div_sqrt_square(x, r):  # x / sqrt(mean(square(x)) + eps), eps first
        h = _ar(x, group) + r
        v = h.float()
        v = v / torch.sqrt(1e-6 + torch.square(v).mean(-1, keepdim=True))
        return w * v.to(h.dtype), h

    def rsqrt_method_no_keepdim(x, r):  # (var + eps).rsqrt() on mean(-1)[..., None]
        h = _ar(x, group) + r
        v = h.float()
        v = v * (v.pow(2).mean(-1)[..., None] + 1e-6).rsqrt()
        return w * v.to(h.dtype), h

    def gemma(x, r):
        h = _ar(x, group) + r
        v = h.float()
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (v * (1.0 + w.float())).to(h.dtype), h

    def llama_fp32_weight(x, r):  # LlamaRMSNorm with its weight kept in fp32: y stays fp32
        h = _ar(x, group) + r
        return _hf_norm(h, wf, 1e-6), h

    def gemma3_fp32_weight(x, r):  # Gemma3RMSNorm: (x * (1 + w.float())).type_as(x)
        h = _ar(x, group) + r
        v = h.float()
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (v * (1.0 + wf.float())).type_as(h), h

    def two_layers_two_eps(x, r):
        h1 = _ar(x, group) + r
        y1 = _hf_norm(h1, w, 1e-6)
        h2 = _ar(y1 @ torch.ones(HIDDEN, HIDDEN, dtype=x.dtype) / HIDDEN, group) + h1
        return _hf_norm(h2, w2, 1e-5), h2

    # Not to be fused: the graph must stay exactly as it was, and the reason be recorded.
    def reduced_value_used_elsewhere(x, r):
        a = _ar(x, group)
        h = a + r
        return _hf_norm(h, w, 1e-6), h, a * 2

    def weight_is_2d(x, r):
        h = _ar(x, group) + r
        return _hf_norm(h, w.view(1, HIDDEN), 1e-6), h

    def mean_over_tokens(x, r):
        h = _ar(x, group) + r
        v = h.float()
        v = v * torch.rsqrt(v.pow(2).mean(0, keepdim=True) + 1e-6)
        return w * v.to(h.dtype), h

    def no_norm_after(x, r):
        return torch.relu(_ar(x, group) + r)

    def sum_leaves_the_graph(x, r):  # what a graph break right after the all-reduce leaves
        return (_ar(x, group),)

    # Tensors laid out column-major: no fused kernel reads them in place (the op would
    # run the reference), so the site is not recorded fused, and the compiled graph runs.
    def column_major_input(x, r):
        h = _ar(x.t().contiguous().t(), group) + r
        return _hf_norm(h, w, 1e-6), h

    def column_major_residual(x, r):
        h = _ar(x, group) + r.t().contiguous().t()
        return _hf_norm(h, w, 1e-6), h

    # Layout-only ops between the all-reduce and the norm (a MoE block's reshape back
    # to [batch, seq, hidden]), and a norm without a weight.
    def moe_reshape(x, r):
        h = r.reshape(1, -1, HIDDEN) + _ar(x, group).reshape(1, -1, HIDDEN)
        return _hf_norm(h, w, 1e-6), h

    def moe_unsqueeze_no_residual(x, r):
        return (_hf_norm(_ar(x, group).unsqueeze(0), w, 1e-6) + r,)

    def weightless(x, r):
        h = _ar(x, group) + r
        v = h.float()
        return (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-3)).to(h.dtype), h

    def weightless_fp32_out(x, r):  # F.rms_norm without a weight, on the fp32 sum
        h = _ar(x, group) + r
        return torch.nn.functional.rms_norm(h.float(), (HIDDEN,), None, 1e-3), h

    # Never to be fused as they stand: the record names the op in the way.
    def transposed_between(x, r):
        h = _ar(x, group).t().contiguous().t() + r
        return _hf_norm(h, w, 1e-6), h

    def bias_after(x, r):
        h = _ar(x, group) + w + r
        return _hf_norm(h, w, 1e-6), h

    def residual_multiplier(x, r):  # Granite: residual + c * all_reduce(x)
        h = r + 0.25 * _ar(x, group)
        return _hf_norm(h, w, 1e-6), h

    def multiplier_after_residual(x, r):  # c * (all_reduce(x) + r): the op cannot scale h
        h = (_ar(x, group) + r) * 0.25
        return _hf_norm(h, w, 1e-6), h

    def vector_multiplier(x, r):  # a [hidden] factor is no scalar multiplier
        h = _ar(x, group) * w + r
        return _hf_norm(h, w, 1e-6), h

    def layer_norm(x, r):
        h = r + _ar(x, group)
        return torch.nn.functional.layer_norm(h, (HIDDEN,), w, w), h

    def reshaped_sum_leaves_the_graph(x, r):  # a graph break after a MoE block
        return (_ar(x, group).reshape(1, -1, HIDDEN),)

    def residual_sum_leaves_the_graph(x, r):  # Qwen3 in transformers without compiled autograd
        return (_ar(x, group) + r,)

    def max_all_reduce(x, r):  # an all-reduce that is not a sum: recorded, never fused
        import torch.distributed._functional_collectives as fc

        return _hf_norm(fc.all_reduce(x, "max", group) + r, w, 1e-6), r

    return {
        "moe_reshape": (moe_reshape, 1, None),
        "moe_unsqueeze_no_residual": (moe_unsqueeze_no_residual, 1, None),
        "weightless": (weightless, 1, None), "weightless_fp32_out": (weightless_fp32_out, 1, None),
        "transposed_between": (transposed_between, 0, "(permute.default) reorders dimensions"),
        "bias_after": (bias_after, 0, "a bias: "),
        "residual_multiplier": (residual_multiplier, 1, None),
        "multiplier_after_residual": (multiplier_after_residual, 0, "a multiplier: "),
        "vector_multiplier": (vector_multiplier, 0, "not a scalar"),
        "layer_norm": (layer_norm, 0, "a LayerNorm, not an RMSNorm"),
        "reshaped_sum_leaves_the_graph": (reshaped_sum_leaves_the_graph, 0, "is a graph output"),
        "residual_sum_leaves_the_graph": (residual_sum_leaves_the_graph, 0, "is a graph output (a graph break"),
        "max_all_reduce": (max_all_reduce, 0, "reduces by 'max', not a sum"),
        "hf_residual": (hf_residual, 1, None), "hf_weight_right": (hf_weight_right, 1, None),
        "hf_no_residual": (hf_no_residual, 1, None),
        "functional_rms_norm": (functional_rms_norm, 1, None),
        "functional_rms_norm_default_eps": (functional_rms_norm_default_eps, 1, None),
        "vllm_native": (vllm_native, 1, None), "square_by_mul": (square_by_mul, 1, None),
        "div_sqrt_square": (div_sqrt_square, 1, None),
        "rsqrt_method_no_keepdim": (rsqrt_method_no_keepdim, 1, None),
        "gemma": (gemma, 1, None), "llama_fp32_weight": (llama_fp32_weight, 1, None),
        "gemma3_fp32_weight": (gemma3_fp32_weight, 1, None),
        "two_layers_two_eps": (two_layers_two_eps, 2, None),
        "reduced_value_used_elsewhere": (reduced_value_used_elsewhere, 0,
                                         "has users outside the pattern"),
        "weight_is_2d": (weight_is_2d, 0, "no [hidden] weight"),
        "mean_over_tokens": (mean_over_tokens, 0, "not the hidden dim alone"),
        "no_norm_after": (no_norm_after, 0, "no RMSNorm after the all-reduce"),
        "sum_leaves_the_graph": (sum_leaves_the_graph, 0, "is a graph output"),
        "column_major_input": (column_major_input, 0, "non-contiguous input (all-reduce input"),
        "column_major_residual": (column_major_residual, 0, "non-contiguous input"),
    }


class _Norm(torch.nn.Module):
    """transformers' RMSNorm classes as they are written (Llama/Qwen3 and Gemma3 styles)."""

    def __init__(self, weight: torch.Tensor, eps: float, style: str) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.eps, self.style = eps, style

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        v = h.float()
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.style == "gemma3":
            return (v * (1.0 + self.weight.float())).type_as(h)
        return self.weight * v.to(h.dtype)


class _Block(torch.nn.Module):
    """Two row-parallel sums, each into a norm: what a decoder layer ends with."""

    def __init__(self, group, norms: list) -> None:
        super().__init__()
        self.group = group
        self.norms = torch.nn.ModuleList(norms)

    def forward(self, x: torch.Tensor, r: torch.Tensor):
        for norm in self.norms:
            r = _ar(x, self.group) + r
            x = norm(r).to(x.dtype)
        return x, r


def _module_cases(group, dtype: torch.dtype) -> dict:
    """torch.compile(dynamic=True) of modules whose norms keep eps as a float attribute:
    eps reaches the post-grad graph as an input, not a literal."""
    g = torch.Generator().manual_seed(5)
    weights = [(1 + 0.1 * torch.randn(HIDDEN, generator=g)) for _ in range(2)]
    return {
        f"dynamic_{style}{'_fp32_weight' if wdt == torch.float32 else ''}": _Block(
            group, [_Norm(w.to(wdt), eps, style) for w, eps in zip(weights, (1e-6, 1e-5))])
        for style in ("llama", "gemma3") for wdt in {dtype, torch.float32}
    }
def _compile_case(fn, args, pass_obj, dynamic=None):
    """Compile ``fn`` with ``pass_obj``; return graphs before/after, outputs, records,
    and the fused ops' arguments."""
    from torch._inductor import config

    from fusion_pass import records

    seen = {}

    class Recording(type(pass_obj)):
        def __call__(self, graph):
            seen["before"] = str(graph)
            super().__call__(graph)
            seen["after"] = str(graph)
            seen["fused"] = [fused_fields(n) for n in graph.nodes
                             if n.target is torch.ops.fusion_pass.allreduce_rmsnorm.default]

    rec_pass = Recording.__new__(Recording)
    rec_pass.__dict__.update(pass_obj.__dict__)
    start = len(records.HISTORY)
    torch._dynamo.reset()
    with config.patch(post_grad_custom_post_pass=rec_pass):
        if dynamic is None:
            for a in args:
                torch._dynamo.mark_dynamic(a, 0)
        out = torch.compile(fn, fullgraph=True, dynamic=dynamic)(*args)
    sites = [s for g in records.HISTORY[start:] for s in g.sites]
    # Picklable: a graph value is named, not returned.
    fused = [{k: v.name if isinstance(v, torch.fx.Node) else v for k, v in f.items()
              if k != "site"} for f in seen["fused"]]
    return dict(before=seen["before"], after=seen["after"], out=out, eager=fn(*args),
                fused=fused, site_tags=[f["site"] for f in seen["fused"]],
                sites=[(s.norm, s.path, s.reason, s.tokens, s.out_dtype) for s in sites])


def _pass_cases(rank: int, world_size: int, dtype_name: str) -> dict:
    import torch.distributed as dist

    from fusion_pass import AllReduceRMSNormFusionPass, TokenRange

    dtype = getattr(torch, dtype_name)
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(1)
    w = (1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(dtype)
    w2 = (1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(dtype)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(24, HIDDEN, generator=g).to(dtype)
    r = torch.randn(24, HIDDEN, generator=torch.Generator().manual_seed(7)).to(dtype)
    out = {}
    for name, (fn, _, _) in _models(w, w2, group).items():
        if dtype_name not in CASE_DTYPES.get(name, CASE_DTYPES["default"]):
            continue
        out[name] = _compile_case(fn, (x.clone(), r.clone()), AllReduceRMSNormFusionPass())
    for name, module in _module_cases(group, dtype).items():
        with torch.inference_mode():
            out[name] = _compile_case(module, (x.clone(), r.clone()),
                                      AllReduceRMSNormFusionPass(), dynamic=True)

    # A training compile: the norm's rsqrt is saved for the backward pass.
    trained = _Block(group, [_Norm(w.clone(), 1e-6, "llama")])
    trained.norms[0].weight.requires_grad_(True)
    out["training"] = _compile_case(trained, (x.clone(), r.clone()), AllReduceRMSNormFusionPass())

    # The gate decides from what is known about tokens.
    fn = _models(w, w2, group)["hf_residual"][0]
    out["range_small"] = _compile_case(fn, (x.clone(), r.clone()),
                                       AllReduceRMSNormFusionPass(token_range=TokenRange(1, 64)))
    out["range_large"] = _compile_case(fn, (x.clone(), r.clone()),
                                       AllReduceRMSNormFusionPass(token_range=TokenRange(81, 512)))

    # A hidden size the gate refuses (row not a whole number of 16-byte packs).
    odd_w = torch.ones(HIDDEN + 1, dtype=dtype)
    out["gate_unfused"] = _compile_case(
        lambda a, b: (_hf_norm(_ar(a, group) + b, odd_w, 1e-6),),
        (torch.randn(24, HIDDEN + 1).to(dtype), torch.randn(24, HIDDEN + 1).to(dtype)),
        AllReduceRMSNormFusionPass())

    # Three all-reduces summed, merged twice into one: one fused site, and a record
    # for each of the two merged away.
    out["three_summed"] = _compile_case(
        lambda a, b: (_hf_norm(_ar(a, group) + _ar(a * 2, group) + _ar(a * 3, group) + b, w, 1e-6),),
        (x.clone(), r.clone()), AllReduceRMSNormFusionPass(merge_summed_all_reduces=True))

    # A group of one rank: nothing to reduce, nothing to fuse.
    singles = [dist.new_group([i]) for i in range(world_size)]
    alone = singles[rank]
    out["world_size_one"] = _compile_case(
        lambda a, b: (_hf_norm(_ar(a, alone) + b, w, 1e-6),), (x.clone(), r.clone()),
        AllReduceRMSNormFusionPass())
    return out


# fp32 models lose every cast: the forms that differ there run in both dtypes.
CASE_DTYPES = {
    "default": ("bfloat16",),
    **{name: ("bfloat16", "float32") for name in (
        "hf_residual", "hf_no_residual", "functional_rms_norm", "vllm_native",
        "llama_fp32_weight", "div_sqrt_square", "moe_reshape", "weightless", "layer_norm",
        "residual_multiplier")},
}


_RESULTS: dict[str, list] = {}


def results(dtype_name: str) -> list:
    """Both ranks' results for one dtype, compiled once per test session."""
    if dtype_name not in _RESULTS:
        _RESULTS[dtype_name] = run_ranks(_pass_cases, 2, dtype_name)
    return _RESULTS[dtype_name]


MODELS = _models(None, None, None)
EXPECTED = {name: n for name, (_, n, _) in MODELS.items()}
CASES = [(dt, name) for name in sorted(EXPECTED)
         for dt in CASE_DTYPES.get(name, CASE_DTYPES["default"])]
MODULE_CASES = [(dt, name) for dt in ("bfloat16", "float32")
                for name in _module_cases(None, getattr(torch, dt))]


@pytest.mark.parametrize("dtype_name,name", CASES)
def test_match_count_and_ops_before_after(dtype_name, name) -> None:
    for res in results(dtype_name):
        case = res[name]
        n = EXPECTED[name]
        assert calls(case["after"], FUSED) == n
        before_ar = calls(case["before"], "_c10d_functional.all_reduce.default")
        after_ar = calls(case["after"], "_c10d_functional.all_reduce.default")
        assert after_ar == before_ar - n
        assert calls(case["after"], "aten.rsqrt.default") + calls(case["after"], "aten.sqrt.default") \
            == calls(case["before"], "aten.rsqrt.default") + calls(case["before"], "aten.sqrt.default") - n
        # Every all-reduce the pass saw is accounted for: fused, or recorded with its reason.
        assert len(case["sites"]) == before_ar
        if n == 0:
            assert case["after"] == case["before"], "an unmatched graph must be left exactly as it was"
            want = MODELS[name][2]
            assert [p for _, p, _, _, _ in case["sites"]] == ["unfused"] * before_ar
            assert all(want in reason for _, _, reason, _, _ in case["sites"]), case["sites"]
        else:
            # Dynamic tokens, unbounded: the decision waits for the concrete count.
            assert [p for _, p, _, _, _ in case["sites"]] == ["runtime"] * n
            assert [f["path"] for f in case["fused"]] == ["runtime"] * n


@pytest.mark.parametrize("dtype_name,name", CASES)
def test_compiled_matches_eager(dtype_name, name) -> None:
    tol = 2e-2 if dtype_name == "bfloat16" else 1e-5
    for res in results(dtype_name):
        out, eager = res[name]["out"], res[name]["eager"]
        for a, b in zip(out, eager):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=2 * tol)


@pytest.mark.parametrize("dtype_name,name", MODULE_CASES)
def test_dynamic_true_fuses_eps_from_a_graph_input(dtype_name, name) -> None:
    """dynamic=True: eps arrives as a 0-dim float64 graph input; every site fuses, the
    op gets that input as its ``eps`` tensor, and numerics match the unfused graph."""
    tol = 2e-2 if dtype_name == "bfloat16" else 1e-5
    for res in results(dtype_name):
        case = res[name]
        assert calls(case["after"], FUSED) == 2 and calls(case["before"], FUSED) == 0
        assert len(case["sites"]) == 2 and all(p != "unfused" for _, p, _, _, _ in case["sites"])
        assert all(f["eps"] == "tensor" for f in case["fused"]), case["fused"]
        # The block casts each norm output back to the activations' dtype: the fused op
        # absorbs that cast (an fp32 y is test_fp32_weights_keep_the_graphs_output_dtype's).
        assert [f["out_dtype"] for f in case["fused"]] == [None, None]
        for a, b in zip(case["out"], case["eager"]):
            assert a.dtype == b.dtype
            rel = (a.double() - b.double()).norm() / b.double().norm()
            assert rel <= tol, (name, float(rel))


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_weightless_norm_gets_a_weight_of_ones(dtype_name) -> None:
    """The op is handed ``full([hidden], 1.0)``: y is the unweighted norm, rounded
    where the graph rounds it (to the activations' dtype)."""
    for res in results(dtype_name):
        case = res["weightless"]
        assert calls(case["after"], "aten.full.default") == calls(case["before"], "aten.full.default") + 1
        assert [f["out_dtype"] for f in case["fused"]] == [None]
        (y, h), (ye, he) = case["out"], case["eager"]
        assert y.dtype == ye.dtype == getattr(torch, dtype_name)
        torch.testing.assert_close(y, ye)
        assert torch.equal(h, he)
    if dtype_name == "bfloat16":
        fp32_out = results(dtype_name)[0]["weightless_fp32_out"]
        assert [f["out_dtype"] for f in fp32_out["fused"]] == ["float32"]


def test_layout_ops_are_replayed_on_the_all_reduce_input() -> None:
    """The fused op reduces the tensor in the shape the norm reads it: the reshape
    (unsqueeze) moves before the op, and no all-reduce or norm is left."""
    for dtype_name in ("bfloat16", "float32"):
        for res in results(dtype_name):
            case = res["moe_reshape"]
            assert calls(case["after"], "_c10d_functional.all_reduce.default") == 0
            assert calls(case["after"], FUSED) == 1
            assert case["out"][0].shape == (1, 24, HIDDEN)
    case = results("bfloat16")[0]["moe_unsqueeze_no_residual"]
    assert calls(case["after"], FUSED) == 1 and case["out"][0].shape == (1, 24, HIDDEN)


def test_fp32_weights_keep_the_graphs_output_dtype() -> None:
    """Llama-style fp32 weight: y stays fp32 (out_dtype); Gemma3 casts back (no out_dtype)."""
    res = results("bfloat16")[0]
    assert [f["out_dtype"] for f in res["llama_fp32_weight"]["fused"]] == ["float32"]
    assert [s[4] for s in res["llama_fp32_weight"]["sites"]] == ["float32"]
    assert [f["out_dtype"] for f in res["gemma3_fp32_weight"]["fused"]] == [None]
    assert [f["gemma"] for f in res["gemma3_fp32_weight"]["fused"]] == [True]


def test_training_graph_is_left_alone_with_its_reason() -> None:
    for res in results("bfloat16"):
        case = res["training"]
        assert case["after"] == case["before"]
        (_, path, reason, _, _), = case["sites"]
        assert path == "unfused" and "training graph" in reason and "backward" in reason


def test_each_epsilon_is_read_from_the_graph() -> None:
    ranks = results("bfloat16")
    assert sorted(f["eps"] for f in ranks[0]["two_layers_two_eps"]["fused"]) == [1e-6, 1e-5]
    (default,) = ranks[0]["functional_rms_norm_default_eps"]["fused"]
    assert default["eps"] == pytest.approx(torch.finfo(torch.bfloat16).eps, rel=1e-6) \
        or default["eps"] == pytest.approx(torch.finfo(torch.float32).eps, rel=1e-6)


def test_gemma_flag_is_baked() -> None:
    ranks = results("bfloat16")
    assert [f["gemma"] for f in ranks[0]["gemma"]["fused"]] == [True]
    assert [f["gemma"] for f in ranks[0]["hf_residual"]["fused"]] == [False]


def test_rounding_before_the_weight_is_baked_and_gives_the_graphs_bits() -> None:
    """Hugging Face's ``w * v.to(dtype)`` and vLLM's native norm round the normalised
    row before the weight multiplies it; Gemma's norms multiply in fp32 and round once.
    The fused op does as its graph did, so in bf16 its ``y`` is the eager model's, bit
    for bit (the reference backend runs the same torch ops on the CPU)."""
    ranks = results("bfloat16")
    rounded = {name: [f["round_normed"] for f in ranks[0][name]["fused"]]
               for name in ("hf_residual", "hf_weight_right", "hf_no_residual", "vllm_native",
                            "div_sqrt_square", "llama_fp32_weight", "gemma",
                            "gemma3_fp32_weight")}
    assert rounded == {"hf_residual": [True], "hf_weight_right": [True],
                       "hf_no_residual": [True], "vllm_native": [True],
                       "div_sqrt_square": [True], "llama_fp32_weight": [True],
                       "gemma": [False], "gemma3_fp32_weight": [False]}
    for res in ranks:
        for name in ("hf_residual", "hf_weight_right", "hf_no_residual", "llama_fp32_weight"):
            y, y_eager = res[name]["out"][0], res[name]["eager"][0]
            assert y.dtype == y_eager.dtype and torch.equal(y, y_eager), name


def test_fused_ops_carry_their_site_records() -> None:
    import json

    case = results("bfloat16")[0]["two_layers_two_eps"]
    tags = [json.loads(t) for t in case["site_tags"]]
    assert len({t["g"] for t in tags}) == 1 and all(t["n"] == 2 for t in tags)
    assert [t["s"]["path"] for t in tags] == ["runtime", "runtime"]


def test_known_token_ranges_are_decided_at_compile_time() -> None:
    ranks = results("bfloat16")
    assert [s[1] for s in ranks[0]["range_small"]["sites"]] == ["one_stage"]
    assert [s[1] for s in ranks[0]["range_large"]["sites"]] == ["two_stage"]
    assert [f["path"] for f in ranks[0]["range_small"]["fused"]] == ["one_stage"]


def test_three_summed_all_reduces_merge_into_one_site_and_keep_every_record() -> None:
    for res in results("bfloat16"):
        case = res["three_summed"]
        assert calls(case["before"], "_c10d_functional.all_reduce.default") == 3
        assert calls(case["after"], FUSED) == 1
        assert calls(case["after"], "_c10d_functional.all_reduce.default") == 0
        sites = case["sites"]
        assert [p for _, p, _, _, _ in sites] == ["runtime", "unfused", "unfused"], sites
        assert "the three all-reduces merged into one" in sites[0][2]
        merged_away = [reason for _, _, reason, _, _ in sites[1:]]
        assert all(r.startswith("merged into the all-reduce of ") for r in merged_away)
        assert len({r.split("; ")[1] for r in merged_away}) == 2  # each names its own


def test_gate_refusal_and_world_size_one_leave_the_graph_alone() -> None:
    ranks = results("bfloat16")
    for name, why in [("gate_unfused", "16-byte packs"), ("world_size_one", "world size 1")]:
        case = ranks[0][name]
        assert case["after"] == case["before"]
        (norm, path, reason, _, _), = case["sites"]
        assert path == "unfused" and why in reason


def test_pass_is_picklable_deepcopyable_and_keyed_by_settings() -> None:
    from fusion_pass import AllReduceRMSNormFusionPass, TokenRange

    p = AllReduceRMSNormFusionPass()
    assert pickle.loads(pickle.dumps(p)).uuid() == p.uuid()
    assert copy.deepcopy(p).uuid() == p.uuid()
    assert AllReduceRMSNormFusionPass(threshold=64).uuid() != p.uuid()
    assert AllReduceRMSNormFusionPass(token_range=TokenRange(1, 80)).uuid() != p.uuid()
    assert AllReduceRMSNormFusionPass(merge_summed_all_reduces=True).uuid() != p.uuid()
