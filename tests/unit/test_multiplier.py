"""Scalar multipliers: ``c * all_reduce(x) (+ residual) -> RMSNorm`` in one op, ``c`` applied inside.

On two gloo ranks:

* the op (reference backend): ``h`` bit for bit the unfused graph's, whose compiled
  kernel rounds ``round(sum) * c (+ r)`` once (an fp32 product, an fp32 sum, then the
  dtype), and the formula of that written out here; ``y`` against float64; a literal
  (rounded to fp32, as torch rounds a Python number), a 0-dim tensor of the model dtype
  (Gemma's buffer), an fp32 one; with and without a residual; bf16, fp16, fp32;
* the pass: Granite's forms (a literal; a float attribute that ``dynamic=True`` turns into
  a graph input) and Gemma's (a buffer, no residual) fused, counted from the models;
  ``h`` equal to the unfused compile's bits, fp32 outputs equal to eager's; a factor
  that promotes the reduced value's dtype left unfused with the reason; a backend
  whose limits lack the multiplier (AITER's) leaves those sites unfused, and says so,
  while the plain site beside them fuses.
"""

from __future__ import annotations

import pytest
import torch

from fusion_pass.testing.spawn import run_ranks
from fx_text import calls, fused_fields
from test_pass import _Norm  # transformers' RMSNorm classes as written

HIDDEN = 64
TOKENS = 6
EPS = 1e-6
FUSED = "fusion_pass.allreduce_rmsnorm.default"
DTYPES = ("bfloat16", "float16", "float32")


def _inputs(rank: int, dtype: torch.dtype, seed: int = 0):
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(seed + rank))
    g = torch.Generator().manual_seed(seed + 99)
    r = torch.randn(TOKENS, HIDDEN, generator=g)
    w = 1 + 0.1 * torch.randn(HIDDEN, generator=g)
    return x.to(dtype), r.to(dtype), w.to(dtype)


def _multipliers(dtype: torch.dtype) -> dict:
    """A Granite-style literal, Gemma's normalizer as a buffer of the model dtype, an fp32 one."""
    return {"literal": 0.22, "buffer": torch.tensor(HIDDEN ** 0.5, dtype=dtype),
            "fp32_tensor": torch.tensor(0.7)}


# -- the op --------------------------------------------------------------------------------------

def _op_cases(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    import fusion_pass

    group = dist.group.WORLD
    out = {}
    for name in DTYPES:
        dtype = getattr(torch, name)
        x, r, w = _inputs(rank, dtype)
        for kind, c in _multipliers(dtype).items():
            for residual in (False, True):
                res = r if residual else None
                y, h = fusion_pass.fused_allreduce_rmsnorm(x, w, EPS, group.group_name,
                                                           residual=res, multiplier=c)

                def graph(a, b):
                    import torch.distributed._functional_collectives as fc

                    s = fc.all_reduce(a, "sum", group) * c
                    return s + b if b is not None else s

                torch._dynamo.reset()
                unfused_h = torch.compile(graph, fullgraph=True)(x, res)
                out[(name, kind, residual)] = (y, h, unfused_h)
    return out


@pytest.fixture(scope="module")
def op_results() -> list:
    return run_ranks(_op_cases, 2)


def _formula_h(name: str, kind: str, residual: bool) -> torch.Tensor:
    """``h`` written out: the ranks' sum rounded to the dtype, times ``c`` in fp32 (a
    literal rounded to fp32 first), plus the residual in fp32, rounded once."""
    dtype = getattr(torch, name)
    xs = [_inputs(r, dtype) for r in range(2)]
    reduced = (xs[0][0].float() + xs[1][0].float()).to(dtype)
    c = _multipliers(dtype)[kind]
    c32 = torch.tensor(c, dtype=torch.float32) if not isinstance(c, torch.Tensor) else c.float()
    h = reduced.float() * c32
    if residual:
        h = h + xs[0][1].float()
    return h.to(dtype)


@pytest.mark.parametrize("name", DTYPES)
def test_h_is_the_graphs_bits_and_y_its_norm(op_results, name) -> None:
    dtype = getattr(torch, name)
    tol = {"bfloat16": 2e-2, "float16": 4e-3, "float32": 1e-5}[name]
    w = _inputs(0, dtype)[2].double()
    for kind in _multipliers(dtype):
        for residual in (False, True):
            key = (name, kind, residual)
            (y, h, unfused_h), (y1, h1, _) = op_results[0][key], op_results[1][key]
            assert h.dtype == dtype and y.dtype == dtype
            assert torch.equal(h, unfused_h), key
            assert torch.equal(h, _formula_h(name, kind, residual)), key
            assert torch.equal(y, y1) and torch.equal(h, h1), key  # every rank the same bits
            hd = h.double()
            y64 = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + EPS) * w
            torch.testing.assert_close(y.double(), y64, rtol=tol, atol=tol)


