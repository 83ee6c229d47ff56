"""What a vLLM user sees offline: vLLM's own ``LLM`` API, with the all-reduce + RMSNorm
fusion off, with vLLM's in-tree fusion and with this plugin, and an A/A pair: a second
engine of one variant (``--aa``, default ``off``), measured exactly as the variants are.

As ``vllm bench latency`` does, the models have real shapes and dummy weights (a
``config.json`` written at run time, no checkpoint) and token-id prompts.  Per engine
and batch size, vLLM's time per output token (TPOT) from the engine core's timestamps
(``RequestOutput.metrics``: (last token - first token) / (tokens - 1), the median over
the batch's requests) of one ``LLM.generate`` call of ``--decode-steps + 1`` greedy
tokens, and the engine's prefill time of one ``--prefill-len`` prompt (first token -
scheduled); the calls' wall-clock latencies are kept as secondary numbers.

How the spread between identical engines is kept out (docs/vllm_benchmark.md has the
reasoning):

* every engine runs in its own process (``vllm_engine_host.py``); they start side by side
  and are then measured one at a time while the others wait idle;
* each engine compiles into its own cache, with the Inductor kernel choices pinned
  (``--kernel-choice``), and the kernels and picks it compiled are read back and compared
  between engines (``compiled_digest.py``);
* every engine has the same KV cache size, whatever else holds memory on the GPU;
* rounds: every engine once per round, in an order that alternates direction and
  rotates (``paired_ratios.round_order``), each turn starting with an untimed call and
  after a pause that lets the previous engine's workers stop spinning; a comparison is
  the median of per-round ratios, with a distribution-free confidence interval; rounds
  go on until every interval is within ``--precision`` or the time is up;
* the GPUs' clocks (NVML) during every call, the engine processes' CPU time and
  involuntary context switches, and the host's steal time are recorded.

The A/A ratio is reported beside every comparison, and the summary says first whether it
stayed inside [0.99, 1.01] everywhere.  A variant that cannot run here (vLLM's in-tree
fusion at TP=1, without FlashInfer, on the CPU) is recorded as not run, with the reason.

    python benchmarks/vllm/bench_vllm.py --tp 2 --out-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import random
import shutil
import statistics
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any, Optional

# This part's modules, and the ones the benchmarks share (bench_common.py).
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import compiled_digest  # noqa: E402
import cpu_placement  # noqa: E402
import paired_ratios  # noqa: E402
import vllm_models  # noqa: E402
import vllm_report  # noqa: E402
import vllm_run  # noqa: E402
import vllm_setup as setup  # noqa: E402
import wave_plan  # noqa: E402
from gpu_telemetry import ClockSampler  # noqa: E402
from vllm_engine_host import EngineError, EngineProcess  # noqa: E402

from fusion_pass import records  # noqa: E402
from fusion_pass.tools.demo import ModelSpec, on_cpu  # noqa: E402

START = time.monotonic()
"""When the run began: its --budget-s counts from here."""

MODELS = setup.MODELS
DECODE_METHOD = ("tpot_b<B>: vLLM's time per output token, (last_token_ts - first_token_ts) / "
                 "(generated tokens - 1) from the engine core's timestamps "
                 "(RequestOutput.metrics), the median over the requests of one LLM.generate "
                 "call of B prompts of input_len tokens, decode_steps + 1 greedy tokens, "
                 "ignore_eos; latency_b<B>: that call's wall-clock time")
PREFILL_METHOD = ("prefill: the engine core's first_token_ts - scheduled_ts of one prompt of "
                  "prefill_len tokens (output_len 1); latency_prefill: that call's wall-clock "
                  "time")
PRIMARY = vllm_report.OFFLINE_PRIMARY
"""Metrics named so are the comparison's numbers; latencies (wall clock) are secondary."""
FIRST_PREFILL = vllm_report.FIRST_PREFILL


# -- what runs ----------------------------------------------------------------------

@dataclasses.dataclass
class Engine:
    label: str
    variant: str
    model: ModelSpec
    work: Path
    proc: EngineProcess
    not_run_reason: Optional[str] = None

    @property
    def name(self) -> str:
        return self.proc.label

    @property
    def pid(self) -> Optional[int]:
        """The engine's frontend process (its engine core and workers are below it)."""
        return self.proc.proc.pid if self.proc.proc is not None else None

    def records(self) -> list[records.GraphRecord]:
        d = self.work / "records"
        return records.read_dir(str(d)) if d.is_dir() else []


