"""A vLLM benchmark's run (``vllm_run.execute``) without vLLM: its waves one after another,
each started once the GPUs have its memory and within its share of the time; a start that
fails says vLLM's root cause; a run stopped by its time limit stops its engines first
(SIGTERM runs its stop, and the handler is gone afterwards)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

# The vllm benchmark's modules, and the ones the benchmarks share (bench_common.py).
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path[:0] = [str(BENCHMARKS / "vllm"), str(BENCHMARKS)]


def _gone(pid: int, within: float = 10.0) -> bool:
    """Whether process ``pid`` has ended (or is a zombie) within ``within`` seconds."""
    import psutil

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def _shape(tp=1):
    import vllm_setup

    return vllm_setup.EngineShape(tp=tp, dtype="bfloat16", max_model_len=2112, max_num_seqs=64,
                                  max_num_batched_tokens=2048, kv_tokens=40960)


def _wave_time(wave):
    import wave_plan

    return wave_plan.WaveTime(up=10.0, first=0.0, round=1.0, rounds=6, stop=1.0)


def _execute(tmp_path, groups, make, start_all, measure, stop, free=None, budget=60.0,
             placement="scheduler", no_halt="off", after_pid=None, beside=0.0,
             start_timeout_s=10.0, read=None, gpu_shared=False, latest=None):
    import vllm_run

    run = SimpleNamespace(deadline=time.monotonic() + budget, started=time.monotonic(),
                          root=tmp_path, shape=_shape(),
                          latest=None if latest is None else time.monotonic() + latest)
    args = SimpleNamespace(tp=1, check="none", start_parallel=0,
                           start_timeout_s=start_timeout_s,
                           work_dir=tmp_path, cpu_placement=placement, cpu_no_halt=no_halt,
                           gpu_free_gib=free, after_pid=after_pid, beside_gib=beside,
                           gpu_shared=gpu_shared)
    result = {"models": [], "settings": {"check": "none"}}
    rc = vllm_run.execute(run, args, result, tmp_path / "r.json", groups, make, start_all,
                          measure, stop, _wave_time, None, "offline", ("tpot",),
                          lambda r: [], free_gib=read or (lambda tp: free))
    return rc, result


def _run(measure, tmp_path, stopped=None):
    stopped = [] if stopped is None else stopped
    rc, _ = _execute(tmp_path, {"tiny": ["off"]}, lambda m, labels: ["engine"],
                     lambda *a: None, measure, stopped.extend)
    return rc, stopped


def test_sigterm_stops_the_engines_and_exits(tmp_path) -> None:
    def measure(units, deadline, clocks, seats, reach_at=None, first_at=None):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the signal arrives before this ends
        raise AssertionError("SIGTERM did not stop the measurement")

    handler: list = []
    stopped: list = []
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        try:
            _run(measure, tmp_path, stopped)
        finally:
            handler.append(signal.getsignal(signal.SIGTERM))
    assert e.value.code == 128 + signal.SIGTERM
    assert stopped == ["engine"], "the engines were not stopped"
    assert handler == [before], "the handler outlived the run"


@pytest.mark.parametrize("body,code,printed", [
    ("return 3", 3, ""),
    ("raise SystemExit(128 + 15)", 143, ""),
    ("raise ValueError('boom')", 1, "ValueError: boom"),
])
def test_a_benchmark_ends_at_once_however_its_main_ends(body, code, printed) -> None:
    import subprocess

    # A thread that would hold the interpreter's own shutdown for a minute.
    paths = [str(BENCHMARKS / "vllm"), str(BENCHMARKS)]
    prog = (f"import sys, threading, time; sys.path[:0] = {paths!r}; import vllm_run\n"
            "threading.Thread(target=time.sleep, args=(60,)).start()\n"
            f"def main():\n    {body}\n"
            "vllm_run.main_then_exit(main)\n")
    t = time.monotonic()
    out = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True,
                         timeout=50)
    assert out.returncode == code and printed in out.stderr
    assert time.monotonic() - t < 30


def test_a_finished_run_leaves_sigterm_as_it_was(tmp_path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    rc, stopped = _run(lambda units, deadline, clocks, seats, **kw: {"model": {"name": "m"},
                                                                     "aa": {}}, tmp_path)
    assert rc == 0
    assert stopped == ["engine"] and signal.getsignal(signal.SIGTERM) == before


def test_wait_for_pid_ends_with_the_process_and_says_when_it_did_not(tmp_path) -> None:
    import subprocess

    import vllm_run

    # A child that has exited but is not reaped yet (a zombie) has ended.
    quick = subprocess.Popen([sys.executable, "-c", "pass"])
    time.sleep(1.0)
    got = vllm_run.wait_for_pid(quick.pid, time.monotonic() + 20)
    assert got["ended"] and got["waited_s"] < 5
    quick.wait()
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        got = vllm_run.wait_for_pid(slow.pid, time.monotonic() + 1.5)
        assert not got["ended"] and 1.0 <= got["waited_s"] < 5
    finally:
        slow.kill()
        slow.wait()


def test_the_end_of_a_run_prints_its_summary_without_importing_torch_or_vllm(tmp_path) -> None:
    import json
    import subprocess

    # The files of a run where nothing started: the summary still reads them all.
    offline = {"benchmark": "bench_vllm", "meta": {"devices": ["gpu"], "versions": {"vllm": "x"}},
               "settings": {"tp": 2, "dtype": "bfloat16", "kernel_choice": "pinned"},
               "attention_backend": {"requested": None}, "models": [],
               "after_pid": {"pid": 7, "ended": False, "waited_s": 1.0}}
    (tmp_path / "o.json").write_text(json.dumps(offline))
    summary = BENCHMARKS / "vllm" / "vllm_summary.py"
    probe = ("import runpy, sys\n"
             f"sys.argv = [{str(summary)!r}, *sys.argv[1:]]\n"
             "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
             "except SystemExit:\n    pass\n"
             "print('HEAVY', sorted(m for m in ('torch', 'vllm') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "none.json"),
                          str(tmp_path / "o.json"), str(tmp_path / "none.json")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout
    assert "A/A serving: no results file" in out.stdout
    assert "WARNING: measured while process 7 still ran" in out.stdout


def test_engines_share_one_folder_of_model_class_answers(tmp_path) -> None:
    import vllm_setup

    shared = tmp_path / "modelinfos"
    roots = [tmp_path / e / "cache" / "vllm" for e in ("off", "off_aa")]
    # A cache root kept from an earlier run holds a folder of its own: replaced by the link.
    (roots[1] / "modelinfos").mkdir(parents=True)
    (roots[1] / "modelinfos" / "old.json").write_text("{}")
    for root in roots:
        vllm_setup.share_model_info(root, shared)
        vllm_setup.share_model_info(root, shared)  # twice: nothing changes
    (shared / "a.json").write_text("{}")
    for root in roots:
        assert (root / "modelinfos").is_symlink()
        assert sorted(p.name for p in (root / "modelinfos").iterdir()) == ["a.json"]


@pytest.mark.vllm
def test_model_class_answer_asked_in_process_is_vllms_own(tmp_path) -> None:
    """The set-up step asks vLLM about the model class in its own process; the answer it
    writes is the one vLLM's child process writes when an engine asks it (the oracle:
    vLLM's own path, in a process of its own with an empty cache)."""
    pytest.importorskip("vllm")
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(BENCHMARKS.parent), os.environ.get("PYTHONPATH")) if p)}
    ours = tmp_path / "ours"
    out = subprocess.run([sys.executable, str(BENCHMARKS / "vllm" / "vllm_setup.py"),
                          "warm-model-info", str(ours)], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    vllms = tmp_path / "vllm_root"
    ask = ("from vllm.model_executor.models.registry import ModelRegistry;"
           "ModelRegistry.models['LlamaForCausalLM'].inspect_model_cls()")
    out = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True,
                         timeout=300, env={**env, "VLLM_CACHE_ROOT": str(vllms)})
    assert out.returncode == 0, out.stderr[-3000:]
    [theirs] = sorted((vllms / "modelinfos").iterdir())
    assert sorted(p.name for p in ours.iterdir()) == [theirs.name]
    assert (ours / theirs.name).read_text() == theirs.read_text()


