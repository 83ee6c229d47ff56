"""What a vLLM user sees: offline latency through vLLM's own ``LLM`` API, with the
all-reduce + RMSNorm fusion off, with vLLM's in-tree fusion, and with this plugin.

As ``vllm bench latency`` does, the models have real shapes and dummy weights
(``load_format="dummy"``: a ``config.json`` written at run time, no
checkpoint), token-id prompts and no tokenizer.  Per variant and per batch size
it measures the decode time per output token as

    (latency of ``output_len = N + 1`` - latency of ``output_len = 1``) / N

(the same prompts; the difference leaves N decode steps, with vLLM's scheduling
and sampling as a user gets them), and the prefill time of one prompt of
``--prefill-len`` tokens (batch 1, one output token).  Sampling is greedy, and
the token ids of the variants are compared.  The plugin's decision records give
the fused sites per compiled token range and rank.

Variants alternate so that drift hits all of them: by default every variant's
engine stays alive in this process (each with its share of
``--gpu-memory-utilization``) and each measurement runs on every engine in
turn, the order rotating every round; medians over ``--repeats`` rounds.  A
variant that cannot run here (vLLM's in-tree fusion at TP=1, without FlashInfer,
on the CPU) is recorded as not run, with the reason.

    python benchmarks/bench_vllm.py --tp 2 --out-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import run_metadata  # noqa: E402

from fusion_pass import records  # noqa: E402
from fusion_pass.tools import demo  # noqa: E402
from fusion_pass.tools.demo import ModelSpec, cpu_env, on_cpu  # noqa: E402
from fusion_pass.environ import patched  # noqa: E402
from fusion_pass.vllm_integration import compat  # noqa: E402

MODELS = {m.name: m for m in (
    ModelSpec("llama3-8b-like", hidden=4096, layers=32, intermediate=14336, heads=32,
              kv_heads=8, head_dim=128, vocab=128256),
    # GPT-OSS's hidden size on a dense Llama (GPT-OSS's own layers are MoE).
    ModelSpec("dense-h2880", hidden=2880, layers=24, intermediate=2880, heads=64,
              kv_heads=8, head_dim=64, vocab=201088),
    ModelSpec("tiny", hidden=256, layers=2, intermediate=512, heads=4, kv_heads=2,
              head_dim=64, vocab=512),
    *demo.MODELS,
)}
GPU_MODELS = ("llama3-8b-like", "dense-h2880")
CPU_MODELS = ("tiny",)
VARIANTS = ("off", "in_tree", "plugin")
DESCRIBE = {
    "off": "no all-reduce fusion (vLLM's in-tree fusion off, no plugin pass)",
    "in_tree": "vLLM's in-tree all-reduce + RMSNorm fusion (FlashInfer / AITER); the plugin's "
               "pass runs after it only to record what it fused and fuses any site it left",
    "plugin": "this plugin's pass (vLLM's in-tree fusion off)",
}
FLASHINFER_ENV = {"VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm"}
"""Set for every engine unless the environment sets it."""
DECODE_METHOD = ("(median over rounds of latency(output_len=N+1) - latency(output_len=1)) / N, "
                 "the same prompts of input_len tokens, greedy, ignore_eos; latency of one "
                 "LLM.generate call, wall clock; tpot_ms: vLLM's time per output token, the "
                 "median over the batch's requests of (last_token_ts - first_token_ts) / "
                 "(generated tokens - 1) from the engine core's timestamps "
                 "(RequestOutput.metrics), median over rounds")


# -- what runs ----------------------------------------------------------------

def write_config(spec: ModelSpec, path: Path, dtype: str) -> Path:
    """A Llama ``config.json`` for ``spec``: all that vLLM needs with dummy weights."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                      num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                      num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim,
                      vocab_size=spec.vocab, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=500000.0,
                      bos_token_id=1, eos_token_id=2, torch_dtype=dtype)
    path.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(path)
    return path


def model_dir(args: argparse.Namespace, spec: ModelSpec, path: Path) -> Path:
    """``--weights dummy``: a config for vLLM's dummy weights; ``random``: the demo's
    random-weight checkpoint (small models: it is written to disk)."""
    if args.weights == "random":
        return demo.make_checkpoint(spec, path, dtype=args.dtype)
    return write_config(spec, path, args.dtype)


