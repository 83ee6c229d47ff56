"""The pass under vLLM's own ``PostGradPassManager``, as VLLM_COMPILE runs it on GPUs: the
config helper's pass, prepared by the plugin's config hook, added to the manager after vLLM's
passes, called inside a pass context per compile range, on two gloo ranks with vLLM's TP
group and its ``vllm.all_reduce`` + ``vllm_ir`` graph forms."""

from __future__ import annotations


import pytest
import torch

from fusion_pass.testing.vllm_tp import run_vllm_ranks, vllm_tp_group
from fx_text import calls

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from vllm.compilation.passes.inductor_pass import InductorPass  # noqa: E402

FUSED = "fusion_pass.allreduce_rmsnorm.default"
HIDDEN = 64
# (compile range, tokens, dynamic): a range compile either side of the one-stage threshold
# (80 tokens: the reference backend's default schedule, which the plugin adds as an
# endpoint), and a single-size range compiled with concrete shapes.
RANGES = [((1, 80), 12, True), ((81, 2048), 96, True), ((4, 4), 4, False)]
PATHS = {(1, 80): "one_stage", (81, 2048): "two_stage", (4, 4): "one_stage"}


class Snapshot(InductorPass):
    """Added to the manager after the fusion pass: keeps the graph as the pass left it."""

    graphs: list[str] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        Snapshot.graphs.append(str(graph))


def _rotary_standin() -> None:
    """vLLM's FixFunctionalizationPass names ``_C.rotary_embedding``, which the GPU wheel's
    absent kernels do not register on the CPU: a stand-in with the real schema (csrc's
    torch_bindings.cpp) that never runs (the graphs here hold no rotary embedding)."""
    if hasattr(torch.ops._C, "rotary_embedding"):
        return
    lib = torch.library.Library("_C", "FRAGMENT")
    lib.define("rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, "
               "int head_size, Tensor cos_sin_cache, bool is_neox) -> ()")
    _KEEP.append(lib)


_KEEP: list = []


def _pass_manager_cases(rank: int, world_size: int) -> dict:
    from vllm.compilation.passes.inductor_pass import pass_context
    from vllm.compilation.passes.pass_manager import PostGradPassManager
    from vllm.config import CompilationConfig, ParallelConfig, VllmConfig
    from vllm.config.utils import Range

    from fusion_pass import records
    from fusion_pass.vllm_integration import VllmAllReduceRMSNormPass, compilation_config, plugin

    plugin.register()  # the config hook, as vLLM's plugin loading runs it
    _rotary_standin()
    cfg = compilation_config()
    vc = VllmConfig(compilation_config=CompilationConfig(**cfg),
                    parallel_config=ParallelConfig(tensor_parallel_size=world_size))
    pass_ = vc.compilation_config.inductor_compile_config["post_grad_custom_post_pass"]
    out: dict = dict(
        prepared_copy=isinstance(pass_, VllmAllReduceRMSNormPass)
        and pass_ is not cfg["inductor_compile_config"]["post_grad_custom_post_pass"],
        inactive=pass_.inactive_reason,
        endpoints=list(vc.compilation_config.compile_ranges_endpoints or []))
    with vllm_tp_group(rank, world_size, vc) as (tp, _):
        manager = PostGradPassManager()
        manager.configure(vc)
        manager.add(pass_)
        manager.add(Snapshot())
        out["passes"] = [type(p).__name__ for p in manager.passes]
        g = torch.Generator().manual_seed(1)
        w = (1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(torch.bfloat16)
        w2 = (1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(torch.bfloat16)

        def layer(x, r):
            """Two sites: o_proj's all-reduce -> residual add + norm, and the MLP's
            all-reduce -> the next norm (no residual)."""
            y, h = torch.ops.vllm_ir.fused_add_rms_norm(torch.ops.vllm.all_reduce(x, tp), r, w,
                                                        1e-5, None)
            z = torch.ops.vllm_ir.rms_norm(torch.ops.vllm.all_reduce(2 * y, tp), w2, 1e-6, None)
            return z, h

        for (lo, hi), tokens, dynamic in RANGES:
            x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(rank))
            r = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(9))
            x, r = x.to(torch.bfloat16), r.to(torch.bfloat16)
            start, Snapshot.graphs = len(records.HISTORY), []
            torch._dynamo.reset()
            with torch._inductor.config.patch(post_grad_custom_post_pass=manager), \
                    pass_context(Range(lo, hi)):
                if dynamic:
                    torch._dynamo.mark_dynamic(x, 0)
                    torch._dynamo.mark_dynamic(r, 0)
                got = torch.compile(layer, fullgraph=True)(x, r)
            out[(lo, hi)] = dict(
                after=Snapshot.graphs, out=got, eager=layer(x, r),
                sites=[(s.norm, s.path, s.tokens) for rec in records.HISTORY[start:]
                       for s in rec.sites])
    return out


@pytest.fixture(scope="module")
def results():
    return run_vllm_ranks(_pass_manager_cases)


def test_the_config_carries_a_prepared_pass_after_vllms_own(results) -> None:
    for res in results:
        assert res["prepared_copy"] and res["inactive"] is None
        assert 80 in res["endpoints"]
        # vLLM's passes first, then the custom post pass (then the snapshot).
        assert res["passes"][-2:] == ["VllmAllReduceRMSNormPass", "Snapshot"]


@pytest.mark.parametrize("rng", [r for r, _, _ in RANGES], ids=str)
def test_each_compile_range_fuses_both_sites_with_its_path(results, rng) -> None:
    lo, hi = rng
    for res in results:
        r = res[rng]
        (after,) = r["after"]
        assert calls(after, FUSED) == 2
        assert calls(after, "vllm.all_reduce") == 0 and calls(after, "vllm_ir.") == 0
        # The range comes from the pass context (the dynamic graphs' own shapes are unbounded).
        tokens = str(lo) if lo == hi else f"[{lo}, {hi}]"
        assert r["sites"] == [("vllm_ir_fused_add_rms_norm", PATHS[rng], tokens),
                              ("vllm_ir_rms_norm", PATHS[rng], tokens)]


@pytest.mark.parametrize("rng", [r for r, _, _ in RANGES], ids=str)
def test_fused_outputs_match_eager(results, rng) -> None:
    for res in results:
        (z, h), (z_e, h_e) = res[rng]["out"], res[rng]["eager"]
        assert torch.equal(h, h_e)
        # The fused norm reads h rounded to bf16, vLLM's native norm the fp32 sum.
        torch.testing.assert_close(z, z_e, atol=3e-2, rtol=2e-2)
