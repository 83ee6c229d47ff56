"""benchmarks/bench_vllm.py on vLLM's CPU build at TP=2, a tiny Llama: the results file's
contents and the plugin's records, never its times.

One run (two engines, alive at once, measured in turn) shared by the assertions.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM (the CPU build in CI) is not importable")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_vllm  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SPEC = bench_vllm.MODELS["tiny"]
BATCHES = [1, 3]
STEPS = 3
ARGS = ["--tp", "2", "--models", "tiny", "--batches", *map(str, BATCHES), "--decode-steps",
        str(STEPS), "--input-len", "8", "--prefill-len", "64", "--repeats", "2", "--warmup", "0",
        "--max-num-seqs", "4", "--check", "all"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from fusion_pass.demo import on_cpu

    if not on_cpu():
        pytest.skip("the CPU build's test (on a GPU, scripts/gpu_vllm.sh runs the benchmark)")
    out = tmp_path_factory.mktemp("results")
    rc = bench_vllm.main([*ARGS, "--out-dir", str(out), "--name", "r.json"])
    return rc, json.loads((out / "r.json").read_text())


def test_results_file_says_what_ran(run):
    rc, r = run
    assert rc == 0, r.get("check")
    assert r["complete"] and r["device"] == "cpu" and r["check"]["problems"] == []
    meta = r["meta"]
    assert meta["versions"]["vllm"] and meta["versions"]["torch"]
    assert meta["git"]["commit"] and meta["command"][-1] == "r.json"
    assert r["settings"]["tp"] == 2 and r["settings"]["batches"] == BATCHES
    assert r["settings"]["max_num_seqs"] == 4 and r["settings"]["dtype"] == "float32"
    [m] = r["models"]
    assert m["model"]["hidden"] == SPEC.hidden and m["model"]["layers"] == SPEC.layers
    assert list(m["variants"]) == ["off", "in_tree", "plugin"]


def test_in_tree_not_run_on_the_cpu_with_its_reason(run):
    v = run[1]["models"][0]["variants"]["in_tree"]
    assert v["run"] is False
    assert "CPU" in v["not_run_reason"]
    assert "in_tree" not in run[1]["models"][0]["ratios_vs_off"]


def test_measured_variants_carry_every_point(run):
    m = run[1]["models"][0]
    for name in ("off", "plugin"):
        v = m["variants"][name]
        assert v["run"] is True
        assert sorted(v["decode"], key=int) == [str(b) for b in BATCHES]
        assert v["prefill"]["tokens"] == 64
        # Every timed call, once per repeat.
        assert all(len(x) == 2 for x in v["latencies_s"].values())
        assert len(v["latencies_s"]) == 2 * len(BATCHES) + 1
        eng = v["engine"]
        assert eng["parallel"]["tensor_parallel_size"] == 2
        assert eng["scheduler"]["max_num_seqs"] == 4
        assert eng["cache"]["enable_prefix_caching"] is False
    assert set(m["ratios_vs_off"]["plugin"]) == {"decode_b1", "decode_b3", "prefill"}
    # The plugin's pass sits in its engine's compilation config, not in the baseline's.
    assert m["variants"]["plugin"]["engine"]["compilation"]["post_grad_custom_post_pass"]
    assert m["variants"]["off"]["engine"]["compilation"]["post_grad_custom_post_pass"] is None
    assert m["variants"]["off"]["engine"]["compilation"]["pass_config"]["fuse_allreduce_rms"] \
        is False


def test_greedy_tokens_identical_and_complete(run):
    m = run[1]["models"][0]
    assert m["tokens"]["identical"] is True
    ids = m["token_ids"]
    for v in ("off", "plugin"):
        assert [len(s) for s in ids[v][f"decode_b3_out{STEPS + 1}"]] == [STEPS + 1] * 3
        assert [len(s) for s in ids[v]["prefill_64"]] == [1]
    assert ids["off"] == ids["plugin"]


def test_every_site_fused_per_rank_and_range(run):
    m = run[1]["models"][0]
    plugin = m["variants"]["plugin"]["sites_per_range"]
    assert sorted(plugin) == ["rank0", "rank1"]
    # vLLM's CPU Llama at TP=2: o_proj and down_proj all-reduces into the next norm in each
    # layer, and the embedding's into the first norm.
    expected = 2 * SPEC.layers + 1
    assert m["expected_sites_per_range"] == expected
    for ranges in plugin.values():
        assert ranges
        for r in ranges.values():
            assert r["sites"] == expected and r["fused"] == expected, r
            assert r["unfused_reasons"] == {}
    assert m["variants"]["plugin"]["all_fused"] is True
    assert m["variants"]["off"]["sites_per_range"] == {}
