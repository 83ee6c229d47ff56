"""Development timings of the Triton backend (not a test): kernel variants (parts
owning their columns, grid caps, warps) against the barrier, and the eager host
cost per call, broken down.

    torchrun --nproc-per-node 2 tests/gpu/dev_timing.py --out DIR
        [--hidden H ...] [--tokens N ...] [--skip-eager] [--watchdog 30]

Every timing is followed by the mailbox protocol's checks on every rank
(:func:`check_buffers`), every buffer growth by a report of the new buffer
(:func:`watch_growth`); ``--watchdog`` describes a hang from both ranks (Python
stacks, then each buffer's state word and the mailbox rows still empty) instead
of waiting for the kernels' wait bound.  They found the buffer defect
that docs/triton_backend.md describes under "Buffers" (``scripts/gpu_hang.sh`` repeats the runs).

Graph timings: 20 calls of a step in one CUDA graph, 50 back-to-back replays,
median per call of the slower rank (as ``benchmarks/op/bench_op.py``).  Eager:
2000 back-to-back calls, host microseconds per call of the slower rank.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", d) for d in ("op", "")]
import bench_op  # noqa: E402  (the benchmark's timing and inputs, so both measure alike)

EPS = bench_op.EPS
CALLS = bench_op.CALLS


SHAPE: dict[str, Any] = {"tokens": 0, "hidden": 0, "variant": ""}
"""The shape and variant being timed, for the watchdog's dump."""

FAILED_CHECKS: list[str] = []
"""Where :func:`check_buffers` failed: the run's JSON reports them."""

CALLED = {"launched": 0, "declined": 0}
"""This rank's calls of the backend: the ranks must agree at every check."""


def counted(run: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def wrapped(call: Any) -> Any:
        out = run(call)
        CALLED["declined" if isinstance(out, str) else "launched"] += 1
        return out
    return wrapped


def non_empty(buf: Any) -> list[int]:
    """Elements per slot of ``buf`` that hold something other than the empty marker."""
    from fusion_pass.backends.triton_symm import buffers

    empty = buffers.negative_zero_bits(8 * buf.tensor.element_size())
    return (buf.tensor.view(buffers.SLOTS, -1) != empty).sum(1).tolist()


def watch_growth(log: Callable[[str], None]) -> None:
    """Wrap the buffer allocation: every rank reports each new buffer's
    addresses and whether it is still all empty once every rank has made it."""
    from fusion_pass.backends.triton_symm import buffers

    allocate = buffers._allocate

    def wrapped(group_name: str, elem_bits: int, device: torch.device, slot_bytes: int) -> Any:
        new = allocate(group_name, elem_bits, device, slot_bytes)
        if isinstance(new, str):
            log(f"GROWTH {SHAPE}: refused: {new}")
            return new
        torch.cuda.synchronize()
        dist.barrier()
        full = non_empty(new)
        h = new.handle
        info = dict(rank=dist.get_rank(), slot_mib=slot_bytes >> 20, tensor=hex(new.tensor.data_ptr()),
                    bases=[hex(b) for b in h.buffer_ptrs], size=h.buffer_size,
                    peers=[hex(v) for v in new.peer_ptrs.tolist()], non_empty=full)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, info)
        log(f"GROWTH {SHAPE}: {every}")
        return new

    buffers._allocate = wrapped


def check_buffers(tag: str) -> None:
    """The mailbox protocol's invariants with every kernel done, on every rank:
    the ranks' state words agree, nobody is counted as arrived, the current
    slot and the one after it are empty, the previous slot holds exactly the
    elements its state word says the last call left (one-stage), nothing if it
    left none (two-stage re-arms at once).  Prints every rank's view where one
    fails; the ranks' call counts with it."""
    from fusion_pass.backends.triton_symm import buffers

    torch.cuda.synchronize()
    for key in sorted(buffers._current):
        buf = buffers._current[key]
        word, arrived = (int(v) for v in buf.state[:2].tolist())
        full = non_empty(buf)
        mine = [word, arrived, *full, CALLED["launched"], CALLED["declined"]]
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        slot, left = word & 3, word >> 2
        prev = (slot + buffers.SLOTS - 1) % buffers.SLOTS
        want = [left * (buf.world_size - 1) if s == prev else 0 for s in range(buffers.SLOTS)]
        good = all(v == every[0] for v in every) and arrived == 0 and full == want
        flags = torch.tensor([0 if good else 1], device="cuda")
        dist.all_reduce(flags)
        if flags.item():
            FAILED_CHECKS.append(f"{tag} at {SHAPE['hidden']} x {SHAPE['tokens']}")
            if dist.get_rank() == 0:
                print(f"CHECK FAILED {tag} at {SHAPE}: buffer {key} per rank [word, arrived, "
                      f"non-empty per slot, launched, declined]: {every}", flush=True)