class _Clocks:
    def start(self): pass
    def stop(self): pass
    def snapshot(self): return None
    def window(self, t0, t1): return None


def _offline_args(**kw):
    base = dict(batches=[1, 2], input_len=4, decode_steps=2, prefill_len=0, warmup=0,
                max_repeats=6, repeats=2, settle_s=0.0, precision=1e-9, aa="off", tp=1,
                prefill_calls=1)
    return SimpleNamespace(**{**base, **kw})


def test_offline_rounds_before_a_failure_survive_and_a_cut_round_does_not() -> None:
    import bench_vllm
    from vllm_engine_host import EngineError

    calls = {"n": 0}

    def generate(batch, max_tokens, timeout):
        assert 0 < timeout <= 70  # the model's deadline and 10 s
        calls["n"] += 1
        # Per round and engine: one untimed call, then batch 1 and batch 2.  The third
        # round's batch-2 call of the first engine fails.
        if calls["n"] == 2 * 2 * 3 + 3:
            raise EngineError("gone")
        # Times that vary, so that no pair of rounds is precise enough to stop early.
        t = 0.001 * (1 + 0.1 * (calls["n"] % 7))
        return {"seconds": 0.01, "ids": [[1, 2]] * len(batch), "tpot_s": [t] * len(batch),
                "prefill_s": [0.002] * len(batch),
                "host": {"engine_cpu_s": 0.0, "engine_involuntary_switches": 0, "steal_s": 0.0}}

    engines = [SimpleNamespace(label=lb, name=f"m/{lb}", model=SimpleNamespace(name="m"),
                               proc=SimpleNamespace(generate=generate)) for lb in ("off", "off_aa")]
    m = bench_vllm.Measurement(engines)
    with pytest.raises(EngineError):
        bench_vllm.measure(engines, _offline_args(), 100, _Clocks(), time.monotonic() + 60, m)
    assert m.rounds == 2
    # The cut round's first call is there, for the engine whose turn came first.
    assert sorted(len(d["tpot_b1"]) for d in m.per_round.values()) == [2, 3]
    assert max(len(v) for c in m.calls.values() for f in c.values() for v in f.values()) == 3
    m.keep_whole_rounds(warmup=0)
    assert {len(v) for d in m.per_round.values() for v in d.values()} == {2}
    assert {len(v) for c in m.calls.values() for f in c.values() for v in f.values()} == {2}
    assert sorted(len(t) for t in m.turns.values()) == [2, 2]


def test_a_turns_prefill_calls_give_the_round_their_medians_each_call_kept() -> None:
    import bench_vllm

    seen: list = []
    # The prefill calls' times, ms, three a round: each round's median is its second call,
    # neither its first, its last nor its mean.
    answers = iter([2.0, 4.0, 9.0, 9.0, 6.0, 1.0, 3.0, 3.0])
    prefills: list = []  # what the engine answered to each prefill call, ms

    def generate(batch, max_tokens, timeout):
        seen.append((len(batch[0]), max_tokens))
        t = 0.001
        if max_tokens == 1:
            prefills.append(next(answers))
            t = 1e-3 * prefills[-1]
        return {"seconds": t + 0.001, "ids": [[1]] * len(batch), "tpot_s": [0.001] * len(batch),
                "prefill_s": [t] * len(batch),
                "host": {"engine_cpu_s": 0.0, "engine_involuntary_switches": 0,
                         "steal_s": 1e3 * t}}

    engines = [SimpleNamespace(label="off", name="m/off", model=SimpleNamespace(name="m"),
                               proc=SimpleNamespace(generate=generate))]
    m = bench_vllm.measure(engines, _offline_args(batches=[1], prefill_len=16, prefill_calls=3,
                                                  max_repeats=2, repeats=2),
                           100, _Clocks(), time.monotonic() + 60)
    assert m.rounds == 2
    # Each turn: the untimed call, batch 1, then three prefill calls of 16 tokens.
    assert [s for s in seen[:5]] == [(4, 2), (4, 3), (16, 1), (16, 1), (16, 1)]
    each = m.calls["off"]["prefill"]["prefill_each_ms"]
    assert each == [pytest.approx(prefills[0:3]), pytest.approx(prefills[3:6])]
    assert m.per_round["off"]["prefill"] == pytest.approx([4.0, 6.0])
    assert m.per_round["off"]["latency_prefill"] == pytest.approx([5.0, 7.0])
    # Beside the median, what one call a turn would have given: each turn's first call.
    assert m.per_round["off"][bench_vllm.FIRST_PREFILL] == pytest.approx([2.0, 9.0])
    assert not bench_vllm.FIRST_PREFILL.startswith(bench_vllm.PRIMARY)
    # The host's telemetry is the median call's (its wall-clock time the median).
    assert m.calls["off"]["prefill"]["steal_s"] == pytest.approx([4.0, 6.0])
    # One call a turn (the default) keeps no list of them.
    m1 = bench_vllm.measure(engines, _offline_args(batches=[1], prefill_len=16, prefill_calls=1,
                                                   max_repeats=2, repeats=2),
                            100, _Clocks(), time.monotonic() + 60)
    assert "prefill_each_ms" not in m1.calls["off"]["prefill"]
    assert bench_vllm.FIRST_PREFILL not in m1.per_round["off"]