def attention_backend(requested: str) -> tuple[Optional[str], str]:
    """The attention backend to ask vLLM for, and why.  vLLM's CUDA default is
    FlashAttention, whose extensions a vLLM install may lack; Triton's then."""
    if requested != "auto":
        return requested, "given on the command line"
    if on_cpu():
        return None, "vLLM's choice (the CPU build)"
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return None, "vLLM's choice"
    have = [m for m in ("vllm.vllm_flash_attn._vllm_fa3_C", "vllm.vllm_flash_attn._vllm_fa2_C",
                        "vllm._vllm_fa3_C", "vllm._vllm_fa2_C") if _spec(m)]
    if have:
        return None, f"vLLM's choice (FlashAttention's extension present: {have[0]})"
    return "TRITON_ATTN", "FlashAttention's extensions are not installed"


def _spec(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# vLLM's own verdict, in a child process (importing FlashInfer's comm module may
# touch the GPU): the module of its in-tree pass keeps ``flashinfer_comm`` None
# unless FlashInfer imports and has what this vLLM calls.
_PROBE = """
import importlib, sys
m = importlib.import_module("vllm.compilation.passes.fusion.allreduce_rms_fusion")
if getattr(m, "flashinfer_comm", None) is not None:
    sys.exit(0)
try:
    import flashinfer.comm
except Exception as e:
    print(f"importing flashinfer.comm failed: {type(e).__name__}: {e}")
else:
    print("this FlashInfer lacks the all-reduce fusion API this vLLM calls")
sys.exit(3)
"""


@functools.cache
def in_tree_unavailable(tp: int) -> Optional[str]:
    """Why vLLM's in-tree all-reduce fusion cannot run here (None: it can)."""
    from vllm.config import PassConfig

    fields = {f.name for f in dataclasses.fields(PassConfig)}
    missing = sorted(set(compat.in_tree_settings(True)) - fields)
    if missing:
        return f"this vLLM's PassConfig has no {', '.join(missing)}"
    if tp < 2:
        return f"tensor_parallel_size={tp}: there is no all-reduce to fuse"
    if on_cpu():
        return "vLLM's CPU build has no in-tree all-reduce fusion (it needs FlashInfer or AITER)"
    from vllm.platforms import current_platform

    if current_platform.is_rocm():
        return None if _spec("aiter") else "AITER is not installed"
    if not _spec("flashinfer"):
        return "FlashInfer is not installed"
    r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                       timeout=600)
    if r.returncode == 0:
        return None
    last = (r.stdout.strip() or r.stderr.strip() or "?").splitlines()[-1]
    return last if r.returncode == 3 else f"probing vLLM's in-tree pass failed: {last}"


def compilation(variant: str) -> dict[str, Any]:
    """The ``compilation_config`` of a variant; vLLM's defaults otherwise (mode,
    CUDA graph mode, capture sizes, sequence parallelism)."""
    from fusion_pass.vllm_integration import compilation_config

    if variant == "plugin":
        return compilation_config()
    if variant == "in_tree":
        return compilation_config(in_tree=True)
    return {"pass_config": compat.in_tree_settings(False)}


@dataclasses.dataclass
class Engine:
    variant: str
    llm: Any
    work: Path
    seconds_to_start: float

    def records(self) -> list[records.GraphRecord]:
        d = self.work / "records"
        return records.read_dir(str(d)) if d.is_dir() else []