# -- the pass ------------------------------------------------------------------------------------

class _Granite(torch.nn.Module):
    """Granite's decoder ends, TP-sharded: ``residual + all_reduce(x) * residual_multiplier``
    into the next norm, twice (o_proj's and down_proj's sums)."""

    def __init__(self, group, weight: torch.Tensor) -> None:
        super().__init__()
        self.group, self.residual_multiplier = group, 0.22
        self.norms = torch.nn.ModuleList([_Norm(weight, EPS, "llama"),
                                          _Norm(weight.flip(0), EPS, "llama")])

    def forward(self, x: torch.Tensor, r: torch.Tensor):
        import torch.distributed._functional_collectives as fc

        outs = []
        for norm in self.norms:
            r = r + fc.all_reduce(x, "sum", self.group) * self.residual_multiplier
            x = norm(r)
            outs += [x, r]
        return tuple(outs)


class _GemmaEmbedding(torch.nn.Module):
    """Gemma 2/3's first site: the vocab-parallel embedding's sum times its normalizer, a
    buffer of the model dtype, into the first layer's input norm (no residual yet)."""

    def __init__(self, group, weight: torch.Tensor) -> None:
        super().__init__()
        self.group = group
        self.register_buffer("normalizer", torch.tensor(HIDDEN ** 0.5, dtype=weight.dtype),
                             persistent=False)
        self.norm = _Norm(weight, EPS, "gemma3")

    def forward(self, x: torch.Tensor, r: torch.Tensor):
        import torch.distributed._functional_collectives as fc

        h = fc.all_reduce(x, "sum", self.group) * self.normalizer
        return self.norm(h), h + r


def _pass_cases(rank: int, world_size: int, name: str) -> dict:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc
    from torch._inductor import config

    from fusion_pass import AllReduceRMSNormFusionPass, backends, gate, records

    dtype = getattr(torch, name)
    group = dist.group.WORLD
    x, r, w = _inputs(rank, dtype, seed=10)
    norm = _Norm(w, EPS, "llama")

    def promoted(a, b):  # a one-element fp32 tensor promotes a 16-bit sum to fp32
        h = b + fc.all_reduce(a, "sum", group) * torch.full((1,), 0.5)
        return norm(h), h

    models = {"granite": (_Granite(group, w), None), "granite_dynamic": (_Granite(group, w), True),
              "gemma_embedding": (_GemmaEmbedding(group, w), None), "promoted": (promoted, None)}

    def compile_run(fn, dynamic, fuse: bool) -> dict:
        seen: dict = {}

        class Recording(AllReduceRMSNormFusionPass):
            def __call__(self, graph):
                seen["before"] = str(graph)
                if fuse:
                    super().__call__(graph)
                seen["after"] = str(graph)
                seen["fused"] = [fused_fields(n) for n in graph.nodes
                                 if n.target is torch.ops.fusion_pass.allreduce_rmsnorm.default]

        start = len(records.HISTORY)
        torch._dynamo.reset()
        with config.patch(post_grad_custom_post_pass=Recording()), torch.inference_mode():
            out = torch.compile(fn, fullgraph=True, dynamic=dynamic)(x.clone(), r.clone())
        seen["out"] = out
        seen["sites"] = [(str(s.path), s.reason) for g in records.HISTORY[start:] for s in g.sites]
        return seen

    out = {}
    for model, (fn, dynamic) in models.items():
        out[model] = {"fused": compile_run(fn, dynamic, True),
                      "unfused": compile_run(fn, dynamic, False),
                      "eager": fn(x.clone(), r.clone())}

    # A backend whose kernels apply no multiplier (AITER's limits say so): the
    # multiplied sites are left unfused, the plain one fuses.
    class NoMultiplier:
        name = "no-multiplier"
        limits = gate.BackendLimits(name="no-multiplier",
                                    lacks=((gate.MULTIPLIER, "has no multiplier (test)"),))

        def run(self, call):
            return "records only (test)"

    def mixed(a, b):
        h = b + fc.all_reduce(a, "sum", group) * 0.5
        y = norm(h)
        h2 = fc.all_reduce(y, "sum", group) + h
        return norm(h2), h2

    backends.register("no-multiplier", NoMultiplier)
    backends.set_backend("no-multiplier")
    try:
        out["lacking"] = compile_run(mixed, None, True)
    finally:
        backends.set_backend(None)
    return out


