"""Latency of fused all-reduce + residual + RMSNorm against the baselines, in one run.

    torchrun --nproc-per-node 2 benchmarks/op/bench_op.py --out-dir benchmarks/results

One process does three phases, so that the final numbers come from the
schedule table this same run produces:

1. ``one_stage`` / ``two_stage``: the Triton kernels forced, at every shape
   (hidden x tokens, bf16) a kernel takes;
2. the crossover (``crossover.py``): the schedule per hidden size, written to
   ``triton_schedule.json`` in ``--out-dir`` and run by a Triton backend of
   this benchmark's own (the package's committed schedule is left as it is:
   ``benchmarks/op/crossover.py RESULT.json`` installs a new one);
3. ``fused`` (``path="auto"``, the gate with that schedule, column
   ``gate_path``) and the baselines:

   * ``nccl``: ``_c10d_functional.all_reduce`` + the torch.compile'd add+norm;
   * ``symm_one_shot``: ``torch.ops.symm_mem.one_shot_all_reduce`` on a
     symmetric input + the compiled add+norm;
   * ``flashinfer``: FlashInfer's TRT-LLM Lamport fusion (what vLLM uses on
     CUDA), the fastest of ``launch_with_pdl`` on/off x one-shot/two-shot
     (two-shot needs tokens > world size), its configuration in
     ``flashinfer_config``; absent, with the reason in ``meta.flashinfer``,
     where FlashInfer cannot be imported;
   * ``barrier``: the symmetric-memory barrier alone (the synchronisation floor);
   * ``one_stage_again`` / ``two_stage_again``: the kernel the gate did not
     pick, forced, timed next to ``fused``; ``fused_vs_faster_kernel`` is
     ``fused`` over the faster of the two kernels in this phase.

Every method is captured as ``--calls`` calls in one CUDA graph on distinct
inputs; the graph is replayed ``--replays`` times back to back after warm-up,
and a call's time is the median replay over ``--calls`` (the slower rank's).
``spread`` holds each column's interquartile range over the replays;
``declined`` the kernel paths the backend does not take at a shape (and why);
``rel_err_y`` the relative L2 error of ``y`` against the op's unfused
reference on the first call's inputs, the worst over the ranks;
``fused_fell_back`` whether the fused call ran that reference.  Then, without a CUDA graph, ``eager``: host time per
call of 2000 back-to-back calls at 8 x 4096 of the op, of NCCL + the eager
norm, of FlashInfer and of one ``torch.add`` (the host's own speed; top-level
``eager_us_per_call``: the op's).

Prints a table of microseconds and ratios; writes ``op_h200x2.json`` (or
``--name``) and ``triton_schedule.json`` in ``--out-dir`` (the JSON after every
shape, so that a run stopped by its time limit keeps what it measured).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

# This part's modules, and the ones the benchmarks share (bench_common.py).
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
import crossover  # noqa: E402
from bench_common import Fallbacks, rel_err, worst_over_ranks  # noqa: E402

HIDDENS = (2880, 4096, 7168, 8192, 12288, 16384)
TOKENS = (1, 2, 4, 8, 16, 32, 64, 80, 128, 256, 512, 1024, 2048)
CALLS = 20
REPLAYS = 20
"""Measured on 2 x H200 (20 replays of 20 calls): the interquartile range of the
per-call times is 0.01-0.3 us (at most 2.5 % of the median, NCCL's), so the
median's standard error is a few nanoseconds; run-to-run differences (clocks,
placement) are far larger, and more replays would only lengthen the run."""
EAGER_CALLS = 2000
EAGER_SHAPE = (8, 4096)
EPS = 1e-6
DTYPE = torch.bfloat16
KERNEL_PATHS = ("one_stage", "two_stage")
OTHER_PATH = {"one_stage": "two_stage", "two_stage": "one_stage"}
COLUMNS = ("fused", "one_stage", "two_stage", "nccl", "symm_one_shot", "flashinfer", "barrier")
RATIOS = (("fused", "nccl"), ("fused", "flashinfer"), ("flashinfer", "nccl"),
          ("one_stage", "nccl"), ("two_stage", "nccl"), ("symm_one_shot", "nccl"))

Step = Callable[[int], object]


class Timed(NamedTuple):
    us: float
    """Median over replays of (replay time / calls), max over ranks."""
    iqr_us: float
    """Interquartile range of the same per-call times, max over ranks."""


@dataclasses.dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    group_name: str


def init() -> Dist:
    """Join the NCCL group (under torchrun) and set what every compile here assumes."""
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    # One compile per hidden size (tokens dynamic, hidden static), plus tokens == 1.
    torch._dynamo.config.automatic_dynamic_shapes = False
    torch._dynamo.config.recompile_limit = 64
    return Dist(dist.get_rank(), dist.get_world_size(), dist.group.WORLD.group_name)


def token_dynamic(fn: Callable[..., Any],
                  options: Optional[dict[str, Any]] = None) -> Callable[..., Any]:
    """``torch.compile(fn, options=options)`` with dim 0 of every 2-d argument (tokens)
    dynamic: one graph per static hidden size serves every token count above 1."""
    compiled = torch.compile(fn, options=options)

    def call(*args: Any) -> Any:
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim() == 2:
                torch._dynamo.maybe_mark_dynamic(a, 0)
        return compiled(*args)

    return call


def add_rms_norm(reduced: torch.Tensor, residual: torch.Tensor,
                 weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from fusion_pass.backends.reference import add_rms_norm as ref

    return ref(reduced, residual, weight, EPS, False)


class Inputs(NamedTuple):
    xs: list[torch.Tensor]
    """Per call: this rank's partial sums, [tokens, hidden] (distinct per rank)."""
    rs: list[torch.Tensor]
    """Per call: the residual, equal on every rank (as in tensor parallelism)."""
    w: torch.Tensor


