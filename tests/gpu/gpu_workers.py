"""Rank programs for the Triton backend's GPU tests, and the launcher that runs them.

Each test spawns one process per GPU (NCCL group, one device each) running a
module-level function; what the function returns comes back to pytest.  The
heavy checks share one spawn (``suite``) because starting NCCL and compiling
the kernels dominates their cost.
"""

from __future__ import annotations

import io
import os
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.multiprocessing as mp

from fusion_pass.spawn import free_port

HIDDENS = (128, 2880, 4096, 5120, 7168, 8192)
TOKENS = (1, 2, 7, 8, 80, 81, 127, 512, 2048)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
EPS = 1e-6
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}


WORLD = int(os.environ.get("FUSION_PASS_GPU_WORLD", "2"))
"""Ranks of the GPU suite: 2 by default, 4 or 8 on machines that have them."""


def shared_gpus(world: int) -> bool:
    """Fewer GPUs than ranks: allowed with ``FUSION_PASS_GPU_SHARE=1`` (a smoke test of
    the kernels' logic on a one-GPU machine; timings mean nothing there)."""
    return torch.cuda.device_count() < world



def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, env: dict,
            log_path: str, queue) -> None:
    # The device assertion's message goes to the process's own stdout/stderr.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(MULTICAST_OFF)
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch.distributed as dist

        if shared_gpus(world):
            # Correctness-only mode: ranks share GPUs (NCCL refuses that; gloo does
            # the tests' own collectives), kernels of different processes time-slice.
            torch.cuda.set_device(rank % torch.cuda.device_count())
            dist.init_process_group("gloo", rank=rank, world_size=world)
        else:
            torch.cuda.set_device(rank)
            dist.init_process_group("nccl", rank=rank, world_size=world,
                                    device_id=torch.device("cuda", rank))
        buf = io.BytesIO()
        torch.save(fn(rank, world, *args), buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        # No process-group teardown: after a device assertion it can hang, and
        # the test only needs the result, which must be flushed first.
        queue.close()
        queue.join_thread()
        os._exit(0)


def spawn(fn: Callable, world: int = 2, *args: Any, env: Optional[dict] = None,
          timeout: float = 900) -> tuple[list[Any], list[str]]:
    """``fn(rank, world, *args)`` on ``world`` GPUs; (results by rank, each rank's output)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    logs = [tempfile.mktemp(prefix=f"fusion_pass_rank{r}_", suffix=".log") for r in range(world)]
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, env or {}, logs[r], queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    outputs = []
    for path in logs:
        with open(path, errors="replace") as f:
            outputs.append(f.read())
        os.unlink(path)
    if errors:
        raise RuntimeError("\n".join(errors) + "\n--- rank output ---\n" + "\n".join(outputs))
    return [results[r] for r in range(world)], outputs


# ---------------------------------------------------------------- references


def unit(dtype: torch.dtype) -> float:
    """Relative spacing of the dtype's numbers (one ulp at 1.0)."""
    return torch.finfo(dtype).eps


def reference(x: torch.Tensor, residual: Optional[torch.Tensor], w: torch.Tensor,
              group_name: str, gemma: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 ``(y_ref, h_ref, magnitude)``: the all-reduce in float64 over the group,
    ``h`` the exact sum (the fused op rounds it once), ``y`` from ``h`` rounded to the
    dtype, ``magnitude`` the sum of the absolute values of the terms of ``h``."""
    s = torch.ops._c10d_functional.all_reduce(x.double(), "sum", group_name)
    s = torch.ops._c10d_functional.wait_tensor(s)
    a = torch.ops._c10d_functional.all_reduce(x.double().abs(), "sum", group_name)
    a = torch.ops._c10d_functional.wait_tensor(a)
    h = s if residual is None else s + residual.double()
    mag = a if residual is None else a + residual.double().abs()
    hr = h.to(x.dtype).double()
    wd = w.double() + 1.0 if gemma else w.double()
    y = hr * torch.rsqrt(hr.pow(2).mean(-1, keepdim=True) + EPS) * wd
    return y, h, mag


def violation(y: torch.Tensor, h: torch.Tensor, ref: tuple) -> torch.Tensor:
    """Largest error over its tolerance, on the device (> 1 fails; NaN fails).

    ``h``: one ulp of the result plus fp32 summation error; ``y``: two ulps plus
    the fp32 normalisation error.  Wrong indexing or a missing row is off by
    O(1), far beyond either.
    """
    y_ref, h_ref, mag = ref
    u = unit(y.dtype)
    f32 = unit(torch.float32)
    tol_h = u * h_ref.abs() + 8 * f32 * mag + 1e-30
    tol_y = 2 * u * y_ref.abs() + 64 * f32 * (y_ref.abs() + 1)
    vh = (h.double() - h_ref).abs() / tol_h
    vy = (y.double() - y_ref).abs() / tol_y
    v = torch.maximum(vh.max(), vy.max())
    return torch.where(torch.isfinite(h).all() & torch.isfinite(y).all(), v,
                       torch.full_like(v, float("inf")))


def inputs(tokens: int, hidden: int, dtype: torch.dtype, seed: int, rank: int,
           residual: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Random ``x`` (different on every rank), ``residual`` and ``w`` (the same on all)."""
    g = torch.Generator(device="cuda").manual_seed(seed * 16 + rank)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(dtype)
    g.manual_seed(seed * 16 + 15)
    r = torch.randn(tokens, hidden, device="cuda", generator=g).to(dtype) if residual else None
    w = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).to(dtype)
    return x, r, w


def same_on_all_ranks(*ts: torch.Tensor) -> bool:
    """Bitwise equality across the ranks: the elementwise max and min of the bits agree."""
    import torch.distributed as dist

    c10d = torch.ops._c10d_functional
    gname = dist.group.WORLD.group_name
    for t in ts:
        bits = t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)
        bits = bits.to(torch.int32).flatten()
        hi = c10d.wait_tensor(c10d.all_reduce(bits, "max", gname))
        lo = c10d.wait_tensor(c10d.all_reduce(bits, "min", gname))
        if not torch.equal(hi, lo):
            return False
    return True


