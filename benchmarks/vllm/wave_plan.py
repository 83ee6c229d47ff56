"""Which engines of a vLLM benchmark start together, and how long a run of them takes: each
engine's memory per GPU from the model's shapes, the memory the GPUs have free, the waves
that fit it, and the time of each wave and of a whole ``scripts/gpu_vllm.sh`` run (below).

A wave is the engines of one model (every variant and the A/A twin) that start, are
measured and stop together; the next wave starts once they are gone.  Nothing of a run is
measured while another of its engines starts, and the engines measured share the GPU only
with the others of their wave.  A model whose engines do not all fit is split into several
waves, each with the baseline and the A/A pair beside the variants compared with them
(every comparison is between engines of one wave).

What one engine holds on each GPU it uses: its weights (computed from the model's shapes,
``vllm_models.weight_bytes``, equal to what vLLM logs), its KV cache (fixed by
``kv_cache_memory_bytes``), and what vLLM logged for an engine started alone on one H200
(``benchmarks/results/dev/vllm_h200x1.log``, the ``Free memory on device ... Actual usage``
lines of the 8B-like model and dense-h2880): the peak activation, the memory outside
torch's allocator, the CUDA graphs and the process's CUDA context.  The logs of six engines
side by side (``gpu_vllm_*_run_h200x1/gpu_vllm.log.gz``) cannot separate these (each
engine's ``Graph capturing ... took`` is a difference of free memory while the others
allocate: -20.6 to 15.1 GiB), so they are not used.  Each GPU keeps :data:`MARGIN_FRACTION`
of its free memory free.

    python benchmarks/vllm/wave_plan.py --tp 2 --gpu-free-gib 79.18 79.18
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import paired_ratios
import vllm_models
import vllm_setup as setup
from vllm_models import ModelSpec

GIB = float(1 << 30)

CONTEXT_GIB = 0.51
"""Held by an engine's process before vLLM allocates (CUDA context, cuBLAS): "Free memory on
device (139.29/139.8 GiB) on startup" of an engine alone on one H200."""
ACTIVATION_GIB = 1.1
"""The forward pass's peak at ``max_num_batched_tokens`` 2048 (:data:`ACTIVATION_TOKENS`):
"1.01 GiB for peak activation" (8B-like), "1.1 GiB" (dense-h2880, GPT-OSS's hidden size and
vocabulary).  Most of it does not grow with the tokens (the sampler's logits over the
vocabulary, vLLM's buffers): a larger budget adds :func:`activation_bytes_per_token` for
each token above 2048."""
ACTIVATION_TOKENS = 2048


