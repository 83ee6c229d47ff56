"""The Triton backend on WORLD GPUs (``FUSION_PASS_GPU_WORLD``, default 2): every output element, ranks, graphs, timeouts, compile.

Run on the GPU machine with ``scripts/gpu_check.sh`` (or ``pytest -m gpu tests/gpu``).
"""

from __future__ import annotations

import json
import os

import pytest

from gpu_workers import WORLD, compiled_model, skipped_call, spawn, suite

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def results():
    ranks, _ = spawn(suite, WORLD, env={"FUSION_PASS_TIMEOUT_S": "10"})
    if os.environ.get("FUSION_PASS_GPU_SUMMARY"):
        with open(os.environ["FUSION_PASS_GPU_SUMMARY"], "w") as f:
            json.dump(_summary(ranks), f, indent=1)
    return ranks


def _summary(ranks):
    """Worst error over tolerance per dtype and path, and the other checks' numbers."""
    worst: dict = {}
    for r in ranks:
        for c in r["sweep"]:
            if not c["declined"]:
                key = f"{c['dtype']} {c['path']}"
                worst[key] = max(worst.get(key, 0.0), c["violation"])
    return {"worst_violation_by_dtype_path": worst,
            "kernel_cases": sum(not c["declined"] for c in ranks[0]["sweep"]),
            "declined": [(c["dtype"], c["hidden"], c["tokens"], c["path"])
                         for c in ranks[0]["sweep"] if c["declined"]],
            "back_to_back": [r["back_to_back"] for r in ranks],
            "graph": [r["graph"] for r in ranks]}


def _kernel_cases(results):
    return [c for c in results[0]["sweep"] if not c["declined"]]


def test_sweep_covers_every_shape(results):
    seen = {(c["dtype"], c["hidden"], c["tokens"]) for c in _kernel_cases(results)}
    assert len(seen) == 6 * 9 * 3


def test_every_element_matches_float64_reference(results):
    bad = [c for r in results for c in r["sweep"] if not c["declined"] and not c["violation"] <= 1.0]
    assert not bad, bad[:10]


def test_declines_only_what_it_must(results):
    declined = [c for c in results[0]["sweep"] if c["declined"]]
    assert all(c["expected_decline"] for c in declined), declined
    # Kernel paths really ran for every shape inside the limits.
    ran = [c for c in results[0]["sweep"] if not c["declined"] and c["path"] != "op-fallback"]
    assert any(c["path"] == "one_stage" for c in ran) and any(c["path"] == "two_stage" for c in ran)
    assert all(c["expected_decline"] is None for c in ran)


def test_outputs_bitwise_identical_on_all_ranks(results):
    bad = [c for c in results[0]["sweep"] if not c["declined"] and not c["same_on_ranks"]]
    assert not bad, bad[:10]


def test_op_runs_the_kernels(results):
    rows = results[0]["op_matches_backend"]
    assert rows and all(ok for *_, ok in rows), [r for r in rows if not r[-1]][:10]


def test_thousand_back_to_back_calls(results):
    for r in results:
        b = r["back_to_back"]
        assert b["calls"] == 1000 and b["violation"] <= 1.0, b


def test_graph_replays_with_new_inputs_and_after_pauses(results):
    for r in results:
        g = r["graph"]
        assert g["replays"] == 100 and g["violation"] <= 1.0, g
        assert g["skewed_pause"] <= 1.0 and g["pause"] <= 1.0, g


def test_rank_that_skips_a_call_gives_timeout_error_not_hang():
    ranks, outputs = spawn(skipped_call, WORLD, env={"FUSION_PASS_TIMEOUT_S": "2"}, timeout=300)
    r0 = ranks[0]
    assert r0["violation_before"] <= 1.0
    assert r0["error"] is not None and "device-side assert" in r0["error"], r0
    assert r0["seconds"] >= 2.0, r0
    assert "timed out waiting for a peer rank" in outputs[0]


def test_compiled_tp_model_runs_the_kernels_and_matches_eager():
    ranks, _ = spawn(compiled_model, WORLD, env={"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"})
    for r in ranks:
        paths = {p for p, _ in r["records"]}
        assert {"one_stage", "two_stage"} <= paths, r["records"]
        for case in r["cases"]:
            assert case["rel_err"] < 1e-2, case
            assert case["same_on_ranks"], case
        assert any("one_stage_kernel" in k for k in r["cases"][0]["kernels"]), r["cases"]
        assert any("two_stage_kernel" in k for k in r["cases"][1]["kernels"]), r["cases"]
