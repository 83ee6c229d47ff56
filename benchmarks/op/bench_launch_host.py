"""Host time of one fused-op call under each Triton, in one run on one GPU.

    python benchmarks/op/bench_launch_host.py OUTDIR [--triton-path DIR ...] [--rounds 30]
        [--calls 100] [--limit 1.10] [--dry-run]

Needs one NVIDIA GPU: two simulated ranks (:class:`fusion_pass.selftest.sim_group.GpuGroup`,
one CUDA stream each) run the one-stage kernel at 8 x 4096 bf16 with a
residual.  ``--dry-run`` needs no GPU: the same orchestration and timing with
the plan's launcher replaced by one that launches nothing (a check of the
script, not a measurement of the launch).

The fast launch (``launch.py``) packs its C call by the launcher generation
of the installed Triton's compiled kernel (``flat`` for Triton 3.6, ``generic``
for 3.8 and later).  This measures what that costs on the host: one child
process per Triton, in this order: the Triton that Python finds on its own
(the reference), one for each ``--triton-path DIR`` (DIR put first on
``PYTHONPATH``; the child refuses to run unless ``triton`` is imported from
DIR), and the reference again, so that the noise between two runs of the same
Triton (A/A) is in the same file.  Each child

* builds a world-2 group and each rank's :class:`Plan`, makes one call on every
  rank, checks ``h`` bit for bit against the ranks' sum and that every rank's
  launcher took the fast path (``Launcher.ready``), and records the Triton
  version, where it came from and the launcher's generation
  (``launch.generation`` of the compiled kernel's launcher);
* times, in each of ``--rounds`` rounds, ``--calls`` calls per rank of each of:
  an empty call (the timer's floor), two ``torch.empty_like`` of the outputs'
  shapes (the baseline any call pays), ``Launcher.launch_addresses`` alone on
  preallocated outputs, and ``Plan.__call__``; the ranks' calls alternate, each
  on its rank's stream, so every kernel finds its peer and ends; each call is
  timed on its own (``perf_counter_ns``: nothing in a call waits for the GPU),
  the streams are synchronized only between rounds.  Per measurement: the
  median and the minimum over rounds of the mean time per call.

Writes ``OUTDIR/launch_host.json``: provenance (command, commit, versions,
devices), every child's record and a summary: each ``--triton-path`` Triton's
``Plan.__call__`` median over the reference's (the mean of its two runs'
medians), which passes at most ``--limit``; the A/A ratio (the reference's
second run over its first).  Exit status: 0 when every ratio passes, 1 when one
does not, 2 when a child failed.  About a minute (most of it compiling).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# This tree's fusion_pass; bench_host beside this file; bench_common, shared by the benchmarks.
sys.path[:0] = [ROOT, HERE, os.path.dirname(HERE)]

SHAPE = (8, 4096)
WORLD = 2
EPS = 1e-6
RESULT = "launch_host.json"
MEASURED = "Plan.__call__"
ITEMS = ("empty call (timer floor)", "empty_like x2 (baseline)", "launch_addresses", MEASURED)
CONNECTIONS_VAR = "CUDA_DEVICE_MAX_CONNECTIONS"  # as sim_group reads it; set before CUDA starts


# ---------------------------------------------------------------- the child

def per_call_ns(items: dict[str, Sequence[Callable[[], Any]]], select: Callable[[int], None],
                sync: Callable[[], None], rounds: int, calls: int) -> dict[str, dict[str, Any]]:
    """Per item (one callable per rank): the median and minimum over ``rounds``
    of the mean ns per call, each round ``calls`` calls per rank with the ranks
    alternating (``select(rank)`` before each, untimed); the items take turns in
    a round, ``sync()`` ends it.  One untimed round first."""
    runs: dict[str, list[float]] = {name: [] for name in items}
    for n in range(rounds + 1):
        for name, fns in items.items():
            total = 0
            for _ in range(calls):
                for rank, fn in enumerate(fns):
                    select(rank)
                    t0 = time.perf_counter_ns()
                    out = fn()
                    total += time.perf_counter_ns() - t0
                    del out  # freeing the outputs is the caller's, later
            if n:
                runs[name].append(total / (calls * len(fns)))
        sync()
    return {name: {"median": statistics.median(v), "min": min(v), "rounds": v}
            for name, v in runs.items()}


def _empty2(empty_like: Callable, x: Any) -> tuple:
    return empty_like(x), empty_like(x)


def _nothing() -> None:
    return None


def triton_folder() -> Optional[str]:
    """The folder on ``sys.path`` that ``import triton`` finds (not imported here)."""
    import importlib.util

    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return None
    return os.path.dirname(os.path.dirname(os.path.abspath(spec.origin)))


def _setup(dry_run: bool) -> tuple[list, list, Any, dict[str, Any], Any]:
    """Each rank's plan and call, the group (None in a dry run), what the run
    records of them and the ``h`` every rank must compute (None in a dry run);
    a failed check raises SystemExit with its reason."""
    import torch

    from fusion_pass.gate import Path
    from fusion_pass.testing.calls import make_call

    dtype = torch.bfloat16
    if dry_run:
        from bench_host import make_plan

        xs = [torch.randn(SHAPE).to(dtype) for _ in range(WORLD)]
        res, w = torch.randn(SHAPE).to(dtype), torch.ones(SHAPE[1], dtype=dtype)
        calls = [make_call(xs[r], res, w, EPS, "dry-run", Path.ONE_STAGE) for r in range(WORLD)]
        plans = [make_plan(-1, dtype, xs[r]) for r in range(WORLD)]
        return plans, calls, None, {"device": "cpu (dry run: nothing launched)",
                                    "generation": None, "ready": None}, None

    from fusion_pass.backends.triton_symm import launch
    from fusion_pass.selftest import kernel_checks
    from fusion_pass.selftest.sim_group import GpuGroup, compile_launcher, launch_heads, layout

    if not torch.cuda.is_available():
        raise SystemExit("needs an NVIDIA GPU (CUDA); --dry-run runs without one")
    group = GpuGroup(world=WORLD)
    dev = torch.device("cuda", group.device)
    gen = torch.Generator(device=dev).manual_seed(0)
    xs = [torch.randn(SHAPE, generator=gen, device=dev).to(dtype) for _ in range(WORLD)]
    res = torch.randn(SHAPE, generator=gen, device=dev).to(dtype)
    w = torch.ones(SHAPE[1], dtype=dtype, device=dev)
    calls = [make_call(xs[r], res, w, EPS, group.name, Path.ONE_STAGE) for r in range(WORLD)]
    plans = group.prepare(calls)[0]
    for r, plan in enumerate(plans):
        if isinstance(plan, str):
            raise SystemExit(f"rank {r}'s call was declined: {plan}")
        if plan.launcher is None:
            raise SystemExit(f"rank {r}'s plan launches in {len(plan.pieces)} pieces, not one")
    # The first call of a launcher proves its fast path (Launcher.ready).
    outs = group.launch(calls)
    failed = group.finish()
    if failed:
        raise SystemExit(f"the first call failed: {failed}")
    want = kernel_checks.rank_order_h(xs, res)
    wrong = [r for r, o in enumerate(outs) if not torch.equal(o.h, want)]
    if wrong:
        raise SystemExit(f"h of ranks {wrong} differs from the ranks' sum")
    slow = [r for r, plan in enumerate(plans) if not plan.launcher.ready]
    if slow:
        raise SystemExit(f"ranks {slow} launch through kernel[grid], not the fast path "
                         "(the warning above says why)")
    (launcher, head), = launch_heads(plans[0], calls[0])
    found = launch.generation(compile_launcher(launcher, head).run)
    return plans, calls, group, {
        "device": torch.cuda.get_device_name(dev), "ready": True,
        "generation": None if found is None else found.name,
        "layout": layout(plans[0], group.budget), "check": "h equal to the ranks' sum"}, want


def child(args: argparse.Namespace) -> int:
    if args.triton_from is not None:  # before anything imports triton
        found = triton_folder()
        if found is None or os.path.realpath(found) != os.path.realpath(args.triton_from):
            print(f"triton is imported from {found}, not from {args.triton_from} "
                  "(DIR must hold the triton package)", file=sys.stderr)
            return 3
    logging.basicConfig(level=logging.WARNING)
    import torch
    import triton

    torch.set_num_threads(1)
    plans, calls, group, record, want = _setup(args.dry_run)
    ys = [torch.empty_like(c.x) for c in calls]
    hs = [torch.empty_like(c.x) for c in calls]
    heads = [(c.x.data_ptr(), c.residual.data_ptr(), c.weight.data_ptr(), EPS, 1.0, y.data_ptr(),
              h.data_ptr(), 0, 0, 0) for c, y, h in zip(calls, ys, hs)]
    items = {
        ITEMS[0]: [_nothing] * WORLD,
        ITEMS[1]: [functools.partial(_empty2, torch.empty_like, c.x) for c in calls],
        ITEMS[2]: [functools.partial(p.launcher.launch_addresses, p.device, hd)
                   for p, hd in zip(plans, heads)],
        ITEMS[3]: [functools.partial(p, c) for p, c in zip(plans, calls)],
    }
    if group is None:
        timing = per_call_ns(items, lambda r: None, lambda: None, args.rounds, args.calls)
    else:
        def select(rank: int) -> None:
            torch.cuda.set_stream(group.streams[rank])

        def sync() -> None:
            torch.cuda.set_stream(torch.cuda.default_stream(group.device))
            failed = group.finish()
            if failed:
                raise SystemExit(f"a timed call failed: {failed}")

        timing = per_call_ns(items, select, sync, args.rounds, args.calls)
        wrong = [r for r, h in enumerate(hs) if not torch.equal(h, want)]
        if wrong:
            raise SystemExit(f"h of ranks {wrong} from launch_addresses differs from the sum")
    record.update({
        "triton": triton.__version__, "triton_from": triton_folder(), "torch": torch.__version__,
        "python": sys.version.split()[0], "shape": list(SHAPE), "dtype": "bfloat16",
        "world": WORLD, "path": "one_stage", "residual": True, "dry_run": args.dry_run,
        "rounds": args.rounds, "calls_per_rank": args.calls, "ns_per_call": timing})
    with open(args.child, "w") as f:
        json.dump(record, f, indent=1)
    return 0


# ---------------------------------------------------------------- the parent

def child_env(triton_dir: Optional[str], given: Sequence[str]) -> dict[str, str]:
    """The child's environment: ``triton_dir`` (if any) first on ``PYTHONPATH``,
    then the repository, then the caller's entries except every ``given``
    Triton folder (the reference must not find one of them)."""
    env = dict(os.environ)
    drop = {os.path.realpath(d) for d in given}
    kept = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
            if p and os.path.realpath(p) not in drop]
    env["PYTHONPATH"] = os.pathsep.join(([triton_dir] if triton_dir else []) + [ROOT] + kept)
    env.setdefault(CONNECTIONS_VAR, "32")
    env.pop("TRITON_INTERPRET", None)
    return env


def run_child(label: str, triton_dir: Optional[str], args: argparse.Namespace,
              folder: str, index: int) -> dict[str, Any]:
    """One child's run: its record, or the error that ended it."""
    out = os.path.join(folder, f"child{index}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", out, "--rounds", str(args.rounds),
           "--calls", str(args.calls)]
    if triton_dir is not None:
        cmd += ["--triton-from", triton_dir]
    if args.dry_run:
        cmd.append("--dry-run")
    run: dict[str, Any] = {"label": label, "triton_path": triton_dir, "error": None,
                           "result": None}
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, env=child_env(triton_dir, args.triton_path), cwd=ROOT,
                              capture_output=True, text=True, timeout=args.child_timeout_s)
    except subprocess.TimeoutExpired:
        run["error"] = f"no result within {args.child_timeout_s} s"
    else:
        if done.returncode != 0 or not os.path.exists(out):
            tail = (done.stdout + done.stderr).strip()[-3000:]
            run["error"] = f"exit status {done.returncode}: {tail}"
        else:
            with open(out) as f:
                run["result"] = json.load(f)
    run["wall_s"] = round(time.perf_counter() - start, 1)
    return run