def activation_bytes_per_token(spec: ModelSpec, tp: int, dtype: str) -> int:
    """What one more token a step adds to the forward pass's peak on one rank: the MLP's
    gate-up output and its activated half alive together (3 x its width split over the
    ranks) beside four hidden-size tensors (the residual, its norm, the attention and MLP
    outputs).  Against what the engines held once measured on one H100
    (``waves[].gib_held_per_gpu``): counted in proportion to the budget (1.1 GiB per 2048
    tokens), the GPT-OSS stand-in's engines at 8192 were planned at 19.46 GiB and held 16.3
    (benchmarks/results/dev/gpu_vllm_h100x1_8b_step_2048); counted so, 16.69 against 16.2,
    and the 8B-like model's 23.18 against 22.6 (benchmarks/results/gpu_vllm_tp1_h100x1).
    Its engines held 1.4 GiB more each at 8192 than at 2048, where this count adds 0.7: the
    per-engine slack (:data:`SLACK_GIB`) covers the rest."""
    return (3 * spec.intermediate // tp + 4 * spec.hidden) * vllm_models.WIDTH[dtype]


NON_TORCH_GIB = 0.22
"""Outside torch's allocator (NCCL at TP=1, driver): "0.22 GiB for non-torch memory" (both)."""
GRAPHS_GIB = 0.21
"""CUDA graphs of batch sizes up to 128: "0.21 GiB for CUDAGraph memory" (8B-like), 0.17
(dense-h2880)."""
TP_COMM_GIB = 1.0
"""At TP > 1, per rank: NCCL's buffers, vLLM's custom all-reduce, and the plugin's
symmetric buffers or FlashInfer's workspace.  No TP > 1 run is logged yet: an allowance,
to be replaced by the first one's numbers."""
SLACK_GIB = 0.5
"""Per engine: what an engine alone did not show (allocator fragmentation beside other
engines, the sampler's temporaries at batch 64 of a 200k vocabulary)."""
MARGIN_FRACTION = 0.05
"""Of each GPU's free memory, kept free."""


@dataclasses.dataclass(frozen=True)
class Memory:
    """What one engine holds on each GPU it uses, GiB."""
    weights: float
    kv_cache: float
    activations: float = ACTIVATION_GIB
    non_torch: float = NON_TORCH_GIB
    cuda_graphs: float = GRAPHS_GIB
    context: float = CONTEXT_GIB
    tp_comm: float = 0.0
    slack: float = SLACK_GIB

    @property
    def total(self) -> float:
        return sum(dataclasses.astuple(self))

    def describe(self) -> dict[str, float]:
        return {**{k: round(v, 2) for k, v in dataclasses.asdict(self).items()},
                "total": round(self.total, 2)}


def engine_memory(spec: ModelSpec, tp: int, dtype: str, kv_tokens: int,
                  step_tokens: Optional[int] = None) -> Memory:
    """One engine of ``spec`` at ``tp`` ranks with a KV cache of ``kv_tokens`` tokens and a
    budget of ``step_tokens`` a step (default: the model's own,
    ``vllm_models.step_tokens``), per GPU."""
    step = vllm_models.step_tokens(spec.name, step_tokens)
    return Memory(weights=vllm_models.weight_bytes(spec, tp, dtype) / GIB,
                  kv_cache=kv_tokens * vllm_models.kv_bytes_per_token(spec, tp, dtype) / GIB,
                  activations=ACTIVATION_GIB + max(step - ACTIVATION_TOKENS, 0)
                  * activation_bytes_per_token(spec, tp, dtype) / GIB,
                  tp_comm=TP_COMM_GIB if tp > 1 else 0.0)


def gpu_free_gib(count: int) -> Optional[list[float]]:
    """The memory free on each of the first ``count`` GPUs this process may use, GiB, from
    NVML (no CUDA context of its own); None without NVML (the CPU build)."""
    try:
        import pynvml

        from gpu_telemetry import _indices

        pynvml.nvmlInit()
        return [pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).free / GIB
                for i in _indices(count)]
    except Exception:  # noqa: BLE001 - no NVML, no GPU: the waves are not sized
        return None


@dataclasses.dataclass
class Wave:
    """Engines that start, are measured and stop together: labels of one model."""
    model: str
    labels: list[str]
    gib: float
    """Per GPU: the engines' memory, and what runs beside the wave (the first only)."""
    after_beside: bool = False
    """Starts only once the job beside the first wave has ended (it would not fit beside it)."""

    def describe(self) -> dict[str, Any]:
        return {"model": self.model, "labels": self.labels, "gib_per_gpu": round(self.gib, 2),
                **({"after_beside": True} if self.after_beside else {})}


