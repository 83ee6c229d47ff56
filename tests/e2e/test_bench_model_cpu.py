"""The model benchmark (benchmarks/model/bench_model.py --smoke) end to end on 2 gloo CPU ranks.

A tiny TP decoder (2 layers, hidden 64) compiled with and without the pass, at
one decode shape and one prefill: the pass must find and fuse both
all-reduce -> residual add -> RMSNorm sites of the layer graph (o_proj into the
post-attention norm, down_proj into the next input norm or the final norm), the
fused step must call the fused op exactly twice per layer and the unfused step
never, and the fused logits must match the unfused compiled and the eager ones.

The FP8 variants (per-tensor static FP8 with ``torch._scaled_mm``, which the CPU
has; per-group FP8, whose blockwise ``_scaled_mm`` the CPU lacks, with the
dequantizing GEMM the benchmark falls back to) the same way, and the pass must
fuse each norm's quantization into the op as well.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from fusion_pass.testing.spawn import run_ranks

# The model benchmark's modules, and the ones the benchmarks share (bench_common.py).
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path[:0] = [str(BENCHMARKS / "model"), str(BENCHMARKS)]

LAYERS = 2
ARGS = ["--smoke", "--layers", str(LAYERS), "--batches", "3", "--context", "8",
        "--prefill", "16", "--reps", "1", "--sample-ms", "0"]


def _run_bench(rank: int, world: int, out: str, extra: list[str]) -> dict[str, Any]:
    import bench_model
    from fusion_pass import records
    from fusion_pass.backends import reference

    # On the CPU the fused op computes through the reference backend: counting
    # its calls counts the fused op's executions.
    calls = [0]
    run = reference.ReferenceBackend.run

    def counting(self, *a, **kw):
        calls[0] += 1
        return run(self, *a, **kw)

    reference.ReferenceBackend.run = counting
    try:
        code = bench_model.main(ARGS + ["--out", out] + extra)
    finally:
        reference.ReferenceBackend.run = run
    return {"code": code, "calls": calls[0],
            "fused_per_graph": [g.fused for g in records.HISTORY],
            "sites_per_graph": [len(g.sites) for g in records.HISTORY]}


@pytest.mark.slow
def test_smoke_model_fuses_both_sites_and_matches(tmp_path: Path) -> None:
    per_rank = run_ranks(_run_bench, 2, str(tmp_path), [], timeout=900)
    result = json.loads((tmp_path / "model_smoke.json").read_text())
    shapes = result["models"][0]["shapes"]
    assert [(s["kind"], s["tokens"]) for s in shapes] == [("decode", 3), ("prefill", 16)]
    assert result["models"][0]["layers"] == LAYERS

    for r in per_rank:
        assert r["code"] == 0
        # One graph per shape went through the pass: the fused layer graph.
        assert r["sites_per_graph"] == [2, 2]
        assert r["fused_per_graph"] == [2, 2]
        # Executions of the fused step on the CPU (no CUDA graph): the compiling
        # call, the logits check, then --reps samples of replays_per_sample calls.
        fused_steps = sum(2 + len(s["fused"]["samples_us"]) * s["replays_per_sample"]
                          for s in shapes)
        assert r["calls"] == 2 * LAYERS * fused_steps

    for s in shapes:
        assert s["sites_per_graph"] == 2 and s["fusions_per_graph"] == 2
        assert s["fusions_per_step"] == 2 * LAYERS
        sites = [site for g in s["graphs"] for site in g["sites"]]
        assert {site["collective"] for site in sites} == {"c10d_functional"}
        assert {site["norm"] for site in sites} == {"native_residual"}
        assert {site["hidden"] for site in sites} == {64}
        assert {site["tokens"] for site in sites} == {str(s["tokens"])}
        assert s["paths"] == ["one_stage"]
        logits = s["logits"]
        # Random, non-degenerate logits: a broken model would not give these.
        assert logits["std"] > 0.3
        for pair in ("fused_vs_unfused", "fused_vs_eager", "unfused_vs_eager"):
            assert logits[pair]["rel_l2"] <= logits["tolerance"] == 2e-2, (pair, logits)
        assert logits["match"]
    assert result["ok"]


@pytest.mark.slow
def test_fp8_models_fuse_norm_and_quantization(tmp_path: Path) -> None:
    models = ["smoke-fp8", "smoke-fp8-group"]
    per_rank = run_ranks(_run_bench, 2, str(tmp_path), ["--models", *models, "--name", "fp8"],
                         timeout=900)
    result = json.loads((tmp_path / "fp8.json").read_text())
    assert [m["name"] for m in result["models"]] == models
    static, group = result["models"]
    assert (static["quant"], static["gemm"], static["gemm_note"]) == ("static", "scaled_mm", None)
    # No blockwise torch._scaled_mm on the CPU: the dequantizing GEMM, and why.
    assert group["quant"] == "group128" and group["gemm"] == "dequant"
    assert "blockwise" in group["gemm_note"]

    for r in per_rank:
        assert r["code"] == 0
        assert r["sites_per_graph"] == [2, 2, 2, 2] and r["fused_per_graph"] == [2, 2, 2, 2]
        fused_steps = sum(2 + len(s["fused"]["samples_us"]) * s["replays_per_sample"]
                          for m in result["models"] for s in m["shapes"])
        assert r["calls"] == 2 * LAYERS * fused_steps

    for m, mode in ((static, "static"), (group, "per_group")):
        for s in m["shapes"]:
            assert s["sites_per_graph"] == 2 and s["fusions_per_graph"] == 2
            assert s["paths"] == ["one_stage"]
            # Both norms' quantizations went into the op, with the graph's mode.
            assert s["quant_fusions_per_graph"] == 2 and s["quants"] == [mode], s["graphs"]
            logits = s["logits"]
            assert logits["std"] > 0.3
            for pair in ("fused_vs_unfused", "fused_vs_eager", "unfused_vs_eager"):
                assert logits[pair]["rel_l2"] <= logits["tolerance"] == 1e-1, (pair, logits)
            # The unfused graph computes what eager torch does, bit for bit
            # (emulate_precision_casts), and so does the fused one: on the CPU h is the
            # same gloo sum, and y rounds before the weight as the model's norm does.
            assert logits["unfused_vs_eager"]["rel_l2"] == 0.0
            assert logits["fused_vs_unfused"]["rel_l2"] == 0.0
    assert result["ok"]
