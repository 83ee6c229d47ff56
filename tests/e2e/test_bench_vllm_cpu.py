"""benchmarks/vllm/bench_vllm.py on vLLM's CPU build at TP=2, a tiny Llama: the results file's
contents, the A/A pair, the compiled digests and the plugin's records, never its times;
then the benchmark's pieces on made-up inputs.

One run (off, the plugin and the plugin's A/A twin, each engine in its own process,
measured in turn) shared by the assertions (tests/helpers/bench_vllm_run.py).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

# The vllm benchmark's modules, and the ones the benchmarks share (bench_common.py).
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path[:0] = [str(BENCHMARKS / "vllm"), str(BENCHMARKS)]

from bench_vllm_run import only_model  # noqa: E402

import compiled_digest  # noqa: E402
import paired_ratios  # noqa: E402
import vllm_report  # noqa: E402

from fusion_pass import records  # noqa: E402

SPEC_NAME = "tiny"


@pytest.fixture(scope="module")
def run():
    import bench_vllm_run

    bench_vllm_run.require_cpu_build()

    rc, result, _ = bench_vllm_run.offline()
    return rc, result


@pytest.mark.vllm
@pytest.mark.slow
def test_results_file_says_what_ran(run):
    import bench_vllm_run

    rc, r = run
    assert rc == 0, r.get("check")
    assert r["complete"] and r["device"] == "cpu" and r["check"]["problems"] == []
    meta = r["meta"]
    assert meta["versions"]["vllm"] and meta["versions"]["torch"]
    assert meta["git"]["commit"] and meta["command"][-1] == "r.json"
    assert r["settings"]["tp"] == 2 and r["settings"]["batches"] == bench_vllm_run.BATCHES
    assert r["settings"]["dtype"] == "float32" and r["settings"]["kernel_choice"] == "pinned"
    # Nothing is timed by Inductor on the CPU: no pinned settings to apply there.
    assert r["kernel_settings"] == {}
    assert r["clock_sampler"] != "" and "NVML" not in r["clock_sampler"]
    # The CPU build binds its own compute threads: nothing pinned, no CPU kept busy.
    assert r["cpu_placement"] == {"mode": "scheduler"}
    m = only_model(run[1])
    assert m["model"]["name"] == SPEC_NAME and m["model"]["layers"] == 2
    assert list(m["variants"]) == ["off", "in_tree", "plugin"]
    assert list(m["engines"]) == ["off", "plugin", "plugin_aa"]


@pytest.mark.vllm
@pytest.mark.slow
def test_measured_after_the_job_it_waits_for_and_one_folder_of_model_answers(run):
    import bench_vllm_run

    _, r, work = bench_vllm_run.offline()
    assert r["after_pid"]["ended"] is True
    # Every engine's vLLM found the answer about the model's class, written once before
    # they started, through its link: vLLM rewrites the file after asking a child process
    # (a new file), so the same file, unchanged, says no engine asked.
    links = sorted(work.glob(f"{SPEC_NAME}/*/cache/vllm/modelinfos"))
    assert [p.parts[-4] for p in links] == ["off", "plugin", "plugin_aa"]
    assert all(p.is_symlink() and p.resolve() == (work / "modelinfos").resolve()
               for p in links)
    name = "vllm-model_executor-models-llama-LlamaForCausalLM.json"
    assert list(bench_vllm_run.WARMED) == [name]
    after = (work / "modelinfos" / name).stat()
    assert (after.st_ino, after.st_mtime_ns) == bench_vllm_run.WARMED[name]


@pytest.mark.vllm
@pytest.mark.slow
def test_in_tree_not_run_on_the_cpu_with_its_reason(run):
    v = only_model(run[1])["variants"]["in_tree"]
    assert v["run"] is False and "CPU" in v["not_run_reason"]
    assert "in_tree" not in only_model(run[1])["engines"]
    assert not any(k.startswith("in_tree") for k in only_model(run[1])["comparisons"])


@pytest.mark.vllm
@pytest.mark.slow
def test_every_engine_measured_every_round(run):
    import bench_vllm_run

    m = only_model(run[1])
    assert m["rounds"]["timed"] == 2 and m["rounds"]["stopped_because"] == "max rounds"
    want = {f"tpot_b{b}" for b in bench_vllm_run.BATCHES} | {
        f"latency_b{b}" for b in bench_vllm_run.BATCHES} | {"prefill", "latency_prefill"}
    for label in ("off", "plugin", "plugin_aa"):
        e = m["engines"][label]
        assert e["run"] is True and e["seconds_to_start"] > 0
        assert set(e["per_round"]) == want
        # One number per round for each, all of them times > 0 (vLLM's own TPOT and prefill
        # from the engine core's timestamps, and the calls' wall-clock latencies).
        assert all(len(v) == 2 and all(x > 0 for x in v) for v in e["per_round"].values())
        # One turn per round, and per call the engine processes' CPU time was read.
        assert [t["round"] for t in e["turns"]] == [0, 1]
        for call in e["calls"].values():
            assert call["engine_cpu_load"] > 0 and call["sm_mhz"] is None
        eng = e["engine"]
        assert eng["parallel"]["tensor_parallel_size"] == 2
        assert eng["cache"]["enable_prefix_caching"] is False
    # The plugin's pass sits in its engine's compilation config, not in the baseline's.
    assert m["engines"]["plugin"]["engine"]["compilation"]["post_grad_custom_post_pass"]
    assert m["engines"]["off"]["engine"]["compilation"]["post_grad_custom_post_pass"] is None
    assert m["engines"]["plugin_aa"]["engine"]["compilation"]["post_grad_custom_post_pass"]
    assert m["engines"]["off"]["engine"]["compilation"]["pass_config"]["fuse_allreduce_rms"] \
        is False


@pytest.mark.vllm
@pytest.mark.slow
def test_the_aa_pair_is_reported_beside_every_comparison(run):
    m = only_model(run[1])
    cmp = m["comparisons"]
    assert set(cmp) == {"plugin_aa/plugin", "plugin/off"}
    metrics = set(cmp["plugin_aa/plugin"])
    assert metrics == set(cmp["plugin/off"])
    for metric, s in cmp["plugin/off"].items():
        assert s["rounds"] == 2 and len(s["per_round"]) == 2
        assert s["ci"][0] <= s["median"] <= s["ci"][1]
        assert s["aa"]["median"] == cmp["plugin_aa/plugin"][metric]["median"]
    verdict = m["aa"]
    assert verdict["pair"] == "plugin_aa/plugin" and verdict["band"] == [0.99, 1.01]
    # The verdict follows from the pair's medians (CPU times are what they are): vLLM's
    # TPOT and prefill decide it, the wall-clock latencies are listed apart.
    outside = {k for k, s in cmp["plugin_aa/plugin"].items() if not 0.99 <= s["median"] <= 1.01}
    primary = {k for k in outside if k.startswith(("tpot_", "prefill"))}
    assert set(verdict["outside"]) == primary and verdict["within"] == (not primary)
    assert set(verdict["secondary_outside"]) == outside - primary
    assert run[1]["aa_overall"]["within"] == verdict["within"]


@pytest.mark.vllm
@pytest.mark.slow
def test_two_compiles_of_one_variant_give_the_same_kernels(run):
    m = only_model(run[1])
    twin = m["engines"]["plugin_aa"]["compiled"]
    assert twin["digest"]["kernels"] > 0 and twin["digest"]["graph_modules"] > 0
    assert twin["vs_plugin"]["same_kernels"] and twin["vs_plugin"]["same_graphs"]
    assert twin["digest"] == m["engines"]["plugin"]["compiled"]["digest"]
    # The plugin's graphs hold its fused op: not the baseline's graphs.
    assert m["engines"]["plugin"]["compiled"]["vs_off"]["same_graphs"] is False
    text = "\n".join(vllm_report.offline_lines(run[1]))
    assert "compiled vs plugin: kernels same, graphs same, picks same" in text
    assert "graphs DIFFER" in text


@pytest.mark.vllm
@pytest.mark.slow
def test_greedy_tokens_identical_and_complete(run):
    import bench_vllm_run

    m = only_model(run[1])
    assert m["tokens"]["identical"] is True
    ids = m["token_ids"]
    for label in ("off", "plugin", "plugin_aa"):
        assert [len(s) for s in ids[label]["decode_b3"]] == [bench_vllm_run.STEPS + 1] * 3
        assert [len(s) for s in ids[label]["prefill"]] == [1]
        assert m["engines"][label]["deterministic"] is True
    assert ids["off"] == ids["plugin"] == ids["plugin_aa"]


@pytest.mark.vllm
@pytest.mark.slow
def test_every_site_fused_per_rank_and_range(run):
    m = only_model(run[1])
    # vLLM's CPU Llama at TP=2: o_proj and down_proj all-reduces into the next norm in each
    # layer, and the embedding's into the first norm.
    expected = 2 * m["model"]["layers"] + 1
    assert m["expected_sites_per_range"] == expected
    for label in ("plugin", "plugin_aa"):
        per_rank = m["engines"][label]["fusion"]["sites_per_range"]
        assert sorted(per_rank) == ["rank0", "rank1"], label
        for ranges in per_rank.values():
            assert ranges
            for r in ranges.values():
                assert r["sites"] == expected and r["fused"] == expected, (label, r)
                assert r["unfused_reasons"] == {}
    assert m["variants"]["plugin"]["all_fused"] is True
    assert m["variants"]["plugin"]["sites_per_range"] == m["engines"]["plugin"]["fusion"][
        "sites_per_range"]
    assert m["variants"]["off"]["sites_per_range"] == {}


# -- the pieces, on made-up inputs ----------------------------------------------------

def test_round_order_alternates_direction_and_rotates_the_first():
    items = ["a", "b", "c"]
    orders = [paired_ratios.round_order(items, r) for r in range(6)]
    assert orders[:2] == [["a", "b", "c"], ["c", "b", "a"]]
    assert orders[2] == ["b", "c", "a"]
    # Over a full cycle every engine takes every position equally often.
    for pos in range(3):
        assert Counter(o[pos] for o in orders) == {"a": 2, "b": 2, "c": 2}
    # Within a pair of rounds a linear drift adds the same to every engine: the sum of
    # positions of each engine over rounds 2k, 2k+1 is the same.
    for k in range(3):
        a, b = orders[2 * k], orders[2 * k + 1]
        assert len({a.index(x) + b.index(x) for x in items}) == 1


def test_median_interval_has_the_binomial_coverage():
    # 5 values: only (min, max), which covers the median with 1 - 2/32.
    assert paired_ratios.median_ci([5, 1, 4, 2, 3]) == (1, 5, pytest.approx(1 - 2 / 32))
    # 9 values: (x2, x8) covers with 1 - 2 * (1 + 9) / 512 = 0.961; (x3, x7) only 0.82.
    lo, hi, cov = paired_ratios.median_ci(list(range(1, 10)))
    assert (lo, hi) == (2, 8) and cov == pytest.approx(1 - 20 / 512)
    lo, hi, cov = paired_ratios.median_ci(list(range(1, 10)), level=0.8)
    assert (lo, hi) == (3, 7) and cov == pytest.approx(1 - 2 * (1 + 9 + 36) / 512)


def test_ratios_are_paired_by_round_and_skip_missing_rounds():
    s = paired_ratios.ratio_stats([2.0, None, 3.3, 4.0], [2.0, 1.0, 3.0, 0.0])
    # Round 2 has no value, round 4 a baseline of 0: two ratios left, 1.0 and 1.1.
    assert s["rounds"] == 2 and s["per_round"] == [1.0, 1.1]
    assert s["median"] == pytest.approx(1.05) and s["ci"] == [1.0, pytest.approx(1.1)]
    assert paired_ratios.ratio_stats([None], [1.0]) is None


def test_the_aa_pair_is_its_twin_over_its_variant_beside_every_comparison():
    per_round = {"off": {"t": [10.0, 10.0]}, "plugin": {"t": [8.0, 9.0]},
                 "plugin_aa": {"t": [8.8, 9.0]}, "in_tree": {"t": [9.0, 9.5], "x": [1.0, 1.0]}}
    cmp = paired_ratios.compare(per_round, "off", ("plugin_aa", "plugin"))
    assert set(cmp) == {"plugin_aa/plugin", "plugin/off", "in_tree/off"}
    assert cmp["plugin_aa/plugin"]["t"]["median"] == pytest.approx((1.1 + 1.0) / 2)
    assert cmp["plugin/off"]["t"]["median"] == pytest.approx(0.85)
    assert cmp["plugin/off"]["t"]["aa"]["median"] == pytest.approx(1.05)
    # A metric the baseline lacks has no ratio.
    assert "x" not in cmp["in_tree/off"]
    v = paired_ratios.aa_verdict(cmp, "plugin_aa/plugin", ("t",))
    assert v["within"] is False and v["outside"] == {"t": 1.05}
    # A secondary metric outside the band is named apart; the verdict is the primary's.
    pair = {"a/b": {"t": {"median": 1.004, "ci": [0.995, 1.012], "ci_coverage": 0.96},
                    "wall": {"median": 1.03, "ci": [1.0, 1.06], "ci_coverage": 0.96}}}
    ok = paired_ratios.aa_verdict(pair, "a/b", ("t",))
    assert ok["within"] is True and ok["secondary_outside"] == {"wall": 1.03}
    assert ok["ci_within"] is False and ok["ci_outside"] == {"t": [0.995, 1.012]}
    assert ok["ci_short"] == []
    # An interval inside the band is one only with the rounds for 95 %: two rounds' range
    # (coverage 0.5) is not.
    narrow = {"a/b": {"t": {"median": 1.0, "ci": [0.998, 1.002], "ci_coverage": 0.96}}}
    assert paired_ratios.aa_verdict(narrow, "a/b", ("t",))["ci_within"] is True
    narrow["a/b"]["t"]["ci_coverage"] = 0.5
    short = paired_ratios.aa_verdict(narrow, "a/b", ("t",))
    assert short["within"] is True and short["ci_within"] is False
    assert short["ci_short"] == ["t"] and short["ci_outside"] == {}
    assert paired_ratios.aa_verdict(cmp, None, ("t",))["within"] is None
    both = paired_ratios.overall({"m1": ok, "m2": v})
    assert both["within"] is False and both["outside"] == {"m2": {"t": 1.05}}
    assert both["secondary_outside"] == {"m1": {"wall": 1.03}}


def test_the_aa_headline_names_intervals_outside_and_too_short_both():
    def model(name, ci, coverage):
        stats = {"t": {"median": 1.0, "ci": ci, "ci_coverage": coverage, "rounds": 8}}
        cmp = {"a/b": stats}
        return {"model": {"name": name}, "comparisons": cmp,
                "aa": paired_ratios.aa_verdict(cmp, "a/b", ("t",))}

    wide, short = model("m1", [0.97, 1.03], 0.96), model("m2", [0.999, 1.001], 0.5)
    head = paired_ratios.aa_lines("offline", [wide, short], ("t",))[0]
    assert "within [0.99, 1.01] at every primary metric" in head
    assert "NOT all inside (m1 t [0.970, 1.030])" in head
    assert "too few rounds for one: m2 t" in head
    ok = paired_ratios.aa_lines("offline", [model("m1", [0.995, 1.005], 0.96)], ("t",))
    assert ok[0].endswith("95 % intervals inside too")


def test_an_aa_pair_on_one_side_beyond_chance_is_named_an_offset_of_an_engine():
    # The twin slower by 1.2 % in every one of 11 rounds, its median inside the band or not:
    # an offset of the engine, not noise (sign test: 2 * 0.5 ** 11 < 5 %).
    base = [5.0 + 0.01 * (i % 3) for i in range(11)]
    cmp = paired_ratios.compare({"off": {"t": base, "u": base},
                                 "off_aa": {"t": [x * 1.012 for x in base],
                                            "u": [x * (1.004 if i % 2 else 0.997)
                                                  for i, x in enumerate(base)]}},
                                "off", ("off_aa", "off"))
    s = cmp["off_aa/off"]["t"]
    assert (s["above"], s["below"], s["rounds"]) == (11, 0, 11)
    v = paired_ratios.aa_verdict(cmp, "off_aa/off", ("t", "u"))
    # Rounds on both sides of 1 in turn (5 above, 6 below) are noise, however the median falls.
    assert v["one_sided"] == {"t": "1.012, above 1 in 11 of 11 rounds"}

    def stats(above, below, equal=0):
        return paired_ratios.ratio_stats([1.01] * above + [0.99] * below + [1.0] * equal,
                                         [1.0] * (above + below + equal))

    # A round or two on the other side does not hide an offset: 10 of 11 is named
    # (p = 0.012), 8 of 11 is not (p = 0.23).
    assert paired_ratios.one_sided(stats(10, 1)) == "above"
    assert paired_ratios.one_sided(stats(1, 10)) == "below"
    assert paired_ratios.one_sided(stats(8, 3)) is None
    # Five of five happen by chance 1 time in 16: not yet an offset; six of six is one.
    assert paired_ratios.one_sided(stats(5, 0)) is None
    assert paired_ratios.one_sided(stats(6, 0)) == "above"
    # Rounds equal to 1 are on neither side and left out of the test.
    assert paired_ratios.one_sided(stats(6, 0, equal=3)) == "above"
    assert paired_ratios.one_sided(stats(5, 0, equal=3)) is None
    assert paired_ratios.sign_p(15, 19) < 0.05 < paired_ratios.sign_p(14, 19)
    # A hand-built ratio without the counts is on no side.
    assert paired_ratios.one_sided({"median": 1.02, "rounds": 9}) is None
    lines = paired_ratios.aa_lines("offline", [{"model": {"name": "m"}, "comparisons": cmp,
                                                "aa": v}], ("t", "u"))
    assert any("more rounds than chance allows" in x and "m t 1.012, above 1 in 11 of 11" in x
               for x in lines)
    assert paired_ratios.overall({"m": v})["one_sided"] == {
        "m": {"t": "1.012, above 1 in 11 of 11 rounds"}}


def test_ratios_of_numpy_scalars_are_plain_numbers_the_results_file_can_hold():
    np = pytest.importorskip("numpy")
    s = paired_ratios.ratio_stats([np.float64(5.1), np.float32(4.9)],
                                  [np.int64(5), np.float64(5.0)])
    text = json.dumps(s)  # raised TypeError on numpy integers before
    assert json.loads(text)["above"] == 1 and type(s["median"]) is float


def test_precision_is_the_interval_half_width_over_the_median():
    tight = {"a/b": {"t": {"median": 1.0, "ci": [0.997, 1.003], "ci_coverage": 0.96}}}
    loose = {"a/b": {"t": {"median": 1.0, "ci": [0.99, 1.003], "ci_coverage": 0.96}}}
    assert paired_ratios.precise_enough(tight, 0.004)
    assert not paired_ratios.precise_enough(loose, 0.004)
    # Two close rounds are not a precise ratio: their range covers the median with 0.5.
    two = paired_ratios.ratio_stats([1.001, 1.002], [1.0, 1.0])
    assert two["ci_coverage"] == 0.5 and paired_ratios.half_width(two) < 0.001
    assert not paired_ratios.precise_enough({"a/b": {"t": two}}, 0.004)
    six = paired_ratios.ratio_stats([1.001, 1.002, 1.0, 1.001, 1.002, 1.0], [1.0] * 6)
    assert six["ci_coverage"] >= paired_ratios.LEVEL
    assert paired_ratios.precise_enough({"a/b": {"t": six}}, 0.004)


def test_compiled_digest_names_kernels_and_picks_that_differ(tmp_path):
    def cache(root, kernels, picks):
        for name, src in kernels.items():
            (root / name[:2]).mkdir(parents=True, exist_ok=True)
            (root / name[:2] / f"{name}.py").write_text(src)
        for name, pick in picks.items():
            (root / name[:2] / f"{name}.best_config").write_text(json.dumps(pick))
        return compiled_digest.scan(root)

    jit = "@triton.jit\ndef k(): pass\n"
    a = cache(tmp_path / "a", {"ab1": jit, "ab2": jit, "cd9": "def call(args): pass\n"},
              {"ab1": {"XBLOCK": 256, "num_warps": 4, "time_taken_ms": 3}})
    # Same kernels; one pick timed differently and one chosen differently.
    b = cache(tmp_path / "b", {"ab1": jit, "ab2": jit, "cd9": "def call(args): pass\n"},
              {"ab1": {"XBLOCK": 1024, "num_warps": 4, "time_taken_ms": 9}})
    c = cache(tmp_path / "c", {"ab1": jit, "ab2": jit, "cd9": "def call(args): pass\n"},
              {"ab1": {"XBLOCK": 256, "num_warps": 4, "time_taken_ms": 7}})
    assert compiled_digest.summary(a)["kernels"] == 2
    assert compiled_digest.summary(a)["graph_modules"] == 1
    ab = compiled_digest.compare(a, b)
    assert ab["same_kernels"] and ab["different_picks"] == 1 and not ab["same_picks"]
    assert ab["different_picks_named"] == [next(iter(a["picks"]))]
    ac = compiled_digest.compare(a, c)
    assert ac["same_picks"] and compiled_digest.summary(a) == compiled_digest.summary(c)
    d = cache(tmp_path / "d", {"ab1": jit}, {})
    ad = compiled_digest.compare(a, d)
    assert ad["kernels_only_here"] == 1 and not ad["same_kernels"] and not ad["same_graphs"]

    # A GPU wrapper module holds its kernels' Triton sources and names the engine's own
    # cache folder in comments: two engines' wrappers of one graph differ there only.
    def wrapper(folder, body="buf0 = empty(8)"):
        return (f"# kernel path: WORK/{folder}/cache/ab/cab1.py\n"
                f"k = async_compile.triton('k', '''\n{jit}''')\n"
                f"def call(args):\n    {body}\n")
    e = cache(tmp_path / "e", {"ab1": jit, "ef1": wrapper("off")}, {})
    f = cache(tmp_path / "f", {"ab1": jit, "ef2": wrapper("off_aa")}, {})
    g = cache(tmp_path / "g", {"ab1": jit, "ef3": wrapper("off_aa", "buf0 = empty(9)")}, {})
    assert compiled_digest.summary(e)["kernels"] == 1
    assert compiled_digest.summary(e)["graph_modules"] == 1
    assert compiled_digest.compare(e, f)["same_graphs"]
    assert compiled_digest.summary(e) == compiled_digest.summary(f)
    assert not compiled_digest.compare(f, g)["same_graphs"]
    # A kernel module with Inductor's benchmark harness (TORCHINDUCTOR_BENCHMARK_KERNEL)
    # has a `def call(` too, and stays a kernel.
    harness = (jit + "def get_args(): pass\ndef call(args): pass\n"
               "def benchmark_all_configs(args): pass\n")
    h = cache(tmp_path / "h", {"ab1": harness, "ef1": wrapper("off")}, {})
    assert compiled_digest.summary(h)["kernels"] == 1
    assert compiled_digest.summary(h)["graph_modules"] == 1


def _site(path: str = "one_stage", reason: str = "fits") -> records.SiteRecord:
    return records.SiteRecord(collective="c10d_functional", norm="native_residual", hidden=256,
                              dtype="bfloat16", world_size=2, tokens="[1, 8]", path=path,
                              reason=reason, backend="triton", group="tp")


def test_sites_per_range_sums_graphs_and_counts_a_cached_graph_by_its_total():
    import bench_vllm

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
    import bench_vllm

    ids = {"off": {"k": [[1, 2, 3], [4, 5, 6], [7, 8, 9]]},
           "plugin": {"k": [[1, 2, 3], [4, 0, 6], [7, 8, 0]]},
           "off_aa": {"k": [[1, 2, 3], [4, 5, 6], [7, 8, 9]]}}
    got = bench_vllm.compare_tokens(ids)
    assert got["identical"] is False and got["reference"] == "off"
    assert got["calls"]["k"]["plugin"] == {"identical": False, "sequences": 3,
                                           "sequences_differing": 2,
                                           "first_differing_position": 1}
    assert got["calls"]["k"]["off_aa"]["identical"] is True


class _Stats:
    def __init__(self, n, scheduled, first, last):
        self.num_generation_tokens, self.scheduled_ts = n, scheduled
        self.first_token_ts, self.last_token_ts = first, last


class _Out:
    def __init__(self, metrics):
        self.metrics = metrics


def test_request_times_come_from_the_engine_cores_timestamps():
    from vllm_engine_host import request_times

    got = request_times(_Out(_Stats(11, 1.5, 2.0, 2.5)))
    assert got["tpot"] == pytest.approx(0.05) and got["prefill"] == pytest.approx(0.5)
    # One token, no stats, or timestamps that did not move: no time.
    assert request_times(_Out(_Stats(1, 1.0, 2.0, 2.0)))["tpot"] is None
    assert request_times(_Out(None)) == {"tpot": None, "prefill": None}
    assert request_times(_Out(_Stats(5, 0.0, 3.0, 3.0))) == {"tpot": None, "prefill": None}


def test_per_round_metrics_of_a_call_are_milliseconds():
    import bench_vllm

    r = {"seconds": 0.25, "tpot_s": [0.02, 0.03, 0.04], "prefill_s": [0.1, 0.1, 0.1]}
    assert bench_vllm.metrics_of("decode_b3", r) == {"tpot_b3": pytest.approx(30.0),
                                                     "latency_b3": pytest.approx(250.0)}
    r = {"seconds": 0.05, "tpot_s": [None], "prefill_s": [0.04]}
    assert bench_vllm.metrics_of("prefill", r) == {"prefill": pytest.approx(40.0),
                                                   "latency_prefill": pytest.approx(50.0)}
    # A request without a time leaves the round's number missing, not wrong.
    r = {"seconds": 0.25, "tpot_s": [0.02, None], "prefill_s": [0.1, 0.1]}
    assert bench_vllm.metrics_of("decode_b2", r)["tpot_b2"] is None


@pytest.mark.vllm
def test_every_variant_compiles_with_the_same_pinned_kernel_choices_on_gpus(monkeypatch, tmp_path):
    pytest.importorskip("vllm", reason="vLLM (the CPU build in CI) is not importable")
    import vllm_setup

    monkeypatch.setattr(vllm_setup, "on_cpu", lambda: False)
    shape = vllm_setup.EngineShape(tp=2, dtype="bfloat16", max_model_len=2112, max_num_seqs=64,
                                   max_num_batched_tokens=2048, kv_tokens=40960)
    pinned = vllm_setup.kernel_settings("pinned")
    # Nothing timed: no combo kernel benchmarked, no pointwise or combo config autotuned.
    assert pinned["benchmark_combo_kernel"] is False and pinned["combo_kernels_autotune"] == 0
    assert pinned["triton.autotune_pointwise"] is False
    # Reductions too: one candidate config each, by Inductor's fixed rule (where this torch
    # has the filter; torch 2.11 and later do).
    from torch._inductor import config as inductor_config

    if hasattr(inductor_config.test_configs, "force_filter_reduction_configs"):
        assert pinned["test_configs.force_filter_reduction_configs"] is True
    cfg = {v: vllm_setup.compilation(v, shape, tmp_path / "dumps") for v in vllm_setup.VARIANTS}
    assert all(c["inductor_compile_config"] == pinned for c in cfg.values())
    assert cfg["off"]["pass_config"] == {"fuse_allreduce_rms": False}
    assert cfg["in_tree"]["pass_config"]["fuse_allreduce_rms"] is True
    assert cfg["plugin"]["pass_config"]["fuse_allreduce_rms"] is False
    # The plugin's pass by its JSON name (what `vllm serve` takes), in in_tree to record.
    for v in ("plugin", "in_tree"):
        assert cfg[v]["inductor_passes"] == {
            "post_grad_custom_post_pass": "fusion_pass.vllm_fusion_pass"}
        assert cfg[v]["debug_dump_path"] == str(tmp_path / "dumps")
    assert "inductor_passes" not in cfg["off"] and "debug_dump_path" not in cfg["off"]
    assert vllm_setup.kernel_settings("vllm") == {}
    # Every engine the same KV cache, in bytes of this model per rank.
    kw = vllm_setup.engine_kwargs(shape, vllm_setup.MODELS["dense-h2880"], tmp_path, "off")
    assert kw["kv_cache_memory_bytes"] == 40960 * 24 * 2 * 4 * 64 * 2