def start_engine(args: argparse.Namespace, model: Path, work: Path, variant: str,
                 share: float, backend: Optional[str]) -> Engine:
    """One vLLM engine for ``variant``, compiling from scratch (fresh caches), with
    the plugin's records written under ``work/records`` by every process it starts."""
    from vllm import LLM

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = {"VLLM_CACHE_ROOT": str(work / "cache" / "vllm"),
           "TORCHINDUCTOR_CACHE_DIR": str(work / "cache" / "inductor"),
           records.RECORD_DIR_ENV: str(work / "records")}
    cc = compilation(variant)
    # FlashInfer's mnnvl all-reduce (vLLM 0.26's default for its fusion) uses NVLink
    # multicast; the trtllm one does not.
    env.update({k: v for k, v in FLASHINFER_ENV.items() if k not in os.environ})
    if on_cpu():
        env.update({k: v for k, v in cpu_env().items() if k not in os.environ})
    elif args.dump and variant != "off":
        cc["debug_dump_path"] = str(work / "dumps")
    kwargs: dict[str, Any] = dict(
        tensor_parallel_size=args.tp, dtype=args.dtype,
        load_format="dummy" if args.weights == "dummy" else "auto",
        skip_tokenizer_init=True, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False, seed=0, compilation_config=cc,
        disable_log_stats=False)  # request stats: the engine's time per output token
    if not on_cpu():
        kwargs["gpu_memory_utilization"] = share
    if backend is not None:
        from vllm.engine.arg_utils import EngineArgs

        if "attention_config" in {f.name for f in dataclasses.fields(EngineArgs)}:
            kwargs["attention_config"] = {"backend": backend}
        else:
            env["VLLM_ATTENTION_BACKEND"] = backend
    start = time.perf_counter()
    with patched(env):
        llm = LLM(str(model), **kwargs)
    return Engine(variant, llm, work, time.perf_counter() - start)


def stop_engine(engine: Engine) -> None:
    """Shut the engine down and drop its compile caches (its records and dumps stay)."""
    engine.llm.llm_engine.engine_core.shutdown()
    engine.llm = None
    gc.collect()
    shutil.rmtree(engine.work / "cache", ignore_errors=True)


def engine_settings(llm: Any) -> dict[str, Any]:
    """What the engine was built with, as vLLM resolved it."""
    vc = llm.llm_engine.vllm_config
    cc = vc.compilation_config

    def get(obj: Any, *names: str) -> dict[str, Any]:
        out = {}
        for n in names:
            v = getattr(obj, n, None)
            out[n] = v if isinstance(v, (int, float, str, bool, type(None), list)) else str(v)
        return out

    pass_cfg = getattr(cc, "pass_config", None)
    ranges = getattr(cc, "get_compile_ranges", None)
    post = (getattr(cc, "inductor_compile_config", None) or {}).get("post_grad_custom_post_pass")
    return {
        "compilation": {**get(cc, "mode", "cudagraph_mode", "backend", "compile_sizes",
                              "compile_ranges_endpoints", "cudagraph_capture_sizes",
                              "max_cudagraph_capture_size", "splitting_ops", "debug_dump_path"),
                        "pass_config": get(pass_cfg, *(f.name for f in dataclasses.fields(
                            pass_cfg))) if pass_cfg else None,
                        "post_grad_custom_post_pass": None if post is None else type(post).__name__,
                        # As the pass's records name them.
                        "compile_ranges": [f"[{r.start}, {r.end}]" for r in ranges()]
                        if ranges else None},
        "model": get(vc.model_config, "dtype", "max_model_len", "enforce_eager"),
        "scheduler": get(vc.scheduler_config, "max_num_seqs", "max_num_batched_tokens",
                         "enable_chunked_prefill"),
        "cache": get(vc.cache_config, "block_size", "gpu_memory_utilization", "cache_dtype",
                     "enable_prefix_caching"),
        "parallel": get(vc.parallel_config, "tensor_parallel_size",
                        "distributed_executor_backend"),
        "attention": get(getattr(vc, "attention_config", None), "backend"),
        "optimization_level": str(getattr(vc, "optimization_level", None)),
    }


# -- measuring ----------------------------------------------------------------

def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def request_tpot(out: Any) -> Optional[float]:
    """vLLM's time per output token of one finished request, in seconds, from the
    engine core's timestamps (None where this vLLM keeps no request stats)."""
    m = getattr(out, "metrics", None)
    n = getattr(m, "num_generation_tokens", 0)
    first, last = getattr(m, "first_token_ts", 0.0), getattr(m, "last_token_ts", 0.0)
    if n < 2 or not last > first:
        return None
    return (last - first) / (n - 1)


