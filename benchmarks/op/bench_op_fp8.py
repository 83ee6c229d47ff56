"""Latency of fused all-reduce + residual + RMSNorm + FP8 quantization against the baselines.

    torchrun --nproc-per-node 2 benchmarks/op/bench_op_fp8.py --out-dir benchmarks/results

Per shape (bf16 input, hidden x tokens) and quantization (``static``: one
checkpoint scale, ``y * (1 / scale)``; ``per_token``: a dynamic scale per token
as vLLM's ``QuantFP8`` computes it; ``group128``: a dynamic scale per 128
elements, divided, as DeepSeek's recipe), in one run and with
``bench_op.py``'s timing (``--calls`` calls per CUDA graph, median of
``--replays`` replays, the slower rank):

* ``fused``: ``fusion_pass.op.fused_allreduce_rmsnorm_quant(path="auto")``;
* ``unfused``: NCCL all-reduce + the torch.compile'd add + norm + quantization
  (one graph: Inductor fuses norm and quantization itself; compiled with
  ``emulate_precision_casts`` so that it quantizes ``y`` rounded to bf16, as
  the math of :func:`fusion_pass.quant.quantize` says);
* ``fused_noquant``: today's fused op + the compiled quantization;
* ``barrier``: the symmetric-memory barrier alone.

The quantization math is :func:`fusion_pass.quant.quantize` everywhere.
``check`` compares ``fused`` and ``fused_noquant`` with ``unfused`` on the first
call's inputs: FP8 codes that differ (``q_mismatch`` of ``q_total``), the
relative L2 error of the dequantized values and of the scales.
``fused_fell_back`` says whether the fused call ran the op's reference (no
fused kernel for that shape or mode); ``meta.fallbacks`` has the op's own words.

Writes ``op_fp8_h200x2.json`` (or ``--name``) in ``--out-dir`` after every shape.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable, Optional

import torch

# This part's modules, and the ones the benchmarks share (bench_common.py).
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
import bench_op as bo  # noqa: E402
from bench_common import Fallbacks, rel_err, worst_over_ranks  # noqa: E402

from fusion_pass.quant import QuantSpec, quantize  # noqa: E402

HIDDENS = (2880, 4096, 7168, 8192)
TOKENS = (1, 8, 32, 80, 128, 512, 2048)
QUANTS: dict[str, QuantSpec] = {
    "static": QuantSpec("static", reciprocal=True),
    "per_token": QuantSpec("per_token", scale_floor=1.0 / (448.0 * 512.0), reciprocal=True),
    "group128": QuantSpec("per_group", group=128, scale_floor=1e-10 / 448.0),
}
STATIC_SCALE = 0.02
"""The checkpoint's activation scale: norm outputs here stay within +-6, well inside
448 * 0.02, so the static codes clip nothing."""
COLUMNS = ("fused", "unfused", "fused_noquant", "barrier")


def compiled_quant_fns(spec: QuantSpec) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The two compiled baselines of one spec: add + norm + quantization, and the
    quantization alone."""

    def norm_quant(reduced: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                   scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        y, h = bo.add_rms_norm(reduced, residual, weight)
        q, s = quantize(y, spec, scale)
        return q, s, h

    def quant(y: torch.Tensor, scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize(y, spec, scale)

    # Inductor rounds y to bf16 before quantizing it, as quantize() and the fused op
    # do; by default it keeps y in fp32 there, and 4-5 % of the codes differed from
    # the fused op's for that alone (2 x H200): the check would measure Inductor.
    exact = {"emulate_precision_casts": True}
    return bo.token_dynamic(norm_quant, exact), bo.token_dynamic(quant, exact)


def dequantize(q: torch.Tensor, scales: torch.Tensor, spec: QuantSpec,
               scale: Optional[torch.Tensor]) -> torch.Tensor:
    qf = q.float()
    if spec.mode == "static":
        assert scale is not None
        return qf * scale.float()
    if spec.mode == "per_token":
        return qf * scales
    return (qf.unflatten(-1, (-1, spec.group)) * scales.unsqueeze(-1)).flatten(-2)


def compare(out: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...], spec: QuantSpec,
            scale: Optional[torch.Tensor]) -> dict[str, Any]:
    """``out`` and ``ref`` start with ``(q, scales)``; each check the worst over the ranks."""
    q, s = out[:2]
    q_ref, s_ref = ref[:2]
    mismatch = int((q.view(torch.uint8) != q_ref.view(torch.uint8)).sum())
    checks: dict[str, Any] = {
        "q_mismatch": mismatch, "q_total": q.numel(),
        "relerr": rel_err(dequantize(q, s, spec, scale),
                          dequantize(q_ref, s_ref, spec, scale))["rel_l2"]}
    if spec.dynamic:
        checks["scales_relerr"] = rel_err(s, s_ref)["rel_l2"]
    return worst_over_ranks(checks)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--name", default="op_fp8_h200x2.json")
    ap.add_argument("--hidden", type=int, nargs="+", default=list(HIDDENS))
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--quant", nargs="+", choices=list(QUANTS), default=list(QUANTS))
    ap.add_argument("--calls", type=int, default=bo.CALLS, help="calls captured per CUDA graph")
    ap.add_argument("--replays", type=int, default=bo.REPLAYS, help="timed replays per method")
    args = ap.parse_args(argv)

    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    import fusion_pass
    from fusion_pass import backends, gate
    from fusion_pass.op import fused_allreduce_rmsnorm_quant

    d = bo.init()
    t_start = time.perf_counter()
    barrier_buf = symm_mem.empty(1024, dtype=bo.DTYPE, device="cuda")
    handle = symm_mem.rendezvous(barrier_buf, d.group_name)
    scale = torch.tensor([STATIC_SCALE], device="cuda", dtype=torch.float32)
    baselines = {name: compiled_quant_fns(spec) for name, spec in QUANTS.items()}
    limits = backends.select("cuda").limits

    def timer(step: bo.Step) -> bo.Timed:
        return bo.time_graph(step, args.calls, args.replays)

    rows: list[dict[str, Any]] = []
    fallbacks = Fallbacks()

    def dump() -> None:
        if d.rank != 0:
            return
        meta = {"device": torch.cuda.get_device_name(), "world_size": d.world,
                "torch": torch.__version__, "dtype": "bfloat16", "fp8": "float8_e4m3fn",
                "calls_per_graph": args.calls, "replays": args.replays,
                "statistic": "median over replays of (replay time / calls), max over ranks, us",
                "quant": {k: QUANTS[k].encode() for k in args.quant},
                "static_scale": STATIC_SCALE, "op_backend": backends.selected_name("cuda"),
                "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                "wall_s": round(time.perf_counter() - t_start, 1),
                "fallbacks": list(fallbacks.messages)}
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, args.name), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)

    with fallbacks:
        for hidden in args.hidden:
            for n in args.tokens:
                inp = bo.make_inputs(hidden, n, d.rank, args.calls)
                for name in args.quant:
                    spec = QUANTS[name]
                    if spec.group and hidden % spec.group:
                        continue  # no whole groups (GPT-OSS's 2880 = 22.5 x 128): nothing to measure
                    sc = scale if spec.mode == "static" else None
                    norm_quant, quant = baselines[name]
                    decision = gate.decide(hidden, bo.DTYPE, d.world, n, limits=limits,
                                           group_size=spec.group or None)
                    row: dict[str, Any] = {"hidden": hidden, "tokens": n, "quant": name,
                                           "gate_path": decision.path.value}

                    def fused(i: int, inp: bo.Inputs = inp, spec: QuantSpec = spec,
                              sc: Optional[torch.Tensor] = sc) -> tuple[torch.Tensor, ...]:
                        return fused_allreduce_rmsnorm_quant(inp.xs[i], inp.w, bo.EPS,
                                                             d.group_name, spec, sc,
                                                             residual=inp.rs[i])

                    def unfused(i: int, inp: bo.Inputs = inp, sc: Optional[torch.Tensor] = sc,
                                norm_quant: Callable[..., Any] = norm_quant
                                ) -> tuple[torch.Tensor, ...]:
                        s = torch.ops._c10d_functional.all_reduce(inp.xs[i], "sum", d.group_name)
                        return norm_quant(torch.ops._c10d_functional.wait_tensor(s), inp.rs[i],
                                          inp.w, sc)

                    def fused_noquant(i: int, inp: bo.Inputs = inp,
                                      sc: Optional[torch.Tensor] = sc,
                                      quant: Callable[..., Any] = quant
                                      ) -> tuple[torch.Tensor, ...]:
                        y, _ = fusion_pass.fused_allreduce_rmsnorm(
                            inp.xs[i], inp.w, bo.EPS, d.group_name, residual=inp.rs[i])
                        return quant(y, sc)

                    bo.measure(row, {"fused": fused, "unfused": unfused,
                                     "fused_noquant": fused_noquant,
                                     "barrier": lambda i: handle.barrier(channel=0)},
                               timer, d.rank)
                    ref = unfused(0)
                    row["check"] = {"fused": compare(fused(0), ref, spec, sc),
                                    "fused_noquant": compare(fused_noquant(0), ref, spec, sc)}
                    row["fused_fell_back"] = bo.fell_back(fused)
                    rows.append(row)
                    if d.rank == 0:
                        print(_line(row), flush=True)
                    dump()
                del inp
                torch.cuda.empty_cache()
    dump()
    if d.rank == 0:
        print(_table(rows), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _line(row: dict[str, Any]) -> str:
    cells = " ".join(f"{c}={row[c]:.1f}" for c in COLUMNS if c in row)
    c = row["check"]["fused"]
    return (f"hidden {row['hidden']} tokens {row['tokens']} {row['quant']} [{row['gate_path']}"
            f"{', fell back' if row['fused_fell_back'] else ''}]: {cells}  fused vs unfused: "
            f"{c['q_mismatch']}/{c['q_total']} codes differ, relerr {c['relerr']:.1e}")


def _table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'hidden':>6} {'tokens':>6} {'quant':>9} {'path':>9} | "
            + " ".join(f"{c[:10]:>10}" for c in COLUMNS)
            + " | fused/unfused  fused/noquant  noquant/unfused | mismatch  relerr")
    out = ["", "us per call (bf16 in, FP8 e4m3 out, residual + RMSNorm + quant, CUDA-graph replay)",
           head]
    for r in rows:
        us = " ".join(f"{r[c]:10.1f}" for c in COLUMNS)
        c = r["check"]["fused"]
        out.append(f"{r['hidden']:>6} {r['tokens']:>6} {r['quant']:>9} {r['gate_path']:>9} | {us} | "
                   f"{r['fused'] / r['unfused']:13.2f}  {r['fused'] / r['fused_noquant']:13.2f}  "
                   f"{r['fused_noquant'] / r['unfused']:15.2f} | {c['q_mismatch']:8d}  "
                   f"{c['relerr']:.1e}")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
