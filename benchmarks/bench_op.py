"""Latency of fused all-reduce + residual + RMSNorm against the baselines, in one run.

    torchrun --nproc-per-node 2 benchmarks/bench_op.py --out-dir benchmarks/results

Per shape (bf16, residual add + RMSNorm, hidden x tokens), each method is
captured as 20 calls in one CUDA graph; the graph is replayed 50 times back to
back after warm-up, and a call's time is the median replay over 20 (the slower
rank's).
Methods:

* ``fused``: ``fusion_pass.fused_allreduce_rmsnorm(path="auto")``, the gate's
  choice with the Triton backend's limits (``unfused`` means the reference);
* ``one_stage`` / ``two_stage``: the Triton kernels forced, for the record;
* ``nccl``: ``_c10d_functional.all_reduce`` + the torch.compile'd add+norm;
* ``symm_one_shot``: ``torch.ops.symm_mem.one_shot_all_reduce`` on a symmetric
  input + the compiled add+norm;
* ``barrier``: the symmetric-memory barrier alone (the synchronisation floor).

Prints a table of microseconds and ratios to ``nccl``; writes
``op_h200x2.json`` (or ``--name``) in ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

HIDDENS = (2880, 4096, 7168, 8192)
TOKENS = (1, 2, 4, 8, 16, 32, 64, 80, 128, 256, 512, 1024, 2048)
CALLS = 20
REPLAYS = 50
EPS = 1e-6
DTYPE = torch.bfloat16


def add_rms_norm(reduced: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor):
    from fusion_pass.backends.reference import add_rms_norm as ref

    return ref(reduced, residual, weight, EPS, False)


def time_graph(step: Callable[[int], object]) -> float:
    """Median microseconds per call of ``CALLS`` calls of ``step(i)`` in one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(CALLS):
            step(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            step(i)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    # Back-to-back replays, one event pair each, one sync at the end: the GPU
    # never idles between replays (idle gaps would add clock and launch noise).
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(REPLAYS)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    times = [start.elapsed_time(end) * 1000 / CALLS for start, end in events]
    del graph
    mine = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--name", default="op_h200x2.json")
    ap.add_argument("--hidden", type=int, nargs="*", default=list(HIDDENS))
    ap.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    args = ap.parse_args(argv)

    import torch.distributed._symmetric_memory as symm_mem

    import fusion_pass
    from fusion_pass import gate
    from fusion_pass.backends import triton_symm

    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    gname = dist.group.WORLD.group_name
    # One compile per hidden size (tokens dynamic, hidden static), plus tokens == 1.
    torch._dynamo.config.automatic_dynamic_shapes = False
    compiled = torch.compile(add_rms_norm)

    def norm(reduced, residual, weight):
        torch._dynamo.maybe_mark_dynamic(reduced, 0)
        torch._dynamo.maybe_mark_dynamic(residual, 0)
        return compiled(reduced, residual, weight)

    max_tokens, max_hidden = max(args.tokens), max(args.hidden)
    symm_in = symm_mem.empty(max_tokens * max_hidden, dtype=DTYPE, device="cuda")
    handle = symm_mem.rendezvous(symm_in, gname)

    rows = []
    for hidden in args.hidden:
        w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(DTYPE)
        for n in args.tokens:
            g = torch.Generator(device="cuda").manual_seed(1000 * rank + n)
            xs = [torch.randn(n, hidden, device="cuda", generator=g).to(DTYPE) for _ in range(CALLS)]
            g.manual_seed(7 + n)
            rs = [torch.randn(n, hidden, device="cuda", generator=g).to(DTYPE) for _ in range(CALLS)]
            sin = symm_in[: n * hidden].view(n, hidden)
            sin.copy_(xs[0])
            decision = gate.decide(hidden, DTYPE, world, n, limits=triton_symm.LIMITS)

            def fused(i, path="auto"):
                return fusion_pass.fused_allreduce_rmsnorm(xs[i], w, EPS, gname, residual=rs[i],
                                                           path=path)

            def nccl(i):
                s = torch.ops._c10d_functional.all_reduce(xs[i], "sum", gname)
                return norm(torch.ops._c10d_functional.wait_tensor(s), rs[i], w)

            def one_shot(i):
                return norm(torch.ops.symm_mem.one_shot_all_reduce(sin, "sum", gname), rs[i], w)

            def barrier(i):
                handle.barrier(channel=0)

            row = {"hidden": hidden, "tokens": n, "gate_path": decision.path.value}
            methods = {"fused": fused, "nccl": nccl, "symm_one_shot": one_shot, "barrier": barrier}
            if gate.one_stage_fits(hidden, "bfloat16"):
                methods["one_stage"] = lambda i: fused(i, "one_stage")
            methods["two_stage"] = lambda i: fused(i, "two_stage")
            for name, step in methods.items():
                try:
                    row[name] = time_graph(step)
                except Exception as e:  # one broken baseline must not lose the others
                    torch.cuda.synchronize()
                    row[name] = float("nan")
                    row.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:300]}"
                    if rank == 0:
                        print(f"{name} failed at {hidden}x{n}: {row['errors'][name]}", flush=True)
            rows.append(row)
            if rank == 0:
                print(_line(row), flush=True)
            del xs, rs
            torch.cuda.empty_cache()

    if rank == 0:
        print(_table(rows))
        os.makedirs(args.out_dir, exist_ok=True)
        meta = {
            "device": torch.cuda.get_device_name(),
            "world_size": world,
            "torch": torch.__version__,
            "triton": __import__("triton").__version__,
            "dtype": "bfloat16",
            "calls_per_graph": CALLS,
            "replays": REPLAYS,
            "statistic": "median over replays of (replay time / calls), max over ranks, us",
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "limits": {"max_bytes": triton_symm.LIMITS.max_bytes,
                       "one_stage_max_bytes": triton_symm.LIMITS.one_stage_max_bytes},
        }
        with open(os.path.join(args.out_dir, args.name), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


COLUMNS = ("fused", "one_stage", "two_stage", "nccl", "symm_one_shot", "barrier")


def _line(row: dict) -> str:
    cells = " ".join(f"{c}={row[c]:.1f}" for c in COLUMNS if c in row)
    return f"hidden {row['hidden']} tokens {row['tokens']} [{row['gate_path']}]: {cells}"


def _table(rows: list[dict]) -> str:
    head = (f"{'hidden':>6} {'tokens':>6} {'path':>9} | " + " ".join(f"{c:>9}" for c in COLUMNS)
            + " | fused/nccl  1st/nccl  2st/nccl  oneshot/nccl")
    out = ["", "us per call (bf16, residual + RMSNorm, CUDA-graph replay)", head]
    for r in rows:
        us = " ".join(f"{r[c]:9.1f}" if c in r else f"{'-':>9}" for c in COLUMNS)
        nccl = r["nccl"]
        ratios = "  ".join(f"{r[c] / nccl:8.2f}" if c in r else f"{'-':>8}"
                           for c in ("fused", "one_stage", "two_stage", "symm_one_shot"))
        out.append(f"{r['hidden']:>6} {r['tokens']:>6} {r['gate_path']:>9} | {us} | {ratios}")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