def test_the_summary_sets_the_first_prefill_call_beside_the_median_of_a_turns_calls() -> None:
    import paired_ratios
    import vllm_report

    # Six rounds of an A/A pair: the median of each turn's calls equal in both engines, the
    # twin's first call 10 % slower in every round.
    first = vllm_report.FIRST_PREFILL
    per_round = {"off": {"prefill": [60.0] * 6, first: [60.0] * 6},
                 "off_aa": {"prefill": [60.0] * 6, first: [66.0] * 6}}
    model = {"comparisons": paired_ratios.compare(per_round, "off", ("off_aa", "off"))}
    assert vllm_report.first_prefill_lines(model) == [
        "  off_aa/off prefill, the median of a turn's calls 1.000 [1.000, 1.000], "
        "the first call alone 1.100 [1.100, 1.100]"]
    # The first call is secondary: it does not decide the A/A verdict.
    verdict = paired_ratios.aa_verdict(model["comparisons"], "off_aa/off",
                                       vllm_report.OFFLINE_PRIMARY)
    assert verdict["within"] is True and first in verdict["secondary_outside"]
    # One call a turn: nothing to set beside it.
    del per_round["off"][first], per_round["off_aa"][first]
    one = {"comparisons": paired_ratios.compare(per_round, "off", ("off_aa", "off"))}
    assert vllm_report.first_prefill_lines(one) == []


def test_no_round_starts_once_start_up_took_the_measuring_time() -> None:
    import bench_vllm

    engines = [SimpleNamespace(label="off", name="m/off", model=SimpleNamespace(name="m"),
                               proc=SimpleNamespace(generate=lambda *a: pytest.fail("measured")))]
    m = bench_vllm.measure(engines, _offline_args(warmup=1), 100, _Clocks(),
                           time.monotonic() - 1)
    assert m.rounds == 0 and m.stopped_because == "time budget"


def test_serving_rounds_before_a_failure_survive(monkeypatch) -> None:
    import bench_serve

    runs = {"n": 0}

    def run_serve_bench(argv, gate=None):
        runs["n"] += 1
        if runs["n"] == 2 * 2 + 2 * 2 * 2 + 1:  # after the untimed runs, the third round's first
            raise RuntimeError("server gone")
        n = int(argv[argv.index("--num-prompts") + 1])
        # Numbers that vary, so that no pair of rounds is precise enough to stop early.
        return {"completed": n, "failed": 0,
                **{m: 1.0 + 0.1 * (runs["n"] % 5) for m in bench_serve.METRICS}}

    monkeypatch.setattr(bench_serve, "run_serve_bench", run_serve_bench)
    servers = [SimpleNamespace(label=lb, name=f"m/{lb}", url="http://x",
                               model=SimpleNamespace(name="m"), model_dir="m")
               for lb in ("off", "off_aa")]
    args = SimpleNamespace(max_repeats=6, repeats=2, settle_s=0.0, concurrency=[1, 2],
                           num_prompts=[1, 2], input_len=8, output_len=2, num_warmups=0,
                           precision=1e-9, aa="off", tp=1)
    out: dict = {}
    longest: dict = {}
    with pytest.raises(RuntimeError):
        bench_serve.measure(args, servers, _Clocks(), time.monotonic() + 60, out, longest)
    assert out["rounds"] == 2
    assert {len(v) for d in out["per_round"].values() for v in d.values()} == {2}
    assert 0 < longest["round_s"] < 60
    # The next model's first round starts only where the longest round so far fits.
    monkeypatch.setattr(bench_serve, "run_serve_bench", lambda argv, gate=None: pytest.fail("measured"))
    late = bench_serve.measure(args, servers, _Clocks(), time.monotonic() + 30, None,
                               {"round_s": 40.0})
    assert late["rounds"] == 0 and late["stopped_because"] == "time budget"


def test_every_server_runs_the_workload_once_untimed_before_the_first_round(monkeypatch) -> None:
    import bench_serve

    calls: list = []

    def run_serve_bench(argv, gate=None):
        n = int(argv[argv.index("--num-prompts") + 1])
        calls.append((argv[argv.index("--base-url") + 1],
                      int(argv[argv.index("--max-concurrency") + 1]), n,
                      int(argv[argv.index("--seed") + 1])))
        if len(calls) == 2:  # off's untimed run at concurrency 32 loses a request
            return {"completed": n - 1, "failed": 1, **{m: 1.0 for m in bench_serve.METRICS}}
        return {"completed": n, "failed": 0,
                **{m: 1.0 + 0.1 * (len(calls) % 5) for m in bench_serve.METRICS}}

    monkeypatch.setattr(bench_serve, "run_serve_bench", run_serve_bench)
    servers = [SimpleNamespace(label=lb, name=f"m/{lb}", url=f"http://{lb}",
                               model=SimpleNamespace(name="m"), model_dir="m")
               for lb in ("off", "off_aa", "plugin")]
    args = SimpleNamespace(max_repeats=2, repeats=2, settle_s=0.0, concurrency=[8, 32],
                           num_prompts=[16, 32], input_len=8, output_len=2, num_warmups=0,
                           precision=1e-9, aa="off", tp=1)
    out = bench_serve.measure(args, servers, _Clocks(), time.monotonic() + 60)
    # First each server's whole workload on prompts no round uses, then the rounds.
    assert calls[:6] == [(f"http://{lb}", c, n, bench_serve.PRIME_SEED)
                         for lb in ("off", "off_aa", "plugin") for c, n in ((8, 16), (32, 32))]
    assert len(calls) == 6 + 2 * 3 * 2
    assert {seed for *_, seed in calls[6:]} == {0, 1}
    assert set(out["primed_s"]) == {"off", "off_aa", "plugin"}
    assert out["primed_problems"] == ["off at concurrency 32: 31 of 32 completed, 1 failed"]
    # Only what the rounds ran is kept.
    assert {len(v) for d in out["per_round"].values() for v in d.values()} == {2}