def plan(args: argparse.Namespace, spec: ModelSpec, root: Path, shape: setup.EngineShape,
         labels: list[str]) -> list[Engine]:
    """The engines ``labels`` of a model (a wave), not started: each under
    ``root/<model>/<label>``."""
    model = setup.write_model(spec, root / spec.name / "model", args.dtype, args.weights)
    out = []
    for label in labels:
        work = root / spec.name / label
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        variant = setup.label_variant(label)
        kw = setup.engine_kwargs(shape, spec, model, variant,
                                 work / "dumps" if args.dump else None)
        out.append(Engine(label, variant, spec, work, EngineProcess(
            f"{spec.name}/{label}", variant, kw, setup.engine_env(work, shape), work)))
    return out


def start_all(engines: list[Engine], parallel: int, timeout: float, deadline: float) -> None:
    """Start the engines, ``parallel`` at a time (0: all), and wait until each is up, at
    most ``timeout`` and not past ``deadline``; an engine that fails or is late is
    recorded as not run (the others go on)."""
    step = parallel if parallel > 0 else max(len(engines), 1)
    for i in range(0, len(engines), step):
        batch = engines[i:i + step]
        for e in batch:
            log(f"starting {e.proc.label} ({e.variant})")
            e.proc.start()
        for e in batch:
            try:
                ready = e.proc.wait_ready(max(min(timeout, deadline - time.monotonic()), 1))
                log(f"{e.proc.label} up in {ready['seconds_to_start']:.1f} s")
            except EngineError as exc:
                e.not_run_reason = e.proc.failure(exc)[:2000]
                log(f"{e.proc.label} not run: {e.not_run_reason}")
                e.proc.kill()


# -- measuring ----------------------------------------------------------------------

def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def points(args: argparse.Namespace, vocab: int) -> list[tuple[str, list[list[int]], int]]:
    """Every timed call of an engine's turn: (key, prompts, max_tokens)."""
    out = [(f"decode_b{b}", prompts(b, args.input_len, vocab, seed=b), args.decode_steps + 1)
           for b in args.batches]
    if args.prefill_len:
        out.append(("prefill", prompts(1, args.prefill_len, vocab, seed=0), 1))
    return out


def metrics_of(key: str, r: dict[str, Any]) -> dict[str, Optional[float]]:
    """The per-round numbers of one call, in ms."""
    def med(xs: list[Optional[float]]) -> Optional[float]:
        return 1e3 * statistics.median(xs) if xs and None not in xs else None

    if key == "prefill":
        return {"prefill": med(r["prefill_s"]), "latency_prefill": 1e3 * r["seconds"]}
    b = key[len("decode_b"):]
    return {f"tpot_b{b}": med(r["tpot_s"]), f"latency_b{b}": 1e3 * r["seconds"]}


