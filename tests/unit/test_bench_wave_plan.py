"""The vLLM benchmarks' plan (benchmarks/vllm/wave_plan.py): each engine's memory from the model's
shapes against what vLLM logged, the waves on one and two H100s (80 GB) and H200s, and the
time of a whole ``scripts/gpu_vllm.sh`` run within its nine minutes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The vllm benchmark's modules, and the ones the benchmarks share (bench_common.py).
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path[:0] = [str(BENCHMARKS / "vllm"), str(BENCHMARKS)]

import vllm_models  # noqa: E402
import vllm_setup  # noqa: E402
import wave_plan  # noqa: E402

H100, H200 = 79.18, 139.8
"""GiB each card has (torch's "total capacity" of an H100 80 GB; NVML's of an H200)."""
MODELS = list(vllm_models.GPU_MODELS)
E2E = ("llama-h2880", 2, 4096, 256)
"""The end-to-end check beside the first offline wave (scripts/gpu_vllm.sh)."""


def test_weights_per_rank_are_what_vllm_logged():
    def gib(name, tp):
        return vllm_models.weight_bytes(vllm_models.MODELS[name], tp, "bfloat16") / wave_plan.GIB

    # "Model loading took 14.96 / 10.81 / 4.55 GiB" (the runs on one H200): the 8B-like
    # model's tensors are whole 2 MiB segments, the hidden-2880 models' are rounded up.
    assert round(gib("llama3-8b-like", 1), 2) == 14.96
    assert round(gib("gptoss-active-h2880", 1), 2) == 10.81
    assert round(gib("dense-h2880", 1), 2) == 4.55
    # At TP=2 every matrix is split (the vocabulary padded to 64 per rank first).
    assert gib("llama3-8b-like", 2) == pytest.approx(gib("llama3-8b-like", 1) / 2, rel=2e-3)
    e = wave_plan.engine_memory(vllm_models.MODELS["llama3-8b-like"], 2, "bfloat16", 40960)
    assert e.kv_cache == pytest.approx(2.5) and e.tp_comm == wave_plan.TP_COMM_GIB
    # Activations at 8192 tokens a step: 2048's, and per token above it the MLP's 3 x 7168
    # per rank and four hidden-size tensors.
    act = 1.1 + 6144 * (3 * 7168 + 4 * 4096) * 2 / 2**30
    assert e.total == pytest.approx(e.weights + 2.5 + act + 0.22 + 0.21 + 0.51 + 1.0 + 0.5)


def test_each_model_has_vllms_step_budget_and_the_plan_counts_its_activations():
    # Every GPU model at vLLM's server default, 8192 tokens a step; a run's own budget for
    # every model alike.
    assert vllm_models.step_tokens("gptoss-active-h2880") == 8192
    assert vllm_models.step_tokens("llama3-8b-like") == 8192
    assert vllm_models.step_tokens("gptoss-active-h2880", 2048) == 2048
    shape = vllm_setup.EngineShape(tp=1, dtype="bfloat16", max_model_len=2112, max_num_seqs=64,
                                   max_num_batched_tokens=None, kv_tokens=40960)
    assert [shape.step_tokens(m) for m in MODELS] == [8192, 8192]
    assert shape.__class__(**{**shape.__dict__, "max_num_batched_tokens": 4096}) \
        .step_tokens("gptoss-active-h2880") == 4096
    # The forward pass's peak measured at 2048 tokens; above it, per token, the MLP's
    # gate-up output and its activated half (3 x 11520 wide) and four hidden-size tensors
    # (4 x 2880), two bytes each.
    spec = vllm_models.MODELS["gptoss-active-h2880"]
    per_token = (3 * 11520 + 4 * 2880) * 2
    assert wave_plan.engine_memory(spec, 1, "bfloat16", 40960).activations == \
        pytest.approx(wave_plan.ACTIVATION_GIB + 6144 * per_token / 2**30)
    assert wave_plan.engine_memory(spec, 1, "bfloat16", 40960, 2048).activations == \
        pytest.approx(wave_plan.ACTIVATION_GIB)
    assert wave_plan.engine_memory(spec, 1, "bfloat16", 40960, 256).activations == \
        pytest.approx(wave_plan.ACTIVATION_GIB)
    # At TP=2 the MLP's share per rank is half.
    assert wave_plan.engine_memory(spec, 2, "bfloat16", 40960).activations == \
        pytest.approx(wave_plan.ACTIVATION_GIB + 6144 * (3 * 5760 + 4 * 2880) * 2 / 2**30)
    # The stand-in's engines at 8192 held 16.34 and 16.21 GiB each once measured on one H100
    # (49.02 and 48.62 for three; benchmarks/results/dev/gpu_vllm_h100x1_8b_step_2048,
    # gpu_vllm_tp1_h100x1), the 8B-like model's 22.63 (67.88): the plan still counts more.
    assert 16.34 < wave_plan.engine_memory(spec, 1, "bfloat16", 40960).total < 17.0
    llama = vllm_models.MODELS["llama3-8b-like"]
    assert 22.63 < wave_plan.engine_memory(llama, 1, "bfloat16", 40960).total < 23.5
    # The plan's engines are the ones the benchmark starts.
    plan = wave_plan.run_plan(1, [H100], MODELS, _labels(1), beside_gib=_beside(1))
    assert plan.offline.engine["gptoss-active-h2880"].activations == pytest.approx(1.63, abs=0.01)
    assert plan.offline.engine["llama3-8b-like"].activations == pytest.approx(1.78, abs=0.01)
    every = wave_plan.run_plan(1, [H100], MODELS, _labels(1), step_tokens=2048)
    assert every.offline.engine["gptoss-active-h2880"].activations == pytest.approx(1.1)


def _labels(tp):
    return vllm_setup.labels(["off", "in_tree", "plugin"] if tp > 1 else ["off", "plugin"],
                             "off")


def _beside(tp):
    return E2E[1] * wave_plan.engine_memory(vllm_models.MODELS[E2E[0]], tp, "bfloat16",
                                            E2E[2], E2E[3]).total


@pytest.mark.parametrize("tp,card", [(1, H100), (1, H200), (2, H100), (2, H200)],
                         ids=["1xH100", "1xH200", "2xH100", "2xH200"])
def test_every_variant_of_both_models_planned_within_memory_and_time(tp, card):
    labels = _labels(tp)
    plan = wave_plan.run_plan(tp, [card] * tp, MODELS, labels, beside_gib=_beside(tp))
    print("\n".join(plan.lines()))
    for steps, times in ((plan.offline, plan.offline_time), (plan.serving, plan.serving_time)):
        assert steps.unplanned == {}
        # Every engine of every model in a wave, and one model's engines per wave.
        assert {(w.model, lb) for w in steps.waves for lb in w.labels} == {
            (m, lb) for m in MODELS for lb in labels}
        for i, w in enumerate(steps.waves):
            # The A/A pair and the baseline never apart from the variants compared with them.
            assert {"off", "off_aa"} <= set(w.labels), w
            # Within each GPU's free memory less the margin, with the end-to-end check's
            # engines beside the first offline wave.
            held = len(w.labels) * steps.engine[w.model].total + (
                steps.beside_gib if steps is plan.offline and i == 0 else 0.0)
            assert w.gib == pytest.approx(held)
            assert held <= card - wave_plan.MARGIN_FRACTION * card
        # Every wave at least six rounds, so that every ratio has a 95 % interval.
        assert all(t.rounds >= wave_plan.MIN_ROUNDS for t in times)
    # Both steps within the nine minutes, with the slack kept: the script's steps' limits
    # are the plan's, each wave its share of its step.
    assert plan.fits and plan.total_s <= wave_plan.RUN_S - wave_plan.SLACK_S
    limits = plan.limits()
    assert limits["BENCH_TIMEOUT_S"] == round(sum(t.total for t in plan.offline_time)
                                              + wave_plan.STEP_END_S)
    assert plan.elapsed_s + limits["BENCH_TIMEOUT_S"] + limits["SERVE_TIMEOUT_S"] \
        + wave_plan.PLAN_S <= wave_plan.RUN_S
    # Offline engines late may take the serving step's rounds beyond one a wave, and no
    # more: the run stays within its limit with the serving step at its least (every
    # server up, primed, one round and stopped, as planned).
    least = sum(t.up + t.first + t.round + t.stop for t in plan.serving_time) \
        + wave_plan.STEP_END_S
    assert limits["SERVE_LEAST_S"] == round(least) < limits["SERVE_TIMEOUT_S"]
    assert limits["BENCH_LATEST_S"] > limits["BENCH_TIMEOUT_S"]
    assert abs(limits["BENCH_LATEST_S"] + limits["SERVE_LEAST_S"]
               - limits["BENCH_TIMEOUT_S"] - limits["SERVE_TIMEOUT_S"]) <= 1
    # Engines up as the logs show them, not faster.
    assert all(t.up >= wave_plan.OFFLINE_UP_S for t in plan.offline_time)
    assert all(t.up >= wave_plan.SERVE_UP_S for t in plan.serving_time)


def test_on_one_h100_each_model_is_a_wave_and_on_an_h200_too():
    for card in (H100, H200):
        plan = wave_plan.run_plan(1, [card], MODELS, _labels(1), beside_gib=_beside(1))
        assert [(w.model, w.labels) for w in plan.offline.waves] == [
            (m, ["off", "off_aa", "plugin"]) for m in MODELS]
        # Both concurrencies at TP=1.
        assert plan.concurrency == [8, 32] and plan.cut == []


def test_at_tp2_serving_keeps_concurrency_8_alone_where_32_does_not_fit_and_says_so():
    plan = wave_plan.run_plan(2, [H100, H100], MODELS, _labels(2), beside_gib=_beside(2))
    assert plan.concurrency == [8] and plan.prompts == [8]
    assert len(plan.cut) == 1 and "concurrency 32" in plan.cut[0]
    assert plan.limits()["SERVE_CONCURRENCY"] == "8"


def test_a_model_that_does_not_fit_is_split_keeping_the_pair_in_every_wave():
    labels = ["off", "off_aa", "in_tree", "plugin"]
    engine = {"m": wave_plan.Memory(weights=17.0, kv_cache=2.0)}  # 21.54 GiB each
    # 80 GiB, 4 margin: three engines fit, not four.
    plan = wave_plan.plan_waves({"m": labels}, engine, [80.0])
    assert [w.labels for w in plan.waves] == [["off", "off_aa", "in_tree"],
                                              ["off", "off_aa", "plugin"]]
    assert all(w.gib <= 76.0 for w in plan.waves) and plan.unplanned == {}
    # The A/A pair of another variant travels with it and with the baseline.
    other = vllm_setup.labels(["off", "in_tree", "plugin"], "plugin")
    split = wave_plan.plan_waves({"m": other}, engine, [80.0])
    assert all({"off", "plugin", "plugin_aa"} <= set(w.labels) for w in split.waves)
    # Not even the pair beside one variant: not planned, and why.
    small = wave_plan.plan_waves({"m": labels}, engine, [60.0])
    assert small.waves == [] and set(small.unplanned) == {f"m/{lb}" for lb in labels}
    assert "do not fit" in small.unplanned["m/off"]
    # The first wave cannot hold one variant beside the job beside it: it waits for the job.
    wait = wave_plan.plan_waves({"m": labels}, engine, [80.0], beside_gib=20.0)
    assert wait.waves[0].after_beside and not wait.waves[1].after_beside
    # Memory not known (the CPU build): one wave per model, not sized.
    assert [w.labels for w in wave_plan.plan_waves({"m": labels}, engine, None).waves] == [
        labels]


def test_the_plan_says_what_each_engine_takes_and_writes_the_steps_limits(tmp_path, capsys):
    rc = wave_plan.main(["--tp", "1", "--gpu-free-gib", str(H100), "--beside", *map(str, E2E),
                         "--shell", str(tmp_path / "limits.sh"), "--json",
                         str(tmp_path / "plan.json")])
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith("run plan, TP=1: ")
    assert "llama3-8b-like: 23.18 GiB per engine per GPU (weights 14.96, KV cache 5.00" in out
    assert "wave 1: llama3-8b-like off, off_aa, plugin" in out
    limits = dict(line.split("=", 1) for line in (tmp_path / "limits.sh").read_text().splitlines())
    assert limits["SERVE_CONCURRENCY"] == "'8 32'" and int(limits["BENCH_TIMEOUT_S"][1:-1]) > 150


def test_a_serving_workload_of_its_own_is_the_one_planned(tmp_path, capsys):
    """More requests a run (16 at concurrency 8, as ``SERVE_PROMPTS`` sets them for
    ``scripts/gpu_vllm.sh``): each serving round takes longer by the one more wave of eight
    requests per server, and on one H100 at TP=1 that leaves no room for concurrency 32."""
    base = wave_plan.run_plan(1, [H100], MODELS, _labels(1), beside_gib=_beside(1),
                              concurrency=(8,), prompts=(8,))
    more = wave_plan.run_plan(1, [H100], MODELS, _labels(1), beside_gib=_beside(1),
                              concurrency=(8,), prompts=(16,))
    for b, m, model in zip(base.serving_time, more.serving_time, MODELS):
        spec = vllm_models.MODELS[model]
        extra = (wave_plan.serve_run_s(spec, 1, "bfloat16", 8, 16)
                 - wave_plan.serve_run_s(spec, 1, "bfloat16", 8, 8))
        # One more wave of requests, 0.69-0.89 s (the GPT-OSS stand-in, the 8B-like).
        assert extra > 0.65 and m.round == pytest.approx(b.round + 3 * extra)
    both = wave_plan.run_plan(1, [H100], MODELS, _labels(1), beside_gib=_beside(1),
                              concurrency=(8, 32), prompts=(16, 32))
    assert both.fits and both.concurrency == [8] and both.prompts == [16]
    assert both.cut and both.cut[0].startswith("serving at concurrency 32")
    with pytest.raises(ValueError, match="one number of prompts per concurrency"):
        wave_plan.run_plan(1, [H100], MODELS, _labels(1), concurrency=(8, 32), prompts=(16,))
    rc = wave_plan.main(["--tp", "1", "--gpu-free-gib", str(H100), "--beside", *map(str, E2E),
                         "--concurrency", "8", "--prompts", "16",
                         "--shell", str(tmp_path / "limits.sh")])
    capsys.readouterr()
    assert rc == 0
    limits = (tmp_path / "limits.sh").read_text().splitlines()
    assert "SERVE_PROMPTS='16'" in limits and "SERVE_CONCURRENCY='8'" in limits
    with pytest.raises(SystemExit):
        wave_plan.main(["--tp", "1", "--gpu-free-gib", str(H100), "--prompts", "32"])
    # A concurrency given alone gets bench_serve.py's default: one wave a run.
    assert wave_plan.main(["--tp", "1", "--gpu-free-gib", str(H100), "--concurrency", "8",
                           "--shell", str(tmp_path / "alone.sh")]) == 0
    capsys.readouterr()
    alone = (tmp_path / "alone.sh").read_text().splitlines()
    assert "SERVE_PROMPTS='8'" in alone and "SERVE_CONCURRENCY='8'" in alone