# ---------------------------------------------------------------- the suite


def suite(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    import fusion_pass
    from fusion_pass import gate
    from fusion_pass.backends import triton_symm

    gname = dist.group.WORLD.group_name
    be = triton_symm.TritonBackend()
    out: dict[str, Any] = {"sweep": [], "op_matches_backend": []}

    seed = 0
    for dtype in DTYPES:
        for hidden in HIDDENS:
            for n in TOKENS:
                seed += 1
                gemma = hidden == 5120
                x, r, w = inputs(n, hidden, dtype, seed, rank, residual=n != 7)
                ref = reference(x, r, w, gname, gemma)
                chosen = gate.decide(hidden, dtype, world, n, limits=be.limits).path
                paths = [gate.Path.TWO_STAGE]
                if gate.one_stage_fits(hidden, gate.dtype_name(dtype)):
                    paths.append(gate.Path.ONE_STAGE)
                for path in paths:
                    res = be.run(x, r, w, EPS, gname, path, gemma)
                    declined = triton_symm.decline_reason(hidden, dtype, world, n, path)
                    case = dict(dtype=str(dtype), hidden=hidden, tokens=n, path=path.value,
                                gemma=gemma, residual=r is not None, chosen=chosen.value)
                    if res is None:
                        case.update(declined=True, expected_decline=declined)
                    else:
                        y, h = res
                        case.update(declined=False, expected_decline=declined,
                                    violation=float(violation(y, h, ref)),
                                    same_on_ranks=same_on_all_ranks(y, h))
                        if path is chosen:
                            oy, oh = fusion_pass.fused_allreduce_rmsnorm(
                                x, w, EPS, gname, residual=r, path="auto", gemma=gemma)
                            out["op_matches_backend"].append(
                                (case["dtype"], hidden, n, torch.equal(oy, y) and torch.equal(oh, h)))
                    out["sweep"].append(case)
                if chosen is gate.Path.UNFUSED or all(
                        triton_symm.decline_reason(hidden, dtype, world, n, p) for p in paths):
                    # Through the op the call falls back to the reference: still right.
                    oy, oh = fusion_pass.fused_allreduce_rmsnorm(
                        x, w, EPS, gname, residual=r, path="auto", gemma=gemma)
                    out["sweep"].append(dict(dtype=str(dtype), hidden=hidden, tokens=n,
                                             path="op-fallback", declined=False,
                                             expected_decline=None,
                                             violation=float(violation(oy, oh, ref)),
                                             same_on_ranks=same_on_all_ranks(oy, oh)))

    out["back_to_back"] = _back_to_back(rank, gname)
    out["graph"] = _graph_replays(rank, gname)
    return out


def _back_to_back(rank: int, gname: str, calls: int = 1000) -> dict[str, Any]:
    """1000 calls, new data each, alternating paths, no host sync until the end."""
    import fusion_pass

    hidden, dtype = 4096, torch.bfloat16
    cycle = (8, 81, 200, 1, 80)
    xs, rs, outs = [], [], []
    _, _, w = inputs(1, hidden, dtype, 7000, rank)
    g = torch.Generator(device="cuda").manual_seed(100 + rank)
    gr = torch.Generator(device="cuda").manual_seed(99)
    for i in range(calls):
        n = cycle[i % len(cycle)]
        xs.append(torch.randn(n, hidden, device="cuda", generator=g).to(dtype))
        rs.append(torch.randn(n, hidden, device="cuda", generator=gr).to(dtype))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for x, r in zip(xs, rs):
        outs.append(fusion_pass.fused_allreduce_rmsnorm(x, w, EPS, gname, residual=r))
    launch_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    worst = torch.zeros((), dtype=torch.float64, device="cuda")
    for x, r, (y, h) in zip(xs, rs, outs):
        worst = torch.maximum(worst, violation(y, h, reference(x, r, w, gname, False)))
    return {"calls": calls, "violation": float(worst), "host_launch_s": launch_s}


def _graph_replays(rank: int, gname: str, replays: int = 100) -> dict[str, Any]:
    """20 calls in one CUDA graph, replayed 100 times with new inputs each time,
    then after pauses (skewed between the ranks, then equal)."""
    import fusion_pass

    hidden, dtype = 2880, torch.bfloat16
    cycle = (1, 8, 80, 81, 512)
    shapes = [cycle[i % len(cycle)] for i in range(20)]
    _, _, w = inputs(1, hidden, dtype, 8000, rank)
    xs = [torch.empty(n, hidden, device="cuda", dtype=dtype) for n in shapes]
    rs = [torch.empty(n, hidden, device="cuda", dtype=dtype) for n in shapes]
    g = torch.Generator(device="cuda").manual_seed(200 + rank)
    gr = torch.Generator(device="cuda").manual_seed(199)

    def refill() -> None:
        for x, r in zip(xs, rs):
            x.copy_(torch.randn(x.shape, device="cuda", generator=g))
            r.copy_(torch.randn(r.shape, device="cuda", generator=gr))

    def check(outs) -> torch.Tensor:
        worst = torch.zeros((), dtype=torch.float64, device="cuda")
        for x, r, (y, h) in zip(xs, rs, outs):
            worst = torch.maximum(worst, violation(y, h, reference(x, r, w, gname, False)))
        return worst

    refill()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up: compile, grow the buffer
        for _ in range(2):
            [fusion_pass.fused_allreduce_rmsnorm(x, w, EPS, gname, residual=r) for x, r in zip(xs, rs)]
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fusion_pass.fused_allreduce_rmsnorm(x, w, EPS, gname, residual=r)
                for x, r in zip(xs, rs)]
    worst = torch.zeros((), dtype=torch.float64, device="cuda")
    for _ in range(replays):
        refill()
        graph.replay()
        worst = torch.maximum(worst, check(outs))
    result = {"replays": replays, "violation": float(worst)}
    for name, pause in (("skewed_pause", 1.0 + 2.0 * rank), ("pause", 3.0)):
        refill()
        torch.cuda.synchronize()
        time.sleep(pause)
        graph.replay()
        result[name] = float(check(outs))
    return result