def median_call(calls: list[dict[str, Any]]) -> dict[str, Any]:
    """One call's result from several of the same prompts (``--prefill-calls``): the
    median of their prefill times and of their wall-clock times, the host's telemetry of
    the call whose wall-clock time is the median (the upper one of an even count)."""
    if len(calls) == 1:
        return calls[0]
    mid = sorted(calls, key=lambda r: r["seconds"])[len(calls) // 2]
    return {**mid, "seconds": statistics.median(r["seconds"] for r in calls),
            "prefill_s": [statistics.median(r["prefill_s"][0] for r in calls)]}


class Measurement:
    """Everything measured on a model's engines: per-round metrics, per-call telemetry,
    per-turn GPU snapshots, the greedy ids of the first round."""

    def __init__(self, engines: list[Engine]) -> None:
        self.per_round: dict[str, dict[str, list[Optional[float]]]] = {e.label: {} for e in engines}
        self.calls: dict[str, dict[str, dict[str, list[Any]]]] = {e.label: {} for e in engines}
        self.turns: dict[str, list[dict[str, Any]]] = {e.label: [] for e in engines}
        self.ids: dict[str, dict[str, list[list[int]]]] = {e.label: {} for e in engines}
        self.deterministic = {e.label: True for e in engines}
        self.rounds = 0
        self.stopped_because = "not measured"

    def keep_whole_rounds(self, warmup: int) -> None:
        """Drop what a round cut short by a failure measured (ratios pair rounds): its
        metrics, its calls' telemetry and its turns (which count ``warmup`` rounds too)."""
        for metrics in self.per_round.values():
            for k in metrics:
                del metrics[k][self.rounds:]
        for calls in self.calls.values():
            for fields in calls.values():
                for k in fields:
                    del fields[k][self.rounds:]
        for turns in self.turns.values():
            del turns[warmup + self.rounds:]

    def keep_ids(self, label: str, key: str, ids: list[list[int]]) -> None:
        if key not in self.ids[label]:
            self.ids[label][key] = ids
        elif self.ids[label][key] != ids:
            self.deterministic[label] = False

    def add(self, label: str, key: str, r: dict[str, Any], gpu: Optional[dict[str, Any]]) -> None:
        for m, v in metrics_of(key, r).items():
            self.per_round[label].setdefault(m, []).append(v)
        c = self.calls[label].setdefault(key, {"seconds": [], "engine_cpu_load": [],
                                               "involuntary_switches": [], "steal_s": [],
                                               "sm_mhz": [], "clock_reasons": []})
        host = r["host"]
        c["seconds"].append(round(r["seconds"], 6))
        c["engine_cpu_load"].append(round(host["engine_cpu_s"] / r["seconds"], 3))
        c["involuntary_switches"].append(host["engine_involuntary_switches"])
        c["steal_s"].append(round(host["steal_s"], 3))
        c["sm_mhz"].append(None if gpu is None or gpu["sm_mhz"] is None else round(gpu["sm_mhz"]))
        c["clock_reasons"].append(None if gpu is None else gpu["reasons"])


def call_limit(deadline: float) -> float:
    """How long one call may go unanswered: until 10 s past the time the model measures
    until (:func:`vllm_run.limit_now`: its deadline, its reach while short of its minimum
    rounds, its first round's latest until that one ends), so that a hung engine is
    killed, and the rounds before it written, before the step's own time limit (10 s past
    ``--latest-s`` in ``gpu_vllm.sh``) stops everything."""
    return min(600.0, max(deadline - time.monotonic(), 0.0) + 10.0)


def measure(engines: list[Engine], args: argparse.Namespace, vocab: int,
            clocks: ClockSampler, deadline: float, m: Optional[Measurement] = None,
            seats: Optional[cpu_placement.Seats] = None,
            reach_at: Optional[float] = None, first_at: Optional[float] = None) -> Measurement:
    """Warm-up rounds, then timed rounds in :func:`paired_ratios.round_order` until every
    primary ratio is within ``--precision`` (after ``--repeats`` rounds, checked after
    each pair of rounds), ``--max-repeats``, or ``deadline`` (``reach_at`` while fewer than
    ``--repeats`` rounds are timed, ``first_at`` until one is: :func:`vllm_run.round_fits`);
    into ``m`` where given (what it holds survives a failure).  Each turn: the engine on its
    CPUs (``seats``; the others parked), an untimed call, the pause since the turn before,
    the timed calls.  The first timed round is expected to take the warm-up's time over
    :data:`wave_plan.FIRST_ROUND`, as the plan counts it (an engine's first calls are the
    slower ones)."""
    pts = points(args, vocab)
    warm = prompts(1, args.input_len, vocab, seed=7)
    m = m if m is not None else Measurement(engines)
    seats = seats if seats is not None else cpu_placement.Seats({}, {})
    settle = vllm_run.settle_s(args.settle_s, args.tp, seats)
    round_s = 0.0
    total = args.warmup + args.max_repeats
    last_turn: Optional[float] = None
    clocks.start()
    try:
        for rnd in range(total):
            timed = rnd >= args.warmup
            n = rnd - args.warmup + 1 if timed else 0
            t_round = time.monotonic()
            # Another round only where one fits; none at all where start-up took the time
            # (the step's own limit would cut it, and with it this model's results).
            done = max(rnd - args.warmup, 0)
            if not vllm_run.round_fits(t_round, round_s if timed else 0.0, deadline, reach_at,
                                       done, args.repeats, first_at):
                m.stopped_because = "time budget"
                break
            until = vllm_run.limit_now(deadline, reach_at, done, args.repeats, first_at)
            for e in paired_ratios.round_order(engines, rnd):
                seats.take(e.name)
                turn = {"round": rnd, "before": clocks.snapshot()}
                # An untimed call first: the engine's workers awake, its caches warm.
                e.proc.generate(warm, 2, timeout=call_limit(until))
                if last_turn is not None:
                    time.sleep(max(settle - (time.monotonic() - last_turn), 0.0))
                for key, batch, max_tokens in pts:
                    t0 = time.monotonic()
                    calls = [e.proc.generate(batch, max_tokens, timeout=call_limit(until))
                             for _ in range(args.prefill_calls if key == "prefill" else 1)]
                    gpu = clocks.window(t0, time.monotonic())
                    for r in calls:
                        m.keep_ids(e.label, key, r["ids"])
                    if timed:
                        m.add(e.label, key, median_call(calls), gpu)
                        if len(calls) > 1:
                            m.calls[e.label][key].setdefault("prefill_each_ms", []).append(
                                [round(1e3 * r["prefill_s"][0], 3) for r in calls])
                            # What one call a turn would have measured, in the same rounds.
                            m.per_round[e.label].setdefault(FIRST_PREFILL, []).append(
                                1e3 * calls[0]["prefill_s"][0])
                last_turn = time.monotonic()
                seats.leave(e.name)
                turn["after"] = clocks.snapshot()
                m.turns[e.label].append(turn)
            took = time.monotonic() - t_round
            round_s = max(round_s, took if timed else took / wave_plan.FIRST_ROUND)
            log(f"{engines[0].model.name}: round {rnd + 1}/{args.warmup}+"
                f"{args.repeats}..{args.max_repeats}{' (warm-up)' if not timed else ''} "
                f"in {time.monotonic() - t_round:.1f} s")
            if not timed:
                continue
            m.rounds = n
            # Checked after whole pairs of rounds (forward and backward).
            if n >= args.repeats and (n % 2 == 0 or n == args.max_repeats):
                cmp = paired_ratios.compare(m.per_round, setup.baseline(m.per_round),
                                            setup.aa_pair(args.aa, m.per_round))
                primary = {k: {mm: s for mm, s in c.items() if mm.startswith(PRIMARY)}
                           for k, c in cmp.items()}
                if paired_ratios.precise_enough(primary, args.precision):
                    m.stopped_because = f"precise: every primary interval within " \
                                        f"{100 * args.precision:.2g} %"
                    break
        else:
            m.stopped_because = "max rounds"
    finally:
        clocks.stop()
    return m


# -- summaries ----------------------------------------------------------------------

def engine_summary(m: Measurement, label: str) -> dict[str, Any]:
    """Medians over rounds of an engine's metrics and of its calls' telemetry."""
    def med(xs: list[Any]) -> Optional[float]:
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    points_ = {k: med(v) for k, v in m.per_round[label].items()}
    calls = {k: {"engine_cpu_load": med(c["engine_cpu_load"]),
                 "involuntary_switches": med(c["involuntary_switches"]),
                 "steal_s": med(c["steal_s"]), "sm_mhz": med(c["sm_mhz"]),
                 "clock_reasons": sorted({r for rs in c["clock_reasons"] if rs for r in rs})}
             for k, c in m.calls[label].items()}
    return {"ms": points_, "calls": calls}


def sites_per_range(graphs: list[records.GraphRecord]) -> dict[str, dict[str, Any]]:
    """Per rank and compiled token range: graphs, all-reduce sites, fused sites, their
    paths and the reasons of those left unfused, from the plugin's records.  A graph
    taken from a compile cache reports its fused sites when they first run; its
    site total is the one recorded when it was compiled."""
    out: dict[str, dict[str, Any]] = {}
    for g in graphs:
        r = out.setdefault(f"rank{g.rank}", {}).setdefault(g.token_range, {
            "graphs": 0, "sites": 0, "fused": 0, "paths": Counter(), "unfused_reasons": Counter(),
            "from_cache": 0})
        r["graphs"] += 1
        r["sites"] += g.total if g.source == "cache" and g.total is not None else len(g.sites)
        r["fused"] += g.fused
        r["from_cache"] += g.source == "cache"
        r["paths"].update(s.path for s in g.sites)
        r["unfused_reasons"].update(s.reason for s in g.sites if not s.fused)
    for ranges in out.values():
        for r in ranges.values():
            r["paths"], r["unfused_reasons"] = dict(r["paths"]), dict(r["unfused_reasons"])
    return out


def fusion_summary(engine: Engine, settings: dict[str, Any], tp: int) -> dict[str, Any]:
    """What the plugin's records say about an engine's compiled graphs."""
    per_range = sites_per_range(engine.records())
    out: dict[str, Any] = {
        "sites_per_range": per_range,
        # Every recorded site fused (a range past vLLM's sequence-parallel threshold
        # has no all-reduce left to record).
        "all_fused": any(r["sites"] for ranges in per_range.values() for r in ranges.values())
        and all(r["fused"] == r["sites"] for ranges in per_range.values()
                for r in ranges.values())}
    compiled = settings["compilation"]["compile_ranges"]
    if engine.variant != "off" and compiled and not on_cpu():
        # A range the pass skipped (past the backend's size limit) has no records.
        out["ranges_without_records"] = {
            f"rank{r}": [c for c in compiled if c not in per_range.get(f"rank{r}", {})]
            for r in range(tp)}
    if engine.variant == "in_tree":
        out["in_tree_fused_sites"] = sum(r["paths"].get(records.IN_TREE, 0)
                                         for ranges in per_range.values() for r in ranges.values())
    return out


def compare_tokens(ids: dict[str, dict[str, list[list[int]]]]) -> dict[str, Any]:
    """Per timed call: whether every engine generated the same greedy token ids, and
    for each engine against ``off`` the sequences that differ and where."""
    labels = list(ids)
    ref = "off" if "off" in ids else labels[0]
    out: dict[str, Any] = {"reference": ref, "identical": True, "calls": {}}
    for key in ids[ref]:
        call: dict[str, Any] = {}
        for v in labels:
            if v == ref or key not in ids[v]:
                continue
            a, b = ids[ref][key], ids[v][key]
            diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
            first = [next(j for j, (p, q) in enumerate(zip(a[i], b[i])) if p != q) if
                     len(a[i]) == len(b[i]) and a[i] != b[i] else 0 for i in diff]
            call[v] = {"identical": a == b, "sequences": len(a), "sequences_differing": len(diff),
                       "first_differing_position": min(first) if first else None}
            out["identical"] &= a == b
        out["calls"][key] = call
    return out


def digests(engines: list[Any]) -> dict[str, Any]:
    """Each engine's compiled kernels and picks, and how they compare with the baseline's
    (the A/A twin's with its variant's)."""
    found = {e.label: compiled_digest.scan(e.work / "cache") for e in engines
             if e.not_run_reason is None}
    out: dict[str, Any] = {}
    base = setup.baseline(found) if found else "off"
    for label, f in found.items():
        out[label] = {"digest": compiled_digest.summary(f)}
        ref = setup.label_variant(label) if label.endswith(setup.AA_SUFFIX) else base
        if ref != label and ref in found:
            out[label][f"vs_{ref}"] = compiled_digest.compare(f, found[ref])
    return out


# -- the run ------------------------------------------------------------------------

def log(msg: str) -> None:
    print(f"bench_vllm: {msg}", file=sys.stderr, flush=True)


def run_model(args: argparse.Namespace, skipped: dict[str, str], engines: list[Engine],
              deadline: float, clocks: ClockSampler,
              seats: Optional[cpu_placement.Seats] = None,
              reach_at: Optional[float] = None,
              first_at: Optional[float] = None) -> dict[str, Any]:
    spec = engines[0].model if engines else None
    assert spec is not None
    live = [e for e in engines if e.not_run_reason is None]
    result: dict[str, Any] = {
        "model": dataclasses.asdict(spec), "expected_sites_per_range": spec.sites(),
        "max_num_batched_tokens": vllm_models.step_tokens(spec.name,
                                                          args.max_num_batched_tokens),
        "variants": {v: {"run": any(e.variant == v for e in live), "description":
                         setup.DESCRIBE[v]} for v in args.variants
                     if v in skipped or any(e.variant == v for e in engines)},
        "engines": {}}
    for v, why in skipped.items():
        result["variants"][v]["not_run_reason"] = why
    for e in engines:
        # A variant ran where any of its engines did (its A/A twin runs it too).
        if e.not_run_reason is not None and not result["variants"][e.variant]["run"]:
            result["variants"][e.variant].setdefault("not_run_reason", e.not_run_reason)
    m = Measurement(live)
    if live:
        try:
            measure(live, args, spec.vocab, clocks, deadline, m, seats, reach_at, first_at)
        except EngineError as exc:
            traceback.print_exc()
            m.stopped_because = f"an engine failed: {exc}"
            m.keep_whole_rounds(args.warmup)
    aa = setup.aa_pair(args.aa, m.per_round)
    cmp = paired_ratios.compare(m.per_round, setup.baseline(m.per_round), aa)
    result["rounds"] = {"warmup": args.warmup, "timed": m.rounds,
                        "stopped_because": m.stopped_because}
    result["comparisons"] = cmp
    result["aa"] = paired_ratios.aa_verdict(cmp, "/".join(aa) if aa else None, PRIMARY)
    digest = digests(engines)
    for e in engines:
        entry: dict[str, Any] = {"variant": e.variant, "run": e.not_run_reason is None}
        if e.not_run_reason is not None:
            entry["not_run_reason"] = e.not_run_reason
        elif e.proc.ready is not None:
            settings = e.proc.ready["settings"]
            entry.update({"seconds_to_start": round(e.proc.ready["seconds_to_start"], 1),
                          "engine": settings, **engine_summary(m, e.label),
                          "deterministic": m.deterministic[e.label],
                          "compiled": digest.get(e.label), "turns": m.turns[e.label],
                          "per_round": m.per_round[e.label], "calls_raw": m.calls[e.label],
                          "fusion": fusion_summary(e, settings, args.tp)})
        result["engines"][e.label] = entry
    for v, r in result["variants"].items():
        # The variant's records: its own engine's, or its A/A twin's where only that one
        # came up (the engine labelled as the variant may have been late or failed).
        ran = [lb for lb in (v, v + setup.AA_SUFFIX) if "fusion" in result["engines"].get(lb, {})]
        if r["run"] and ran:
            r.update(result["engines"][ran[0]]["fusion"])
    result["tokens"] = compare_tokens(m.ids) if live else {"identical": None}
    result["token_ids"] = {lb: {k: ids for k, ids in calls.items() if len(ids) <= args.keep_ids}
                           for lb, calls in m.ids.items()}
    return result


def fusion_problems(where: str, per_rank: dict[str, Any], want: int, tp: int) -> list[str]:
    """A plugin engine's records against the model: records from every rank, and in every
    compiled range ``want`` sites, all fused."""
    out = []
    missing = sorted(set(range(tp)) - {int(k[4:]) for k in per_rank})
    if missing:
        out.append(f"{where}: no records from rank(s) {missing}")
    for rank, ranges in per_rank.items():
        for rng, r in ranges.items():
            if r["fused"] != r["sites"] or r["sites"] != want:
                out.append(f"{where}: {rank} range {rng}: {r['fused']} of {r['sites']} "
                           f"site(s) fused, {want} expected ({r['unfused_reasons']})")
    return out


def problems(result: dict[str, Any], tp: int, check: str) -> list[str]:
    """What ``--check`` fails on: a rank or compiled range of a plugin engine with a site
    unfused or a site count other than the model's; with ``all``, greedy tokens that
    differ between engines."""
    out = []
    for m in result["models"]:
        name, want = m["model"]["name"], m["expected_sites_per_range"]
        plugin = m["variants"].get("plugin", {})
        if "plugin" in m["variants"] and not plugin["run"]:
            out.append(f"{name}: the plugin variant did not run: {plugin.get('not_run_reason')}")
        for label, e in m["engines"].items():
            if e["variant"] == "plugin" and e["run"] and tp > 1:
                out += fusion_problems(f"{name}/{label}", e["fusion"]["sites_per_range"],
                                       want, tp)
        if check == "all" and m["tokens"]["identical"] is False:
            out.append(f"{name}: greedy tokens differ between engines: {m['tokens']['calls']}")
    return out


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    cpu = on_cpu()
    p = setup.engine_parser(__doc__)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64])
    p.add_argument("--decode-steps", type=int, default=8 if cpu else 32,
                   help="tokens generated per decode call, after the first")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens of the decode calls")
    p.add_argument("--prefill-len", type=int, default=128 if cpu else 2048,
                   help="0: no prefill measurement")
    p.add_argument("--prefill-calls", type=int, default=1,
                   help="timed prefill calls in each engine's turn, one after another: the "
                        "round's prefill and its latency are their medians, each call's "
                        "prefill kept (calls_raw.prefill.prefill_each_ms), the first's "
                        "compared too (first_call_prefill, secondary)")
    p.add_argument("--repeats", type=int, default=wave_plan.MIN_ROUNDS,
                   help="timed rounds at least (fewer than 6 give no 95 %% interval)")
    p.add_argument("--max-repeats", type=int, default=0,
                   help="timed rounds at most (0: 4 x --repeats)")
    p.add_argument("--precision", type=float, default=0.004,
                   help="stop once every primary ratio's 95 %% interval is within this "
                        "fraction of its median")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--settle-s", type=float, default=None,
                   help="pause before each engine's timed calls since the turn before "
                        "(default 0.2 s; 1.2 s at TP > 1 where the engine measured before "
                        "is not parked: its workers poll their queue in a busy loop for 1 s "
                        "after its last message)")
    p.add_argument("--start-timeout-s", type=float, default=900)
    p.add_argument("--check", choices=("none", "records", "all"), default="none",
                   help="exit 1 unless the plugin's records show, per rank and compiled range, "
                        "every expected site fused (records), and the engines' greedy tokens "
                        "are identical (all)")
    p.add_argument("--dump", action="store_true",
                   help="vLLM's debug_dump_path under each engine's folder (GPU)")
    p.add_argument("--keep-caches", action="store_true",
                   help="keep the engines' compile caches in --work-dir (bench_serve.py then "
                        "starts its servers from them)")
    p.add_argument("--keep-ids", type=int, default=8,
                   help="keep the token ids of calls with at most this many sequences in the JSON")
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    p.add_argument("--name", default=None, help="results file name (default vllm_<dev>_tp<N>.json)")
    a = p.parse_args(argv)
    a.max_repeats = max(a.max_repeats or 4 * a.repeats, a.repeats)
    longest = max(a.prefill_len, a.input_len + a.decode_steps + 1)
    if longest > a.max_model_len or max(a.batches) > a.max_num_seqs or \
            max(a.prefill_len, max(a.batches) * a.input_len) > setup.least_step_tokens(a):
        p.error(f"the calls need max_model_len >= {longest}, max_num_seqs >= {max(a.batches)} "
                f"and max_num_batched_tokens >= {max(a.prefill_len, max(a.batches) * a.input_len)}")
    if a.decode_steps < 1:
        p.error("--decode-steps must be at least 1")
    if a.prefill_calls < 1:
        p.error("--prefill-calls must be at least 1")
    setup.check_engine_args(p, a)
    return a


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    run = vllm_run.begin(args, argv, "benchmarks/vllm/bench_vllm.py", args.reserve_s, START)
    result: dict[str, Any] = {
        **run.head("bench_vllm"),
        "engine_environment": {k: os.environ.get(k, v) for k, v in setup.FLASHINFER_ENV.items()},
        "decode_method": DECODE_METHOD, "prefill_method": PREFILL_METHOD,
        "order": "every engine once per round, one at a time, the others idle (parked on "
                 "CPUs of their own where pinned); rounds in pairs (forward, backward), each "
                 "pair starting one engine later; an untimed call, then a pause of settle_s "
                 "since the turn before, before each turn's timed calls",
        "comparison_method": "median over rounds of the per-round ratio engine / off; 95 % "
                             "interval for the median from order statistics",
        "sites_note": "sites per rank and compiled token range, summed over the graphs the "
                      "plugin's pass compiled there (vLLM splits the model at attention)",
        "models": []}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / (args.name or f"vllm_{result['device']}_tp{args.tp}.json")
    want, skipped = setup.runnable(args)
    groups = {name: setup.labels(want, args.aa) for name in args.models}

    def wave_time(w: wave_plan.Wave) -> wave_plan.WaveTime:
        return wave_plan.offline_wave_time(
            w, MODELS[w.model], args.tp, args.dtype, args.repeats, args.warmup,
            args.decode_steps + 1, wave_plan.SETTLE_S if args.settle_s is None else args.settle_s)

    def stop(engines: list[Engine]) -> None:
        for e in engines:  # side by side: each asked first, then each waited for
            e.proc.request_stop()
        until = time.monotonic() + vllm_run.STOP_S
        for e in engines:
            e.proc.wait_stopped(max(until - time.monotonic(), 0.1))
            if not args.keep_caches:
                shutil.rmtree(e.work / "cache", ignore_errors=True)

    return vllm_run.execute(run, args, result, path, groups,
                            lambda m, labels: plan(args, MODELS[m], run.root, run.shape, labels),
                            start_all, functools.partial(run_model, args, skipped), stop,
                            wave_time, problems, "offline", PRIMARY, vllm_report.offline_lines)


if __name__ == "__main__":
    vllm_run.main_then_exit(main)