def generate(llm: Any, batch: list[list[int]],
             max_tokens: int) -> tuple[float, list[list[int]], Optional[float]]:
    """Wall-clock seconds of one LLM.generate call, the greedy ids, and the median
    over its requests of vLLM's time per output token (None with one token)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            detokenize=False)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tpots = [t for t in map(request_tpot, outs) if t is not None]
    tpot = statistics.median(tpots) if len(tpots) == len(outs) else None
    return seconds, [list(o.outputs[0].token_ids) for o in outs], tpot


def points(args: argparse.Namespace, vocab: int) -> list[tuple[str, list[list[int]], int]]:
    """Every timed call of a round: (key, prompts, max_tokens)."""
    out = []
    for b in args.batches:
        batch = prompts(b, args.input_len, vocab, seed=b)
        out.append((f"decode_b{b}_out1", batch, 1))
        out.append((f"decode_b{b}_out{args.decode_steps + 1}", batch, args.decode_steps + 1))
    if args.prefill_len:
        out.append((f"prefill_{args.prefill_len}", prompts(1, args.prefill_len, vocab, seed=0), 1))
    return out


def measure(engines: list[Engine], args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Warm-up and timed rounds; each point runs on every engine in turn, the order
    rotating per round."""
    pts = points(args, vocab)
    lat: dict[str, dict[str, list[float]]] = {e.variant: {k: [] for k, _, _ in pts}
                                              for e in engines}
    tpot: dict[str, dict[str, list[Optional[float]]]] = {e.variant: {k: [] for k, _, _ in pts}
                                                          for e in engines}
    ids: dict[str, dict[str, list[list[int]]]] = {e.variant: {} for e in engines}
    stable = {e.variant: True for e in engines}
    for rnd in range(args.warmup + args.repeats):
        order = engines[rnd % len(engines):] + engines[:rnd % len(engines)]
        for key, batch, max_tokens in pts:
            for e in order:
                seconds, got, t = generate(e.llm, batch, max_tokens)
                if rnd >= args.warmup:
                    lat[e.variant][key].append(seconds)
                    tpot[e.variant][key].append(t)
                if key not in ids[e.variant]:
                    ids[e.variant][key] = got
                elif ids[e.variant][key] != got:
                    stable[e.variant] = False
        log(f"round {rnd + 1}/{args.warmup + args.repeats}"
            f"{' (warm-up)' if rnd < args.warmup else ''} done")
    return {"latencies_s": lat, "tpot_s": tpot, "token_ids": ids, "deterministic": stable}