def make_inputs(hidden: int, tokens: int, rank: int, calls: int) -> Inputs:
    """Deterministic in (hidden, tokens, rank): every phase sees the same data."""
    g = torch.Generator(device="cuda").manual_seed(1000 * rank + tokens)
    xs = [torch.randn(tokens, hidden, device="cuda", generator=g).to(DTYPE) for _ in range(calls)]
    g.manual_seed(7 + tokens)
    rs = [torch.randn(tokens, hidden, device="cuda", generator=g).to(DTYPE) for _ in range(calls)]
    g.manual_seed(hidden)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).to(DTYPE)
    return Inputs(xs, rs, w)


def time_graph(step: Step, calls: int = CALLS, replays: int = REPLAYS) -> Timed:
    """Per-call time of ``calls`` calls of ``step(i)`` captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):
            step(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            step(i)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    # Back-to-back replays, one event pair each, one sync at the end: the GPU
    # never idles between replays (idle gaps would add clock and launch noise).
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(replays)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    times = [start.elapsed_time(end) * 1000 / calls for start, end in events]
    del graph
    q1, _, q3 = statistics.quantiles(times, n=4) if len(times) > 1 else (times[0],) * 3
    mine = torch.tensor([statistics.median(times), q3 - q1], device="cuda")
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return Timed(float(mine[0]), float(mine[1]))


def time_eager(step: Step, n: int, calls: int) -> float:
    """Host microseconds per call of ``n`` back-to-back eager calls (slower rank).

    The garbage collector is off while timing, as ``timeit`` has it: late in a
    run the heap holds every compiled graph, and one full collection inside the
    window would add its tens of milliseconds to whichever method it hit."""
    for i in range(calls):
        step(i)
    torch.cuda.synchronize()
    dist.barrier()
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for i in range(n):
            step(i % calls)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    finally:
        gc.enable()
    mine = torch.tensor([elapsed * 1e6 / n], device="cuda")
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine)


def measure(row: dict[str, Any], methods: dict[str, Step], timer: Callable[[Step], Timed],
            rank: int) -> None:
    """Time each method into ``row`` (us, ``spread``); a failing one gets NaN and its error."""
    for name, step in methods.items():
        try:
            t = timer(step)
            row[name] = t.us
            row.setdefault("spread", {})[name] = round(t.iqr_us, 3)
        except Exception as e:  # one broken baseline must not lose the others
            torch.cuda.synchronize()
            row[name] = float("nan")
            row.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:300]}"
            if rank == 0:
                print(f"{name} failed at {row['hidden']}x{row['tokens']}: "
                      f"{row['errors'][name]}", flush=True)


def fell_back(step: Step) -> bool:
    """Whether one call of ``step`` ran the op's reference (a fused column that fell
    back measures the reference, not a kernel)."""
    from fusion_pass import backends

    ref = backends.get("reference")
    seen: list[object] = []

    def counting(call: Any) -> Any:
        seen.append(call)
        return type(ref).run(ref, call)

    ref.run = counting  # type: ignore[method-assign]
    try:
        step(0)
    finally:
        del ref.run
    torch.cuda.synchronize()
    return bool(seen)


MEASURED_BACKEND = "triton-measured"
"""The benchmark's own Triton backend: the kernels with the schedules this run measured."""