def _median(run: dict[str, Any], item: str = MEASURED) -> float:
    return run["result"]["ns_per_call"][item]["median"]


def summarize(runs: Sequence[dict[str, Any]], limit: float) -> dict[str, Any]:
    """Each ``--triton-path`` run's ``Plan.__call__`` median over the reference's
    (the mean of the reference runs' medians); the A/A ratio; pass when no run
    failed and every ratio is at most ``limit``."""
    failed = [r["label"] for r in runs if r["error"] is not None]
    refs = [r for r in runs if r["triton_path"] is None and r["error"] is None]
    summary: dict[str, Any] = {"measured": MEASURED, "limit": limit, "failed_runs": failed}
    if not refs:
        summary.update(passed=False, text="no run of the reference Triton finished")
        return summary
    ref = statistics.mean(_median(r) for r in refs)
    ref_base = statistics.mean(_median(r, ITEMS[1]) for r in refs)
    aa = _median(refs[-1]) / _median(refs[0]) if len(refs) > 1 else None
    compared = []
    for r in runs:
        if r["triton_path"] is None or r["error"] is not None:
            continue
        med, res = _median(r), r["result"]
        compared.append({"triton": res["triton"], "triton_path": r["triton_path"],
                         "generation": res["generation"], "median_ns": med,
                         "ratio": med / ref, "passed": med / ref <= limit,
                         "ratio_beyond_baseline": ((med - _median(r, ITEMS[1])) / (ref - ref_base)
                                                   if ref > ref_base else None)})
    first = refs[0]["result"]
    summary.update(
        reference={"triton": first["triton"], "generation": first["generation"],
                   "median_ns": ref, "runs": len(refs)},
        aa_ratio=aa, compared=compared,
        passed=not failed and all(c["passed"] for c in compared))
    words = [f"{MEASURED} per call: Triton {first['triton']} ({first['generation']}) "
             f"{ref / 1000:.2f} us"]
    words += [f"Triton {c['triton']} ({c['generation']}) {c['median_ns'] / 1000:.2f} us, "
              f"ratio {c['ratio']:.3f} ({'pass' if c['passed'] else 'FAIL'}, limit {limit})"
              for c in compared]
    if aa is not None:
        words.append(f"A/A ratio {aa:.3f}")
    if failed:
        words.append(f"failed runs: {', '.join(failed)}")
    summary["text"] = "; ".join(words)
    return summary


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", nargs="?", help="where launch_host.json is written")
    ap.add_argument("--triton-path", action="append", default=[], metavar="DIR",
                    help="a folder holding another Triton package (repeatable)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=100, help="calls per rank per round")
    ap.add_argument("--limit", type=float, default=1.10,
                    help="the largest passing ratio to the reference")
    ap.add_argument("--child-timeout-s", type=float, default=240.0)
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU: a launcher that launches nothing (checks the script only)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--triton-from", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is None and not args.outdir:
        ap.error("OUTDIR is required")
    if args.rounds < 1 or args.calls < 1:
        ap.error("--rounds and --calls must be at least 1")
    for d in args.triton_path:
        if not os.path.isdir(os.path.join(d, "triton")):
            ap.error(f"--triton-path {d}: no triton package in it")
    args.triton_path = [os.path.abspath(d) for d in args.triton_path]
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        return child(args)
    from bench_common import run_metadata

    os.makedirs(args.outdir, exist_ok=True)
    order = ([("reference", None)] + [(f"--triton-path {d}", d) for d in args.triton_path]
             + [("reference again (A/A)", None)])
    runs = []
    with tempfile.TemporaryDirectory(prefix="launch_host_") as folder:
        for i, (label, triton_dir) in enumerate(order):
            run = run_child(label, triton_dir, args, folder, i)
            runs.append(run)
            res = run["result"]
            print(f"{label}: " + (f"Triton {res['triton']} ({res['generation']}), {MEASURED} "
                                  f"{_median(run) / 1000:.2f} us per call" if res else
                                  f"FAILED: {run['error']}") + f" [{run['wall_s']} s]",
                  flush=True)
    summary = summarize(runs, args.limit)
    result = {"provenance": run_metadata(list(sys.argv if argv is None else [__file__, *argv])),
              "what": __doc__.split("\n\n")[0], "dry_run": args.dry_run, "runs": runs,
              "summary": summary}
    path = os.path.join(args.outdir, RESULT)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(summary["text"])
    print(f"wrote {path}")
    return 2 if summary["failed_runs"] or "reference" not in summary else (
        0 if summary["passed"] else 1)


if __name__ == "__main__":
    sys.exit(main())
