"""Real ecosystem end to end on 2 gloo ranks: transformers' TP models and norm classes.

* ``AutoModelForCausalLM.from_pretrained(dir, tp_plan="auto")`` (DTensor tensor
  parallelism) for a Llama, a Qwen3, a Gemma3 and a Granite config (a scalar
  multiplies every reduced value), and torch's ``parallelize_module`` with
  ``ColwiseParallel``/``RowwiseParallel`` (torchtitan's plan, the embedding sharded by
  vocabulary) on the same Llama and Granite; random weights, tiny configs written at test time, compiled
  with ``dynamic=None`` and ``dynamic=True``. Every all-reduce -> norm site is fused,
  greedy generation is token-identical to the unfused compile in fp32, logits are close
  in bf16.
* A hand-sharded TP=2 decoder built from ``LlamaRMSNorm``, ``Qwen3RMSNorm`` and
  ``Gemma3RMSNorm``, compiled with ``dynamic=True`` in bf16, fp32, and bf16 with fp32
  norm weights.

All of it runs in one spawn (tests/helpers/hf_tp_workers.py) that the tests share.
"""

from __future__ import annotations

import pytest
import torch

import hf_tp_workers as w
from fusion_pass.testing.spawn import run_ranks

TOL = {"float32": 1e-5, "bfloat16": 2e-2}
"""Relative L2 of the fused compile's outputs against the unfused compile's."""


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           # One rank per core already: a pool of compile workers per rank would only
           # compete with the other rank, and each worker imports torch.
           "TORCHINDUCTOR_COMPILE_THREADS": "1",
           # The pass does not run on an FX-graph-cache hit, and these tests count
           # what it does.
           "TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
    return run_ranks(w.all_cases, 2, str(tmp_path_factory.mktemp("hf_tp")), env=env, timeout=900)




def _why(graph: dict, sites: list[dict]) -> str:
    """For a failure message: each site's decision, and the post-grad graph from each
    all-reduce on."""
    decisions = [f"{s['path']} ({s['norm']}, tokens {s['tokens']}, {s['dtype']}): {s['reason']}"
                 for s in sites]
    return ("\nsites:\n  " + "\n  ".join(decisions) + "\npost-grad graph after each all-reduce:\n"
            + "\n----\n".join(graph["text"]))


def _assert_all_fused(graph: dict, sites: list[dict], expected: list[tuple[bool, bool]]) -> None:
    why = _why(graph, sites)
    n = len(expected)
    assert graph["all_reduce_before"] == n and len(sites) == n, why
    assert [s for s in sites if s["path"] == "unfused"] == [], why
    assert graph["fused_ops"] == n and graph["all_reduce_after"] == 0, why
    assert graph["rsqrt_after"] == graph["rsqrt_before"] - n, why
    assert graph["fused_args"] == expected, why


# --- transformers models ------------------------------------------------------------

@pytest.mark.parametrize("kind,dtype_name", [(k, d) for k in w.HF_MODELS for d in w.BASELINE_MODE])
def test_baseline_is_the_unfused_model(ranks, kind, dtype_name) -> None:
    """Each graph is a whole forward holding one all-reduce per rowwise module of the
    plan and no fused op: the sites the fused compiles must all fuse."""
    n = len(w.expected_sites(kind))
    for case in w.rank_cases(ranks, kind):
        assert case[("plan_all_reduces", dtype_name)] == n
        base = case[(dtype_name, w.BASELINE_MODE[dtype_name], False)]
        assert base["graphs"] and base["sites"] == [], "the baseline compile ran the pass"
        for g in base["graphs"]:
            assert g["fused_ops"] == 0 and g["all_reduce_before"] == g["all_reduce_after"] == n


@pytest.mark.parametrize("kind,dtype_name,mode",
                         [(k, d, m) for k in w.HF_MODELS for d, m in w.FUSED_COMPILES])
def test_every_site_is_fused(ranks, kind, dtype_name, mode) -> None:
    for case in w.rank_cases(ranks, kind):
        fused = case[(dtype_name, mode, True)]
        assert fused["graphs"] and len(fused["graphs"]) == len(fused["sites"])
        for g, sites in zip(fused["graphs"], fused["sites"]):
            _assert_all_fused(g, sites, w.expected_sites(kind))


