"""Whole-model benefit of the fusion pass: a compiled TP decoder with and without it.

Launch (2 x H200)::

    torchrun --nproc-per-node 2 benchmarks/model/bench_model.py --out benchmarks/results

Tiny model, a sanity check (2 gloo ranks on the CPU, or the 2 GPUs)::

    torchrun --nproc-per-node 2 benchmarks/model/bench_model.py --smoke --out /tmp/smoke

``--backend reference`` forces the fused op's reference backend (a dry run of
everything but the fused kernels).  See docs/model_benchmark.md.

FP8 models (``--models llama3-70b-fp8 deepseek-like-fp8``) quantize each norm's
output in the layer graph; the pass fuses that quantization into the op where
it recognises it, and each shape's ``quant_fusions_per_graph`` says how many
sites it did so for.

Several result files of separate runs (one model per process) become one::

    python benchmarks/model/bench_model.py --merge A.json B.json --out DIR --name model_h200x2

For every model and shape the decoder layer (:mod:`tp_decoder`) is compiled
twice with ``torch.compile(fullgraph=True, dynamic=False)``: once with
:class:`fusion_pass.AllReduceRMSNormFusionPass` as Inductor's
``post_grad_custom_post_pass`` and once without.  Shapes are static (one
compile per batch size), so the gate decides each site's path at compile time.
On CUDA the whole step (embedding, every layer, lm_head) is captured in one CUDA
graph per variant and the two graphs are timed alternately; the JSON gets the
median step time of each, their ratio, the pass's decisions per compiled graph
and the relative error of the logits (fused vs unfused vs eager).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch
import torch._dynamo.config
import torch._functorch.config
import torch._inductor.config
import torch.distributed as dist

# This part's modules, and the ones the benchmarks share (bench_common.py).
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
import tp_decoder as tpd  # noqa: E402
from bench_common import Fallbacks, rel_err  # noqa: E402

import fusion_pass  # noqa: E402
from fusion_pass import backends, records  # noqa: E402

# Largest ||a - b|| / ||b|| accepted between two computations of the logits, by
# dtype (the op tests' relative tolerances).  The norm-wise error, not the
# max-wise one: two correct bf16 computations round differently in every
# layer, and the worst element drifts with depth (1.4e-2 max-wise after 8 tiny
# layers on the CPU) while a real mistake (a lost residual or norm weight)
# moves the whole vector by 10 % or more.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4}
# FP8 models: where two correct computations of the norm output round to
# neighbouring bf16 values, the FP8 codes land one code, 6 %, apart, and the
# layers carry those flips on.  Fused and unfused logits are the same bits on
# the CPU, and on 2 x H200 at decode batches 1 and 8 (h is NCCL's or gloo's sum
# plus the residual, y rounded before the weight as the model's norm does).  At
# 128 and 2048 tokens on the GPU they differ by 1 % and 7 % after 8 random
# layers: h is the same bits there too (the GPU suite compares it with NCCL's),
# so y's rounding moves, most likely from the compiled norm summing the squares
# in another order at those shapes (not verified).  Compiled and eager drift apart with depth (17 %
# after 80 random FP8 layers), fused and unfused alike.  A wrong scale or a lost
# residual moves the logits by far more.
FP8_TOLERANCE = 1e-1
SITES_PER_LAYER = 2
DEFAULT_MODELS = ("gpt-oss-like", "llama3-8b-like", "llama3-70b-like")


@dataclass(frozen=True)
class ShapeSpec:
    kind: str      # "decode" or "prefill"
    batch: int
    new: int       # new tokens per sequence
    context: int   # cached tokens per sequence before this step

    @property
    def tokens(self) -> int:
        return self.batch * self.new

    def label(self) -> str:
        if self.kind == "decode":
            return f"decode b={self.batch} ctx={self.context}"
        return f"prefill {self.new}"


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for the JSON and markdown results")
    p.add_argument("--name", default=None,
                   help="results file stem (default: model_h200x2, or model_smoke with --smoke)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny model and shapes: a sanity check (CPU with gloo, or the GPUs)")
    p.add_argument("--models", nargs="+", choices=sorted(tpd.CONFIGS), default=None)
    p.add_argument("--layers", type=int, default=None, help="override every model's layer count")
    p.add_argument("--batches", type=int, nargs="+", default=None,
                   help="decode batch sizes (default 1 8 32 80 128; smoke: 1 4)")
    p.add_argument("--context", type=int, default=None,
                   help="cached tokens per sequence at decode (default 1000; smoke 16)")
    p.add_argument("--prefill", type=int, default=None,
                   help="prefill length, one sequence; 0 to skip (default 2048; smoke 32)")
    p.add_argument("--backend", default=None, choices=backends.names(),
                   help="force the fused op's backend (fusion_pass.set_backend)")
    p.add_argument("--reps", type=int, default=None,
                   help="timed samples per variant, alternating (default 11; smoke 3)")
    p.add_argument("--sample-ms", type=float, default=25.0,
                   help="target duration of one timed sample (replays are repeated to fill it)")
    p.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                   help="merge these result files into <out>/<name>.json and .md (no run)")
    a = p.parse_args(argv)
    smoke = a.smoke
    a.models = a.models or (["smoke"] if smoke else list(DEFAULT_MODELS))
    a.batches = list(dict.fromkeys(a.batches or ([1, 4] if smoke else [1, 8, 32, 80, 128])))
    a.context = a.context if a.context is not None else (16 if smoke else 1000)
    a.prefill = a.prefill if a.prefill is not None else (32 if smoke else 2048)
    a.reps = a.reps or (3 if smoke else 11)
    a.name = a.name or ("model_smoke" if smoke else "model_h200x2")
    if a.reps < 1 or min(a.batches) < 1 or a.context < 0 or a.prefill < 0:
        p.error("reps and batches must be positive, context and prefill non-negative")
    return a


class Replayer:
    """A step made cheap to repeat: a captured CUDA graph on CUDA, the call itself on the CPU."""

    def __init__(self, fn: Callable[[], torch.Tensor], device: torch.device) -> None:
        self.fn = fn
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        if device.type == "cuda":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize(device)
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: the NCCL watchdog thread may query events meanwhile.
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.out = fn()

    def __call__(self) -> torch.Tensor:
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        return self.out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_us(run: Replayer, n: int, device: torch.device) -> float:
    """Mean microseconds per call over ``n`` back-to-back calls."""
    dist.barrier()
    _sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1000.0 / n
    t0 = time.perf_counter()
    for _ in range(n):
        run()
    return (time.perf_counter() - t0) * 1e6 / n


def _inductor(graph_pass: Optional[fusion_pass.AllReduceRMSNormFusionPass],
              fp8: bool) -> Callable:
    """Inductor as a Dynamo backend with ``post_grad_custom_post_pass`` set for its compiles.

    A backend object per variant: Dynamo keys compiled entries by backend, and
    two ``torch.compile(..., options=...)`` wrappers that compare equal would
    share one compiled graph between the variants.  FP8 models (both variants)
    compile with ``emulate_precision_casts``: Inductor then rounds a bf16 value
    to bf16 before quantizing it, as eager torch and the fused op do; without
    it 2-3 % of the FP8 codes of every quantization land one code apart
    between two correct computations (measured on the CPU), and the logits
    check could not tell a mistake from rounding.
    """
    from torch._inductor.compile_fx import compile_fx

    return functools.partial(compile_fx,
                             config_patches={"post_grad_custom_post_pass": graph_pass,
                                             "emulate_precision_casts": fp8})


def group_gemm(cfg: tpd.ModelConfig, world: int, device: torch.device
               ) -> tuple[str, Optional[str]]:
    """The GEMM of a per-group FP8 model, the same on every rank (``dequant`` if any
    rank's blockwise ``torch._scaled_mm`` failed its probe), and why not ``scaled_mm``."""
    if cfg.quant != "group128":
        return "scaled_mm", None
    mine = tpd.group_gemm(device)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    return next((g for g in every if g[0] == "dequant"), mine)


def compile_variants(s: tpd.Shard) -> dict[str, Callable]:
    """The layer compiled with and without the pass, and the prologue (no all-reduce)."""
    def compiled(fn: Callable, graph_pass: Optional[fusion_pass.AllReduceRMSNormFusionPass]
                 ) -> Callable:
        return torch.compile(fn, backend=_inductor(graph_pass, s.quant is not None),
                             fullgraph=True, dynamic=False)

    layer = functools.partial(tpd.decoder_layer, s)
    return {"fused": compiled(layer, fusion_pass.AllReduceRMSNormFusionPass()),
            "unfused": compiled(layer, None),
            "prologue": compiled(functools.partial(tpd.prologue, s), None)}


def run_shape(cfg: tpd.ModelConfig, s: tpd.Shard, w: tpd.Weights, fns: dict[str, Callable],
              spec: ShapeSpec, args: argparse.Namespace, rank: int, world: int,
              device: torch.device, log: Callable[[str], None]) -> dict[str, Any]:
    inp = tpd.make_inputs(cfg, rank, world, spec.batch, spec.new, spec.context, device)
    steps = {v: functools.partial(tpd.step, s, w, inp, fns[v], fns["prologue"])
             for v in ("fused", "unfused")}
    out: dict[str, Any] = {"kind": spec.kind, "batch": spec.batch, "new_tokens": spec.new,
                           "context": spec.context, "tokens": spec.tokens}

    # Compile (on the first call) and capture; the pass's records of each call
    # are its graphs' (the prologue compiles, without the pass, in the first).
    runs: dict[str, Replayer] = {}
    graphs: dict[str, list[records.GraphRecord]] = {}
    for v in ("unfused", "fused"):
        before = len(records.HISTORY)
        t0 = time.perf_counter()
        steps[v]()
        _sync(device)
        out[f"compile_s_{v}"] = round(time.perf_counter() - t0, 2)
        graphs[v] = records.HISTORY[before:]
        runs[v] = Replayer(steps[v], device)
    # Embedding and lm_head alone, to tell the layers' share of the step.
    runs["head"] = Replayer(functools.partial(tpd.step, s, w, inp, fns["unfused"],
                                              fns["prologue"], depth=0), device)
    if graphs["unfused"]:
        raise RuntimeError("the pass ran while the unfused variant compiled")
    fused = graphs["fused"]
    out["graphs"] = [{"token_range": g.token_range,
                      "sites": [asdict(site) for site in g.sites]} for g in fused]
    sites = [site for g in fused for site in g.sites]
    # None when the fused call did not compile exactly one graph (a cache hit: no records).
    one = len(fused) == 1
    out["sites_per_graph"] = len(sites) if one else None
    out["fusions_per_graph"] = sum(site.fused for site in sites) if one else None
    out["fusions_per_step"] = out["fusions_per_graph"] * cfg.layers if one else None
    out["paths"] = sorted({site.path for site in sites})
    # FP8 models: the sites whose quantization went into the op (SiteRecord.quant).
    out["quant_fusions_per_graph"] = (sum(site.fused and site.quant is not None
                                          for site in sites) if one else None)
    out["quants"] = sorted({site.quant for site in sites if site.quant is not None})

    logits = {v: runs[v]().clone() for v in ("fused", "unfused")}
    logits["eager"] = tpd.step(s, w, inp)
    tol = FP8_TOLERANCE if cfg.quant else TOLERANCE[logits["eager"].dtype]
    errs = {"fused_vs_unfused": rel_err(logits["fused"], logits["unfused"]),
            "fused_vs_eager": rel_err(logits["fused"], logits["eager"]),
            "unfused_vs_eager": rel_err(logits["unfused"], logits["eager"])}
    out["logits"] = {**errs, "tolerance": tol, "max_abs": float(logits["eager"].abs().max()),
                     "std": float(logits["eager"].float().std()),
                     "match": all(e["rel_l2"] <= tol for e in errs.values())}

    # Replays per sample: enough to fill --sample-ms, the same for both variants
    # and on every rank (each replay holds collectives: unequal counts would hang).
    probe = time_us(runs["unfused"], 2, device)
    n = max(2, min(200, int(args.sample_ms * 1000 / max(probe, 1.0))))
    counts: list[Any] = [None] * world
    dist.all_gather_object(counts, n)
    n = max(counts)
    samples: dict[str, list[float]] = {"fused": [], "unfused": [], "head": []}
    for r in range(args.reps):
        order = ("fused", "unfused") if r % 2 == 0 else ("unfused", "fused")
        for v in order + ("head",):
            samples[v].append(time_us(runs[v], n, device))
    out["replays_per_sample"] = n
    for v in samples:
        out[v] = {"median_us": statistics.median(samples[v]),
                  "samples_us": [round(x, 2) for x in samples[v]]}
    f, u, hd = (out[v]["median_us"] for v in ("fused", "unfused", "head"))
    out["ratio"] = f / u
    # The same step without embedding and lm_head, and scaled to the real depth
    # (a projection: every layer costs what the measured ones cost).
    out["ratio_layers_only"] = (f - hd) / (u - hd)
    scale = (cfg.real_layers or cfg.layers) / cfg.layers
    out["ratio_at_real_depth"] = ((f - hd) * scale + hd) / ((u - hd) * scale + hd)
    log(f"  {spec.label():28s} unfused {u:9.1f} us  fused {f:9.1f} us  ratio {out['ratio']:.3f}"
        f" (layers only {out['ratio_layers_only']:.3f}; emb+lm_head {hd:.1f} us)  "
        f"fusions {out['fusions_per_graph']}/{out['sites_per_graph']} {out['paths']}  "
        + (f"quant fused {out['quant_fusions_per_graph']} {out['quants']}  " if cfg.quant else "")
        + f"err {errs['fused_vs_unfused']['rel_l2']:.1e}  compile {out['compile_s_unfused']}"
        f"+{out['compile_s_fused']} s")
    del runs, logits
    return out


def shapes(args: argparse.Namespace) -> list[ShapeSpec]:
    out = [ShapeSpec("decode", b, 1, args.context) for b in args.batches]
    if args.prefill:
        out.append(ShapeSpec("prefill", 1, args.prefill, 0))
    return out


def markdown_table(result: dict[str, Any]) -> str:
    lines = ["| model | layers | step | unfused us | fused us | fused/unfused | layers only | "
             "at real depth | fusions / sites per layer graph | FP8 quant fused | paths | "
             "logits rel. L2 err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in result["models"]:
        for sh in m["shapes"]:
            step = (f"decode b={sh['batch']}" if sh["kind"] == "decode"
                    else f"prefill {sh['new_tokens']}")
            quant = (f"{sh.get('quant_fusions_per_graph')}/{sh['sites_per_graph']} {m['quant']}"
                     if m.get("quant") else "-")
            lines.append(
                f"| {m['name']} | {m['layers']} | {step} | "
                f"{sh['unfused']['median_us']:.1f} | {sh['fused']['median_us']:.1f} | "
                f"{sh['ratio']:.3f} | {sh['ratio_layers_only']:.3f} | "
                f"{sh['ratio_at_real_depth']:.3f} ({m['real_layers'] or m['layers']}) | "
                f"{sh['fusions_per_graph']}/{sh['sites_per_graph']} | {quant} | "
                f"{', '.join(sh['paths'])} | {sh['logits']['fused_vs_unfused']['rel_l2']:.1e} |")
    return "\n".join(lines)


def write_result(result: dict[str, Any], out: str, name: str) -> str:
    """``<out>/<name>.json`` and the markdown table beside it; the JSON's path."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name + ".json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    table = markdown_table(result)
    with open(os.path.join(out, name + ".md"), "w") as f:
        f.write(table + "\n")
    print(table, flush=True)
    return path


def merge(paths: list[str]) -> dict[str, Any]:
    """One result of several runs' (one model each, as scripts/gpu_model.sh runs them)."""
    parts = []
    for p in paths:
        with open(p) as f:
            parts.append(json.load(f))
    meta = {**parts[0]["meta"], "wall_s": round(sum(p["meta"]["wall_s"] for p in parts), 1),
            "merged_from": [os.path.basename(p) for p in paths]}
    return {"meta": meta, "models": [m for p in parts for m in p["models"]],
            "ok": all(p["ok"] for p in parts)}


def _init_dist() -> tuple[bool, torch.device]:
    """Join (or, under torchrun, create) the process group; the device this rank uses."""
    created = False
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise SystemExit("bench_model: launch with torchrun --nproc-per-node 2 (needs a "
                             "process group)")
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
        created = True
    return created, device


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.merge:
        result = merge(args.merge)
        print(f"wrote {write_result(result, args.out, args.name)}")
        return 0 if result["ok"] else 1
    created, device = _init_dist()
    rank, world = dist.get_rank(), dist.get_world_size()
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    # A hit in the FX graph (or AOTAutograd) cache would skip the pass and leave
    # no records.  Only those two: force_disable_caches would also give every
    # compile a fresh kernel cache, recompiling each Triton kernel per graph.
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    # One entry per (shape, variant) on the layer function's code object.
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    if args.backend:
        fusion_pass.set_backend(args.backend)
    op_backend = backends.selected_name(device.type)
    log(f"world {world}, device {device.type}"
        f" ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
        f"torch {torch.__version__}, fused op backend {op_backend}")

    result: dict[str, Any] = {
        "meta": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "world_size": world,
            "dtype": "bfloat16",
            "op_backend": op_backend,
            "compile": "torch.compile(fullgraph=True, dynamic=False) of one decoder layer "
                       "(weights as arguments, one compile per shape and variant, called once "
                       "per layer) with Inductor (compile_fx) as the backend and the pass as "
                       "post_grad_custom_post_pass in the fused variant's config patches; "
                       "compile_s_unfused includes the prologue; "
                       "FX graph and AOTAutograd caches off so that the pass runs; "
                       "FP8 models: both variants with Inductor's emulate_precision_casts",
            "timing": ("whole step (embedding, layers, lm_head shard) captured in one CUDA "
                       "graph per variant; median over --reps samples of back-to-back "
                       "replays, fused and unfused alternating; rank 0's clock and logits "
                       "errors (median_us_per_rank has both ranks; ok covers both)"
                       if device.type == "cuda" else "eager calls of the compiled step, CPU"),
            "logits_error": "rel_l2 = ||a-b|| / ||b||, max_rel = max|a-b| / max|b|, over this "
                            "rank's vocab shard of the last token's logits of each sequence; "
                            "match: every rel_l2 <= tolerance",
            "head": "embedding, first norm and lm_head alone (no layers), timed alongside; "
                    "ratio_layers_only = (fused - head) / (unfused - head); "
                    "ratio_at_real_depth scales the layers' time to real_layers (a projection)",
            "embedding": "replicated (no all-reduce), so the first input norm is not a site; "
                         "the last layer's down_proj all-reduce fuses with the final norm",
            "reps": args.reps, "sample_ms": args.sample_ms,
        },
        "models": [],
    }
    ok = True
    with torch.no_grad(), Fallbacks() as fallbacks:
        for name in args.models:
            cfg = tpd.scaled(tpd.CONFIGS[name], args.layers)
            gemm, gemm_note = group_gemm(cfg, world, device)
            s = tpd.Shard.of(cfg, world, tpd.group_name(), gemm=gemm)
            log(f"{cfg.name}: hidden {cfg.hidden}, heads {cfg.heads}/{cfg.kv_heads} x "
                f"{cfg.head_dim}, intermediate {cfg.intermediate}, {cfg.layers} layers, vocab "
                f"{cfg.vocab}, {tpd.params_per_rank(cfg, world) / 1e9:.2f} B params per rank"
                + (f", FP8 {cfg.quant} (GEMM: {gemm}{'; ' + gemm_note if gemm_note else ''})"
                   if cfg.quant else ""))
            w = tpd.make_weights(cfg, rank, world, device, gemm=gemm)
            fns = compile_variants(s)
            model = {**asdict(cfg), "params_per_rank": tpd.params_per_rank(cfg, world),
                     "shapes": []}
            if cfg.quant:
                model.update(gemm=gemm, gemm_note=gemm_note)
            for spec in shapes(args):
                sh = run_shape(cfg, s, w, fns, spec, args, rank, world, device, log)
                sh["fallbacks"] = list(fallbacks.messages)
                fallbacks.messages.clear()
                per_rank = [None] * world
                dist.all_gather_object(per_rank, {v: sh[v]["median_us"]
                                                  for v in ("fused", "unfused")})
                sh["median_us_per_rank"] = per_rank
                model["shapes"].append(sh)
                if sh["sites_per_graph"] != SITES_PER_LAYER or not sh["logits"]["match"]:
                    ok = False
                    log(f"  CHECK FAILED: sites per graph {sh['sites_per_graph']} (expected "
                        f"{SITES_PER_LAYER}), logits {sh['logits']}")
                for msg in sh["fallbacks"]:
                    log(f"  note: {msg}")
            result["models"].append(model)
            del w, fns
            torch._dynamo.reset()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    oks: list[Any] = [None] * world
    dist.all_gather_object(oks, ok)
    ok = all(oks)
    result["ok"] = ok
    result["meta"]["wall_s"] = round(time.perf_counter() - t_start, 1)
    if rank == 0:
        path = write_result(result, args.out, args.name)
        log(f"wrote {path} ({'all checks passed' if ok else 'SOME CHECKS FAILED'})")
    if created:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