def test_with_arrival_staggered_requests_beyond_the_concurrency_go_evenly_apart(monkeypatch):
    import bench_serve

    # From the untimed runs' median end-to-end latency: 0.75 of a request's life over the
    # concurrency; none where the requests all fit the concurrency, or none was measured.
    e2el = {8: [700.0, 720.0, 680.0], 32: [1300.0]}
    assert bench_serve.spacing_s("staggered", e2el, [8, 32], [16, 32]) == {
        8: pytest.approx(bench_serve.STAGGER * 0.7 / 8, abs=1e-4)}
    assert bench_serve.spacing_s("burst", e2el, [8, 32], [16, 32]) == {}
    assert bench_serve.spacing_s("staggered", {8: [None]}, [8], [16]) == {}
    assert bench_serve.spacing_s("staggered", e2el, [8, 32], [16, 64])[32] == pytest.approx(
        bench_serve.STAGGER * 1.3 / 32, abs=1e-4)

    seen: list = []

    gates: list = []

    def run_serve_bench(argv, gate=None):
        n = int(argv[argv.index("--num-prompts") + 1])
        seen.append(argv)
        gates.append(gate)
        return {"completed": n, "failed": 0, "median_e2el_ms": 800.0,
                "itls": [[0.005] * 97 + [0.03, 0.03] for _ in range(n)],
                **{m: 1.0 for m in bench_serve.METRICS}}

    monkeypatch.setattr(bench_serve, "run_serve_bench", run_serve_bench)
    servers = [SimpleNamespace(label=lb, name=f"m/{lb}", url=f"http://{lb}",
                               model=SimpleNamespace(name="m"), model_dir="m")
               for lb in ("off", "off_aa")]
    args = SimpleNamespace(max_repeats=2, repeats=2, settle_s=0.0, concurrency=[8, 32],
                           num_prompts=[16, 32], input_len=8, output_len=2, num_warmups=0,
                           precision=1e-9, aa="off", tp=1, arrival="staggered")
    out = bench_serve.measure(args, servers, _Clocks(), time.monotonic() + 60)
    rate = {(a[a.index("--max-concurrency") + 1], a[a.index("--seed") + 1]):
            a[a.index("--request-rate") + 1] for a in seen}
    # The untimed runs at once; the timed ones at concurrency 8 at 8 / (0.75 * 0.8 s) a
    # second, evenly (a large gamma shape), every server alike; at 32 at once.
    assert rate[("8", str(bench_serve.PRIME_SEED))] == "inf"
    assert {rate[("8", "0")], rate[("8", "1")]} == {f"{8 / (bench_serve.STAGGER * 0.8):.6g}"}
    assert {rate[("32", "0")], rate[("32", "1")]} == {"inf"}
    timed8 = [a for a in seen if a[a.index("--max-concurrency") + 1] == "8"][2:]
    assert all(a[a.index("--burstiness") + 1] == "10000" and "--save-detailed" in a
               for a in timed8)
    assert out["arrival"]["spacing_s"] == {"8": pytest.approx(0.075)}
    assert out["arrival"]["untimed_median_e2el_ms"] == {"8": [800.0, 800.0],
                                                        "32": [800.0, 800.0]}
    # Each timed run says how many of its requests' decode steps had a prefill beside them.
    run8 = [r for r in out["runs"]["off"] if r["concurrency"] == 8][0]
    assert run8["decode_prefills"] == {"median": 2.0, "min": 2, "max": 2,
                                       "share_of_decode": pytest.approx(0.06 / 0.545, abs=1e-3)}
    assert [r for r in out["runs"]["off"] if r["concurrency"] == 32][0][
        "decode_prefills"]["median"] == 2.0
    assert set(gates) == {None}
    # Sent at once, not held (burst), and by default sent at once and held until the first
    # wave (the concurrency, or the prompts where fewer) is in the server (gated), untimed
    # runs included.
    for arrival, wave in (("burst", {}), ("gated", {"8": 8, "32": 32})):
        seen.clear()
        gates.clear()
        args.arrival = arrival
        out = bench_serve.measure(args, servers, _Clocks(), time.monotonic() + 60)
        assert {a[a.index("--request-rate") + 1] for a in seen} == {"inf"}
        assert out["arrival"]["spacing_s"] == {} and out["arrival"]["how"] == arrival
        timed = [a for a in seen if a[a.index("--seed") + 1] != str(bench_serve.PRIME_SEED)]
        assert len(timed) == 2 * 2 * 2 and all("--save-detailed" in a for a in timed)
        assert all(r["decode_prefills"]["median"] == 2.0
                   for v in out["runs"].values() for r in v)
        want = [(a[a.index("--base-url") + 1], wave[a[a.index("--max-concurrency") + 1]])
                if wave else None for a in seen]
        assert gates == want
    assert bench_serve.parse_args(["--max-model-len", "2112", "--max-num-seqs", "64"]
                                  ).arrival == "gated"


def test_the_prefills_in_each_requests_decode_are_counted_from_its_token_times() -> None:
    import bench_serve

    # Three requests: decode steps of 5 ms, with 0, 1 and 3 steps of 30 ms among them.
    itls = [[0.005] * 10, [0.005] * 9 + [0.03], [0.005] * 7 + [0.03] * 3]
    got = bench_serve.decode_prefills({"itls": itls + [[]]})
    assert got == {"median": 1.0, "min": 0, "max": 3,
                   "share_of_decode": pytest.approx(0.12 / (0.05 + 0.075 + 0.125), abs=1e-4)}
    assert bench_serve.decode_prefills({}) is None
    assert bench_serve.decode_prefills({"itls": [[0.0, 0.0]]})["share_of_decode"] is None


def test_the_serving_summary_says_how_requests_were_sent_and_the_prefills_per_round() -> None:
    import json

    import vllm_report

    # A committed run with --arrival staggered at concurrency 8 (one H100).
    path = (Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "dev"
            / "gpu_vllm_h100x1_staggered" / "serve_gpu_tp1.json")
    result = json.loads(path.read_text())
    text = "\n".join(vllm_report.serving_lines(result))
    assert "requests sent 86 ms apart at concurrency 8\n" in text
    assert "prefill steps in a request's decode, median per round: c8 7 7 7 7 7 7\n" in text
    result["settings"]["concurrency"] = [8, 32]
    assert "86 ms apart at concurrency 8, at once at 32" in "\n".join(
        vllm_report.serving_lines(result))
    for m in result["models"]:
        m["arrival"] = {"how": "burst", "spacing_s": {}}
    assert "requests sent" not in "\n".join(vllm_report.serving_lines(result))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_engines_pinned_and_cpus_kept_busy_only_while_measuring(tmp_path, monkeypatch) -> None:
    import psutil

    import cpu_placement
    import vllm_run
    from test_cpu_placement_cpu import _engine_tree

    cpus = sorted(os.sched_getaffinity(0))
    a, b = cpus[0], cpus[-1]
    monkeypatch.setattr(cpu_placement, "plan", lambda tp, topo, f, c: (cpu_placement.Placement(
        frontend=[a], core=[b], workers=[], driver=[a]), ""))
    engine = _engine_tree(tmp_path, 1)
    core = next(c.pid for c in psutil.Process(engine.pid).children()
                if cpu_placement._title(c.pid).startswith("VLLM::EngineCore"))
    unit = SimpleNamespace(name="m/off", pid=engine.pid, not_run_reason=None)
    seen = {}

    def measure(units, deadline, clocks, seats, reach_at=None, first_at=None):
        me = psutil.Process()
        seen["spinners"] = [(p.pid, p.cpu_affinity()) for p in me.children()
                            if "SCHED_IDLE" in " ".join(p.cmdline())]
        seen["affinity"] = [os.sched_getaffinity(pid) for pid in (engine.pid, core, 0)]
        return {"model": {"name": "m"}, "aa": {}}

    def stop(units):
        seen["affinity_at_stop"] = [os.sched_getaffinity(pid) for pid in (engine.pid, core, 0)]

    try:
        _, result = _execute(tmp_path, {"tiny": ["off"]}, lambda m, labels: [unit],
                             lambda *x: None, measure, stop, placement="pinned", no_halt="on")
    finally:
        engine.kill()
        engine.wait()
        os.sched_setaffinity(0, cpus)
    placed = result["cpu_placement"]
    assert placed["mode"] == "pinned"
    assert placed["engines"]["m/off"]["roles"] == ["core", "frontend"]
    # While measuring: the frontend, its engine core and this process where planned, one
    # busy loop on each CPU given out.
    assert seen["affinity"] == [{a}, {b}, {a}]
    assert placed["no_halt"] == [a, b]
    assert sorted((aff[0] for _, aff in seen["spinners"])) == [a, b]
    # Stopped unpinned, and no loop outlives the measurement.
    assert seen["affinity_at_stop"] == [set(cpus)] * 3
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                   for p, _ in seen["spinners"]), "a spinner outlived the measurement"


