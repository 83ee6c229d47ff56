"""benchmarks/vllm/bench_serve.py on vLLM's CPU build at TP=2, a tiny Llama: vLLM's OpenAI server
for the plugin and its A/A twin, each finding the offline benchmark's compile under its key,
driven by ``vllm bench serve``; the results file's contents and the plugin's records, never
its times.  Then the serving benchmark's pieces on made-up inputs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

# The vllm benchmark's modules, and the ones the benchmarks share (bench_common.py).
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path[:0] = [str(BENCHMARKS / "vllm"), str(BENCHMARKS)]

from bench_vllm_run import only_model  # noqa: E402

CONCURRENCY = [2, 4]
PROMPTS = [4, 8]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import bench_vllm_run

    bench_vllm_run.require_cpu_build()
    import bench_serve

    _, _, work = bench_vllm_run.offline()
    out = tmp_path_factory.mktemp("serve")
    rc = bench_serve.main([*bench_vllm_run.ENGINE, "--variants", "plugin",
                           "--concurrency", *map(str, CONCURRENCY),
                           "--num-prompts", *map(str, PROMPTS), "--input-len", "16",
                           "--output-len", "4", "--num-warmups", "1", "--repeats", "2",
                           "--max-repeats", "2", "--check", "records", "--work-dir", str(work),
                           "--out-dir", str(out), "--name", "s.json"])
    return rc, json.loads((out / "s.json").read_text())


@pytest.mark.vllm
@pytest.mark.slow
def test_every_server_ran_every_request_of_every_round(run):
    rc, r = run
    assert rc == 0, r.get("check")
    assert r["complete"] and r["check"]["problems"] == []
    assert r["settings"]["concurrency"] == CONCURRENCY and r["settings"]["tp"] == 2
    # What the servers were asked for (vLLM's CPU platform spawns whatever is asked).
    # Gated arrival (the default) needs vLLM's development endpoints, whatever the
    # environment says.
    assert r["server_environment"] == {
        "VLLM_WORKER_MULTIPROC_METHOD": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "fork"),
        "VLLM_SERVER_DEV_MODE": "1"}
    m = only_model(run[1])
    assert m["rounds"]["timed"] == 2
    # Gated (the default): sent at once, not spaced; the untimed runs' latencies recorded
    # (one a server and concurrency).
    arrival = m["arrival"]
    assert arrival["how"] == "gated" and arrival["spacing_s"] == {}
    assert all(len(v) == 2 for v in arrival["untimed_median_e2el_ms"].values())
    assert list(m["servers"]) == ["plugin", "plugin_aa"] and list(m["variants"]) == ["plugin"]
    for label, s in m["servers"].items():
        assert s["run"] is True, s.get("not_run_reason")
        runs = s["runs"]
        assert [(x["round"], x["concurrency"], x["prompts"]) for x in runs] == [
            (rnd, c, n) for rnd in (0, 1) for c, n in zip(CONCURRENCY, PROMPTS)]
        for x in runs:
            assert x["completed"] == x["prompts"] and not x["failed"]
            # Each request's token times came back (--save-detailed) and were counted.
            d = x["decode_prefills"]
            assert d is not None and 0 <= d["min"] <= d["median"] <= d["max"] <= 3
            # vllm bench serve's own numbers: ignore_eos, so every request gave output_len tokens.
            assert x["total_output_tokens"] == 4 * x["prompts"]
            # The gate held the first wave (the concurrency: fewer than the prompts) until the
            # server had all of it: no request had a token before the release. Counted from
            # the release (the first wave) or a request's own later send (the rest), the
            # times are no longer than vllm bench serve's, counted from each send, and the
            # run's window is shorter than its duration, which holds the hold.
            g = x["gate"]
            assert g["expected"] == x["concurrency"] and g["queued"] >= g["expected"], g
            assert "error" not in g and g["hold_s"] > 0 and g["base"] >= 0
            assert x["first_tokens_before_release"] == 0
            assert len(x["ttft_ms_each"]) == len(x["tpot_ms_each"]) == x["prompts"]
            assert all(v > 0 for v in x["ttft_ms_each"] + x["tpot_ms_each"])
            held = x["with_hold"]
            assert held["output_throughput"] < x["output_throughput"]
            assert 0 < x["median_ttft_ms"] <= held["median_ttft_ms"]
            assert 0 < x["median_e2el_ms"] <= held["median_e2el_ms"]
            assert 0 < x["duration"] < held["duration"]
            assert x["max_concurrent_requests"] <= x["prompts"]
            for k in ("median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms",
                      "output_throughput"):
                assert x[k] > 0, (label, k)
        assert set(s["per_round"]) == {f"{k}_c{c}" for c in CONCURRENCY for k in (
            "median_tpot", "p99_tpot", "median_itl", "p99_itl", "median_ttft",
            "output_throughput")}


@pytest.mark.vllm
@pytest.mark.slow
def test_servers_find_the_offline_engines_compiles_under_their_key(run):
    # The same engine arguments and compilation config as the offline engines: the same
    # compile cache key, so each server finds what its offline engine compiled (vLLM's CPU
    # build 0.32 then fails to load it, "'function' object has no attribute
    # 'finalize_loading'", and compiles again under that key; vLLM on GPUs loads it).
    for label, s in only_model(run[1])["servers"].items():
        assert s["compile_cache_key"] == "the offline engine's", label
        assert s["compile"] in ("loaded from the cache", "compiled")


@pytest.mark.vllm
@pytest.mark.slow
def test_serving_reports_the_aa_pair_and_its_verdict(run):
    m = only_model(run[1])
    # Only the plugin and its twin ran: the pair is the one comparison, the plugin the baseline.
    assert list(m["comparisons"]) == ["plugin_aa/plugin"]
    pair = m["comparisons"]["plugin_aa/plugin"]
    assert set(pair) == set(m["servers"]["plugin"]["per_round"])
    for metric, s in pair.items():
        assert s["rounds"] == 2 and s["ci"][0] <= s["median"] <= s["ci"][1]
        assert s["kind"] == ("rate" if metric.startswith("output_throughput") else "time")
    v = m["aa"]
    outside = {k for k, s in pair.items() if not 0.99 <= s["median"] <= 1.01}
    assert v["pair"] == "plugin_aa/plugin"
    assert set(v["outside"]) | set(v["secondary_outside"]) == outside
    assert all(k.startswith(("median_tpot", "median_itl", "output_throughput"))
               for k in v["outside"])


@pytest.mark.vllm
@pytest.mark.slow
def test_both_plugin_servers_fused_every_site_on_both_ranks(run):
    servers, want = only_model(run[1])["servers"], only_model(run[1])["expected_sites_per_range"]
    for label in ("plugin", "plugin_aa"):
        per_rank = servers[label]["sites_per_range"]
        assert sorted(per_rank) == ["rank0", "rank1"], label
        assert all(r["fused"] == r["sites"] == want
                   for ranges in per_rank.values() for r in ranges.values()), label


# -- the pieces, on made-up inputs ----------------------------------------------------

def test_server_flags_are_the_engine_arguments():
    import vllm_setup

    kw = {"model": "/m", "tensor_parallel_size": 2, "enable_prefix_caching": False,
          "compilation_config": {"pass_config": {"fuse_allreduce_rms": False}},
          "kv_cache_memory_bytes": 1024, "seed": 0}
    assert vllm_setup.server_args(kw) == [
        "--model", "/m", "--tensor-parallel-size", "2", "--no-enable-prefix-caching",
        "--compilation-config", '{"pass_config": {"fuse_allreduce_rms": false}}',
        "--kv-cache-memory-bytes", "1024", "--seed", "0"]


def test_vllm_bench_serve_gets_the_rounds_workload():
    import bench_serve

    args = SimpleNamespace(input_len=1000, output_len=100)
    server = SimpleNamespace(url="http://127.0.0.1:8000", model_dir=Path("/m"))
    argv = bench_serve.serve_bench_argv(args, server, 8, 64, seed=3)

    def flag(name):
        return argv[argv.index(name) + 1]

    assert flag("--dataset-name") == "random" and flag("--random-input-len") == "1000"
    assert flag("--random-output-len") == "100" and "--ignore-eos" in argv
    assert flag("--max-concurrency") == "8" and flag("--num-prompts") == "64"
    # The round's prompts (every server of a round the same), no warm-up of its own: the
    # server was warmed up before its turn.
    assert flag("--seed") == "3" and flag("--num-warmups") == "0"
    assert flag("--metric-percentiles") == "50,99"
    defaults = bench_serve.parse_args(["--max-model-len", "2112", "--max-num-seqs", "64",
                                       "--concurrency", "8", "32"])
    # One wave of requests a run at each concurrency; the warm-up a burst of 8.
    assert defaults.num_prompts == [8, 32] and defaults.num_warmups == 8


def test_a_scheduler_budget_reaches_the_servers_within_its_bounds(tmp_path, monkeypatch):
    import bench_serve
    import vllm_models
    import vllm_setup

    gpu = ["--max-model-len", "2112", "--max-num-seqs", "64", "--input-len", "1000",
           "--max-num-batched-tokens", "2048", "--concurrency", "8", "32"]
    # vLLM's own budget unless asked: the servers schedule as the offline engines do.
    assert bench_serve.parse_args(gpu).max_num_scheduled_tokens == 0
    assert bench_serve.parse_args([*gpu, "--max-num-scheduled-tokens", "1032"]) \
        .max_num_scheduled_tokens == 1032
    for bad in ("32", "4096"):  # no room beside 32 decodes; over the compiled batch
        with pytest.raises(SystemExit):
            bench_serve.parse_args([*gpu, "--max-num-scheduled-tokens", bad])

    shape = vllm_setup.EngineShape(tp=1, dtype="float32", max_model_len=256, max_num_seqs=8,
                                   max_num_batched_tokens=256, kv_tokens=4096)
    args = SimpleNamespace(dtype="float32", weights="dummy", aa="off",
                           max_num_scheduled_tokens=20)
    for s in bench_serve.plan(args, vllm_setup.MODELS["tiny"], tmp_path, shape, ["off"]):
        assert s.cmd[s.cmd.index("--max-num-scheduled-tokens") + 1] == "20"
        assert s.cmd[s.cmd.index("--max-num-batched-tokens") + 1] == "256"
    args.max_num_scheduled_tokens = 0  # vLLM's budget: the flag left out
    for s in bench_serve.plan(args, vllm_setup.MODELS["tiny"], tmp_path, shape, ["off"]):
        assert "--max-num-scheduled-tokens" not in s.cmd
    # The scheduled budget is checked against the smallest of the models' budgets: each
    # model's own where no run-wide one is given (the GPUs' default), else the one given.
    both = SimpleNamespace(models=["llama3-8b-like", "gptoss-active-h2880"],
                           max_num_batched_tokens=None)
    assert vllm_setup.least_step_tokens(both) == 8192  # vLLM's server default for both
    monkeypatch.setitem(vllm_models.MODEL_STEP_TOKENS, "llama3-8b-like", 2048)
    assert vllm_setup.least_step_tokens(both) == 2048
    assert vllm_setup.least_step_tokens(SimpleNamespace(models=["gptoss-active-h2880"],
                                                        max_num_batched_tokens=None)) == 8192
    assert vllm_setup.least_step_tokens(SimpleNamespace(**{**vars(both),
                                                           "max_num_batched_tokens": 1024})) \
        == 1024
    with pytest.raises(SystemExit):
        bench_serve.parse_args(["--models", *both.models, "--max-model-len", "2112",
                                "--max-num-seqs", "64", "--input-len", "1000",
                                "--concurrency", "8", "32", "--max-num-batched-tokens", "1024",
                                "--max-num-scheduled-tokens", "1032"])


def test_each_model_s_servers_get_its_own_step_budget(tmp_path, monkeypatch):
    import bench_serve
    import vllm_models
    import vllm_setup

    # No run-wide budget (the GPUs' default): each model's own, on its servers' command line.
    shape = vllm_setup.EngineShape(tp=1, dtype="float32", max_model_len=256, max_num_seqs=8,
                                   max_num_batched_tokens=None, kv_tokens=4096)
    args = SimpleNamespace(dtype="float32", weights="dummy", aa="off",
                           max_num_scheduled_tokens=0)
    # vLLM's server default for every model, unless a model names its own.
    monkeypatch.setitem(vllm_models.MODEL_STEP_TOKENS, "gptoss-active-h2880", 4096)
    for name, want in (("tiny", "8192"), ("gptoss-active-h2880", "4096")):
        # The tiny model's shapes under each name: the budget follows the name.
        spec = dataclasses.replace(vllm_setup.MODELS["tiny"], name=name)
        for s in bench_serve.plan(args, spec, tmp_path, shape, ["off"]):
            assert s.cmd[s.cmd.index("--max-num-batched-tokens") + 1] == want


def test_kv_cache_bytes_follow_the_model_and_the_ranks():
    import vllm_setup

    spec = vllm_setup.MODELS["llama3-8b-like"]
    # 32 layers, K and V, 8 KV heads of 128, bf16: 128 KiB per token; 4 heads per rank at TP=2.
    assert vllm_setup.kv_bytes_per_token(spec, 1, "bfloat16") == 32 * 2 * 8 * 128 * 2
    assert vllm_setup.kv_bytes_per_token(spec, 2, "bfloat16") == 32 * 2 * 4 * 128 * 2
    # More ranks than KV heads: each rank keeps a whole head.
    assert vllm_setup.kv_bytes_per_token(spec, 16, "bfloat16") == 32 * 2 * 1 * 128 * 2


def test_engines_are_each_variant_with_the_twin_after_its_variant():
    import vllm_setup

    assert vllm_setup.labels(["off", "in_tree", "plugin"], "off") == [
        "off", "off_aa", "in_tree", "plugin"]
    assert vllm_setup.labels(["off", "plugin"], "plugin") == ["off", "plugin", "plugin_aa"]
    assert vllm_setup.labels(["off", "plugin"], "none") == ["off", "plugin"]
    assert vllm_setup.label_variant("plugin_aa") == "plugin"
    assert vllm_setup.aa_pair("off", ["off", "off_aa", "plugin"]) == ("off_aa", "off")
    assert vllm_setup.aa_pair("off", ["off", "plugin"]) is None
    assert vllm_setup.baseline(["plugin", "plugin_aa"]) == "plugin"


def test_a_server_forks_its_engine_core_unless_the_environment_says(tmp_path, monkeypatch):
    import bench_serve
    import vllm_setup

    args = SimpleNamespace(dtype="float32", weights="dummy", aa="off",
                           max_num_scheduled_tokens=0)
    shape = vllm_setup.EngineShape(tp=1, dtype="float32", max_model_len=256, max_num_seqs=8,
                                   max_num_batched_tokens=256, kv_tokens=4096)
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    labels = ["off", "off_aa"]
    servers = bench_serve.plan(args, vllm_setup.MODELS["tiny"], tmp_path, shape, labels)
    assert [s.env["VLLM_WORKER_MULTIPROC_METHOD"] for s in servers] == ["fork", "fork"]
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    servers = bench_serve.plan(args, vllm_setup.MODELS["tiny"], tmp_path, shape, labels)
    assert all("VLLM_WORKER_MULTIPROC_METHOD" not in s.env for s in servers)


def test_gated_servers_get_the_pause_and_the_count_whatever_the_environment_says(
        tmp_path, monkeypatch):
    import bench_serve
    import vllm_setup

    shape = vllm_setup.EngineShape(tp=1, dtype="float32", max_model_len=256, max_num_seqs=8,
                                   max_num_batched_tokens=256, kv_tokens=4096)
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "0")
    for arrival, gated in (("gated", True), ("burst", False), ("staggered", False)):
        args = SimpleNamespace(dtype="float32", weights="dummy", aa="off",
                               max_num_scheduled_tokens=0, arrival=arrival)
        s, = bench_serve.plan(args, vllm_setup.MODELS["tiny"], tmp_path, shape, ["off"])
        # vLLM's /pause and /resume exist only in its development mode; /load counts only
        # with the server's load tracking on.
        assert (s.env.get("VLLM_SERVER_DEV_MODE") == "1") is gated, arrival
        assert ("--enable-server-load-tracking" in s.cmd) is gated, arrival
    assert bench_serve.parse_args([]).arrival == "gated"
    # Flags of the user's own for every server, after the benchmark's (one token each).
    args.server_arg = bench_serve.parse_args(
        ["--server-arg=--enable-logging-iteration-details",
         "--server-arg=--no-async-scheduling"]).server_arg
    s, = bench_serve.plan(args, vllm_setup.MODELS["tiny"], tmp_path, shape, ["off"])
    assert s.cmd[-2:] == ["--enable-logging-iteration-details", "--no-async-scheduling"]


@pytest.mark.vllm
def test_a_server_gets_the_offline_engines_config_and_its_hash(tmp_path):
    # The server's flags (server_args) parsed by vLLM's own engine-argument parser give the
    # config of the offline engine's keyword arguments: the same hash, so the same compile
    # cache key; and the GPU-only arguments come through as given.
    pytest.importorskip("vllm", reason="vLLM (the CPU build in CI) is not importable")
    import vllm_setup
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from fusion_pass.vllm_integration import plugin

    plugin.register()  # what vLLM's plugin loading does: the pass under its JSON name
    spec = vllm_setup.MODELS["tiny"]
    model = vllm_setup.write_model(spec, tmp_path / "m", "float32", "dummy")
    shape = vllm_setup.EngineShape(tp=2, dtype="float32", max_model_len=256, max_num_seqs=8,
                                   max_num_batched_tokens=256, kv_tokens=4096)
    parser = FlexibleArgumentParser()
    AsyncEngineArgs.add_cli_args(parser)
    for variant in ("off", "plugin"):
        kw = vllm_setup.engine_kwargs(shape, spec, model, variant)
        offline = EngineArgs(**kw).create_engine_config()
        served = AsyncEngineArgs.from_cli_args(parser.parse_args(vllm_setup.server_args(kw)))
        assert served.create_engine_config().compute_hash() == offline.compute_hash(), variant
        # The scheduler's budget a step (bench_serve.py --max-num-scheduled-tokens) is not
        # in the key: servers given one still load the offline compiles.
        budget = AsyncEngineArgs.from_cli_args(parser.parse_args(
            vllm_setup.server_args({**kw, "max_num_scheduled_tokens": 20})))
        config = budget.create_engine_config()
        assert config.scheduler_config.max_num_scheduled_tokens == 20
        assert config.compute_hash() == offline.compute_hash(), variant
    gpu = {**kw, "kv_cache_memory_bytes": 123456789, "gpu_memory_utilization": 0.05}
    served = AsyncEngineArgs.from_cli_args(parser.parse_args(vllm_setup.server_args(gpu)))
    assert (served.kv_cache_memory_bytes, served.gpu_memory_utilization) == (123456789, 0.05)
    assert served.enable_prefix_caching is False and served.seed == 0