def summarise(m: dict[str, Any], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    out = {}
    n = args.decode_steps
    for v, lat in m["latencies_s"].items():
        decode = {}
        for b in args.batches:
            diffs = [(hi - lo) / n for lo, hi in zip(lat[f"decode_b{b}_out1"],
                                                     lat[f"decode_b{b}_out{n + 1}"])]
            decode[str(b)] = {"ms_per_token": 1e3 * statistics.median(diffs),
                              "ms_per_token_min": 1e3 * min(diffs),
                              "ms_per_token_max": 1e3 * max(diffs),
                              "first_token_ms": 1e3 * statistics.median(lat[f"decode_b{b}_out1"])}
            tp = m.get("tpot_s", {}).get(v, {}).get(f"decode_b{b}_out{n + 1}", [])
            if tp and None not in tp:
                decode[str(b)].update(tpot_ms=1e3 * statistics.median(tp),
                                      tpot_ms_min=1e3 * min(tp), tpot_ms_max=1e3 * max(tp))
        res: dict[str, Any] = {"decode": decode}
        if args.prefill_len:
            p = lat[f"prefill_{args.prefill_len}"]
            res["prefill"] = {"tokens": args.prefill_len, "ms": 1e3 * statistics.median(p),
                              "ms_min": 1e3 * min(p), "ms_max": 1e3 * max(p)}
        out[v] = res
    return out


def ratios(summary: dict[str, dict[str, Any]],
           base: str = "off") -> dict[str, dict[str, Optional[float]]]:
    """Each variant's time over the ``base`` variant's in the same run (< 1: faster);
    None where the base's time is not positive (a decode difference lost in noise)."""
    if base not in summary:
        return {}
    b = summary[base]
    out = {}
    for v, s in summary.items():
        if v == base:
            continue
        r: dict[str, Optional[float]] = {
            f"decode_b{k}": d["ms_per_token"] / b["decode"][k]["ms_per_token"]
            if b["decode"][k]["ms_per_token"] > 0 else None for k, d in s["decode"].items()}
        r.update({f"tpot_b{k}": d["tpot_ms"] / b["decode"][k]["tpot_ms"]
                  for k, d in s["decode"].items()
                  if "tpot_ms" in d and "tpot_ms" in b["decode"][k]})
        if "prefill" in s:
            r["prefill"] = s["prefill"]["ms"] / b["prefill"]["ms"]
        out[v] = r
    return out


def compare_tokens(ids: dict[str, dict[str, list[list[int]]]]) -> dict[str, Any]:
    """Per timed call: whether every variant generated the same greedy token ids,
    and for each variant against ``off`` the sequences that differ and where."""
    variants = list(ids)
    ref = "off" if "off" in ids else variants[0]
    out: dict[str, Any] = {"reference": ref, "identical": True, "calls": {}}
    for key in ids[ref]:
        call: dict[str, Any] = {}
        for v in variants:
            if v == ref:
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


# -- the run ------------------------------------------------------------------

def log(msg: str) -> None:
    print(f"bench_vllm: {msg}", file=sys.stderr, flush=True)


def run_model(args: argparse.Namespace, spec: ModelSpec, root: Path,
              backend: Optional[str]) -> dict[str, Any]:
    path = model_dir(args, spec, root / spec.name / "model")
    skipped: dict[str, str] = {}
    want = list(args.variants)
    if "in_tree" in want:
        why = in_tree_unavailable(args.tp)
        if why is not None:
            skipped["in_tree"] = why
            want.remove("in_tree")
    if "plugin" in want and compat.unsupported_reason() is not None:
        skipped["plugin"] = str(compat.unsupported_reason())
        want.remove("plugin")
    for v, why in skipped.items():
        log(f"{spec.name}: variant {v} not run: {why}")
    result: dict[str, Any] = {
        "model": dataclasses.asdict(spec), "expected_sites_per_range": spec.sites(),
        "variants": {v: {"run": v in want, "description": DESCRIBE[v],
                         **({"not_run_reason": skipped[v]} if v in skipped else {})}
                     for v in args.variants}}
    share = args.gpu_memory_utilization / max(len(want) if args.alternate == "engines" else 1, 1)
    engines: list[Engine] = []
    measured: dict[str, Any] = {"latencies_s": {}, "tpot_s": {}, "token_ids": {},
                                "deterministic": {}}
    try:
        for v in list(want):
            log(f"{spec.name}: starting the {v} engine (TP={args.tp}, {args.dtype})")
            try:
                e = start_engine(args, path, root / spec.name / v, v, share, backend)
            except Exception as exc:  # one variant's failure leaves the others measured
                traceback.print_exc()
                why = f"its engine did not start: {type(exc).__name__}: {exc}"
                log(f"{spec.name}: variant {v} not run: {why}")
                want.remove(v)
                result["variants"][v].update({"run": False, "not_run_reason": why[:2000]})
                continue
            log(f"{spec.name}: {v} engine up in {e.seconds_to_start:.1f} s")
            result["variants"][v]["seconds_to_start"] = round(e.seconds_to_start, 1)
            result["variants"][v]["engine"] = engine_settings(e.llm)
            engines.append(e)
            if args.alternate == "sequential":
                m = measure([e], args, spec.vocab)
                for k in measured:
                    measured[k].update(m[k])
                stop_engine(e)
        if args.alternate == "engines" and engines:
            measured = measure(engines, args, spec.vocab)
    finally:
        for e in engines:
            if e.llm is not None:
                stop_engine(e)
    summary = summarise(measured, args)
    for v in want:
        graphs = [g for e in engines if e.variant == v for g in e.records()]
        per_range = sites_per_range(graphs)
        result["variants"][v].update({
            **summary[v], "deterministic": measured["deterministic"][v],
            "sites_per_range": per_range,
            # Every recorded site fused (a range past vLLM's sequence-parallel threshold
            # has no all-reduce left to record).
            "all_fused": any(r["sites"] for ranges in per_range.values()
                             for r in ranges.values())
            and all(r["fused"] == r["sites"] for ranges in per_range.values()
                    for r in ranges.values()),
            "latencies_s": measured["latencies_s"][v], "tpot_s": measured["tpot_s"][v]})
        compiled = result["variants"][v]["engine"]["compilation"]["compile_ranges"]
        if v != "off" and compiled and not on_cpu():
            # A range the pass skipped (past the backend's size limit) has no records.
            result["variants"][v]["ranges_without_records"] = {
                f"rank{r}": [c for c in compiled if c not in per_range.get(f"rank{r}", {})]
                for r in range(args.tp)}
        if v == "in_tree":
            result["variants"][v]["in_tree_fused_sites"] = sum(
                r["paths"].get(records.IN_TREE, 0) for ranges in per_range.values()
                for r in ranges.values())
    result["ratios_vs_off"] = ratios(summary)
    result["tokens"] = compare_tokens(measured["token_ids"]) if want else {"identical": None}
    result["token_ids"] = {v: {k: ids for k, ids in calls.items() if len(ids) <= args.keep_ids}
                           for v, calls in measured["token_ids"].items()}
    return result


def problems(result: dict[str, Any], tp: int, check: str) -> list[str]:
    """What ``--check`` fails on: a rank or compiled range of the plugin variant with
    a site unfused or a site count other than the model's; with ``all``, greedy
    tokens that differ between variants."""
    out = []
    for m in result["models"]:
        name, want = m["model"]["name"], m["expected_sites_per_range"]
        plugin = m["variants"].get("plugin", {})
        if "plugin" in m["variants"] and not plugin["run"]:
            out.append(f"{name}: the plugin variant did not run: {plugin['not_run_reason']}")
        if plugin.get("run") and tp > 1:
            per_rank = plugin["sites_per_range"]
            missing = sorted(set(range(tp)) - {int(k[4:]) for k in per_rank})
            if missing:
                out.append(f"{name}: no records from rank(s) {missing}")
            for rank, ranges in per_rank.items():
                for rng, r in ranges.items():
                    if r["fused"] != r["sites"] or r["sites"] != want:
                        out.append(f"{name}: {rank} range {rng}: {r['fused']} of {r['sites']} "
                                   f"site(s) fused, {want} expected ({r['unfused_reasons']})")
        if check == "all" and not m["tokens"]["identical"]:
            out.append(f"{name}: greedy tokens differ between variants: {m['tokens']['calls']}")
    return out


def format_text(result: dict[str, Any]) -> str:
    lines = [f"bench_vllm: TP={result['settings']['tp']}, {result['settings']['dtype']}, "
             f"{result['meta']['devices'][0]}, vLLM {result['meta']['versions']['vllm']}, "
             f"attention {result['attention_backend']['requested'] or 'auto'}"]
    for m in result["models"]:
        lines.append(f"== {m['model']['name']} (hidden {m['model']['hidden']}, "
                     f"{m['model']['layers']} layers)")
        for v, r in m["variants"].items():
            if not r["run"]:
                lines.append(f"  {v:8} not run: {r['not_run_reason']}")
                continue
            dec = "  ".join(f"b{b} {d['ms_per_token']:.3f}" for b, d in r["decode"].items())
            pre = f"  prefill {r['prefill']['ms']:.2f} ms" if "prefill" in r else ""
            fused = {rk: {rng: f"{x['fused']}/{x['sites']}" for rng, x in rr.items()}
                     for rk, rr in r["sites_per_range"].items()}
            lines.append(f"  {v:8} decode ms/token: {dec}{pre}")
            if all("tpot_ms" in d for d in r["decode"].values()):
                tpot = "  ".join(f"b{b} {d['tpot_ms']:.3f}" for b, d in r["decode"].items())
                lines.append(f"  {'':8} vLLM's TPOT, ms:  {tpot}")
            lines.append(f"  {'':8} fused/sites per range: {fused or 'no records'}")
            gaps = {k: x for k, x in r.get("ranges_without_records", {}).items() if x}
            if gaps:
                lines.append(f"  {'':8} compiled ranges without records: {gaps}")
        for v, rr in m["ratios_vs_off"].items():
            lines.append(f"  {v} / off: " + "  ".join(
                f"{k} {'-' if x is None else f'{x:.3f}'}" for k, x in rr.items()))
        lines.append(f"  greedy tokens identical across variants: {m['tokens']['identical']}")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    cpu = on_cpu()
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2 if cpu else 1, help="tensor_parallel_size")
    p.add_argument("--models", nargs="+", choices=sorted(MODELS),
                   default=list(CPU_MODELS if cpu else GPU_MODELS))
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64])
    p.add_argument("--decode-steps", type=int, default=8 if cpu else 32,
                   help="N: decode time per token from output_len N+1 and 1")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens of the decode calls")
    p.add_argument("--prefill-len", type=int, default=2048, help="0: no prefill measurement")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--dtype", default="float32" if cpu else "bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: max(64, largest batch)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="default: room for the prefill and for the largest batch's prompts at once")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: the longest call plus 64")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                   help="in total: each engine alive at once gets an equal share")
    p.add_argument("--attention-backend", default="auto",
                   help="auto: vLLM's choice, or TRITON_ATTN where FlashAttention is not installed")
    p.add_argument("--alternate", choices=("engines", "sequential"), default="engines",
                   help="engines: every variant's engine alive at once, each measurement on each "
                        "in turn; sequential: one engine at a time (less memory; drift is not "
                        "spread over the variants)")
    p.add_argument("--weights", choices=("dummy", "random"), default="dummy",
                   help="dummy: vLLM's dummy weights from a config (as vllm bench latency); "
                        "random: a random-weight checkpoint written first (small models)")
    p.add_argument("--check", choices=("none", "records", "all"), default="none",
                   help="exit 1 unless the plugin's records show, per rank and compiled range, "
                        "every expected site fused (records), and the variants' greedy tokens "
                        "are identical (all)")
    p.add_argument("--dump", action="store_true",
                   help="vLLM's debug_dump_path under the work directory (GPU)")
    p.add_argument("--keep-ids", type=int, default=8,
                   help="keep the token ids of calls with at most this many sequences in the JSON")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="configs, caches, records, dumps (default: a temporary directory, removed)")
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--name", default=None, help="results file name (default vllm_<dev>_tp<N>.json)")
    a = p.parse_args(argv)
    longest = max(a.prefill_len, a.input_len + a.decode_steps + 1)
    a.max_num_seqs = a.max_num_seqs or max(64, *a.batches)
    a.max_num_batched_tokens = a.max_num_batched_tokens or max(
        a.prefill_len, max(a.batches) * a.input_len, a.max_num_seqs, 256)
    a.max_model_len = a.max_model_len or longest + 64
    if a.repeats < 1 or a.decode_steps < 1:
        p.error("--repeats and --decode-steps must be at least 1")
    return a


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    meta = run_metadata(None if argv is None else ["benchmarks/bench_vllm.py", *argv])
    backend, why = attention_backend(args.attention_backend)
    root = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    root.mkdir(parents=True, exist_ok=True)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result: dict[str, Any] = {
        "benchmark": "bench_vllm", "meta": meta, "settings": settings,
        "device": "cpu" if on_cpu() else "gpu",
        "attention_backend": {"requested": backend, "why": why},
        "engine_environment": {k: os.environ.get(k, v) for k, v in FLASHINFER_ENV.items()},
        "decode_method": DECODE_METHOD,
        "prefill_method": "median over rounds of the latency of one LLM.generate call: one "
                          "prompt of prefill_len tokens, output_len=1",
        "alternation": ("every variant's engine alive at once; each timed call runs on every "
                        "engine in turn, the order rotating each round" if args.alternate ==
                        "engines" else "one engine at a time, all its rounds, then the next"),
        "sites_note": "sites per rank and compiled token range, summed over the graphs the "
                      "plugin's pass compiled there (vLLM splits the model at attention; a graph "
                      "identical to one compiled earlier in the process comes from Inductor's "
                      "cache and is not recorded again)",
        "models": []}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / (args.name or f"vllm_{result['device']}_tp{args.tp}.json")
    try:
        for name in args.models:
            result["models"].append(run_model(args, MODELS[name], root, backend))
            # Each model's results survive a later one running out of time.
            result["complete"] = len(result["models"]) == len(args.models)
            result["seconds"] = round(time.perf_counter() - START, 1)
            if args.check != "none":
                result["check"] = {"what": args.check,
                                   "problems": problems(result, args.tp, args.check)}
            path.write_text(json.dumps(result, indent=1) + "\n")
    finally:
        if args.work_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(format_text(result))
    print(f"wrote {path}")
    if args.check == "none":
        return 0
    bad = problems(result, args.tp, args.check)
    for b in bad:
        print(f"CHECK FAILED: {b}")
    print(f"check ({args.check}): {'FAILED' if bad else 'OK'}")
    return 1 if bad else 0


START = time.perf_counter()

if __name__ == "__main__":
    sys.exit(main())