def select_measured(table: dict[str, Any]) -> Any:
    """Select, in this process, a Triton backend that runs ``table``'s schedules (the
    package's backends and committed schedule stay as they are); its limits."""
    from fusion_pass import backends, schedules
    from fusion_pass.backends import triton_symm
    from fusion_pass.backends.triton_symm.limits import limits as triton_limits

    limits = triton_limits(schedules.parse(table))
    backends.register(MEASURED_BACKEND, lambda: triton_symm.TritonBackend(limits))
    backends.forget(MEASURED_BACKEND)
    backends.set_backend(MEASURED_BACKEND)
    assert backends.select("cuda").limits is limits, "the op would not see the schedules"
    return limits


class FlashInfer:
    """FlashInfer's TRT-LLM one-kernel all-reduce + residual + RMSNorm (``trtllm`` backend).

    One workspace for every shape (sized for the largest); the residual must be
    equal on every rank, as ours is.
    """

    def __init__(self, d: Dist, max_tokens: int, max_hidden: int) -> None:
        import flashinfer.comm as fc

        self.fc = fc
        self.world = d.world
        # FlashInfer exchanges its IPC handles over a CPU group.
        self.group = dist.new_group(backend="gloo")
        self.workspace = fc.create_allreduce_fusion_workspace(
            backend="trtllm", world_size=d.world, rank=d.rank, max_token_num=max_tokens,
            hidden_dim=max_hidden, dtype=DTYPE, group=self.group)

    def configs(self, tokens: int) -> list[dict[str, bool]]:
        return [{"launch_with_pdl": pdl, "use_oneshot": one}
                for pdl in (False, True) for one in (True, False)
                if one or tokens > self.world]

    def __call__(self, x: torch.Tensor, r: torch.Tensor, w: torch.Tensor,
                 cfg: dict[str, bool]) -> tuple[torch.Tensor, torch.Tensor]:
        y, h = torch.empty_like(x), torch.empty_like(x)
        self.fc.allreduce_fusion(
            input=x, workspace=self.workspace,
            pattern=self.fc.AllReduceFusionPattern.kARResidualRMSNorm,
            trigger_completion_at_end=True, residual_out=h, norm_out=y, residual_in=r,
            rms_gamma=w, rms_eps=EPS, fp32_acc=True, **cfg)
        return y, h


def open_flashinfer(d: Dist, max_tokens: int, max_hidden: int
                    ) -> tuple[Optional[FlashInfer], dict[str, Any]]:
    """FlashInfer, or None and why (the run goes on without the column)."""
    try:
        import flashinfer

        fi = FlashInfer(d, max_tokens, max_hidden)
        return fi, {"available": True, "version": flashinfer.__version__,
                    "backend": "trtllm", "fp32_acc": True}
    except Exception as e:  # not installed, or its build or workspace failed
        why = f"{type(e).__name__}: {str(e)[:300]}"
        if d.rank == 0:
            print(f"flashinfer column skipped: {why}", flush=True)
        return None, {"available": False, "reason": why}