def test_an_engine_that_does_not_answer_is_killed_with_its_processes(tmp_path) -> None:
    import subprocess

    from vllm_engine_host import EngineError, EngineProcess

    # An engine host that reads its requests and never answers, with a child of its own.
    prog = ("import subprocess, sys, time\n"
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print(c.pid, file=sys.stderr, flush=True)\n"
            "for line in sys.stdin: pass\n"
            "time.sleep(60)\n")
    e = EngineProcess("m/off", "off", {}, {}, tmp_path)
    e.proc = subprocess.Popen([sys.executable, "-c", prog], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              start_new_session=True)
    child = int(e.proc.stderr.readline())
    try:
        t = time.monotonic()
        with pytest.raises(EngineError, match="no answer within 2 s"):
            e.generate([[1, 2]], 2, timeout=2)
        assert time.monotonic() - t < 10
        assert e.proc.poll() is not None
        assert _gone(child)
    finally:
        if e.proc.poll() is None:
            os.killpg(e.proc.pid, signal.SIGKILL)
        e.proc.wait()


# An engine host that answers the stop and then lingers (vLLM's shutdown done, the process
# not), or ends at once leaving a child in its process group (an engine core).
_STOPPED = ("import json, subprocess, sys, time\n"
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print(c.pid, file=sys.stderr, flush=True)\n"
            "sys.stdin.readline()\n"
            "print(json.dumps({'event': 'stopped'}), flush=True)\n"
            "{after}\n")


