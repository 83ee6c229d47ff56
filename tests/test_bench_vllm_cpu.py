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

from fusion_pass import records  # noqa: E402

pytestmark = pytest.mark.vllm

SPEC = bench_vllm.MODELS["tiny"]
BATCHES = [1, 3]
STEPS = 3
ARGS = ["--tp", "2", "--models", "tiny", "--batches", *map(str, BATCHES), "--decode-steps",
        str(STEPS), "--input-len", "8", "--prefill-len", "64", "--repeats", "2", "--warmup", "0",
        "--max-num-seqs", "4", "--check", "all"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from fusion_pass.tools.demo import on_cpu

    if not on_cpu():
        pytest.skip("the CPU build's test (on a GPU, scripts/gpu_vllm.sh runs the benchmark)")
    out = tmp_path_factory.mktemp("results")
    rc = bench_vllm.main([*ARGS, "--out-dir", str(out), "--name", "r.json"])
    return rc, json.loads((out / "r.json").read_text())


@pytest.mark.slow
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


@pytest.mark.slow
def test_in_tree_not_run_on_the_cpu_with_its_reason(run):
    v = run[1]["models"][0]["variants"]["in_tree"]
    assert v["run"] is False
    assert "CPU" in v["not_run_reason"]
    assert "in_tree" not in run[1]["models"][0]["ratios_vs_off"]


@pytest.mark.slow
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
    # A ratio for every point (None where the baseline's decode difference is not positive).
    assert set(m["ratios_vs_off"]["plugin"]) == {"decode_b1", "decode_b3", "prefill",
                                                 "tpot_b1", "tpot_b3"}
    # vLLM's own time per output token, from the engine's request stats.
    assert all(d["tpot_ms"] > 0 for v in ("off", "plugin")
               for d in m["variants"][v]["decode"].values())
    # The plugin's pass sits in its engine's compilation config, not in the baseline's.
    assert m["variants"]["plugin"]["engine"]["compilation"]["post_grad_custom_post_pass"]
    assert m["variants"]["off"]["engine"]["compilation"]["post_grad_custom_post_pass"] is None
    assert m["variants"]["off"]["engine"]["compilation"]["pass_config"]["fuse_allreduce_rms"] \
        is False


@pytest.mark.slow
def test_greedy_tokens_identical_and_complete(run):
    m = run[1]["models"][0]
    assert m["tokens"]["identical"] is True
    ids = m["token_ids"]
    for v in ("off", "plugin"):
        assert [len(s) for s in ids[v][f"decode_b3_out{STEPS + 1}"]] == [STEPS + 1] * 3
        assert [len(s) for s in ids[v]["prefill_64"]] == [1]
    assert ids["off"] == ids["plugin"]


@pytest.mark.slow
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


# -- the summaries, on made-up inputs ---------------------------------------------

def _site(path: str = "one_stage", reason: str = "fits") -> records.SiteRecord:
    return records.SiteRecord(collective="c10d_functional", norm="native_residual", hidden=256,
                              dtype="bfloat16", world_size=2, tokens="[1, 8]", path=path,
                              reason=reason, backend="triton", group="tp")


def test_sites_per_range_sums_graphs_and_counts_a_cached_graph_by_its_total():
    graphs = [
        records.GraphRecord(graph=0, rank=0, token_range="[1, 8]", sites=[_site(), _site()]),
        records.GraphRecord(graph=1, rank=0, token_range="[1, 8]",
                            sites=[_site(), _site("unfused", "too many tokens")]),
        # From a compile cache: only its fused sites report, of the 3 it had.
        records.GraphRecord(graph=2, rank=0, token_range="[9, 64]", sites=[_site(), _site()],
                            source="cache", total=3),
        records.GraphRecord(graph=0, rank=1, token_range="[1, 8]", sites=[_site()]),
    ]
    got = bench_vllm.sites_per_range(graphs)
    assert got["rank0"]["[1, 8]"] == {
        "graphs": 2, "sites": 4, "fused": 3, "from_cache": 0,
        "paths": {"one_stage": 3, "unfused": 1},
        "unfused_reasons": {"too many tokens": 1}}
    assert (got["rank0"]["[9, 64]"]["sites"], got["rank0"]["[9, 64]"]["fused"]) == (3, 2)
    assert got["rank1"]["[1, 8]"]["sites"] == 1


def test_compare_tokens_names_the_sequences_and_the_first_position_that_differ():
    ids = {"off": {"k": [[1, 2, 3], [4, 5, 6], [7, 8, 9]]},
           "plugin": {"k": [[1, 2, 3], [4, 0, 6], [7, 8, 0]]},
           "in_tree": {"k": [[1, 2, 3], [4, 5, 6], [7, 8, 9]]}}
    got = bench_vllm.compare_tokens(ids)
    assert got["identical"] is False and got["reference"] == "off"
    assert got["calls"]["k"]["plugin"] == {"identical": False, "sequences": 3,
                                           "sequences_differing": 2,
                                           "first_differing_position": 1}
    assert got["calls"]["k"]["in_tree"]["identical"] is True


class _Stats:
    def __init__(self, n, first, last):
        self.num_generation_tokens, self.first_token_ts, self.last_token_ts = n, first, last


class _Out:
    def __init__(self, metrics):
        self.metrics = metrics


def test_tpot_is_the_engines_time_between_first_and_last_token():
    assert bench_vllm.request_tpot(_Out(_Stats(11, 2.0, 2.5))) == pytest.approx(0.05)
    # One token, no stats, or timestamps that did not move: no time per token.
    assert bench_vllm.request_tpot(_Out(_Stats(1, 2.0, 2.0))) is None
    assert bench_vllm.request_tpot(_Out(None)) is None
    assert bench_vllm.request_tpot(_Out(_Stats(5, 3.0, 3.0))) is None
    args = bench_vllm.parse_args(["--batches", "4", "--decode-steps", "10", "--prefill-len", "0"])
    lat = {"decode_b4_out1": [0.1] * 3, "decode_b4_out11": [0.6] * 3}
    got = bench_vllm.summarise({"latencies_s": {"off": lat, "plugin": lat},
                                "tpot_s": {"off": {"decode_b4_out11": [0.02, 0.03, 0.04]},
                                           "plugin": {"decode_b4_out11": [0.03, 0.03, 0.03]}}},
                               args)
    assert got["off"]["decode"]["4"]["tpot_ms"] == pytest.approx(30.0)
    assert got["off"]["decode"]["4"]["tpot_ms_max"] == pytest.approx(40.0)
    assert bench_vllm.ratios(got)["plugin"]["tpot_b4"] == pytest.approx(1.0)


def test_decode_time_per_token_is_the_difference_over_the_steps():
    args = bench_vllm.parse_args(["--batches", "4", "--decode-steps", "10", "--prefill-len", "0"])
    lat = {"decode_b4_out1": [0.10, 0.30, 0.20], "decode_b4_out11": [0.60, 0.70, 0.90]}
    got = bench_vllm.summarise({"latencies_s": {"off": lat, "plugin": {
        "decode_b4_out1": [0.1] * 3, "decode_b4_out11": [0.35] * 3}}}, args)
    # Per round (0.5, 0.4, 0.7) / 10 steps: median 0.05 s.
    assert got["off"]["decode"]["4"]["ms_per_token"] == pytest.approx(50.0)
    assert got["off"]["decode"]["4"]["ms_per_token_min"] == pytest.approx(40.0)
    assert "prefill" not in got["off"]
    assert bench_vllm.ratios(got)["plugin"]["decode_b4"] == pytest.approx(25.0 / 50.0)
    assert "tpot_ms" not in got["off"]["decode"]["4"]  # no request stats given
    # A baseline lost in noise gives no ratio rather than a negative one.
    got["off"]["decode"]["4"]["ms_per_token"] = -1.0
    assert bench_vllm.ratios(got)["plugin"] == {"decode_b4": None}
