"""Serving as vLLM's users measure it: vLLM's OpenAI server for each variant (and the A/A
twin, ``--aa``), driven by vLLM's own ``vllm bench serve`` (random prompts of
``--input-len`` tokens, ``--output-len`` tokens each with ``ignore_eos``, at each
``--concurrency``, after warm-up requests), reporting per server the median and p99 time
per output token (TPOT), inter-token latency (ITL), time to first token and the output
throughput, as ``vllm bench serve`` computes them from the streamed responses.

The servers run the same engines as ``bench_vllm.py`` (``vllm_setup.py``: model, engine
arguments, compilation config, pinned kernel choices, KV cache size); with the same
``--work-dir`` after ``bench_vllm.py --keep-caches`` each server loads its variant's
compile from the offline engine's cache instead of compiling again, which the results
say per server.  The servers start side by side, then are measured one at a time in the
rounds of ``paired_ratios.round_order``, the others idle; a comparison is the median of
per-round ratios against ``off``, with the A/A pair's beside it.

``vllm bench serve`` is run in this process through its module
(``vllm.benchmarks.serve``: the ``vllm`` command is missing from vLLM's CPU build).  By
default each run's requests are held at the server until all of its first wave is in, then
released together (``--arrival gated``, ``serve_gate.py``).

    python benchmarks/vllm/bench_serve.py --tp 2 --out-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import os
import signal
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any, Optional

# This part's modules, and the ones the benchmarks share (bench_common.py).
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import bench_vllm  # noqa: E402
import cpu_placement  # noqa: E402
import paired_ratios  # noqa: E402
import serve_gate  # noqa: E402
import vllm_models  # noqa: E402
import vllm_report  # noqa: E402
import vllm_run  # noqa: E402
import vllm_setup as setup  # noqa: E402
import wave_plan  # noqa: E402
from gpu_telemetry import ClockSampler  # noqa: E402
from vllm_engine_host import TAIL, kill_group, root_cause  # noqa: E402

from fusion_pass import records  # noqa: E402
from fusion_pass.tools.demo import ModelSpec, on_cpu  # noqa: E402
from fusion_pass.testing.spawn import free_port  # noqa: E402

START = time.monotonic()
"""When the run began: its --budget-s counts from here."""

ROOT = Path(__file__).resolve().parents[2]
# vllm bench serve's numbers kept per run (ms, tokens/s); the per-request lists are left out.
KEEP = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
        "request_throughput", "output_throughput", "total_token_throughput",
        "max_concurrent_requests", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
        "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms",
        "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms", "first_tokens_before_release",
        "ttft_ms_each", "tpot_ms_each", "with_hold")
METRICS = ("median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_ttft_ms",
           "output_throughput")
PRIMARY = vllm_report.SERVING_PRIMARY
RATES = ("output_throughput",)


@dataclasses.dataclass
class Server:
    label: str
    variant: str
    model: ModelSpec
    model_dir: Path
    work: Path
    cmd: list[str]
    env: dict[str, str]
    port: int
    proc: Optional[subprocess.Popen] = None
    not_run_reason: Optional[str] = None
    seconds_to_start: Optional[float] = None
    log_tail: list[str] = dataclasses.field(default_factory=list)
    loaded_from_cache: bool = False
    keys_before: set[str] = dataclasses.field(default_factory=set)
    keys_after: set[str] = dataclasses.field(default_factory=set)

    def compile_keys(self) -> set[str]:
        """The compile cache keys (vLLM's AOT folders) under this label's cache."""
        d = self.work / "cache" / "vllm" / "torch_compile_cache" / "torch_aot_compile"
        return {p.name for p in d.iterdir()} if d.is_dir() else set()

    @property
    def name(self) -> str:
        return f"{self.model.name}/{self.label}"

    @property
    def pid(self) -> Optional[int]:
        """The API server's process (its engine core and workers are below it)."""
        return self.proc.pid if self.proc is not None else None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def records(self) -> list[records.GraphRecord]:
        d = self.work / "records_serve"
        return records.read_dir(str(d)) if d.is_dir() else []


SERVER_ENV = {"VLLM_WORKER_MULTIPROC_METHOD": "fork"}
"""Set for every server unless the environment sets it (``server_environment`` in the
results: what was asked).  vLLM's OpenAI server makes its engine core processes by
``spawn`` (``cli_env_setup``), a fresh interpreter that imports the server's whole module
again before the engine starts: about 20 s per server on one H200, six servers at once,
against 0-2 s for the offline engines, which vLLM's library makes by ``fork`` on GPUs.  The
engine core runs the same code either way; where CUDA is already initialised in the
parent, vLLM falls back to ``spawn`` itself and says so, and vLLM's CPU platform sets
``spawn`` for itself whatever is asked."""


ARRIVAL = "gated"
"""``--arrival``'s default (``serve_gate``: a wave held until it is all in)."""


def arrival(args: argparse.Namespace) -> str:
    """How a run's requests arrive: ``--arrival``, :data:`ARRIVAL` where not given."""
    return getattr(args, "arrival", ARRIVAL)


def gated(args: argparse.Namespace) -> bool:
    return arrival(args) == "gated"


def server_env(args: argparse.Namespace, inherited: bool = False) -> dict[str, str]:
    """What a server's environment adds to this process's: :data:`SERVER_ENV` where this
    process's does not set it, and with ``--arrival gated`` vLLM's development endpoints
    (``serve_gate``), which the gate needs whatever this process's environment says;
    ``inherited``: what the server sees for those names, this process's values included."""
    base = {k: os.environ.get(k, v) for k, v in SERVER_ENV.items()
            if inherited or k not in os.environ}
    return {**base, **(serve_gate.SERVER_ENV if gated(args) else {})}


def gate_args(args: argparse.Namespace) -> list[str]:
    return serve_gate.SERVER_ARGS if gated(args) else []


def log(msg: str) -> None:
    print(f"bench_serve: {msg}", file=sys.stderr, flush=True)


def plan(args: argparse.Namespace, spec: ModelSpec, root: Path, shape: setup.EngineShape,
         labels: list[str]) -> list[Server]:
    """The servers ``labels`` of a model (a wave).  A label's folder keeps what an offline
    engine of it compiled (its cache); the server's records go to ``records_serve``."""
    model = setup.write_model(spec, root / spec.name / "model", args.dtype, args.weights)
    out = []
    for label in labels:
        work = root / spec.name / label
        work.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(work / "records_serve", ignore_errors=True)
        variant = setup.label_variant(label)
        kw = setup.engine_kwargs(shape, spec, model, variant)
        if args.max_num_scheduled_tokens:  # 0: vLLM's budget, the flag left out
            kw["max_num_scheduled_tokens"] = args.max_num_scheduled_tokens
        env = {**setup.engine_env(work, shape),
               **server_env(args),
               records.RECORD_DIR_ENV: str(work / "records_serve")}
        port = free_port()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               *setup.server_args(kw), "--host", "127.0.0.1", "--port", str(port),
               "--disable-uvicorn-access-log", *gate_args(args),
               *(getattr(args, "server_arg", None) or [])]
        out.append(Server(label, variant, spec, model, work, cmd, env, port))
    return out