@dataclasses.dataclass
class Plan:
    """The waves of one benchmark's run, and what they were sized against."""
    waves: list[Wave]
    engine: dict[str, Memory]
    """Per model, one engine's memory per GPU."""
    free_gib: Optional[list[float]]
    """Each GPU's free memory when planned; None: not known (nothing sized)."""
    margin_gib: float
    beside_gib: float
    """Held on each GPU by a job beside the first wave (the end-to-end check's engines)."""
    unplanned: dict[str, str]
    """``model/label``: why it has no wave (it does not fit even beside the pair alone)."""

    @property
    def usable_gib(self) -> Optional[float]:
        return None if self.free_gib is None else min(self.free_gib) - self.margin_gib

    def describe(self) -> dict[str, Any]:
        return {"waves": [w.describe() for w in self.waves],
                "engine_gib_per_gpu": {m: e.describe() for m, e in self.engine.items()},
                "gpu_free_gib": None if self.free_gib is None else
                [round(x, 2) for x in self.free_gib],
                "margin_gib": round(self.margin_gib, 2), "beside_gib": round(self.beside_gib, 2),
                "usable_gib": None if self.usable_gib is None else round(self.usable_gib, 2),
                "unplanned": self.unplanned}

    def lines(self, what: str) -> list[str]:
        """The plan as text: what each engine takes, what the GPUs have, each wave."""
        if self.free_gib is None:
            room = "GPU memory not known (no NVML): one wave per model, not sized"
        else:
            room = (f"GPU free {', '.join(f'{x:.2f}' for x in self.free_gib)} GiB, margin "
                    f"{self.margin_gib:.2f}, usable {self.usable_gib:.2f} GiB per GPU"
                    + (f", {self.beside_gib:.2f} GiB beside the first wave"
                       if self.beside_gib else ""))
        out = [f"plan ({what}): {len(self.waves)} wave(s); {room}"]
        for m, e in self.engine.items():
            out.append(f"  {m}: {e.total:.2f} GiB per engine per GPU (weights {e.weights:.2f}, "
                       f"KV cache {e.kv_cache:.2f}, activations {e.activations:.2f}, "
                       f"other {e.total - e.weights - e.kv_cache - e.activations:.2f})")
        for i, w in enumerate(self.waves):
            out.append(f"  wave {i + 1}: {w.model} {', '.join(w.labels)}: "
                       f"{w.gib:.2f} GiB per GPU"
                       + (" (once the job beside it has ended)" if w.after_beside else ""))
        for k, why in self.unplanned.items():
            out.append(f"  NOT PLANNED {k}: {why}")
        return out


def keep_together(labels: Sequence[str]) -> list[str]:
    """The engines every wave of a model must hold: the baseline (what every variant is
    compared with) and the A/A pair (the twin and its variant)."""
    base = setup.baseline(labels)
    twins = [lb for lb in labels if lb.endswith(setup.AA_SUFFIX)]
    core = {base, *twins, *(setup.label_variant(t) for t in twins)}
    return [lb for lb in labels if lb in core]