@pytest.mark.parametrize("after", ["time.sleep(60)", "sys.exit(0)"])
def test_an_engine_is_gone_with_its_processes_within_the_time_given(tmp_path, after) -> None:
    import subprocess

    import psutil

    from vllm_engine_host import EngineProcess

    e = EngineProcess("m/off", "off", {}, {}, tmp_path)
    e.proc = subprocess.Popen([sys.executable, "-c", _STOPPED.replace("{after}", after)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, start_new_session=True)
    child = int(e.proc.stderr.readline())
    e.ready = {"event": "ready"}
    t = time.monotonic()
    e.request_stop()
    e.wait_stopped(1.5)  # both waits, the answer and the exit, inside it
    try:
        assert e.proc.poll() is not None and time.monotonic() - t < 6
        assert _gone(child), \
            "a process of the engine's group outlived its stop"
    finally:
        if psutil.pid_exists(child):
            os.kill(child, signal.SIGKILL)


def test_a_spinner_ends_with_the_process_that_started_it(tmp_path) -> None:
    import subprocess

    bench = BENCHMARKS / "vllm"
    # A parent that starts a spinner and dies at once, without stopping it.
    code = (f"import sys, os; sys.path.insert(0, {str(bench)!r}); import cpu_placement; "
            "s = cpu_placement.Spinners([min(os.sched_getaffinity(0))], max_s=60).start(); "
            "print(s.procs[0].pid, flush=True); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    # The loop was spinning when its parent died (start() waits for its word).
    assert _gone(int(out.stdout.split()[0])), "the spinner outlived its parent"


def test_a_stopped_server_leaves_no_process_of_its_group() -> None:
    import subprocess

    import psutil

    import bench_serve

    # A server that ends at SIGINT, leaving a process it started (its engine core) behind.
    prog = ("import signal, subprocess, sys, time\n"
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "signal.signal(signal.SIGINT, lambda *a: sys.exit(0))\n"
            "print(c.pid, flush=True)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", prog], stdout=subprocess.PIPE,
                            start_new_session=True)
    child = int(proc.stdout.readline())
    try:
        t = time.monotonic()
        bench_serve.stop(SimpleNamespace(proc=proc), timeout=5)
        assert proc.poll() == 0 and time.monotonic() - t < 10
        assert _gone(child)
    finally:
        if psutil.pid_exists(child):
            os.kill(child, signal.SIGKILL)


def test_waves_start_one_after_another_each_once_the_one_before_is_stopped(tmp_path) -> None:
    import wave_plan

    events = []

    def make(model, labels):
        return [SimpleNamespace(name=f"{model}/{lb}", label=lb, pid=None, not_run_reason=None)
                for lb in labels]

    def start_all(units, parallel, timeout, deadline):
        events.append(("start", [u.name for u in units]))

    def measure(units, deadline, clocks, seats, reach_at=None, first_at=None):
        events.append(("measure", [u.name for u in units]))
        return {"model": {"name": units[0].name.split("/")[0]}, "aa": {}}

    def stop(units):
        events.append(("stop", [u.name for u in units]))

    # One H100's worth: the 8B-like model's three engines (22.5 GiB each) and the GPT-OSS
    # stand-in's three (16.2 GiB each) do not fit together, each model's do.
    labels = ["off", "off_aa", "plugin"]
    rc, result = _execute(tmp_path, {"llama3-8b-like": labels, "gptoss-active-h2880": labels},
                          make, start_all, measure, stop, free=[79.18])
    assert rc == 0
    assert [w["labels"] for w in result["plan"]["waves"]] == [labels, labels]
    assert [e[0] for e in events] == ["start", "measure", "stop"] * 2
    assert events[0][1] == [f"llama3-8b-like/{lb}" for lb in labels]
    assert events[3][1] == [f"gptoss-active-h2880/{lb}" for lb in labels]
    assert [m["wave"] for m in result["models"]] == [1, 2] and result["complete"] is True
    assert [w["model"] for w in result["waves"]] == ["llama3-8b-like", "gptoss-active-h2880"]
    assert all(w["gpu_free_gib_at_start"] == [79.18] for w in result["waves"])
    # What was planned is in the results, memory and time; with two waves of the same time,
    # the first was measured within about half of the run's time.
    plan = result["plan"]
    assert plan["engine_gib_per_gpu"]["llama3-8b-like"]["weights"] == 14.96
    assert plan["margin_gib"] == round(0.05 * 79.18, 2) and len(plan["time"]) == 2


def test_what_each_wave_held_once_measured_is_recorded_beside_the_plans_count(tmp_path):
    import vllm_report
    import vllm_run

    # The GPU's free memory as NVML would read it: less what the wave's engines hold while
    # they are up (their activations' peak reached while measuring), all of it back once
    # they stop.
    holds = {"llama3-8b-like": 70.5, "gptoss-active-h2880": 52.25}
    up: dict = {}

    def start_all(units, parallel, timeout, deadline):
        up["gib"] = holds[units[0].name.split("/")[0]]

    def stop(units):
        up.clear()

    labels = ["off", "off_aa", "plugin"]
    rc, result = _execute(
        tmp_path, {m: labels for m in holds},
        lambda model, lbs: [SimpleNamespace(name=f"{model}/{lb}", label=lb, pid=None,
                                            not_run_reason=None) for lb in lbs],
        start_all, lambda units, *a, **k: {"model": {"name": units[0].name}, "aa": {}},
        stop, free=[79.18], read=lambda tp: [79.18 - up.get("gib", 0.0)])
    assert rc == 0
    assert [w["gib_held_per_gpu"] for w in result["waves"]] == [70.5, 52.25]
    assert [w["gpu_free_gib_measured"] for w in result["waves"]] == [[8.68], [26.93]]
    lines = vllm_report.plan_lines(result)
    # Set against the engines' own share of the plan (the job beside the first wave aside).
    engines = [3 * result["plan"]["engine_gib_per_gpu"][m]["total"] for m in holds]
    assert [w["gib_planned_engines"] for w in result["waves"]] == pytest.approx(engines, abs=0.02)
    first = result["waves"][0]["gib_planned_engines"]
    assert f"engines {first:.2f} planned, 70.50 held once measured" in lines[1]
    # No reading (the CPU build, no NVML): nothing recorded, nothing said.
    assert vllm_run.held_gib(None, [1.0]) == {} and vllm_run.held_gib([1.0], None) == {}

    # A run that shares the GPU with another job (the end-to-end check, whose "before" reading
    # comes before the offline benchmark's engines start beside it) records no held memory:
    # its free memory falls by the other job's engines too.
    up.clear()
    rc, shared = _execute(
        tmp_path, {"llama3-8b-like": labels},
        lambda model, lbs: [SimpleNamespace(name=f"{model}/{lb}", label=lb, pid=None,
                                            not_run_reason=None) for lb in lbs],
        start_all, lambda units, *a, **k: {"model": {"name": units[0].name}, "aa": {}},
        stop, free=[79.18], read=lambda tp: [79.18 - up.get("gib", 0.0) - 60.0],
        gpu_shared=True)
    assert rc == 0
    wave = shared["waves"][0]
    assert "gib_held_per_gpu" not in wave and wave["held_not_measured"]
    line = vllm_report.plan_lines(shared)[1]
    assert "held not measured: another job shares the GPUs" in line and "planned," not in line


def test_a_waves_engines_may_take_until_what_the_later_waves_leave_to_come_up(tmp_path):
    starts = []

    def make(model, labels):
        return [SimpleNamespace(name=f"{model}/{lb}", label=lb, pid=None, not_run_reason=None)
                for lb in labels]

    def start_all(units, parallel, timeout, deadline):
        starts.append(deadline - time.monotonic())

    def measure(units, deadline, clocks, seats, reach_at=None, first_at=None):
        return {"model": {"name": units[0].name.split("/")[0]}, "aa": {}}

    labels = ["off", "off_aa", "plugin"]
    rc, _ = _execute(tmp_path, {"llama3-8b-like": labels, "gptoss-active-h2880": labels},
                     make, start_all, measure, lambda units: None, free=[79.18], budget=100.0,
                     start_timeout_s=900.0)
    assert rc == 0 and len(starts) == 2
    # Two waves of 17 s planned (up 10, six rounds of 1, stop 1) in 100 s: the first one's
    # share ends at 50 s, but its engines may take until the 88 s the second one needs
    # to have results (up 10, one round, its stop), less its own round and stop: 86 s (its
    # deadline less two rounds would be 47 s, the second wave's whole plan 81 s).
    assert 84.0 < starts[0] <= 86.0
    # Given a latest past the budget (the serving step's rounds beyond its least), the
    # starts reach into it; the wave's own share stays what the budget gives it.
    starts.clear()
    rc, _ = _execute(tmp_path, {"llama3-8b-like": labels, "gptoss-active-h2880": labels},
                     make, start_all, measure, lambda units: None, free=[79.18], budget=100.0,
                     start_timeout_s=900.0, latest=130.0)
    assert rc == 0 and len(starts) == 2
    assert 114.0 < starts[0] <= 116.0 and 126.0 < starts[1] <= 128.0


def test_a_runs_latest_counts_only_past_its_budget(tmp_path) -> None:
    import vllm_run

    def run(budget_s, latest_s):
        args = SimpleNamespace(attention_backend=None, work_dir=tmp_path, budget_s=budget_s,
                               latest_s=latest_s, tp=1, dtype="bfloat16", max_model_len=2112,
                               max_num_seqs=64, max_num_batched_tokens=None, kv_tokens=40960,
                               kernel_choice="pinned", weights="dummy", model_info_dir=None)
        return vllm_run.begin(args, [], "bench_vllm.py", 5.0, 1000.0)

    r = run(200.0, 260.0)
    assert (r.deadline, r.latest) == (1195.0, 1255.0)
    assert run(200.0, 0.0).latest is None and run(200.0, 150.0).latest is None
    assert run(0.0, 260.0).latest is None and run(0.0, 260.0).deadline == float("inf")


def test_a_wave_starts_once_the_gpus_have_its_memory_free() -> None:
    import vllm_run
    import wave_plan

    plan = wave_plan.Plan([], {}, [80.0], 4.0, 0.0, {})
    wave = wave_plan.Wave("m", ["off", "off_aa"], 40.0)
    readings = iter([[30.0], [41.0], [50.0], [80.0]])
    t = time.monotonic()
    # The wave before it gives its memory back: 30, then 41 GiB free (less the margin, not
    # yet 40), then 50.
    assert vllm_run.wait_for_memory(plan, wave, 1, lambda tp: next(readings)) == [50.0]
    assert time.monotonic() - t < 5
    # Never free: given up after the time given, the reading said.
    assert vllm_run.wait_for_memory(plan, wave, 1, lambda tp: [10.0], timeout=1.0) == [10.0]
    # Not sized (no GPU memory known): nothing to wait for.
    unsized = wave_plan.Plan([], {}, None, 0.0, 0.0, {})
    assert vllm_run.wait_for_memory(unsized, wave, 1, lambda tp: pytest.fail("read")) is None


def test_each_wave_gets_its_planned_share_of_the_time_left() -> None:
    import vllm_run
    import wave_plan

    times = [wave_plan.WaveTime(10.0, 0.0, 1.0, 10, 0.0),
             wave_plan.WaveTime(30.0, 0.0, 1.0, 30, 0.0)]
    now = time.monotonic()
    first = vllm_run.shares(now + 100.0, times)
    assert 24.0 < first - now < 26.0  # 20 of the 80 planned seconds: a quarter
    assert vllm_run.shares(float("inf"), times) == float("inf")
    # The engines must be up early enough for the untimed round, one round and the stop
    # before the deadline, or before the reach where that is later.
    t = wave_plan.WaveTime(50.0, 5.0, 4.0, 6, 3.0)
    assert vllm_run.start_limit(now + 100.0, t, 900) == pytest.approx(now + 100 - 12, abs=0.5)
    assert vllm_run.start_limit(now + 100.0, t, 900, now + 130.0) == pytest.approx(
        now + 130 - 12, abs=0.5)
    assert vllm_run.start_limit(now + 100.0, t, 900, now + 90.0) == pytest.approx(
        now + 100 - 12, abs=0.5)
    assert vllm_run.start_limit(float("inf"), t, 10) == pytest.approx(now + 10, abs=0.5)


def test_a_wave_short_of_its_minimum_rounds_may_run_on_into_what_later_waves_leave() -> None:
    import vllm_run
    import wave_plan

    later = [wave_plan.WaveTime(30.0, 5.0, 10.0, 6, 5.0)]  # planned 100 s
    assert vllm_run.reach(1000.0, later) == 900.0 and vllm_run.reach(1000.0, []) == 1000.0
    # Short of 6 rounds: a round that ends past the wave's deadline (500) but by 900 starts.
    assert vllm_run.round_fits(495.0, 12.0, 500.0, 900.0, 5, 6)
    # With its minimum measured, the wave's own deadline again.
    assert not vllm_run.round_fits(495.0, 12.0, 500.0, 900.0, 6, 6)
    # Never past what the later waves need, and never before the wave's own deadline.
    assert not vllm_run.round_fits(895.0, 12.0, 500.0, 900.0, 2, 6)
    assert vllm_run.round_fits(480.0, 12.0, 500.0, 400.0, 6, 6)
    assert not vllm_run.round_fits(500.0, 0.0, 500.0, 400.0, 0, 6)
    # A wave whose engines came up late has its first round where the later waves still
    # have their least (up, untimed runs, one round, stop: 50 s of their planned 100)...
    assert vllm_run.reach(1000.0, later, least=True) == 950.0
    assert vllm_run.round_fits(920.0, 12.0, 500.0, 900.0, 0, 6, 950.0)
    assert vllm_run.limit_now(500.0, 900.0, 0, 6, 950.0) == 950.0
    # ... and no second one past the reach of their plans.
    assert not vllm_run.round_fits(932.0, 12.0, 500.0, 900.0, 1, 6, 950.0)
    assert vllm_run.limit_now(500.0, 900.0, 1, 6, 950.0) == 900.0
    assert not vllm_run.round_fits(940.0, 12.0, 500.0, 900.0, 0, 6, 950.0)


def test_serving_rounds_go_on_to_the_minimum_within_the_reach(monkeypatch) -> None:
    import bench_serve

    monkeypatch.setattr(bench_serve, "run_serve_bench", lambda argv, gate=None: (time.sleep(0.01), {
        "completed": 1, "failed": 0, **{m: 1.0 for m in bench_serve.METRICS}})[1])
    servers = [SimpleNamespace(label=lb, name=f"m/{lb}", url="http://x",
                               model=SimpleNamespace(name="m"), model_dir="m")
               for lb in ("off", "off_aa")]
    args = SimpleNamespace(max_repeats=6, repeats=4, settle_s=0.0, concurrency=[1],
                           num_prompts=[1], input_len=8, output_len=2, num_warmups=0,
                           precision=0.0, aa="off", tp=1)
    now = time.monotonic()
    # The wave's own deadline has passed after the untimed runs; its reach has not.
    out = bench_serve.measure(args, servers, _Clocks(), now + 0.02, None, {}, None,
                              reach_at=now + 30)
    assert out["rounds"] == 4 and out["stopped_because"] == "time budget"
    out = bench_serve.measure(args, servers, _Clocks(), now + 0.02, None, {})
    assert out["rounds"] <= 1
    # Servers up so late that the reach has passed too: one round where the later waves
    # still have their least, and no more.
    now = time.monotonic()
    out = bench_serve.measure(args, servers, _Clocks(), now - 1, None, {}, None,
                              reach_at=now - 1, first_at=now + 30)
    assert out["rounds"] == 1 and out["stopped_because"] == "time budget"


def test_an_engine_that_did_not_start_says_vllms_root_cause() -> None:
    from vllm_engine_host import root_cause

    log = [
        "(EngineCore pid=7) ERROR 12-05 10:00:01 [core.py:900] EngineCore failed to start.\n",
        "(EngineCore pid=7) ERROR 12-05 10:00:01 [core.py:900] Traceback (most recent call "
        "last):\n",
        "(EngineCore pid=7) ERROR 12-05 10:00:01 [core.py:900] torch.OutOfMemoryError: CUDA "
        "out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.18 GiB "
        "of which 11.12 MiB is free.\n",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core "
        "proc(s): {}\n"]
    assert root_cause(log) == ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
                               "2.00 GiB. GPU 0 has a total capacity of 79.18 GiB of which "
                               "11.12 MiB is free.")
    # No memory error: the last exception that is not vLLM's pointer to one above.
    other = ["ValueError: first\n", "(EngineCore pid=7) ERROR x] KeyError: 'rope_theta'\n",
             "RuntimeError: Engine core initialization failed. See root cause above.\n"]
    assert root_cause(other) == "KeyError: 'rope_theta'"
    assert root_cause(["INFO all well\n"]) is None
    # A traceback vLLM logs as a warning (an optional module that failed to import, and
    # vLLM went on without it) is not why an engine failed: here none is named.
    warned = [f"(EngineCore pid=1391) WARNING 12-06 17:07:01 [import_utils.py:408] {t}\n"
              for t in ("Module vllm.third_party.deep_gemm was found but failed to import",
                        "Traceback (most recent call last):",
                        "ImportError: cannot import name '_C' from partially initialized "
                        "module 'vllm.third_party.deep_gemm'")]
    assert root_cause(warned) is None
    assert root_cause(warned + other) == "KeyError: 'rope_theta'"