def _relay(s: Server) -> None:
    """The server's output to this process's stderr, prefixed; the last lines kept."""
    assert s.proc is not None and s.proc.stdout is not None
    for raw in iter(s.proc.stdout.readline, b""):
        line = raw.decode(errors="replace")
        if "Directly load AOT compilation" in line or "Directly load the compiled graph" in line:
            s.loaded_from_cache = True
        s.log_tail = (s.log_tail + [line])[-TAIL:]
        sys.stderr.write(f"[{s.model.name}/{s.label} server] {line}")


def _healthy(s: Server) -> bool:
    try:
        with urllib.request.urlopen(f"{s.url}/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def start_all(servers: list[Server], parallel: int, timeout: float, deadline: float) -> None:
    """Start the servers, ``parallel`` at a time (0: all), and wait until each answers its
    health check, at most ``timeout`` and not past ``deadline``; one that fails or is late
    is recorded as not run."""
    step = parallel if parallel > 0 else max(len(servers), 1)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    for i in range(0, len(servers), step):
        batch = servers[i:i + step]
        t0 = time.monotonic()
        for s in batch:
            s.keys_before = s.compile_keys()
            log(f"starting the {s.model.name}/{s.label} server on port {s.port}")
            s.proc = subprocess.Popen(s.cmd, env={**os.environ, "PYTHONPATH": path, **s.env},
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      start_new_session=True)
            threading.Thread(target=_relay, args=(s,), daemon=True).start()
        waiting = list(batch)
        limit = min(timeout, deadline - t0)
        while waiting and time.monotonic() - t0 < limit:
            for s in list(waiting):
                assert s.proc is not None
                if s.proc.poll() is not None:
                    time.sleep(0.5)  # its last lines relayed
                    cause = root_cause(s.log_tail) or "".join(s.log_tail[-5:])
                    s.not_run_reason = (f"the server exited with {s.proc.returncode}: "
                                        f"{cause}")[:2000]
                elif _healthy(s):
                    s.seconds_to_start = round(time.monotonic() - t0, 1)
                    s.keys_after = s.compile_keys()
                    log(f"{s.model.name}/{s.label} up in {s.seconds_to_start} s"
                        f"{' (its compile loaded from the cache)' if s.loaded_from_cache else ''}")
                else:
                    continue
                waiting.remove(s)
            time.sleep(1)
        for s in waiting:
            s.not_run_reason = f"not healthy within {limit:.0f} s"
            stop(s)
        for s in batch:
            if s.not_run_reason:
                log(f"{s.model.name}/{s.label} not run: {s.not_run_reason}")


def stop(s: Server, timeout: float = 60, signalled: bool = False) -> None:
    """SIGINT (vLLM's clean shutdown; once: a second one makes uvicorn skip it), then
    SIGKILL to whatever is left of the server's process group (an engine core whose server
    has ended included)."""
    if s.proc is None:
        return
    if not signalled and s.proc.poll() is None:
        s.proc.send_signal(signal.SIGINT)
    try:
        s.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    kill_group(s.proc)


STAGGER = 0.75
"""``--arrival staggered``: where a run's requests outnumber its concurrency (later requests
start as earlier ones end), they are sent ``STAGGER`` times a request's life (its
end-to-end latency in the wave's untimed runs) over the concurrency apart.  Sent at once
and not held (``burst``), two prompts that reach the scheduler in the same step are
prefilled together (at 2048 tokens a step, the 8B-like model's budget), and whether they do
turns on a millisecond of the client's and the server's turnaround against a 5 ms decode
step: the count of prefills in a request's decode, and so median TPOT, takes one of two
values from run to run (one prompt a step, ``--max-num-scheduled-tokens``, spread it wider:
docs/vllm_benchmark.md, section 9).
Apart by more than a prefill step, that count is the same in every run (on one H100 seven
in every run of every server).  Below 1, the first requests are all in before the first
ends and the later ones start as earlier ones end, so the server sets the pace, as long as
a request takes at least ``STAGGER`` of its untimed life (a server over a quarter faster
than the untimed runs would wait for the schedule).  Not the default (``gated``,
``serve_gate``, holds one wave until it is all queued): sent at once, some of
the others' prefills fall in a request's time to first token instead of its decode, and
where the prefill step's own time varies from run to run, as the GPT-OSS stand-in's did on
one H100 (median TTFT 38-60 ms a run), median TPOT varies less than with all of them in its
decode (docs/vllm_benchmark.md, section 9).  The run plan (``wave_plan``) counts requests
sent at once; staggered, a run at concurrency 8 takes about a quarter longer."""
BURSTINESS = 1e4
"""``vllm bench serve``'s gamma shape for the intervals between requests: 1 % apart from
evenly spaced (1: Poisson arrivals, whose random intervals put prompts together again);
the same intervals for every server of a round (the round's seed)."""


def spacing_s(arrival: str, e2el_ms: dict[int, list[float]], concurrency: list[int],
              prompts: list[int]) -> dict[int, float]:
    """Seconds between a run's requests at each concurrency (:data:`STAGGER`): for runs
    whose requests outnumber their concurrency, from the median end-to-end latency
    ``e2el_ms`` of the wave's untimed runs at that concurrency; none (sent at once) for
    the others, with ``arrival`` "burst", or where no untimed run measured it."""
    out: dict[int, float] = {}
    for c, n in zip(concurrency, prompts):
        known = [x for x in e2el_ms.get(c, []) if x]
        spacing = STAGGER * statistics.median(known) / 1000.0 / c if known else 0.0
        if arrival == "staggered" and n > c and spacing >= 1e-4:
            out[c] = round(spacing, 4)
    return out


def serve_bench_argv(args: argparse.Namespace, s: Server, concurrency: int,
                     prompts: int, seed: int, spacing: Optional[float] = None,
                     detailed: bool = False) -> list[str]:
    """``vllm bench serve``'s command line for one run against ``s``: the prompts of
    ``seed`` (a round's: every server of the round gets the same), sent ``spacing`` seconds
    apart (:data:`STAGGER`; None: at once) and admitted ``concurrency`` at a time in their
    order; no warm-up of its own (the server was warmed up before its turn,
    :func:`warm_up`); ``detailed``: each request's times in the result
    (:func:`decode_prefills`)."""
    rate = ["--request-rate", "inf"] if not spacing else [
        "--request-rate", f"{1.0 / spacing:.6g}", "--burstiness", f"{BURSTINESS:g}"]
    return ["--base-url", s.url, "--model", str(s.model_dir), "--dataset-name", "random",
            "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(prompts),
            "--max-concurrency", str(concurrency), *rate, "--ignore-eos",
            "--num-warmups", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--temperature", "0", "--seed", str(seed), "--disable-tqdm",
            *(["--save-detailed"] if detailed else [])]


SLOW_STEP = 3.0
"""A token that came over this many times the run's median inter-token latency after the
one before: a step with a prompt's prefill in it (on one H100, 5 ms decode steps, 30-40 ms
with a 1000-token prefill beside them)."""


def decode_prefills(result: dict[str, Any]) -> Optional[dict[str, float]]:
    """From one run's per-request inter-token latencies (``--save-detailed``): how many of
    each request's decode steps had a prefill in them (:data:`SLOW_STEP`): the median, the
    least and the most over the run's requests, and the share of its decode time they took.
    What moves a request's time per output token from one run to the next where its
    decode steps themselves do not (docs/vllm_benchmark.md, section 9).  None where the
    result has no per-request times."""
    itls = [x for x in result.get("itls") or [] if x]
    flat = sorted(t for x in itls for t in x)
    if not flat:
        return None
    cut = SLOW_STEP * flat[len(flat) // 2]
    counts = [sum(t > cut for t in x) for x in itls]
    slow, total = sum(t for t in flat if t > cut), sum(flat)
    return {"median": float(statistics.median(counts)), "min": min(counts),
            "max": max(counts), "share_of_decode": round(slow / total, 4) if total > 0 else None}


def warm_up(s: Server, requests: int, input_len: int, tokens: int = 16) -> None:
    """``requests`` completions sent to ``s`` at once, each a prompt of ``input_len`` token
    ids and ``tokens`` tokens out: the server's processes awake and its prefill and decode
    paths run before its turn is measured (``vllm bench serve``'s own warm-up sends the
    whole workload's first request ``--num-warmups`` times, 0.75 s a server at concurrency 8
    on one H200, for the same purpose)."""
    import concurrent.futures
    import json

    vocab = s.model.vocab
    body = json.dumps({"model": str(s.model_dir), "max_tokens": tokens, "temperature": 0,
                       "ignore_eos": True,
                       "prompt": [3 + (7919 * i) % (vocab - 3) for i in range(input_len)]})

    def one(_: int) -> None:
        req = urllib.request.Request(f"{s.url}/v1/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()

    with concurrent.futures.ThreadPoolExecutor(requests) as pool:
        list(pool.map(one, range(requests)))


PRIME_SEED = 1_000_003
"""The prompts of the untimed runs (:func:`prime`): a seed no round uses (rounds use 0, 1, ...)."""


def prime(args: argparse.Namespace, servers: list[Server],
          seats: Optional[cpu_placement.Seats] = None,
          e2el: Optional[dict[int, list[float]]] = None) -> tuple[dict[str, float], list[str]]:
    """Every server runs the whole workload once, untimed, before the first round: each
    concurrency with its number of prompts.  A burst of requests that start and end together
    (:func:`warm_up`) never makes the batches of a run, where new prefills join running
    decodes; the first run that does compiles kernels for them in the middle of a timed
    run (vLLM 0.26's Triton attention logged "JIT compilation during inference:
    kernel_unified_attention" in the first timed run of every server on one H100; that
    round's output throughput at concurrency 8 came out 20 % apart between two servers of
    the same code, 2.14 s against 1.76 s for its 16 requests; docs/vllm_benchmark.md).
    Returns each server's seconds and what went wrong (a run with requests that failed or
    did not complete: that server's timed runs may still meet a first compile); each run's
    median end-to-end latency goes into ``e2el`` by concurrency (:func:`spacing_s`)."""
    seats = seats if seats is not None else cpu_placement.Seats({}, {})
    took: dict[str, float] = {}
    problems: list[str] = []
    e2el = e2el if e2el is not None else {}
    for s in servers:
        t0 = time.monotonic()
        seats.take(s.name)
        try:
            for c, n in zip(args.concurrency, args.num_prompts):
                r = run_serve_bench(serve_bench_argv(args, s, c, n, seed=PRIME_SEED,
                                                     detailed=gated(args)),
                                    gate_for(args, s, c, n))
                e2el.setdefault(c, []).append(r.get("median_e2el_ms"))
                if r.get("completed") != n or r.get("failed"):
                    problems.append(f"{s.label} at concurrency {c}: {r.get('completed')} of {n} "
                                    f"completed, {r.get('failed')} failed")
                    log(f"{s.model.name}/{problems[-1]} (untimed run)")
        finally:
            seats.leave(s.name)
        took[s.label] = round(time.monotonic() - t0, 2)
        log(f"{s.model.name}/{s.label}: primed (the workload once, untimed) in "
            f"{took[s.label]:.1f} s")
    return took, problems


def timed_run(argv: list[str], gate: Optional[tuple[str, int]] = None) -> dict[str, Any]:
    """:func:`run_serve_bench` with this process's garbage collector held off while it
    runs: the client reads every streamed token in this process, and a collection of the
    benchmark's own objects in the middle of a run would add to the times it measures."""
    gc.collect()
    gc.disable()
    try:
        return run_serve_bench(argv, gate)
    finally:
        gc.enable()


def gate_for(args: argparse.Namespace, s: Server, concurrency: int,
             prompts: int) -> Optional[tuple[str, int]]:
    """With ``--arrival gated``: the server and the size of a run's first wave (its requests
    up to the concurrency), for :func:`run_serve_bench`."""
    return (s.url, min(concurrency, prompts)) if gated(args) else None


def run_serve_bench(argv: list[str], gate: Optional[tuple[str, int]] = None) -> dict[str, Any]:
    """One ``vllm bench serve`` run, in this process, through vLLM's own module; ``gate``
    (server URL, first wave): its requests held until that many are in the server, its
    times to first token and its rates counted from their release (``serve_gate``), the
    hold under ``gate``."""
    import vllm.benchmarks.serve as serve
    from vllm.tokenizers import cached_get_tokenizer
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # The client loads the tokenizer before it sends anything; here once per process rather
    # than once per run (a 200k-word vocabulary takes seconds), the same tokenizer.
    serve.get_tokenizer = cached_get_tokenizer
    add_cli_args, main = serve.add_cli_args, serve.main
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    if gate is None:
        return main(parser.parse_args(argv))
    r, hold = serve_gate.run(serve, *gate, lambda: main(parser.parse_args(argv)))
    return {**serve_gate.from_release(r, hold), "gate": hold.record()}


def measure(args: argparse.Namespace, servers: list[Server], clocks: ClockSampler,
            deadline: float, out: Optional[dict[str, Any]] = None,
            longest: Optional[dict[str, float]] = None,
            seats: Optional[cpu_placement.Seats] = None,
            reach_at: Optional[float] = None,
            first_at: Optional[float] = None) -> dict[str, Any]:
    """First every server's untimed run of the workload (:func:`prime`, where a round can
    follow it), then rounds: each server in turn (on its CPUs, the others parked:
    ``seats``) is warmed up (:func:`warm_up`, ``--num-warmups`` requests), waits the pause
    since the turn before, and runs every concurrency with the round's prompts, sent as
    :func:`spacing_s` says from the untimed runs (the same for every server); per-round
    metrics per server, kept in ``out`` where given as each round ends (what it holds
    survives a failure).
    ``longest["round_s"]``: the longest round of the models measured before, updated here:
    a model's first round starts only where one of those would fit (a round overrunning
    the last model's deadline would meet the step's time limit, and this model's results
    would go with it), its later rounds where its own longest would.  Rounds stop at
    ``deadline``, or at ``reach_at`` while fewer than ``--repeats`` are measured, at
    ``first_at`` until one is (:func:`vllm_run.round_fits`)."""
    per_round: dict[str, dict[str, list[Optional[float]]]] = {s.label: {} for s in servers}
    runs: dict[str, list[dict[str, Any]]] = {s.label: [] for s in servers}
    longest = longest if longest is not None else {}
    # The first round's estimate is the longest of the models before; then this model's.
    rounds, why, round_s, own = 0, "max rounds", longest.get("round_s", 0.0), 0.0
    out = out if out is not None else {}
    seats = seats if seats is not None else cpu_placement.Seats({}, {})
    settle = vllm_run.settle_s(args.settle_s, args.tp, seats)
    last_turn: Optional[float] = None
    # Primed only where a round can follow it (the untimed runs take about a round's time).
    e2el: dict[int, list[float]] = {}
    if vllm_run.round_fits(time.monotonic(), 2 * round_s, deadline, reach_at, 0, args.repeats,
                           first_at):
        t0 = time.monotonic()
        out["primed_s"], out["primed_problems"] = prime(args, servers, seats, e2el)
        # This model's first round is about as long as its untimed runs, where no longer
        # estimate is known.
        round_s = max(round_s, time.monotonic() - t0)
    else:
        out["primed_s"], out["primed_problems"] = None, ["no round would follow: not primed"]
    # One spacing for every server of the wave: the same requests at the same times.
    how = arrival(args)
    spacing = spacing_s(how, e2el, args.concurrency, args.num_prompts)
    out["arrival"] = {"how": how, "spacing_s": {str(c): x for c, x in spacing.items()},
                      "stagger": STAGGER, "burstiness": BURSTINESS,
                      "untimed_median_e2el_ms": {str(c): v for c, v in e2el.items()}}
    clocks.start()
    try:
        for rnd in range(args.max_repeats):
            t_round = time.monotonic()
            # Another round only where one fits; none at all where start-up took the time
            # (the step's own limit would cut it, and with it this model's results).
            if not vllm_run.round_fits(t_round, round_s, deadline, reach_at, rnd, args.repeats,
                                       first_at):
                why = "time budget"
                break
            for s in paired_ratios.round_order(servers, rnd):
                seats.take(s.name)
                if args.num_warmups:
                    warm_up(s, args.num_warmups, args.input_len)
                if last_turn is not None:
                    time.sleep(max(settle - (time.monotonic() - last_turn), 0.0))
                for c, n in zip(args.concurrency, args.num_prompts):
                    t0 = time.monotonic()
                    r = timed_run(serve_bench_argv(args, s, c, n, seed=rnd,
                                                   spacing=spacing.get(c), detailed=True),
                                  gate_for(args, s, c, n))
                    gpu = clocks.window(t0, time.monotonic())
                    kept = {k: r.get(k) for k in KEEP}
                    runs[s.label].append({"round": rnd, "concurrency": c, "prompts": n, **kept,
                                          "gate": r.get("gate"),
                                          "decode_prefills": decode_prefills(r),
                                          "sm_mhz": None if gpu is None else gpu["sm_mhz"],
                                          "clock_reasons": None if gpu is None else gpu["reasons"]})
                    ok = r.get("completed") == n and not r.get("failed")
                    for m in METRICS:
                        per_round[s.label].setdefault(f"{m.removesuffix('_ms')}_c{c}", []).append(
                            r.get(m) if ok else None)
                last_turn = time.monotonic()
                seats.leave(s.name)
            rounds = rnd + 1
            out.update(per_round={k: {m: list(v) for m, v in d.items()}
                                  for k, d in per_round.items()},
                       runs={k: list(v) for k, v in runs.items()}, rounds=rounds)
            own = round_s = max(own, time.monotonic() - t_round)
            longest["round_s"] = max(longest.get("round_s", 0.0), own)
            log(f"{servers[0].model.name}: round {rounds} in {time.monotonic() - t_round:.1f} s")
            # Checked after whole pairs of rounds (forward and backward).
            if rounds >= args.repeats and rounds % 2 == 0:
                cmp = paired_ratios.compare(per_round, setup.baseline(per_round),
                                            setup.aa_pair(args.aa, per_round), _rates(args))
                primary = {k: {m: x for m, x in v.items() if m.startswith(PRIMARY)}
                           for k, v in cmp.items()}
                if paired_ratios.precise_enough(primary, args.precision):
                    why = "precise"
                    break
    finally:
        clocks.stop()
    out.update(per_round=per_round, runs=runs, rounds=rounds, stopped_because=why)
    return out


def _rates(args: argparse.Namespace) -> list[str]:
    return [f"{m}_c{c}" for m in RATES for c in args.concurrency]


def run_model(args: argparse.Namespace, skipped: dict[str, str], longest: dict[str, float],
              servers: list[Server], deadline: float, clocks: ClockSampler,
              seats: Optional[cpu_placement.Seats] = None,
              reach_at: Optional[float] = None,
              first_at: Optional[float] = None) -> dict[str, Any]:
    spec = servers[0].model
    live = [s for s in servers if s.not_run_reason is None]
    result: dict[str, Any] = {
        "model": dataclasses.asdict(spec), "expected_sites_per_range": spec.sites(),
        "max_num_batched_tokens": vllm_models.step_tokens(spec.name,
                                                          args.max_num_batched_tokens),
        "variants": {v: {"run": any(s.variant == v for s in live),
                         "description": setup.DESCRIBE[v]} for v in args.variants
                     if v in skipped or any(s.variant == v for s in servers)},
        "servers": {}}
    for v, why in skipped.items():
        result["variants"][v]["not_run_reason"] = why
    m: dict[str, Any] = {"per_round": {}, "runs": {}, "rounds": 0, "stopped_because": "no server"}
    if live:
        try:
            measure(args, live, clocks, deadline, m, longest, seats, reach_at, first_at)
        except Exception as exc:  # noqa: BLE001 - what was measured is still written
            traceback.print_exc()
            # The whole rounds before the failure are kept (``m`` as the last one ended).
            m["stopped_because"] = f"a run failed: {type(exc).__name__}: {exc}"
    aa = setup.aa_pair(args.aa, m["per_round"])
    cmp = paired_ratios.compare(m["per_round"], setup.baseline(m["per_round"]), aa, _rates(args))
    result.update({"rounds": {"timed": m["rounds"], "stopped_because": m["stopped_because"],
                              "primed_s": m.get("primed_s"),
                              "primed_problems": m.get("primed_problems", [])},
                   "arrival": m.get("arrival"),
                   "comparisons": cmp,
                   "aa": paired_ratios.aa_verdict(cmp, "/".join(aa) if aa else None, PRIMARY)})
    digest = bench_vllm.digests(servers)
    for s in servers:
        entry: dict[str, Any] = {"variant": s.variant, "run": s.not_run_reason is None}
        if s.not_run_reason is not None:
            entry["not_run_reason"] = s.not_run_reason
            # A variant ran where any of its servers did (its A/A twin runs it too).
            if not result["variants"][s.variant]["run"]:
                result["variants"][s.variant].setdefault("not_run_reason", s.not_run_reason)
        else:
            per_range = bench_vllm.sites_per_range(s.records())
            entry.update({
                "seconds_to_start": s.seconds_to_start,
                "compile": "loaded from the cache" if s.loaded_from_cache else "compiled",
                # The offline engine's key (the same engine arguments and compilation
                # config) or a new one; vLLM may still fail to load what is there.
                "compile_cache_key": ("the offline engine's" if s.keys_before and
                                      s.keys_after == s.keys_before else
                                      "new" if s.keys_after - s.keys_before else "none"),
                "compiled": digest.get(s.label),
                "median": {k: statistics.median(x for x in v if x is not None)
                           if any(x is not None for x in v) else None
                           for k, v in m["per_round"].get(s.label, {}).items()},
                "per_round": m["per_round"].get(s.label), "runs": m["runs"].get(s.label),
                "sites_per_range": per_range})
        result["servers"][s.label] = entry
    return result


def problems(result: dict[str, Any], tp: int, check: str) -> list[str]:
    """What ``--check`` fails on: a plugin server whose records show a site unfused (TP > 1),
    a variant that did not run, a run whose requests did not all complete, a gated run whose
    wave was not all in the server at its release or had a token before it."""
    out = []
    for m in result["models"]:
        name, want = m["model"]["name"], m["expected_sites_per_range"]
        for label, s in m["servers"].items():
            if not s["run"]:
                out.append(f"{name}/{label}: not run: {s['not_run_reason']}")
                continue
            for run in s["runs"] or []:
                if run["completed"] != run["prompts"] or run["failed"]:
                    out.append(f"{name}/{label}: {run['completed']} of {run['prompts']} "
                               f"requests completed at concurrency {run['concurrency']}")
                gate = run.get("gate")
                if gate and (gate.get("error") or (gate["queued"] or 0) < gate["expected"]
                             or run.get("first_tokens_before_release")):
                    out.append(f"{name}/{label}: round {run['round']} at concurrency "
                               f"{run['concurrency']}: the gate did not hold its wave: {gate}, "
                               f"{run.get('first_tokens_before_release')} first tokens "
                               f"before the release")
            if s["variant"] == "plugin" and tp > 1:
                out += bench_vllm.fusion_problems(f"{name}/{label}", s["sites_per_range"],
                                                  want, tp)
    return out


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    cpu = on_cpu()
    p = setup.engine_parser(__doc__)
    p.add_argument("--concurrency", nargs="+", type=int, default=[2, 4] if cpu else [8, 32])
    p.add_argument("--num-prompts", nargs="+", type=int, default=None,
                   help="prompts per run, one per concurrency (default: the concurrency, "
                        "one wave of requests sent together)")
    p.add_argument("--input-len", type=int, default=16 if cpu else 1000)
    p.add_argument("--output-len", type=int, default=4 if cpu else 100)
    p.add_argument("--arrival", choices=("gated", "burst", "staggered"), default=ARRIVAL,
                   help="gated: a run's requests all at once, held at the server until its "
                        "first wave (up to --concurrency) is in, then released together "
                        "(serve_gate.py; times to first token and rates from the release); "
                        "burst: all at once, admitted --concurrency at a time; staggered: "
                        "where they outnumber the concurrency, sent evenly apart (STAGGER "
                        "times a request's life over the concurrency, from the untimed runs; "
                        "runs take longer than wave_plan counts)")
    p.add_argument("--max-num-scheduled-tokens", type=int, default=0,
                   help="the servers' token budget a step, vLLM's max_num_scheduled_tokens "
                        "(0: vLLM's, --max-num-batched-tokens); not in the compile key, so "
                        "the servers still load the offline compiles")
    p.add_argument("--server-arg", action="append", default=[], metavar="FLAG",
                   help="a flag added to every server's command line, one token each "
                        "(--server-arg=--enable-logging-iteration-details logs every "
                        "scheduler step); in the results' settings")
    p.add_argument("--num-warmups", type=int, default=None,
                   help="requests sent at once to warm a server up before its turn (default: "
                        "the first concurrency; 0: none)")
    p.add_argument("--repeats", type=int, default=wave_plan.MIN_ROUNDS,
                   help="rounds at least (fewer than 6 give no 95 %% interval)")
    p.add_argument("--max-repeats", type=int, default=24, help="rounds at most")
    p.add_argument("--precision", type=float, default=0.004,
                   help="stop once every primary ratio's 95 %% interval is within this "
                        "fraction of its median")
    p.add_argument("--settle-s", type=float, default=None,
                   help="pause before each server's runs since the turn before (default "
                        "0.2 s; 1.2 s at TP > 1 where the server before is not parked)")
    p.add_argument("--start-timeout-s", type=float, default=900)
    p.add_argument("--check", choices=("none", "records"), default="none",
                   help="exit 1 unless every server ran every request and the plugin's records "
                        "show every site fused per rank and range")
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    p.add_argument("--name", default=None,
                   help="results file name (default serve_<dev>_tp<N>.json)")
    a = p.parse_args(argv)
    setup.check_engine_args(p, a)
    # One wave of requests a run: sent together, their prefills are laid out by the token
    # budget; with more, each later request starts as an earlier one ends, and whether two
    # of them share a prefill step turns on a millisecond of turnaround (median TPOT at 8
    # took one of two values 4 % apart from run to run: docs/vllm_benchmark.md, section 9).
    a.num_prompts = a.num_prompts or list(a.concurrency)
    if a.num_warmups is None:
        a.num_warmups = a.concurrency[0]
    if len(a.num_prompts) != len(a.concurrency):
        p.error("--num-prompts: one per --concurrency")
    if a.input_len + a.output_len > a.max_model_len or max(a.concurrency) > a.max_num_seqs:
        p.error(f"the requests need max_model_len >= {a.input_len + a.output_len} and "
                f"max_num_seqs >= {max(a.concurrency)}")
    if a.max_num_scheduled_tokens and not \
            max(a.concurrency) < a.max_num_scheduled_tokens <= setup.least_step_tokens(a):
        p.error(f"--max-num-scheduled-tokens {a.max_num_scheduled_tokens}: over the highest "
                f"concurrency ({max(a.concurrency)}), a prefill beside its decodes, and at "
                f"most every model's max_num_batched_tokens ({setup.least_step_tokens(a)})")
    return a


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    run = vllm_run.begin(args, argv, "benchmarks/vllm/bench_serve.py", args.reserve_s, START)
    result: dict[str, Any] = {
        **run.head("bench_serve"),
        "server_environment": server_env(args, inherited=True),
        "method": "vllm bench serve (vllm.benchmarks.serve), random dataset, ignore_eos, "
                  "temperature 0, request rate inf, bounded by max_concurrency; TPOT/ITL/TTFT "
                  "as it computes them from the streamed responses (ms), output throughput "
                  "in tokens/s; with arrival 'gated' each run's first wave held at the server "
                  "until all of it is in, TTFT, end-to-end latency and the rates counted from "
                  "its release (vllm bench serve's own under 'with_hold')",
        "order": "every server once per round, one at a time, the others idle (parked on "
                 "CPUs of their own where pinned); rounds in pairs (forward, backward), each "
                 "pair starting one server later; per turn a warm-up, the pause since the "
                 "turn before, then every concurrency with the round's prompts (seed = the "
                 "round), this process's garbage collector held off during each run",
        "comparison_method": "median over rounds of the per-round ratio server / off (for "
                             "output_throughput > 1 is faster); 95 % interval from order "
                             "statistics",
        "models": []}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / (args.name or f"serve_{result['device']}_tp{args.tp}.json")
    want, skipped = setup.runnable(args)
    groups = {name: setup.labels(want, args.aa) for name in args.models}

    def wave_time(w: wave_plan.Wave) -> wave_plan.WaveTime:
        return wave_plan.serve_wave_time(
            w, setup.MODELS[w.model], args.tp, args.dtype, args.repeats, args.concurrency,
            args.num_prompts, args.output_len,
            wave_plan.SETTLE_S if args.settle_s is None else args.settle_s)

    def stop_all(servers: list[Server]) -> None:
        for s in servers:  # SIGINT to every server first: they shut down side by side
            if s.proc is not None and s.proc.poll() is None:
                s.proc.send_signal(signal.SIGINT)
        until = time.monotonic() + vllm_run.STOP_S
        for s in servers:
            stop(s, timeout=max(until - time.monotonic(), 0.1), signalled=True)

    return vllm_run.execute(run, args, result, path, groups,
                            lambda m, labels: plan(args, setup.MODELS[m], run.root, run.shape,
                                                   labels),
                            start_all, functools.partial(run_model, args, skipped, {}),
                            stop_all, wave_time, problems, "serving", PRIMARY,
                            lambda r: [*vllm_report.serving_aa_lines(r),
                                       *vllm_report.serving_lines(r)])


if __name__ == "__main__":
    vllm_run.main_then_exit(main)