def flashinfer_best(fi: FlashInfer, inp: Inputs, row: dict[str, Any],
                    timer: Callable[[Step], Timed], rank: int, ref: torch.Tensor) -> None:
    """The fastest configuration into ``row["flashinfer"]``, every one in its config."""
    per: dict[str, dict[str, Any]] = {}
    for cfg in fi.configs(row["tokens"]):
        key = f"pdl={int(cfg['launch_with_pdl'])},oneshot={int(cfg['use_oneshot'])}"
        sub: dict[str, Any] = {"hidden": row["hidden"], "tokens": row["tokens"]}
        measure(sub, {"flashinfer": lambda i, c=cfg: fi(inp.xs[i], inp.rs[i], inp.w, c)},
                timer, rank)
        per[key] = {**cfg, "us": sub["flashinfer"], **({"error": sub["errors"]["flashinfer"]}
                                                       if "errors" in sub else {})}
    ok = {k: v for k, v in per.items() if math.isfinite(v["us"])}
    if not ok:
        row["flashinfer"] = float("nan")
        row["flashinfer_config"] = {"all": per}
        return
    best = min(ok, key=lambda k: ok[k]["us"])
    cfg = {k: per[best][k] for k in ("launch_with_pdl", "use_oneshot")}
    y, _ = fi(inp.xs[0], inp.rs[0], inp.w, cfg)
    row["flashinfer"] = per[best]["us"]
    worst = worst_over_ranks({"rel_err_y": rel_err(y, ref)["rel_l2"]})
    row["flashinfer_config"] = {**cfg, **worst, "all": {k: v["us"] for k, v in per.items()}}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--name", default="op_h200x2.json")
    ap.add_argument("--hidden", type=int, nargs="+", default=list(HIDDENS))
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--calls", type=int, default=CALLS, help="calls captured per CUDA graph")
    ap.add_argument("--replays", type=int, default=REPLAYS, help="timed replays per method")
    ap.add_argument("--eager-calls", type=int, default=EAGER_CALLS,
                    help="back-to-back eager calls at 8 x 4096 (0: skip)")
    ap.add_argument("--noise", type=float, default=crossover.NOISE,
                    help="crossover: relative difference below which a count keeps its path")
    ap.add_argument("--no-flashinfer", action="store_true", help="leave the FlashInfer column out")
    args = ap.parse_args(argv)
    if args.calls < 1 or args.replays < 1:
        ap.error("--calls and --replays must be positive")

    import torch.distributed._symmetric_memory as symm_mem

    import fusion_pass
    from fusion_pass import gate
    from fusion_pass.backends import triton_symm

    d = init()
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        if d.rank == 0:
            print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    norm = token_dynamic(add_rms_norm)
    max_tokens, max_hidden = max(args.tokens), max(args.hidden)
    symm_in = symm_mem.empty(max_tokens * max_hidden, dtype=DTYPE, device="cuda")
    handle = symm_mem.rendezvous(symm_in, d.group_name)
    fi, fi_meta = ((None, {"available": False, "reason": "--no-flashinfer"}) if args.no_flashinfer
                   else open_flashinfer(d, max_tokens, max_hidden))

    def timer(step: Step) -> Timed:
        return time_graph(step, args.calls, args.replays)

    def fused(inp: Inputs, path: str) -> Step:
        return lambda i: fusion_pass.fused_allreduce_rmsnorm(
            inp.xs[i], inp.w, EPS, d.group_name, residual=inp.rs[i], path=path)

    shapes = [(h, n) for h in args.hidden for n in args.tokens]
    rows = {s: {"hidden": s[0], "tokens": s[1]} for s in shapes}
    result: dict[str, Any] = {"meta": {}, "rows": list(rows.values())}
    fallbacks = Fallbacks()

    def dump(phase: str) -> None:
        if d.rank != 0:
            return
        result["meta"] = {
            "device": torch.cuda.get_device_name(), "world_size": d.world,
            "torch": torch.__version__, "triton": __import__("triton").__version__,
            "dtype": "bfloat16", "calls_per_graph": args.calls, "replays": args.replays,
            "statistic": "median over replays of (replay time / calls), max over ranks, us; "
                         "spread: interquartile range of the same, max over ranks",
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "phase": phase,
            "wall_s": round(time.perf_counter() - t_start, 1),
            "flashinfer": fi_meta, "fallbacks": list(fallbacks.messages),
            "limits": {"max_bytes": triton_symm.LIMITS.max_bytes,
                       "schedules": "triton_schedule.json of this run (run by the "
                                    "benchmark's own backend in phase 3)" if phase != "kernels" else "none yet"},
        }
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, args.name), "w") as f:
            json.dump(result, f, indent=1)

    with fallbacks:
        # Phase 1: both kernels, forced, wherever the backend takes the shape.
        for h, n in shapes:
            row, inp = rows[(h, n)], make_inputs(h, n, d.rank, args.calls)
            methods = {}
            for path in KERNEL_PATHS:
                why = triton_symm.LIMITS.accepts(h, DTYPE, d.world, n, gate.Path(path))
                if why is None:
                    methods[path] = fused(inp, path)
                else:
                    row.setdefault("declined", {})[path] = why
            measure(row, methods, timer, d.rank)
            del inp
            torch.cuda.empty_cache()
        log("phase 1 (one_stage, two_stage) done")
        dump("kernels")

        # Phase 2: the crossover table, written and installed.
        table = crossover.table(
            rows.values(), "bfloat16", d.world, noise=args.noise,
            source=f"benchmarks/op/bench_op.py, {d.world} x {torch.cuda.get_device_name()}, "
                   f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
        if d.rank == 0:
            crossover.write(table, os.path.join(args.out_dir, "triton_schedule.json"))
        limits = select_measured(table)
        log("phase 2: the measured schedules selected\n" + crossover.describe(table))

        # Phase 3: the op as the gate now schedules it, and the baselines.
        for h, n in shapes:
            row, inp = rows[(h, n)], make_inputs(h, n, d.rank, args.calls)
            row["gate_path"] = gate.decide(h, DTYPE, d.world, n, limits=limits).path.value
            sin = symm_in[: n * h].view(n, h)
            sin.copy_(inp.xs[0])

            def nccl(i: int, inp: Inputs = inp) -> object:
                s = torch.ops._c10d_functional.all_reduce(inp.xs[i], "sum", d.group_name)
                return norm(torch.ops._c10d_functional.wait_tensor(s), inp.rs[i], inp.w)

            def one_shot(i: int, inp: Inputs = inp, sin: torch.Tensor = sin) -> object:
                return norm(torch.ops.symm_mem.one_shot_all_reduce(sin, "sum", d.group_name),
                            inp.rs[i], inp.w)

            methods = {"fused": fused(inp, "auto"), "nccl": nccl, "symm_one_shot": one_shot,
                       "barrier": lambda i: handle.barrier(channel=0)}
            other = OTHER_PATH.get(row["gate_path"])
            if other is not None and other in row:
                # The other kernel again, next to `fused` (which runs the gate's path):
                # phase 1's columns are minutes older, and the clocks drift.
                methods[f"{other}_again"] = fused(inp, other)
            measure(row, methods, timer, d.rank)
            if other is not None and f"{other}_again" in row:
                row["fused_vs_faster_kernel"] = row["fused"] / min(row["fused"],
                                                                   row[f"{other}_again"])
            ref, _ = fusion_pass.fused_allreduce_rmsnorm(inp.xs[0], inp.w, EPS, d.group_name,
                                                         residual=inp.rs[0], path="unfused")
            y, _ = fused(inp, "auto")(0)
            row["rel_err_y"] = worst_over_ranks({"fused": rel_err(y, ref)["rel_l2"]})
            row["fused_fell_back"] = fell_back(fused(inp, "auto"))
            if fi is not None:
                flashinfer_best(fi, inp, row, timer, d.rank, ref)
            log(_line(row))
            del inp, sin, ref, y
            torch.cuda.empty_cache()
            dump("final")
        log("phase 3 (fused, baselines) done")

        if args.eager_calls:
            result["eager"] = eager(d, fi, rows, args.eager_calls, args.calls)
            result["eager_us_per_call"] = result["eager"]["fused_us_per_call"]
            log(f"eager at {EAGER_SHAPE[0]} x {EAGER_SHAPE[1]}: {result['eager']}")
    dump("final")
    if d.rank == 0:
        print(_table(list(rows.values())), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def eager(d: Dist, fi: Optional[FlashInfer], rows: dict[tuple[int, int], dict[str, Any]],
          n: int, calls: int) -> dict[str, Any]:
    """Host time per call without a CUDA graph: the op, NCCL + eager norm, FlashInfer."""
    import fusion_pass

    hidden, tokens = EAGER_SHAPE[1], EAGER_SHAPE[0]
    inp = make_inputs(hidden, tokens, d.rank, calls)

    def nccl(i: int) -> object:
        s = torch.ops._c10d_functional.all_reduce(inp.xs[i], "sum", d.group_name)
        return add_rms_norm(torch.ops._c10d_functional.wait_tensor(s), inp.rs[i], inp.w)

    out: dict[str, Any] = {
        "hidden": hidden, "tokens": tokens, "calls": n,
        "fused_us_per_call": time_eager(lambda i: fusion_pass.fused_allreduce_rmsnorm(
            inp.xs[i], inp.w, EPS, d.group_name, residual=inp.rs[i]), n, calls),
        "nccl_eager_us_per_call": time_eager(nccl, n, calls),
        # One eager ATen op and its launch: how fast this run's host dispatches at
        # all (it varied 2-3 x between machines of one kind), to compare runs by.
        "torch_add_us_per_call": time_eager(lambda i: torch.add(inp.xs[i], 1), n, calls)}
    if fi is not None:
        # The configuration phase 3 found fastest at this shape, if it measured it.
        best = rows.get((hidden, tokens), {}).get("flashinfer_config", {})
        cfg = {k: best.get(k, default) for k, default in (("launch_with_pdl", False),
                                                           ("use_oneshot", True))}
        out["flashinfer_us_per_call"] = time_eager(
            lambda i: fi(inp.xs[i], inp.rs[i], inp.w, cfg), n, calls)
        out["flashinfer_config"] = cfg
    return out


def _line(row: dict[str, Any]) -> str:
    cells = " ".join(f"{c}={row[c]:.1f}" for c in COLUMNS if c in row)
    return f"hidden {row['hidden']} tokens {row['tokens']} [{row.get('gate_path')}]: {cells}"


def _table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'hidden':>6} {'tokens':>6} {'path':>9} | " + " ".join(f"{c[:9]:>9}" for c in COLUMNS)
            + " | " + " ".join(f"{(a[:5] + '/' + b[:5]):>11}" for a, b in RATIOS))
    out = ["", "us per call (bf16, residual + RMSNorm, CUDA-graph replay); ratios a/b", head]
    for r in rows:
        us = " ".join(f"{r[c]:9.1f}" if c in r else f"{'-':>9}" for c in COLUMNS)
        ratios = " ".join(f"{r[a] / r[b]:11.2f}" if a in r and b in r and r[b] > 0
                          else f"{'-':>11}" for a, b in RATIOS)
        out.append(f"{r['hidden']:>6} {r['tokens']:>6} {r.get('gate_path', '-'):>9} | {us} | {ratios}")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
