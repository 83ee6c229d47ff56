"""Mixture-of-experts models end to end on 2 gloo ranks (tests/helpers/hf_moe_workers.py).

* transformers' Mixtral and Qwen3-MoE with ``tp_plan="auto"``, fp32 and bf16,
  ``dynamic=None`` and ``True``: every site fused, the experts' one through the
  reshape back to ``[batch, seq, hidden]``; logits match the unfused compile.
* A DeepSeek-V3-style layer (routed + shared experts, two all-reduces summed):
  as it stands both all-reduces are left unfused with a reason that names the
  sum; with ``merge_summed_all_reduces`` they become one fused site, and the other
  is recorded as merged into it.

All of it runs in one spawn that the tests share.
"""

from __future__ import annotations

import pytest
import torch

import hf_moe_workers as m
import hf_tp_workers as w
from fusion_pass.testing.spawn import run_ranks

TOL = {"float32": 1e-5, "bfloat16": 2e-2}
"""Relative L2 against the unfused compile (test_hf_tp_e2e.py's)."""


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1",
           "TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
    return run_ranks(m.all_cases, 2, str(tmp_path_factory.mktemp("hf_moe")), env=env, timeout=900)




def _why(graph: dict, sites: list[dict]) -> str:
    return ("\nsites:\n  " + "\n  ".join(f"{s['path']} ({s['norm']}): {s['reason']}" for s in sites)
            + "\npost-grad graph after each all-reduce:\n" + "\n----\n".join(graph["text"]))


CASES = [(k, d, mode) for k in m.HF_MOE_MODELS for d in m.DTYPES for mode in m.MODES]


@pytest.mark.parametrize("kind,dtype_name,mode", CASES)
def test_every_moe_site_is_fused(ranks, kind, dtype_name, mode) -> None:
    n = m.expected_sites(kind)
    for case in w.rank_cases(ranks, kind):
        base = case[(dtype_name, "none", False)]
        assert [g["all_reduce_before"] for g in base["graphs"]] == [n] and base["sites"] == []
        fused = case[(dtype_name, mode, True)]
        (g,), (sites,) = fused["graphs"], fused["sites"]
        why = _why(g, sites)
        assert g["all_reduce_before"] == n and len(sites) == n, why
        assert [s for s in sites if s["path"] == "unfused"] == [], why
        assert g["fused_ops"] == n and g["all_reduce_after"] == 0, why
        assert g["rsqrt_after"] == g["rsqrt_before"] - n, why
        assert g["fused_args"] == [(True, False, False)] * n, why


@pytest.mark.parametrize("kind,dtype_name,mode", CASES)
def test_moe_logits_match_the_unfused_compile(ranks, kind, dtype_name, mode) -> None:
    cases = w.rank_cases(ranks, kind)
    for case in cases:
        base = case[(dtype_name, "none", False)]["out"]
        fused = case[(dtype_name, mode, True)]["out"]
        assert fused.dtype == base.dtype == getattr(torch, dtype_name) and base.float().std() > 0
        assert w.rel_l2(fused, base) <= TOL[dtype_name]
        if dtype_name == "float32":  # greedy tokens at every position
            assert torch.equal(fused.argmax(-1), base.argmax(-1))
    assert torch.equal(cases[0][(dtype_name, mode, True)]["out"], cases[1][(dtype_name, mode, True)]["out"])


@pytest.mark.parametrize("dtype_name", m.DTYPES)
def test_summed_all_reduces_as_they_stand_say_why(ranks, dtype_name) -> None:
    """Two all-reduces per layer, both recorded unfused, each naming the sum."""
    n = 2 * m.MOE_LAYERS
    for case in w.rank_cases(ranks, "deepseek_style"):
        fused = case[(dtype_name, "none", "as_is")]
        (g,), (sites,) = fused["graphs"], fused["sites"]
        why = _why(g, sites)
        assert g["all_reduce_before"] == n and len(sites) == n, why
        assert g["fused_ops"] == 0 and g["all_reduce_after"] == n, why
        assert all(s["path"] == "unfused" and "summed with another all-reduce" in s["reason"]
                   for s in sites), why
        assert w.rel_l2(fused["out"][0], case[(dtype_name, "none", False)]["out"][0]) <= TOL[dtype_name]


@pytest.mark.parametrize("dtype_name,mode", [(d, mode) for d in m.DTYPES for mode in m.MODES])
def test_merged_summed_all_reduces_fuse(ranks, dtype_name, mode) -> None:
    """merge_summed_all_reduces: per layer one all-reduce of routed + shared, fused
    with the residual add and the norm; the other recorded as merged into it."""
    layers = m.MOE_LAYERS
    for case in w.rank_cases(ranks, "deepseek_style"):
        fused = case[(dtype_name, mode, "merged")]
        (g,), (sites,) = fused["graphs"], fused["sites"]
        why = _why(g, sites)
        assert g["all_reduce_before"] == 2 * layers and len(sites) == 2 * layers, why
        assert g["fused_ops"] == layers and g["all_reduce_after"] == 0, why
        assert g["fused_args"] == [(True, False, False)] * layers, why
        merged = [s for s in sites if s["reason"].startswith("merged into")]
        kept = [s for s in sites if s not in merged]
        assert len(merged) == layers and all(s["path"] == "unfused" for s in merged), why
        assert all(s["path"] != "unfused" for s in kept), why
        assert all("summed" in s["reason"] for s in kept), why
        base = case[(dtype_name, "none", False)]["out"]
        for a, b in zip(fused["out"], base, strict=True):
            assert a.dtype == b.dtype
            assert w.rel_l2(a, b) <= TOL[dtype_name]
