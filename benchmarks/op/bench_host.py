"""Host (Python) time of one eager call of the fused op, on the CPU, without a GPU.

    .venv/bin/python benchmarks/op/bench_host.py [--calls 2000] [--repeats 15] [--out PATH]

What ``bench_op.py``'s ``eager`` column measures on a GPU host is the op's
Python path, the Triton backend's host side (``TritonBackend.run`` and
``Plan.__call__``: two ``torch.empty_like`` and pointer reads) and one C
launch.  This script measures everything but the launch, on the CPU:

* a single-process ``fake`` c10d group of world size 2 (the gate's smallest
  fused world size; ``c10d_world_size`` resolves it like a real group);
* a stand-in backend registered as ``host-standin``: the real
  :class:`~fusion_pass.backends.triton_symm.TritonBackend` (its ``run_on``,
  plan cache and :class:`~fusion_pass.backends.triton_symm.Plan`) with the
  device check done for the CPU (device -1) and the plan's launcher replaced by
  one whose launch does nothing;
* ``--calls`` back-to-back calls of ``fused_allreduce_rmsnorm(x, w, eps, group,
  residual=r, path="auto")`` at 8 x 4096 bf16 on rotating inputs, and of each
  piece of the path alone (the pieces a call made before the op kept routes
  per signature, and ``op._signature + route lookup``, what a call makes
  now), taking turns in each of ``--repeats`` rounds: the median and the
  minimum over rounds; with the same-run baseline, the two
  ``torch.empty_like`` that any call must make (``ratio``: op / baseline, so
  that hosts of different speed compare).

Prints microseconds per call; writes the JSON to ``--out``.  The host is
shared: compare ratios, or runs made back to back.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import fusion_pass  # noqa: E402
from fusion_pass import backends, gate, op  # noqa: E402
from fusion_pass.backends import Call  # noqa: E402
from fusion_pass.backends.base import unfit_layout  # noqa: E402
from fusion_pass.spec import NormSpec  # noqa: E402
from fusion_pass.testing.calls import make_call  # noqa: E402
from fusion_pass.backends import triton_symm  # noqa: E402

SHAPE = (8, 4096)
DTYPE = torch.bfloat16
EPS = 1e-6
ROTATE = 20
"""Distinct inputs the calls cycle through, as bench_op's eager phase does."""


class NoLaunch:
    """A launcher whose fast path is ready and launches nothing."""

    ready = True

    def launch_addresses(self, device: int, head: tuple) -> None:
        pass

    def __call__(self, device: int, head: tuple, aligned: bool) -> None:
        pass


class HostStandIn(triton_symm.TritonBackend):
    """The Triton backend's host side on the CPU: run's device check, run_on's
    plan lookup, the Plan's call; no kernel."""

    name = "host-standin"

    def run(self, call: Call):
        device = call.x.get_device()
        if device != -1:  # the real one compares with torch.cuda's current device
            return "input is not on the CPU"
        return self.run_on(call, device)

    def _plan(self, call: Call, device: int):
        return make_plan(device, call.out_dtype, call.x), True


def make_plan(device: int, out_dtype: torch.dtype, x: torch.Tensor) -> triton_symm.Plan:
    """A Plan with one no-op launcher, for the Plan's signature of the day."""
    return triton_symm.Plan(((0, NoLaunch()),), device, out_dtype, True, None, 0, x)


def per_call_ns(fns: dict[str, Callable[[int], Any]], calls: int,
                repeats: int) -> dict[str, tuple[float, float]]:
    """Per name: (median, min) over ``repeats`` of the mean ns per call of ``calls``
    back-to-back calls.  The functions take turns within each repeat, so that a
    busy host slows them alike."""
    for fn in fns.values():
        for i in range(min(calls, 200)):
            fn(i % ROTATE)
    runs: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter_ns()
            for i in range(calls):
                fn(i % ROTATE)
            runs[name].append((time.perf_counter_ns() - t0) / calls)
    return {name: (statistics.median(r), min(r)) for name, r in runs.items()}


def init_group() -> str:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    return dist.group.WORLD.group_name