def dump_buffers(why: str) -> None:
    """This rank's symmetric buffers as the kernels see them: the state word
    and, per slot and source rank, the one-stage mailbox rows still empty.
    Copied on a stream of its own while the kernels may still be waiting."""
    from fusion_pass.backends.triton_symm import buffers

    n, hidden = SHAPE["tokens"], SHAPE["hidden"]
    side = torch.cuda.Stream()
    lines = [f"[rank {dist.get_rank()}] {why} at {hidden} x {n}, {SHAPE['variant']}, calls {CALLED}"]
    for key, buf in list(buffers._current.items()):
        state = torch.empty(buf.state.numel(), dtype=torch.int32, pin_memory=True)
        boxes = torch.empty(buf.tensor.numel(), dtype=buf.tensor.dtype, pin_memory=True)
        with torch.cuda.stream(side):
            state.copy_(buf.state, non_blocking=True)
            boxes.copy_(buf.tensor, non_blocking=True)
        side.synchronize()
        word = int(state[0])
        lines.append(f"  buffer {key}: slot {word & 3}, previous call left {word >> 2} per "
                     f"source, programs arrived {int(state[1])}, retired {len(buffers._retired)}")
        empty = buffers.negative_zero_bits(8 * buf.tensor.element_size())
        for slot in range(buffers.SLOTS):
            for src in range(buf.world_size):
                lo = slot * buf.slot_elems + src * n * hidden
                if n * hidden == 0 or lo + n * hidden > (slot + 1) * buf.slot_elems:
                    continue
                rows = (boxes[lo:lo + n * hidden].view(n, hidden) == empty).any(1)
                lines.append(f"    slot {slot} source {src}: {int(rows.sum())} of {n} rows "
                             f"empty, first {torch.nonzero(rows).flatten()[:8].tolist()}")
    print("\n".join(lines), flush=True)


BEAT = [0.0]
"""When this rank last made progress (a graph timed, a shape begun)."""


def install_watchdog(seconds: float) -> None:
    """A thread that, once this rank has made no progress for ``seconds``,
    prints every thread's Python stack, then the buffers (:func:`dump_buffers`),
    and exits.  Each rank has its own, so a hang is described from both sides
    wherever each one is stuck: in a synchronize, a collective or a driver call
    (the stacks come first: copying the buffers needs the driver too)."""
    import faulthandler
    import threading

    BEAT[0] = time.time()
    device = torch.cuda.current_device()

    def watch() -> None:
        torch.cuda.set_device(device)  # the current device is per thread: the rank's own
        while time.time() - BEAT[0] < seconds:
            time.sleep(0.5)
        print(f"[rank {dist.get_rank()}] no progress for {seconds:.0f} s", flush=True)
        faulthandler.dump_traceback(all_threads=True)
        try:
            dump_buffers("stuck")
        finally:
            time.sleep(3)  # the peer's watchdog reports too before torchrun ends the job
            os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def time_graph(step: Callable[[int], object]) -> float:
    BEAT[0] = time.time()
    us = round(bench_op.time_graph(step, replays=50).us, 3)
    BEAT[0] = time.time()
    return us


def time_eager(step: Callable[[int], object], n: int = 2000) -> float:
    BEAT[0] = time.time()
    us = round(bench_op.time_eager(step, n, CALLS), 2)
    BEAT[0] = time.time()
    return us


def inputs(n: int, hidden: int, rank: int):
    return bench_op.make_inputs(hidden, n, rank, CALLS)