def plan_waves(groups: dict[str, list[str]], engine: dict[str, Memory],
               free_gib: Optional[Sequence[float]], beside_gib: float = 0.0,
               margin_fraction: float = MARGIN_FRACTION) -> Plan:
    """The waves of ``groups`` (per model, its engines' labels, in order), each engine of a
    model taking ``engine[model].total`` on every GPU: a model's engines in one wave where
    they fit the usable memory (the free memory of the fullest GPU, less the margin; the
    first wave less ``beside_gib`` too), else split so that every wave holds
    :func:`keep_together` and as many of the others as fit.  Without ``free_gib`` one wave
    per model, not sized."""
    free = None if free_gib is None else [float(x) for x in free_gib]
    margin = 0.0 if free is None else margin_fraction * min(free)
    plan = Plan([], dict(engine), free, margin, beside_gib, {})
    for model, labels in groups.items():
        each = engine[model].total
        if free is None:
            plan.waves.append(Wave(model, list(labels), each * len(labels)))
            continue
        later = min(free) - margin  # nothing runs beside a wave but the first
        beside = beside_gib if not plan.waves else 0.0
        if each * len(labels) + beside <= later:
            plan.waves.append(Wave(model, list(labels), each * len(labels) + beside))
            continue
        core = keep_together(labels)
        rest = [lb for lb in labels if lb not in core]
        if each * (len(core) + bool(rest)) > later:
            why = (f"{len(core) + bool(rest)} engines of {each:.2f} GiB (the baseline and the A/A "
                   f"pair{' beside one variant' if rest else ''}) do not fit {later:.2f} GiB")
            plan.unplanned.update({f"{model}/{lb}": why for lb in labels})
            continue
        while rest:
            beside = beside_gib if not plan.waves else 0.0
            n = int((later - beside - each * len(core)) // each)
            wait = n < 1  # not even one variant beside the job: the wave starts after it
            if wait:
                beside, n = 0.0, int((later - each * len(core)) // each)
            take, rest = rest[:n], rest[n:]
            wave = [lb for lb in labels if lb in core or lb in take]
            plan.waves.append(Wave(model, wave, each * len(wave) + beside, wait))
    return plan


# -- time ------------------------------------------------------------------------------
# From the runs on one H200 at TP=1 (benchmarks/results/dev/gpu_vllm_*_run_h200x1) and on one
# H100 (benchmarks/results/dev/gpu_vllm_h100x1_waves); where the cards differ, the slower one's
# (the H100's rounds took 1.14-1.18 times the H200's), so that a plan holds on both; TP > 1 has
# no run yet: its allowances are stated as such.

SETUP_S = 30.0
"""FlashInfer's check beside the model-class answers: 16 and 28 s on one H200 (seventh run),
29-42 s on one H100 (``scripts/gpu_vllm.sh`` passes what it took, ``--elapsed-s``)."""
PLAN_S = 12.0
"""This plan, 8-11 s on one H100 (it reads the GPUs' memory and imports the model table),
and the summary at the end (under a second: it reads JSON only)."""
OFFLINE_UP_S = 70.0
"""A wave of offline engines compiling side by side, up: one model's three engines and the
end-to-end check's two, 51-52 s on one H100 (the first run in waves), 78-86 s on another
(benchmarks/results/dev/gpu_vllm_h100x1_one_prompt_a_step); 61-69 s for six engines and the
check's two on one H200 (sixth, seventh runs).  Planned short, a wave gets its start-up all
the same and the rounds of the waves after it go; planned long, concurrency 32 is cut."""
SERVE_UP_S = 55.0
"""A wave of servers loading the offline engines' compiles, up: 32-53 s for six (fourth to
seventh runs), 64 s for three on the slower H100."""
TP_UP_S = 10.0
"""More per wave at TP > 1 (NCCL, the custom all-reduce, symmetric memory): an allowance."""
STOP_S = 4.0
"""A wave's engines or servers stopped: 1-2 s in the runs' logs, at most ``vllm_run.STOP_S``
(8 s) before their process groups are killed."""
STEP_END_S = 5.0
"""A benchmark's last results written and its process gone."""
TP_STEP = 1.1
"""A decode step at TP > 1 against TP=1 at the same weights per GPU: the all-reduces of
every layer (an allowance)."""
SETTLE_S = 0.2
"""The pause before a turn where the engine measured before it is parked or at TP=1."""
WARM_UP_S = 0.3
"""A server's warm-up before its turn (a short burst at the first concurrency)."""
CLIENT_S = 0.2
"""``vllm bench serve``'s own time per run outside its measured duration (its prompts
sampled, its metrics computed): 21.9 s a round of three servers in the seventh run less
their runs' durations (13.4 s), their warm-ups and pauses."""
GATE_S = 0.1
"""A gated run's hold (``bench_serve``'s default arrival, ``serve_gate``): the pause, the
wave's way into the server, its margin (36 ms at 8, 84 at 32) and the release; on one H100
0.05 s a run at 8 and 0.11-0.13 s at 32."""


def offline_turn_s(spec: ModelSpec, tp: int, dtype: str, decode_tokens: int = 33) -> float:
    """One engine's turn of the offline benchmark (an untimed call, batch 1, 8, 32, 64 of
    ``decode_tokens`` tokens and one 2048-token prefill): linear in the weights a GPU
    reads per step, through the rounds of three engines on one H100 (3.8 s for the 8B-like
    model's 14.96 GiB, 3.3 s for the GPT-OSS stand-in's 10.81, each turn with 0.2 s of
    pause; one H200's seventh run: 3.3 and 2.9 s)."""
    w = vllm_models.weight_bytes(spec, tp, dtype) / GIB
    return (0.465 + 0.0402 * w) * decode_tokens / 33 * (TP_STEP if tp > 1 else 1.0)


def serve_run_s(spec: ModelSpec, tp: int, dtype: str, concurrency: int, prompts: int,
                output_len: int = 100) -> float:
    """One ``vllm bench serve`` run's measured duration: its prompts in waves of
    ``concurrency``, each wave as long as the logged ones (input 1000, output 100, one
    H100: a wave at concurrency 8 took 0.89 s for the 8B-like model and 0.69 s for the
    GPT-OSS stand-in, at 32 1.69 and 1.33 s; one H200: 0.75, 0.6, 1.5 and 1.22 s), linear in
    the weights and, between and beyond those, in the concurrency."""
    w = vllm_models.weight_bytes(spec, tp, dtype) / GIB
    at8, at32 = 0.182 + 0.0472 * w, 0.397 + 0.0863 * w
    wave = at8 + (at32 - at8) * (concurrency - 8) / 24
    return (-(-prompts // concurrency) * max(wave, 0.05) * output_len / 100
            * (TP_STEP if tp > 1 else 1.0))


@dataclasses.dataclass
class WaveTime:
    """A wave's planned seconds: engines up, untimed rounds, its timed rounds, stopped."""
    up: float
    first: float
    round: float
    rounds: int
    stop: float

    @property
    def total(self) -> float:
        return self.up + self.first + self.rounds * self.round + self.stop

    @property
    def least(self) -> float:
        """What the wave needs to have results at all: up, its untimed runs, one round."""
        return self.up + self.first + self.round + self.stop

    def describe(self) -> dict[str, Any]:
        return {"up_s": round(self.up, 1), "untimed_s": round(self.first, 1),
                "round_s": round(self.round, 2), "rounds": self.rounds,
                "total_s": round(self.total, 1)}


FIRST_ROUND = 1.6
"""An offline warm-up round against a timed one: the first calls after start took 1.6 times a
round (5.4 s against 3.3)."""


def offline_wave_time(wave: Wave, spec: ModelSpec, tp: int, dtype: str, rounds: int,
                      warmup: int = 1, decode_tokens: int = 33,
                      settle_s: float = SETTLE_S) -> WaveTime:
    """An offline wave: its engines compile side by side, ``warmup`` untimed rounds
    (:data:`FIRST_ROUND` times a round each), ``rounds`` rounds."""
    turn = offline_turn_s(spec, tp, dtype, decode_tokens) + settle_s
    rnd = turn * len(wave.labels)
    return WaveTime(OFFLINE_UP_S + (TP_UP_S if tp > 1 else 0.0), FIRST_ROUND * rnd * warmup,
                    rnd, rounds, STOP_S)


def serve_wave_time(wave: Wave, spec: ModelSpec, tp: int, dtype: str, rounds: int,
                    concurrency: Sequence[int], prompts: Sequence[int], output_len: int = 100,
                    settle_s: float = SETTLE_S) -> WaveTime:
    """A serving wave: its servers load the offline compiles and run the workload once
    untimed (``bench_serve.prime``), then ``rounds`` rounds, each server in turn warmed up
    and then run at every concurrency."""
    runs = sum(serve_run_s(spec, tp, dtype, c, n, output_len) + CLIENT_S + GATE_S
               for c, n in zip(concurrency, prompts))
    turn = max(WARM_UP_S, settle_s) + runs
    return WaveTime(SERVE_UP_S + (TP_UP_S if tp > 1 else 0.0), runs * len(wave.labels),
                    turn * len(wave.labels), rounds, STOP_S)


RUN_S = 515.0
"""``scripts/gpu_vllm.sh``'s steps' limits add up to this; a step that overruns its limit is
killed 10 s later, and the run stays within 540 s (nine minutes)."""
SLACK_S = 10.0
"""Kept out of the plan (a wave's deadline is its share of the step's time, slack included).
Engines slower to start than planned are waited for until the latest their wave may measure
with the later waves left what they need for one round each, less its own untimed runs, one
round and its stop (``vllm_run.start_limit``): they cost rounds, not results. On one H100
three offline engines took 70-80 s to come up where another H100 had taken 51, on a third
82-86 s, and the setup 39-42 s where 30 are planned: no slack covers that spread, and a
wave's results count the rounds it got."""
MIN_ROUNDS = paired_ratios.fewest_rounds()
"""Rounds a wave measures at least, six: with fewer, no pair of order statistics covers the
median with 95 % (``paired_ratios.LEVEL``)."""
CONCURRENCY = (8, 32)
PROMPTS = CONCURRENCY
"""``bench_serve.py``'s defaults on GPUs: one wave of requests a run at each concurrency."""


@dataclasses.dataclass
class RunPlan:
    """A run of ``scripts/gpu_vllm.sh``: both benchmarks' waves and their time."""
    tp: int
    offline: Plan
    serving: Plan
    offline_time: list[WaveTime]
    serving_time: list[WaveTime]
    concurrency: list[int]
    prompts: list[int]
    elapsed_s: float
    cut: list[str]

    @property
    def offline_s(self) -> float:
        return sum(t.total for t in self.offline_time) + STEP_END_S

    @property
    def serving_s(self) -> float:
        return sum(t.total for t in self.serving_time) + STEP_END_S

    @property
    def serving_least_s(self) -> float:
        """The serving step's least: every wave up, primed, one round, stopped."""
        return sum(t.least for t in self.serving_time) + STEP_END_S

    @property
    def total_s(self) -> float:
        return self.elapsed_s + self.offline_s + self.serving_s + PLAN_S

    @property
    def fits(self) -> bool:
        return (self.total_s <= RUN_S - SLACK_S and not self.offline.unplanned
                and not self.serving.unplanned)

    def limits(self) -> dict[str, Any]:
        """What the script gives its steps: the offline step its planned seconds, and as its
        latest (for engines that come up late, ``--latest-s``) those and the serving step's
        beyond its least; the serving step the rest of the run, at least its least."""
        return {"RUN_LIMIT_S": int(RUN_S), "BENCH_TIMEOUT_S": int(round(self.offline_s)),
                "BENCH_LATEST_S": int(round(self.offline_s + self.serving_s
                                            - self.serving_least_s)),
                "SERVE_LEAST_S": int(round(self.serving_least_s)),
                "BESIDE_GIB": round(self.offline.beside_gib, 2),
                "SERVE_TIMEOUT_S": int(round(self.serving_s)),
                "SERVE_CONCURRENCY": " ".join(map(str, self.concurrency)),
                "SERVE_PROMPTS": " ".join(map(str, self.prompts))}

    def describe(self) -> dict[str, Any]:
        return {"tp": self.tp, "fits": self.fits, "total_s": round(self.total_s, 1),
                "run_s": RUN_S, "elapsed_s": self.elapsed_s, "cut": self.cut,
                "offline": {**self.offline.describe(),
                            "time": [t.describe() for t in self.offline_time],
                            "step_s": round(self.offline_s, 1)},
                "serving": {**self.serving.describe(),
                            "time": [t.describe() for t in self.serving_time],
                            "step_s": round(self.serving_s, 1),
                            "concurrency": self.concurrency, "prompts": self.prompts},
                "limits": self.limits()}

    def lines(self) -> list[str]:
        out = [f"run plan, TP={self.tp}: {self.total_s:.0f} s of {RUN_S:.0f} "
               f"({'fits' if self.fits else 'DOES NOT FIT'} with {SLACK_S:.0f} s to spare): "
               f"{self.elapsed_s:.0f} s before, "
               f"offline {self.offline_s:.0f} s, serving {self.serving_s:.0f} s "
               f"(concurrency {', '.join(map(str, self.concurrency))}), "
               f"{PLAN_S:.0f} s for the plan and the summary"]
        for what, plan, times in (("offline", self.offline, self.offline_time),
                                  ("serving", self.serving, self.serving_time)):
            out += plan.lines(what)
            out += [f"    wave {i + 1}: up {t.up:.0f} s, untimed {t.first:.0f} s, "
                    f"{t.rounds} rounds of {t.round:.1f} s, stop {t.stop:.0f} s: {t.total:.0f} s"
                    for i, t in enumerate(times)]
        out += [f"  cut: {c}" for c in self.cut]
        return out


def run_plan(tp: int, free_gib: Optional[Sequence[float]], models: Sequence[str],
             labels: Sequence[str], dtype: str = "bfloat16", kv_tokens: int = 40960,
             beside_gib: float = 0.0, elapsed_s: float = SETUP_S,
             concurrency: Sequence[int] = CONCURRENCY,
             prompts: Sequence[int] = PROMPTS,
             step_tokens: Optional[int] = None) -> RunPlan:
    """Both benchmarks' waves for ``labels`` of every model, each wave measuring
    :data:`MIN_ROUNDS` rounds and the time left shared out as more rounds; a serving run at
    each of ``concurrency`` with as many of ``prompts``; each model's token budget a step
    its own unless ``step_tokens`` sets every model's.  Where that does not fit
    :data:`RUN_S` with :data:`SLACK_S` to spare, the serving benchmark keeps its first
    concurrency alone (said in ``cut``)."""
    if len(concurrency) != len(prompts) or not concurrency:
        raise ValueError(f"one number of prompts per concurrency: {list(concurrency)} and "
                         f"{list(prompts)}")
    specs = {m: vllm_models.MODELS[m] for m in models}
    engine = {m: engine_memory(s, tp, dtype, kv_tokens, step_tokens) for m, s in specs.items()}
    groups = {m: list(labels) for m in models}
    offline = plan_waves(groups, engine, free_gib, beside_gib)
    serving = plan_waves(groups, engine, free_gib)
    cut: list[str] = []
    conc, prompts = list(concurrency), list(prompts)

    def make() -> RunPlan:
        return RunPlan(tp, offline, serving,
                       [offline_wave_time(w, specs[w.model], tp, dtype, MIN_ROUNDS)
                        for w in offline.waves],
                       [serve_wave_time(w, specs[w.model], tp, dtype, MIN_ROUNDS, conc, prompts)
                        for w in serving.waves], conc, prompts, elapsed_s, cut)

    plan = make()
    if plan.total_s > RUN_S - SLACK_S and len(conc) > 1:
        cut.append(f"serving at concurrency {', '.join(map(str, conc[1:]))}: "
                   f"{plan.total_s:.0f} s with it")
        conc, prompts = conc[:1], prompts[:1]
        plan = make()
    spare = RUN_S - SLACK_S - plan.total_s
    # The time left goes to both steps as they need it: more rounds in every wave.
    times = plan.offline_time + plan.serving_time
    busy = sum(t.round * t.rounds for t in times)
    for t in times:
        if spare > 0 and busy > 0:
            t.rounds += int(spare * t.round * t.rounds / busy // t.round)
    return plan


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--models", nargs="+", default=list(vllm_models.GPU_MODELS),
                   choices=sorted(vllm_models.MODELS))
    p.add_argument("--variants", nargs="+", default=None, choices=setup.VARIANTS,
                   help="default: every variant (vLLM's in-tree fusion only at TP > 1)")
    p.add_argument("--aa", default="off")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-tokens", type=int, default=40960)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="every model's token budget a step (default: each model's own)")
    p.add_argument("--beside", nargs=4, metavar=("MODEL", "ENGINES", "KV_TOKENS", "STEP_TOKENS"),
                   default=None, help="a job beside the first offline wave: ENGINES engines "
                   "of MODEL with KV_TOKENS tokens of KV cache and STEP_TOKENS a step (the "
                   "end-to-end check)")
    p.add_argument("--gpu-free-gib", type=float, nargs="+", default=None,
                   help="each GPU's free memory (default: read by NVML)")
    p.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY),
                   help="the serving runs' concurrencies")
    p.add_argument("--prompts", type=int, nargs="+", default=None,
                   help="the serving runs' requests, one number per concurrency (default: "
                        "the concurrency, bench_serve.py's one wave a run)")
    p.add_argument("--elapsed-s", type=float, default=SETUP_S,
                   help="seconds the run has taken before the benchmarks")
    p.add_argument("--json", type=Path, default=None, help="the plan written here too")
    p.add_argument("--shell", type=Path, default=None,
                   help="the steps' limits written here as shell assignments")
    a = p.parse_args(argv)
    variants = a.variants or [v for v in setup.VARIANTS if v != "in_tree" or a.tp > 1]
    free = a.gpu_free_gib if a.gpu_free_gib is not None else gpu_free_gib(a.tp)
    beside = 0.0 if a.beside is None else int(a.beside[1]) * engine_memory(
        vllm_models.MODELS[a.beside[0]], a.tp, a.dtype, int(a.beside[2]),
        int(a.beside[3])).total
    try:
        plan = run_plan(a.tp, free, a.models, setup.labels(variants, a.aa), a.dtype,
                        a.kv_tokens, beside, a.elapsed_s, a.concurrency,
                        a.prompts or a.concurrency, a.max_num_batched_tokens)
    except ValueError as e:  # one number of prompts per concurrency
        p.error(str(e))
    print("\n".join(plan.lines()), flush=True)
    if a.json is not None:
        a.json.write_text(json.dumps(plan.describe(), indent=1) + "\n")
    if a.shell is not None:
        a.shell.write_text("".join(f"{k}='{v}'\n" for k, v in plan.limits().items()))
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
