"""The pass at compile level on two gloo ranks: what it matches, what it leaves, numerics."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from fusion_pass.spawn import run_ranks

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
    """name -> (fn(x, r) -> outputs, expected fusions)."""

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

    def gemma(x, r):
        h = _ar(x, group) + r
        v = h.float()
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (v * (1.0 + w.float())).to(h.dtype), h

    def two_layers_two_eps(x, r):
        h1 = _ar(x, group) + r
        y1 = _hf_norm(h1, w, 1e-6)
        h2 = _ar(y1 @ torch.ones(HIDDEN, HIDDEN, dtype=x.dtype) / HIDDEN, group) + h1
        return _hf_norm(h2, w2, 1e-5), h2

    # Not to be fused: the graph must stay exactly as it was.
    def reduced_value_used_elsewhere(x, r):
        a = _ar(x, group)
        h = a + r
        return _hf_norm(h, w, 1e-6), h, a * 2

    def weight_is_fp32(x, r):
        h = _ar(x, group) + r
        return _hf_norm(h, w.float(), 1e-6), h

    def weight_is_2d(x, r):
        h = _ar(x, group) + r
        return _hf_norm(h, w.view(1, HIDDEN), 1e-6), h

    def mean_over_tokens(x, r):
        h = _ar(x, group) + r
        v = h.float()
        v = v * torch.rsqrt(v.pow(2).mean(0, keepdim=True) + 1e-6)
        return w * v.to(h.dtype), h

    return {
        "hf_residual": (hf_residual, 1), "hf_weight_right": (hf_weight_right, 1),
        "hf_no_residual": (hf_no_residual, 1), "functional_rms_norm": (functional_rms_norm, 1),
        "vllm_native": (vllm_native, 1), "square_by_mul": (square_by_mul, 1),
        "gemma": (gemma, 1), "two_layers_two_eps": (two_layers_two_eps, 2),
        "reduced_value_used_elsewhere": (reduced_value_used_elsewhere, 0),
        "weight_is_fp32": (weight_is_fp32, 0), "weight_is_2d": (weight_is_2d, 0),
        "mean_over_tokens": (mean_over_tokens, 0),
    }


def _count(graph_str: str, name: str) -> int:
    return graph_str.count(f"target={name}]") + graph_str.count(f"target=torch.ops.{name}]")


def _compile_case(fn, args, pass_obj):
    """Compile ``fn`` with ``pass_obj``; return graphs before/after, outputs, records."""
    from torch._inductor import config

    from fusion_pass import records

    seen = {}

    class Recording(type(pass_obj)):
        def __call__(self, graph):
            seen["before"] = str(graph)
            super().__call__(graph)
            seen["after"] = str(graph)

    rec_pass = Recording.__new__(Recording)
    rec_pass.__dict__.update(pass_obj.__dict__)
    start = len(records.HISTORY)
    torch._dynamo.reset()
    with config.patch(post_grad_custom_post_pass=rec_pass):
        for a in args:
            torch._dynamo.mark_dynamic(a, 0)
        out = torch.compile(fn, fullgraph=True)(*args)
    sites = [s for g in records.HISTORY[start:] for s in g.sites]
    return dict(before=seen["before"], after=seen["after"], out=out, eager=fn(*args),
                sites=[(s.norm, s.path, s.reason, s.tokens) for s in sites])


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
    for name, (fn, _) in _models(w, w2, group).items():
        if dtype_name not in CASE_DTYPES.get(name, CASE_DTYPES["default"]):
            continue
        out[name] = _compile_case(fn, (x.clone(), r.clone()), AllReduceRMSNormFusionPass())

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
        "hf_residual", "hf_no_residual", "functional_rms_norm", "vllm_native", "weight_is_fp32")},
}


_RESULTS: dict[str, list] = {}


def results(dtype_name: str) -> list:
    """Both ranks' results for one dtype, compiled once per test session."""
    if dtype_name not in _RESULTS:
        _RESULTS[dtype_name] = run_ranks(_pass_cases, 2, dtype_name)
    return _RESULTS[dtype_name]


def expected_fusions(name: str, dtype_name: str) -> int:
    if name == "weight_is_fp32" and dtype_name == "float32":
        return 1  # the weight matches the activations there
    return EXPECTED[name]


EXPECTED = {name: n for name, (_, n) in _models(None, None, None).items()}
CASES = [(dt, name) for name in sorted(EXPECTED)
         for dt in CASE_DTYPES.get(name, CASE_DTYPES["default"])]


@pytest.mark.parametrize("dtype_name,name", CASES)
def test_match_count_and_ops_before_after(dtype_name, name) -> None:
    for res in results(dtype_name):
        case = res[name]
        n = expected_fusions(name, dtype_name)
        assert _count(case["after"], FUSED) == n
        before_ar = _count(case["before"], "_c10d_functional.all_reduce.default")
        after_ar = _count(case["after"], "_c10d_functional.all_reduce.default")
        assert after_ar == before_ar - n
        assert _count(case["after"], "aten.rsqrt.default") == _count(case["before"], "aten.rsqrt.default") - n
        if n == 0:
            assert case["after"] == case["before"], "an unmatched graph must be left exactly as it was"
        else:
            # Dynamic tokens, unbounded: the decision waits for the concrete count.
            assert [p for _, p, _, _ in case["sites"]] == ["runtime"] * n
            assert "runtime" in case["after"]


@pytest.mark.parametrize("dtype_name,name", CASES)
def test_compiled_matches_eager(dtype_name, name) -> None:
    tol = 2e-2 if dtype_name == "bfloat16" else 1e-5
    for res in results(dtype_name):
        out, eager = res[name]["out"], res[name]["eager"]
        for a, b in zip(out, eager):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=2 * tol)


def test_each_epsilon_is_read_from_the_graph() -> None:
    ranks = results("bfloat16")
    after = ranks[0]["two_layers_two_eps"]["after"]
    assert "1e-06" in after and "1e-05" in after


def test_gemma_flag_is_baked() -> None:
    ranks = results("bfloat16")
    after = ranks[0]["gemma"]["after"]
    line = next(l for l in after.splitlines() if FUSED in l)
    assert line.rstrip().endswith("True), kwargs = {})")


def test_known_token_ranges_are_decided_at_compile_time() -> None:
    ranks = results("bfloat16")
    assert [s[1] for s in ranks[0]["range_small"]["sites"]] == ["one_stage"]
    assert [s[1] for s in ranks[0]["range_large"]["sites"]] == ["two_stage"]
    assert "one_stage" in ranks[0]["range_small"]["after"]


def test_gate_refusal_and_world_size_one_leave_the_graph_alone() -> None:
    ranks = results("bfloat16")
    for name, why in [("gate_unfused", "16-byte packs"), ("world_size_one", "world size 1")]:
        case = ranks[0][name]
        assert case["after"] == case["before"]
        (norm, path, reason, _), = case["sites"]
        assert path == "unfused" and why in reason


def test_pass_is_picklable_deepcopyable_and_keyed_by_settings() -> None:
    from fusion_pass import AllReduceRMSNormFusionPass, TokenRange

    p = AllReduceRMSNormFusionPass()
    assert pickle.loads(pickle.dumps(p)).uuid() == p.uuid()
    assert copy.deepcopy(p).uuid() == p.uuid()
    assert AllReduceRMSNormFusionPass(threshold=64).uuid() != p.uuid()
    assert AllReduceRMSNormFusionPass(token_range=TokenRange(1, 80)).uuid() != p.uuid()