def test_a_failed_start_is_reported_with_its_root_cause(tmp_path) -> None:
    import subprocess

    from vllm_engine_host import EngineError, EngineProcess

    # An engine host whose engine core logged its cause, then said only that it failed.
    prog = ("import json, sys\n"
            "sys.stdin.readline()\n"
            "print('(EngineCore pid=9) ERROR [core.py:1] torch.OutOfMemoryError: CUDA out of "
            "memory. GPU 0 has a total capacity of 79.18 GiB', file=sys.stderr, flush=True)\n"
            "print(json.dumps({'event': 'error', 'error': 'RuntimeError: Engine core "
            "initialization failed. See root cause above.'}), flush=True)\n")
    e = EngineProcess("m/off", "off", {}, {}, tmp_path)
    # Started as start() does, with this program in place of the engine host.
    e.proc = subprocess.Popen([sys.executable, "-c", prog], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              start_new_session=True)
    e._relay_thread = threading.Thread(target=e._relay, daemon=True)
    e._relay_thread.start()
    e._send({"label": "m/off", "kwargs": {}})
    with pytest.raises(EngineError) as exc:
        e.wait_ready(30)
    why = e.failure(exc.value)
    assert why.startswith("torch.OutOfMemoryError: CUDA out of memory. GPU 0 has a total "
                          "capacity of 79.18 GiB (m/off: its engine did not start")
    e.kill()


class _Seats:
    """Records where the benchmark seats its engines; parks like a pinned placement."""
    parks = True

    def __init__(self, log):
        self.log = log

    def take(self, name):
        self.log.append(("take", name, time.monotonic()))

    def leave(self, name):
        self.log.append(("leave", name, time.monotonic()))