@pytest.mark.parametrize("kind", w.HF_MODELS)
def test_dynamic_none_generation_meets_static_and_dynamic_graphs(ranks, kind) -> None:
    """fp32 generation under dynamic=None compiles the prompt's static shapes (path
    baked at compile time), then automatic dynamic shapes (path decided per call)."""
    for case in w.rank_cases(ranks, kind):
        sites = case[("float32", "none", True)]["sites"]
        assert [{s["tokens"] == str(w.PROMPT) for s in g} for g in sites] == [{True}, {False}]
        assert {s["path"] for s in sites[0]} == {"one_stage"}
        assert {s["path"] for s in sites[1]} == {"runtime"}


@pytest.mark.parametrize("kind,mode", [(k, m) for k in w.HF_MODELS for m in w.MODES])
def test_fp32_greedy_generation_is_token_identical(ranks, kind, mode) -> None:
    cases = w.rank_cases(ranks, kind)
    for case in cases:
        base = case[("float32", w.BASELINE_MODE["float32"], False)]["out"]
        fused = case[("float32", mode, True)]["out"]
        assert fused["tokens"].shape == (1, w.PROMPT + w.NEW_TOKENS)
        assert torch.equal(fused["tokens"], base["tokens"])
        assert w.rel_l2(fused["logits"], base["logits"]) <= TOL["float32"]
    # The outputs are replicated: a rank that summed something else would differ.
    assert torch.equal(cases[0][("float32", mode, True)]["out"]["tokens"],
                       cases[1][("float32", mode, True)]["out"]["tokens"])


@pytest.mark.parametrize("kind,mode", [(k, m) for k in w.HF_MODELS for m in w.MODES])
def test_bf16_logits_are_close(ranks, kind, mode) -> None:
    for case in w.rank_cases(ranks, kind):
        base = case[("bfloat16", w.BASELINE_MODE["bfloat16"], False)]["out"]["logits"]
        fused = case[("bfloat16", mode, True)]["out"]["logits"]
        assert fused.dtype == torch.bfloat16 and base.float().std() > 0
        assert w.rel_l2(fused, base) <= TOL["bfloat16"]


# --- the hand-sharded decoder -----------------------------------------------------------

@pytest.mark.parametrize("variant", list(w.DECODER_VARIANTS))
def test_decoder_sites_are_fused_or_say_why(ranks, variant) -> None:
    """bf16 and fp32: every site fused. fp32 norm weights in a bf16 model: each site
    fused, or left unfused with a reason naming the weight's dtype."""
    n = len(w.DECODER_SITES)
    for case in w.rank_cases(ranks, "decoder"):
        base, fused = case[(variant, False)], case[(variant, True)]
        (bg,), (g,), (sites,) = base["graphs"], fused["graphs"], fused["sites"]
        assert bg["fused_ops"] == 0 and bg["all_reduce_before"] == n
        if variant in ("bfloat16", "float32"):
            _assert_all_fused(g, sites, w.DECODER_SITES)
            continue
        why = _why(g, sites)
        assert g["all_reduce_before"] == n and len(sites) == n, why
        left = [s for s in sites if s["path"] == "unfused"]
        for s in left:
            assert "weight" in s["reason"] and "float32" in s["reason"], why
        assert g["fused_ops"] == n - len(left) and g["all_reduce_after"] == len(left), why


@pytest.mark.parametrize("variant", list(w.DECODER_VARIANTS))
def test_decoder_matches_the_unfused_compile(ranks, variant) -> None:
    tol = TOL[str(w.DECODER_VARIANTS[variant][0]).removeprefix("torch.")]
    for case in w.rank_cases(ranks, "decoder"):
        base, fused = case[(variant, False)]["out"], case[(variant, True)]["out"]
        for a, b in zip(fused, base, strict=True):
            assert a.dtype == b.dtype
            assert w.rel_l2(a, b) <= tol