# ---------------------------------------------------------------- timeout


def skipped_call(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 skips a call that rank 0 makes: rank 0 must fail, not hang."""
    import torch.distributed as dist

    import fusion_pass

    gname = dist.group.WORLD.group_name
    x, r, w = inputs(8, 4096, torch.bfloat16, 9000, rank)
    for _ in range(3):
        y, h = fusion_pass.fused_allreduce_rmsnorm(x, w, EPS, gname, residual=r)
    ok = float(violation(y, h, reference(x, r, w, gname, False)))
    torch.cuda.synchronize()
    dist.barrier()
    if rank != 0:
        # Stay alive (memory mapped) while rank 0 pushes into this rank's buffer and waits.
        time.sleep(float(os.environ["FUSION_PASS_TIMEOUT_S"]) + 5)
        return {"skipped": True, "violation_before": ok}
    t0 = time.perf_counter()
    try:
        fusion_pass.fused_allreduce_rmsnorm(x, w, EPS, gname, residual=r)
        torch.cuda.synchronize()
        error = None
    except Exception as e:  # the CUDA error of the device assertion
        error = f"{type(e).__name__}: {e}"
    return {"skipped": False, "violation_before": ok, "error": error,
            "seconds": time.perf_counter() - t0}


# ---------------------------------------------------------------- torch.compile


def compiled_model(rank: int, world: int) -> dict[str, Any]:
    """A two-layer TP=2 block compiled with the pass vs the same block uncompiled."""
    import torch.distributed as dist
    import torch._inductor.config as inductor_config
    from torch.profiler import ProfilerActivity, profile

    from fusion_pass import records
    from fusion_pass.allreduce_rmsnorm_pass import AllReduceRMSNormFusionPass

    gname = dist.group.WORLD.group_name
    hidden, dtype = 2880, torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(300 + rank)
    shards = [(torch.randn(hidden, hidden, device="cuda", generator=g) / hidden ** 0.5).to(dtype)
              for _ in range(2)]
    g.manual_seed(301)
    norms = [(1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).to(dtype) for _ in range(2)]

    def block(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        for shard, nw in zip(shards, norms):
            partial = x @ shard  # a row-parallel projection: each rank holds a partial sum
            s = torch.ops._c10d_functional.wait_tensor(
                torch.ops._c10d_functional.all_reduce(partial, "sum", gname))
            residual = s + residual
            v = residual.float()
            v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS)
            x = nw * v.to(dtype)
        return x

    inductor_config.post_grad_custom_post_pass = AllReduceRMSNormFusionPass()
    compiled = torch.compile(block, dynamic=False)
    out: dict[str, Any] = {"cases": []}
    for n in (8, 512):
        x = torch.randn(n, hidden, device="cuda", generator=g).to(dtype)
        g.manual_seed(302 + n)
        res = torch.randn(n, hidden, device="cuda", generator=g).to(dtype)
        want = block(x, res)
        got = compiled(x, res)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            compiled(x, res)
            torch.cuda.synchronize()
        kernels = sorted({e.name for e in prof.events() if "stage_kernel" in e.name})
        rel = float((got.double() - want.double()).norm() / want.double().norm())
        out["cases"].append({"tokens": n, "rel_err": rel, "kernels": kernels,
                             "same_on_ranks": same_on_all_ranks(got)})
    out["records"] = [(s.path, s.reason) for rec in records.HISTORY for s in rec.sites]
    return out