def test_an_offline_turn_takes_its_engine_calls_warm_then_pauses_then_times() -> None:
    import bench_vllm

    log = []

    def engine(label):
        def generate(batch, max_tokens, timeout):
            log.append(("call", label, time.monotonic(), max_tokens))
            return {"seconds": 0.01, "ids": [[1]] * len(batch), "tpot_s": [0.001] * len(batch),
                    "prefill_s": [0.002] * len(batch),
                    "host": {"engine_cpu_s": 0.0, "engine_involuntary_switches": 0,
                             "steal_s": 0.0}}
        return SimpleNamespace(label=label, name=f"m/{label}", model=SimpleNamespace(name="m"),
                               proc=SimpleNamespace(generate=generate))

    engines = [engine("off"), engine("off_aa")]
    args = _offline_args(batches=[1], max_repeats=2, settle_s=0.3)
    bench_vllm.measure(engines, args, 100, _Clocks(), time.monotonic() + 60, None, _Seats(log))
    # Per turn: the engine on its CPUs, its untimed call (2 tokens), its timed call, parked.
    kinds = [(e[0], e[1]) for e in log]
    assert kinds[:4] == [("take", "m/off"), ("call", "off"), ("call", "off"), ("leave", "m/off")]
    assert [e[3] for e in log if e[0] == "call"][:2] == [2, args.decode_steps + 1]
    # The next engine's timed calls come the pause after the last turn's end, its untimed
    # call within it.
    leave = log[3][2]
    untimed, timed = [e[2] for e in log[4:] if e[0] == "call"][:2]
    assert untimed - leave < 0.3 <= timed - leave + 0.01


def test_a_server_is_warmed_up_by_a_burst_of_short_requests(tmp_path) -> None:
    import http.server
    import json

    import bench_serve

    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the handler's name
            length = int(self.headers["Content-Length"])
            seen.append((self.path, json.loads(self.rfile.read(length))))
            body = b'{"choices": []}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        server = SimpleNamespace(url=f"http://127.0.0.1:{httpd.server_port}",
                                 model_dir=tmp_path, model=SimpleNamespace(vocab=512))
        bench_serve.warm_up(server, 8, 1000)
    finally:
        httpd.shutdown()
    assert len(seen) == 8 and {p for p, _ in seen} == {"/v1/completions"}
    body = seen[0][1]
    assert body["model"] == str(tmp_path) and body["max_tokens"] == 16
    assert len(body["prompt"]) == 1000 and all(3 <= t < 512 for t in body["prompt"])
    assert body["ignore_eos"] is True and body["temperature"] == 0


def test_a_waves_engines_are_launched_in_an_order_of_the_runs_seed() -> None:
    import vllm_run

    units = list("abcdef")
    assert vllm_run.launch_order(units, "given", "1/0") == units
    shuffled = vllm_run.launch_order(units, "shuffled", "1/0")
    assert sorted(shuffled) == units and shuffled != units
    assert vllm_run.launch_order(units, "shuffled", "1/0") == shuffled
    assert vllm_run.launch_order(units, "shuffled", "2/0") != shuffled


def test_the_pause_before_a_turn_is_long_only_where_the_engine_before_still_polls_here(
        monkeypatch) -> None:
    import vllm_run

    monkeypatch.setattr(vllm_run, "on_cpu", lambda: False)
    parked, unparked = SimpleNamespace(parks=True), SimpleNamespace(parks=False)
    assert vllm_run.settle_s(None, 2, unparked) == 1.2
    assert vllm_run.settle_s(None, 2, parked) == vllm_run.settle_s(None, 1, unparked) == 0.2
    assert vllm_run.settle_s(0.5, 2, unparked) == 0.5


def test_a_variant_whose_own_engine_came_up_late_is_measured_by_its_twin(tmp_path) -> None:
    """``off`` missed its wave's start limit while ``off_aa`` (the same variant) and
    ``plugin`` came up: the wave measures those two, and ``off``'s records and results
    are its twin's, with the late engine's reason kept on the engine alone."""
    import bench_vllm
    import vllm_models

    def generate(batch, max_tokens, timeout):
        return {"seconds": 0.01, "ids": [[1, 2]] * len(batch), "tpot_s": [0.001] * len(batch),
                "prefill_s": [0.002] * len(batch),
                "host": {"engine_cpu_s": 0.0, "engine_involuntary_switches": 0, "steal_s": 0.0}}

    ready = {"seconds_to_start": 80.0,
             "settings": {"compilation": {"compile_ranges": [[1, 2048]]}}}
    spec = vllm_models.MODELS["tiny"]
    engines = []
    for label in ("off", "off_aa", "plugin"):
        (tmp_path / label).mkdir()
        proc = SimpleNamespace(generate=generate, ready=None if label == "off" else ready,
                               label=f"tiny/{label}")
        engines.append(bench_vllm.Engine(label, label.split("_")[0], spec, tmp_path / label,
                                         proc))
    engines[0].not_run_reason = "tiny/off: no answer within 1 s"
    args = _offline_args(variants=["off", "plugin"], max_num_batched_tokens=None, keep_ids=0,
                         repeats=6, max_repeats=6)
    out = bench_vllm.run_model(args, {}, engines, time.monotonic() + 60, _Clocks())
    assert out["rounds"]["timed"] == 6
    assert sorted(out["engines"]) == ["off", "off_aa", "plugin"]
    assert out["engines"]["off"] == {"variant": "off", "run": False,
                                     "not_run_reason": "tiny/off: no answer within 1 s"}
    for v in ("off", "plugin"):
        assert out["variants"][v]["run"] and "not_run_reason" not in out["variants"][v]
        assert out["variants"][v]["sites_per_range"] == {}
    assert list(out["comparisons"]) == ["plugin/off_aa"]


def test_the_first_timed_round_is_expected_to_be_shorter_than_the_warm_up() -> None:
    """An engine's first calls are its slower ones (the plan counts the warm-up round at
    ``wave_plan.FIRST_ROUND`` rounds): the time the warm-up took, over that, is the first
    timed round's estimate, so that a wave up at its start limit still gets its round."""
    import bench_vllm

    calls = {"n": 0}

    def generate(batch, max_tokens, timeout):
        calls["n"] += 1
        # Six calls a round (two engines: an untimed call, batch 1, batch 2); the warm-up's
        # take 1.6 times as long.
        time.sleep(0.16 if calls["n"] <= 6 else 0.1)
        return {"seconds": 0.05, "ids": [[1, 2]] * len(batch), "tpot_s": [0.001] * len(batch),
                "prefill_s": [0.002] * len(batch),
                "host": {"engine_cpu_s": 0.0, "engine_involuntary_switches": 0, "steal_s": 0.0}}

    engines = [SimpleNamespace(label=lb, name=f"m/{lb}", model=SimpleNamespace(name="m"),
                               proc=SimpleNamespace(generate=generate)) for lb in ("off", "off_aa")]
    # The warm-up takes 0.96 s; 0.75 s is left after it: room for one round of 0.6 s, not
    # for one as long as the warm-up.
    until = time.monotonic() + 1.71
    m = bench_vllm.measure(engines, _offline_args(warmup=1), 100, _Clocks(), until,
                           first_at=until)
    assert m.rounds == 1 and m.stopped_because == "time budget"