def variants(rank: int, gname: str, handle: Any, log: Callable[[str], None],
             hiddens: list[int], counts: list[int]) -> list[dict]:
    """Per shape: the barrier and each kernel path; for one-stage split rows
    also every part reading the whole row (``whole``), at 4-16 tokens of the
    wide rows the grid capped at 32 programs even where its parts would own
    their columns at 64 (``p32``), and from 128 tokens rows of up to 8192
    elements in programs of 16 warps instead of 32 (``w16``: more than one program
    fits an SM; 16-warp programs of 4096 x 1024 ran 396 at once, three per SM).
    Every variant's output is checked once against float64 on every rank
    (``worst_violation`` <= 1 passes); 8192 x 80 also against NCCL + compiled
    norm."""
    from gpu_workers import reference, violation

    from fusion_pass.backends import triton_symm
    from fusion_pass.backends.triton_symm import geometry
    from fusion_pass.backends.reference import add_rms_norm
    from fusion_pass.gate import Path
    from fusion_pass.spec import NormSpec
    from fusion_pass.testing.calls import make_call

    be = triton_symm.TritonBackend()
    run = counted(be.run)
    watch_growth(log)
    sms = triton_symm.sm_count(torch.cuda.current_device())
    norm = bench_op.token_dynamic(lambda r, res, w: add_rms_norm(r, res, w, NormSpec(eps=EPS)))
    rows = []
    barrier = time_graph(lambda i: handle.barrier(channel=0))
    for hidden, n in [(h, n) for h in hiddens for n in counts]:
        SHAPE.update(tokens=n, hidden=hidden)
        xs, rs, w = inputs(n, hidden, rank)
        ref = reference(xs[0], rs[0], w, gname, False)
        split = triton_symm.one_stage_layout(n, hidden, 2, sms, 0, 128)[0]
        row: dict[str, Any] = {"hidden": hidden, "tokens": n, "barrier": barrier, "split": split}
        tried: list[tuple[str, Path, dict[str, Any]]] = [("one_stage", Path.ONE_STAGE, {})]
        if split > 1:
            tried.append(("one_stage_whole", Path.ONE_STAGE, {"owns_columns": lambda *a: False}))
        if 4 <= n <= 16 and hidden >= 7168:
            tried.append(("one_stage_p32", Path.ONE_STAGE,
                          {"OWN_SPLIT_PROGRAMS": triton_symm.SPLIT_PROGRAMS}))
        if n >= 128 and hidden <= 8192:
            warps = triton_symm.num_warps
            tried.append(("one_stage_w16", Path.ONE_STAGE,
                          {"num_warps": lambda h, e: min(16, warps(h, e))}))
        if n >= 80:
            tried.append(("two_stage", Path.TWO_STAGE, {}))
        worst = 0.0
        for key, path, knobs in tried:
            SHAPE["variant"] = key
            saved = {k: getattr(geometry, k) for k in knobs}
            try:
                for k, v in knobs.items():
                    setattr(geometry, k, v)
                be._plans.clear()
                row[key] = time_graph(lambda i: run(make_call(xs[i], rs[i], w, EPS, gname, path)))
                check_buffers(f"{key} graph")
                out = run(make_call(xs[0], rs[0], w, EPS, gname, path))
                check_buffers(f"{key} eager")
                v = violation(out.y, out.h, ref).reshape(1).float()
                dist.all_reduce(v, op=dist.ReduceOp.MAX)  # a wrong rank 1 must show too
                worst = max(worst, float(v))
            finally:
                for k, v in saved.items():
                    setattr(geometry, k, v)
                be._plans.clear()
        row["worst_violation"] = worst
        if (hidden, n) == (8192, 80):
            def nccl(i: int) -> object:
                s = torch.ops._c10d_functional.all_reduce(xs[i], "sum", gname)
                return norm(torch.ops._c10d_functional.wait_tensor(s), rs[i], w)

            row["nccl_compiled"] = time_graph(nccl)
        rows.append(row)
        log(json.dumps(row))
        torch.cuda.empty_cache()
    return rows