_RESULTS: dict = {}


def pass_results(name: str) -> list:
    if name not in _RESULTS:
        _RESULTS[name] = run_ranks(_pass_cases, 2, name)
    return _RESULTS[name]


# Sites per model, from its structure: Granite's two sums, each times its multiplier into
# a norm; Gemma's one embedding sum times its buffer.
SITES = {"granite": 2, "granite_dynamic": 2, "gemma_embedding": 1, "promoted": 1}


@pytest.mark.parametrize("name", ["bfloat16", "float32"])
def test_granite_and_gemma_sites_fuse_with_the_multiplier_inside(name) -> None:
    for res in pass_results(name):
        for model in ("granite", "granite_dynamic", "gemma_embedding"):
            case = res[model]["fused"]
            n = SITES[model]
            assert calls(case["before"], FUSED) == 0 and calls(case["after"], FUSED) == n
            assert calls(case["after"], "_c10d_functional.all_reduce.default") == 0
            assert len(case["sites"]) == n and all(p != "unfused" for p, _ in case["sites"])
            want = {"granite": 0.22, "granite_dynamic": "tensor", "gemma_embedding": "tensor"}[model]
            assert [f["multiplier"] for f in case["fused"]] == [want] * n
            assert [f["residual"] is not None for f in case["fused"]] == [model != "gemma_embedding"] * n
            assert [f["gemma"] for f in case["fused"]] == [model == "gemma_embedding"] * n


@pytest.mark.parametrize("name", ["bfloat16", "float32"])
def test_fused_h_is_the_unfused_compiles_bits(name) -> None:
    """The first site's ``h`` (the residual stream) is the unfused compile's, bit for bit (a
    later site reduces the norm output before it, which the compile reduces in its own
    order); in fp32 every output is eager's too (in bf16 the compile rounds ``h`` once where
    eager rounds twice)."""
    for res in pass_results(name):
        for model in ("granite", "granite_dynamic", "gemma_embedding"):
            fused, unfused, eager = (res[model][k] for k in ("fused", "unfused", "eager"))
            fused_out, unfused_out = fused["out"], unfused["out"]
            assert torch.equal(fused_out[1], unfused_out[1]), model
            if name == "float32":
                assert all(torch.equal(a, b) for a, b in zip(fused_out, eager)), model
            for a, b in zip(fused_out, unfused_out):
                torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=4e-2)


def test_a_factor_that_promotes_the_sum_is_no_multiplier() -> None:
    for res in pass_results("bfloat16"):
        case = res["promoted"]["fused"]
        assert calls(case["after"], FUSED) == 0 and case["after"] == case["before"]
        ((path, reason),) = case["sites"]
        assert path == "unfused" and "keeps the reduced value's dtype" in reason, reason
    for res in pass_results("float32"):  # fp32 times fp32: the dtype is kept, and it fuses
        assert calls(res["promoted"]["fused"]["after"], FUSED) == 1


def test_a_backend_without_the_multiplier_leaves_those_sites_and_says_why() -> None:
    for res in pass_results("bfloat16"):
        case = res["lacking"]
        assert calls(case["after"], FUSED) == 1
        (scaled, plain) = case["sites"]
        assert scaled == ("unfused", "backend no-multiplier has no multiplier (test)")
        assert plain[0] != "unfused", plain