def pieces(group: str, xs: list, rs: list, w: torch.Tensor) -> dict[str, Callable[[int], Any]]:
    """Each step of the eager path alone, on the same inputs."""
    from fusion_pass.groups import c10d_world_size

    be = backends.select("cpu")
    limits = be.limits
    calls = [make_call(xs[i], rs[i], w, EPS, group, gate.FusionPath.ONE_STAGE)
             for i in range(ROTATE)]
    spec = NormSpec(eps=EPS)
    plan = next(p for p in be._plans.values() if isinstance(p, triton_symm.Plan))
    out: dict[str, Callable[[int], Any]] = {
        "empty_like_x2 (baseline)": lambda i: (torch.empty_like(xs[i]), torch.empty_like(xs[i])),
        "op._eager": lambda i: op._eager(xs[i]),
        "op._check": lambda i: op._check(xs[i], rs[i], w, None, None, None, "auto", spec, 2),
        "Call(...)": lambda i: Call(xs[i], rs[i], w, spec, group),
        "backends.select": lambda i: backends.select(xs[i].device.type),
        "c10d_world_size": lambda i: c10d_world_size(group),
        "gate.decide": lambda i: gate.decide(SHAPE[1], DTYPE, 2, SHAPE[0], limits=limits),
        "unfit_layout": lambda i: unfit_layout(calls[i].x, calls[i].residual, calls[i].weight),
        "backend.run (run_on + Plan)": lambda i: be.run(calls[i]),
        "op._signature + route lookup": lambda i: op._routes.get(op._signature(
            xs[i], rs[i], w, None, None, None, group, "auto", spec.encode())),
        "Plan.__call__": lambda i: plan(calls[i]),
        "op.allreduce_rmsnorm (no wrapper)": lambda i: op.allreduce_rmsnorm(
            xs[i], rs[i], w, None, None, None, group, "auto", spec),
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="also print a cProfile of the op")
    ap.add_argument("--out", default="/tmp/fusion_pass_bench_host.json")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    group = init_group()
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(SHAPE, generator=g).to(DTYPE) for _ in range(ROTATE)]
    rs = [torch.randn(SHAPE, generator=g).to(DTYPE) for _ in range(ROTATE)]
    w = torch.ones(SHAPE[1], dtype=DTYPE)

    def fused(i: int) -> Any:
        return fusion_pass.fused_allreduce_rmsnorm(xs[i], w, EPS, group, residual=rs[i],
                                                   path="auto")

    backends.register("host-standin", HostStandIn)
    backends.set_backend("host-standin")
    y, h = fused(0)
    be = backends.select("cpu")
    assert isinstance(be, HostStandIn) and y.shape == SHAPE and h.dtype == DTYPE
    chosen = gate.decide(SHAPE[1], DTYPE, 2, SHAPE[0], limits=be.limits).path.value
    print(f"{SHAPE[0]} x {SHAPE[1]} {DTYPE}, world 2 (fake group), path auto -> {chosen}; "
          f"{args.calls} calls x {args.repeats} repeats: us per call, median (min)")
    table = per_call_ns({"fused_allreduce_rmsnorm": fused, **pieces(group, xs, rs, w)},
                        args.calls, args.repeats)
    base, op_ns = table["empty_like_x2 (baseline)"][0], table["fused_allreduce_rmsnorm"][0]
    for name, (med, low) in table.items():
        print(f"  {name:40s} {med / 1000:8.3f} ({low / 1000:.3f})")
    print(f"op / baseline (two empty_like): {op_ns / base:.2f}; "
          f"op beyond the baseline: {(op_ns - base) / 1000:.2f} us")

    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for i in range(args.calls):
            fused(i % ROTATE)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)

    result = {
        "shape": list(SHAPE), "dtype": str(DTYPE), "world_size": 2, "path": "auto",
        "gate_path": chosen, "calls": args.calls, "repeats": args.repeats,
        "threads": args.threads, "torch": torch.__version__,
        "host": {"machine": platform.machine(), "processor": platform.processor(),
                 "python": platform.python_version(), "cpus": os.cpu_count()},
        "op_us_per_call": op_ns / 1000, "baseline_us_per_call": base / 1000,
        "ratio_op_to_baseline": op_ns / base,
        "us_per_call": {k: {"median": med / 1000, "min": low / 1000}
                        for k, (med, low) in table.items()},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