def eager(rank: int, gname: str, log: Callable[[str], None], out_dir: str) -> dict[str, Any]:
    import fusion_pass
    from fusion_pass import op
    from fusion_pass.backends import triton_symm
    from fusion_pass.gate import Path
    from fusion_pass.spec import NormSpec
    from fusion_pass.testing.calls import make_call

    xs, rs, w = inputs(8, 4096, rank)
    k = lambda i: i % CALLS  # noqa: E731
    be = fusion_pass.backends.get("triton")
    res: dict[str, Any] = {}
    res["op_auto"] = time_eager(lambda i: fusion_pass.fused_allreduce_rmsnorm(
        xs[k(i)], w, EPS, gname, residual=rs[k(i)]))
    res["op_baked_one_stage"] = time_eager(lambda i: fusion_pass.fused_allreduce_rmsnorm(
        xs[k(i)], w, EPS, gname, residual=rs[k(i)], path="one_stage"))
    spec = NormSpec(eps=EPS).encode()
    res["torch_ops_baked"] = time_eager(lambda i: torch.ops.fusion_pass.allreduce_rmsnorm(
        xs[k(i)], rs[k(i)], w, None, None, None, gname, "one_stage", spec))
    res["python_impl_baked"] = time_eager(lambda i: op.allreduce_rmsnorm(
        xs[k(i)], rs[k(i)], w, None, None, None, gname, "one_stage", spec))
    res["op_run_baked"] = time_eager(lambda i: op.run(
        make_call(xs[k(i)], rs[k(i)], w, EPS, gname, Path.UNFUSED), "one_stage"))
    res["backend_run"] = time_eager(lambda i: be.run(
        make_call(xs[k(i)], rs[k(i)], w, EPS, gname, Path.ONE_STAGE)))
    call = make_call(xs[0], rs[0], w, EPS, gname, Path.ONE_STAGE)
    be.run(call)
    plan = next(p for p in be._plans.values() if isinstance(p, triton_symm.Plan))
    res["plan_call"] = time_eager(lambda i: plan(call))
    y, h = torch.empty_like(xs[0]), torch.empty_like(xs[0])
    head = (xs[0], rs[0], w, EPS, 1.0, y, h, h, h, h)  # PER_CALL: no multiplier (1.0, unread)
    res["launch_only"] = time_eager(lambda i: plan.launcher(plan.device, head, True))
    addrs = tuple(t.data_ptr() if isinstance(t, torch.Tensor) else t for t in head)
    res["launch_addresses"] = time_eager(
        lambda i: plan.launcher.launch_addresses(plan.device, addrs))
    res["fast_launcher"] = plan.launcher._fast is not None
    res["two_empty_like"] = time_eager(lambda i: (torch.empty_like(xs[0]), torch.empty_like(xs[0])))

    def nccl_eager(i: int) -> object:
        from fusion_pass.backends.reference import add_rms_norm

        s = torch.ops._c10d_functional.all_reduce(xs[k(i)], "sum", gname)
        return add_rms_norm(torch.ops._c10d_functional.wait_tensor(s), rs[k(i)], w,
                            NormSpec(eps=EPS))

    res["nccl_eager_norm"] = time_eager(nccl_eager)
    prof = cProfile.Profile()
    prof.enable()
    time_eager(lambda i: fusion_pass.fused_allreduce_rmsnorm(xs[k(i)], w, EPS, gname,
                                                            residual=rs[k(i)]))
    prof.disable()
    if rank == 0:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        with open(os.path.join(out_dir, "eager_profile.txt"), "w") as f:
            f.write(s.getvalue())
    log(json.dumps(res))
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--skip-variants", action="store_true")
    ap.add_argument("--skip-eager", action="store_true")
    ap.add_argument("--watchdog", type=float, default=0.0,
                    help="dump stacks and buffers, then exit, after this many seconds "
                         "without progress (above a first compile: 30 s)")
    ap.add_argument("--hidden", type=int, nargs="+", default=[2880, 4096, 7168, 8192, 12288, 16384])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 16, 80, 128, 256])
    args = ap.parse_args()
    import torch.distributed._symmetric_memory as symm_mem

    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank = dist.get_rank()
    gname = dist.group.WORLD.group_name
    torch._dynamo.config.recompile_limit = 64

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    if args.watchdog:
        install_watchdog(args.watchdog)
    t = symm_mem.empty(1 << 20, dtype=bench_op.DTYPE, device="cuda")
    handle = symm_mem.rendezvous(t, gname)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    if not args.skip_eager:
        result["eager"] = eager(rank, gname, log, args.out)
    if not args.skip_variants:
        result["variants"] = variants(rank, gname, handle, log, args.hidden, args.tokens)
        result["failed_protocol_checks"] = FAILED_CHECKS
    if rank == 0:
        with open(os.path.join(args.out, "dev_timing.json"), "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
