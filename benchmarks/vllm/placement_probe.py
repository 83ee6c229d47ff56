"""Does where the engine's processes run on the host explain the spread of vLLM's TPOT?

Two identical engines (``off`` and its A/A twin, built as ``bench_vllm.py`` builds them)
of one model, measured call by call, alternating, under several placements of their
processes on the host's CPUs (``cpu_placement``): left to the scheduler, pinned (one CPU
each for the frontend and the engine core, or two each), each of those with every CPU kept
from halting (``cpu_placement.Spinners``), frontend and engine core on one CPU, and on the
two SMT siblings of one core where the host shows them.  Per placement and batch: every
call's TPOT for each engine, the medians, the A/A ratio of the medians and the range of the
per-call ratios.  Also the host's CPU topology and the two compiles' kernel digests
(whether their kernel choices agree).

Needs one NVIDIA GPU and vLLM (0.26 or later); about 3 minutes.

    python benchmarks/vllm/placement_probe.py OUTDIR [--model dense-h2880] [--calls 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

# This part's modules, and the ones the benchmarks share (bench_common.py).
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import bench_vllm  # noqa: E402
import cpu_placement  # noqa: E402
import vllm_run  # noqa: E402
from bench_common import run_metadata  # noqa: E402

START = time.monotonic()


def placements(topo: cpu_placement.Topology) \
        -> dict[str, tuple[Optional[cpu_placement.Placement], bool]]:
    """The placements to compare, by name: (the CPUs of each role, None for the
    scheduler's choice; whether every CPU is kept from halting, cpu_placement.Spinners)."""
    out: dict[str, tuple[Optional[cpu_placement.Placement], bool]] = {
        "scheduler": (None, False), "scheduler, no halt": (None, True)}
    for f, c in ((1, 1), (2, 2)):
        p, why = cpu_placement.plan(1, topo, f, c)
        if p is None:
            print(f"pinned {f}+{c}: {why}", flush=True)
            continue
        out[f"pinned {f}+{c}"] = (p, False)
        out[f"pinned {f}+{c}, no halt"] = (p, True)
    base = out.get("pinned 1+1", (None, False))[0]
    if base is not None:
        out["one CPU"] = (cpu_placement.Placement(frontend=base.core, core=base.core,
                                                  workers=[], driver=base.driver), False)
        pair = next((c for c in topo.cores if len(c) > 1), None)
        if pair is not None:
            out["SMT siblings"] = (cpu_placement.Placement(
                frontend=[pair[0]], core=[pair[1]], workers=[],
                driver=[c for c in topo.allowed if c not in pair]), False)
    return out


def tpot_ms(r: dict[str, Any]) -> Optional[float]:
    xs = r["tpot_s"]
    return 1e3 * statistics.median(xs) if xs and None not in xs else None


def measure(up: list[Any], args: argparse.Namespace, spec: Any, batch: int, n: int,
            name: str) -> dict[str, Any]:
    """``n`` timed calls of each engine at ``batch``, alternating, each after an untimed
    one and the bench's pause, as ``bench_vllm.py`` measures a turn."""
    ps = bench_vllm.prompts(batch, args.input_len, spec.vocab, seed=batch)
    calls: dict[str, list[Optional[float]]] = {e.label: [] for e in up}
    for i in range(n):
        for e in (up if i % 2 == 0 else up[::-1]):
            time.sleep(0.2 if args.settle_s is None else args.settle_s)
            e.proc.generate(ps, args.decode_steps + 1)
            calls[e.label].append(tpot_ms(e.proc.generate(ps, args.decode_steps + 1)))
    med = {k: statistics.median(v) for k, v in calls.items() if None not in v}
    ratios = [t / o for t, o in zip(calls[up[1].label], calls[up[0].label]) if t and o]
    # The ratio of the medians; the benchmarks' median of paired ratios beside it.
    aa = med[up[1].label] / med[up[0].label] if len(med) == 2 else None
    print(f"{name:>22} b{batch}: " + "  ".join(
        f"{k} {m:.3f} ms [{min(calls[k]):.3f}-{max(calls[k]):.3f}]" for k, m in med.items())
        + (f"  A/A {aa:.3f}" if aa is not None else "  A/A -"), flush=True)
    return {"tpot_ms": calls, "median_ms": med, "aa": aa,
            "aa_paired": statistics.median(ratios) if ratios else None,
            "per_call_ratio_range": [min(ratios), max(ratios)] if ratios else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--model", default="dense-h2880", choices=sorted(bench_vllm.MODELS))
    p.add_argument("--calls", type=int, default=10, help="timed calls per engine, batch and "
                   "placement")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/placement_probe"))
    p.add_argument("--only", nargs="+", default=None, help="these placements only, by name")
    a = p.parse_args()
    args = bench_vllm.parse_args(["--tp", "1", "--models", a.model, "--variants", "off",
                                  "--aa", "off", "--batches", *map(str, a.batches),
                                  "--prefill-len", "0", "--work-dir", str(a.work_dir)])
    run = vllm_run.begin(args, None, "benchmarks/vllm/placement_probe.py", 0, START)
    spec = bench_vllm.MODELS[a.model]
    engines = bench_vllm.plan(args, spec, run.root, run.shape, ["off", "off_aa"])
    topo = cpu_placement.topology(cpu_placement.gpu_bus_ids(1))
    print("topology:", json.dumps(topo.describe()), flush=True)
    result: dict[str, Any] = {
        "benchmark": "placement_probe", "meta": run_metadata(sys.argv),
        "kernel_settings": run.head("placement_probe")["kernel_settings"],
        "model": a.model, "topology": topo.describe(), "placements": {}}
    a.out_dir.mkdir(parents=True, exist_ok=True)
    path = a.out_dir / f"placement_probe_{a.model}.json"
    me = os.getpid()
    try:
        bench_vllm.start_all(engines, 0, 600, time.monotonic() + 400)
        up = [e for e in engines if e.not_run_reason is None]
        if len(up) < 2:
            raise SystemExit(f"engines not up: {[e.not_run_reason for e in engines]}")
        result["digests"] = bench_vllm.digests(up)
        chosen = placements(topo)
        for name, (pl, no_halt) in chosen.items():
            if a.only and name not in a.only:
                continue
            for e in up:
                if pl is None:
                    cpu_placement.place_engine(e.proc.proc.pid, topo.allowed)
                else:
                    cpu_placement.pin_engine(e.proc.proc.pid, pl)
            cpu_placement.pin_process(me, pl.driver if pl else topo.allowed)
            # The benchmarks' rule for which CPUs get a loop (TP=1 here).
            spin = cpu_placement.keep_awake("on", {"placement": pl.describe()} if pl else {},
                                            topo.allowed) if no_halt else None
            try:
                entry = {"placement": pl.describe() if pl else None, "no_halt": no_halt,
                         **{f"b{b}": measure(up, args, spec, b, a.calls, name)
                            for b in a.batches}}
            finally:
                if spin is not None:
                    spin.stop()
            result["placements"][name] = entry
            path.write_text(json.dumps(result, indent=1) + "\n")
    finally:
        for e in engines:
            e.proc.stop()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
