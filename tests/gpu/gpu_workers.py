"""Rank programs for the Triton backend's GPU tests, and the launcher that runs them.

Each test spawns one process per GPU (NCCL group, one device each; with
``share=True`` every rank on GPU 0, over gloo) running a module-level function;
what the function returns comes back to pytest.  The heavy checks share one
spawn (``suite``) because starting NCCL and compiling the kernels dominates
their cost.
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

from fusion_pass.selftest.kernel_checks import fp8_check, violation  # noqa: F401
from fusion_pass.testing.spawn import free_port

HIDDENS = (128, 2880, 4096, 5120, 7168, 8192)
WIDE = (12288, 16384)
"""Rows wider than the gate's one-block rule: the kernels take them (bf16 sweep)."""
TOKENS = (1, 2, 7, 8, 80, 81, 127, 512, 2048)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
EPS = 1e-6
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}


WORLD = int(os.environ.get("FUSION_PASS_GPU_WORLD", "2"))
"""Ranks of the GPU suite: 2 by default, 4 or 8 on machines that have them."""


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, env: dict,
            log_path: str, queue, share: bool) -> None:
    # The device assertion's message goes to the process's own stdout/stderr.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(MULTICAST_OFF)
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch.distributed as dist

        if share:
            # Every rank on GPU 0: NCCL refuses that, gloo does the collectives.
            torch.cuda.set_device(0)
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
          timeout: float = 900, share: bool = False) -> tuple[list[Any], list[str]]:
    """``fn(rank, world, *args)`` on ``world`` GPUs (``share``: every rank on GPU 0);
    (results by rank, each rank's output)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    logs = [tempfile.mktemp(prefix=f"fusion_pass_rank{r}_", suffix=".log") for r in range(world)]
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, env or {}, logs[r], queue,
                                                   share))
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


def reference(x: torch.Tensor, residual: Optional[torch.Tensor], w: torch.Tensor,
              group_name: str, gemma: bool, eps: float = EPS,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """float64 ``(h_ref, magnitude, weight, eps)``: the all-reduce in float64 over
    the group, ``h_ref`` the exact sum, ``magnitude`` the sum of the absolute
    values of its terms, the norm's weight (``w + 1`` for Gemma)."""
    s = torch.ops._c10d_functional.all_reduce(x.double(), "sum", group_name)
    s = torch.ops._c10d_functional.wait_tensor(s)
    a = torch.ops._c10d_functional.all_reduce(x.double().abs(), "sum", group_name)
    a = torch.ops._c10d_functional.wait_tensor(a)
    h = s if residual is None else s + residual.double()
    mag = a if residual is None else a + residual.double().abs()
    return h, mag, w.double() + 1.0 if gemma else w.double(), float(eps)


def inputs(tokens: int, hidden: int, dtype: torch.dtype, seed: int, rank: int,
           residual: bool = True, wdtype: Optional[torch.dtype] = None,
           ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Random ``x`` (different on every rank), ``residual`` and ``w`` (the same on all:
    tensor parallelism replicates the residual stream)."""
    g = torch.Generator(device="cuda").manual_seed(seed * 16 + rank)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(dtype)
    g.manual_seed(seed * 16 + 15)
    r = torch.randn(tokens, hidden, device="cuda", generator=g).to(dtype) if residual else None
    w = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).to(wdtype or dtype)
    return x, r, w


def same_on_all_ranks(*ts: torch.Tensor) -> bool:
    """Bitwise equality across the ranks: the elementwise max and min of the bits agree."""
    import torch.distributed as dist

    c10d = torch.ops._c10d_functional
    gname = dist.group.WORLD.group_name
    for t in ts:
        if t.numel() == 0:
            continue
        bits = t.contiguous().view(torch.uint8) if t.element_size() == 1 else \
            t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)
        bits = bits.to(torch.int32).flatten()
        hi = c10d.wait_tensor(c10d.all_reduce(bits, "max", gname))
        lo = c10d.wait_tensor(c10d.all_reduce(bits, "min", gname))
        if not torch.equal(hi, lo):
            return False
    return True


def one_stage_takes(hidden: int, dtype: torch.dtype) -> bool:
    """Rows the one-stage kernel holds (the gate may still send them elsewhere)."""
    from fusion_pass.backends import triton_symm

    return triton_symm.next_pow2(hidden) <= triton_symm.MAX_BLOCK


# ---------------------------------------------------------------- the suite

SWEEP = ((torch.bfloat16, HIDDENS + WIDE), (torch.float16, (128, 4096, 8192)),
         (torch.float32, (128, 2880, 8192)))
if os.environ.get("FUSION_PASS_GPU_QUICK") == "1":  # development runs: fewer compiles
    SWEEP = ((torch.bfloat16, (2880, 7168, 16384)), (torch.float32, (4096,)))
    TOKENS = (1, 7, 80, 81, 2048)


def suite(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    import fusion_pass
    from fusion_pass import gate
    from fusion_pass.backends import triton_symm
    from fusion_pass.testing.calls import make_call

    gname = dist.group.WORLD.group_name
    be = triton_symm.TritonBackend()
    out: dict[str, Any] = {"sweep": [], "op_matches_backend": []}

    seed = 0
    for dtype, hiddens in SWEEP:
        for hidden in hiddens:
            for n in TOKENS:
                seed += 1
                gemma = hidden == 5120
                x, r, w = inputs(n, hidden, dtype, seed, rank, residual=n != 7)
                ref = reference(x, r, w, gname, gemma)
                unfused_h = torch.ops._c10d_functional.wait_tensor(
                    torch.ops._c10d_functional.all_reduce(x, "sum", gname))
                if r is not None:  # the graph's h: NCCL's sum, then the residual add
                    unfused_h = unfused_h + r
                chosen = gate.decide(hidden, dtype, world, n, limits=be.limits).path
                paths = [gate.Path.TWO_STAGE]
                if one_stage_takes(hidden, dtype):
                    paths.append(gate.Path.ONE_STAGE)
                for path in paths:
                    res = be.run(make_call(x, r, w, EPS, gname, path, gemma=gemma))
                    declined = triton_symm.LIMITS.supports(hidden, dtype, world, path)
                    case = dict(dtype=str(dtype), hidden=hidden, tokens=n, path=path.value,
                                gemma=gemma, residual=r is not None, chosen=chosen.value)
                    if isinstance(res, str):
                        case.update(declined=True, expected_decline=declined, why=res)
                    else:
                        y, h = res.y, res.h
                        case.update(declined=False, expected_decline=declined,
                                    violation=float(violation(y, h, ref)),
                                    same_on_ranks=same_on_all_ranks(y, h),
                                    h_elements=h.numel(),
                                    h_differs_from_unfused=int((h != unfused_h).sum()))
                        if path is chosen:
                            oy, oh = fusion_pass.fused_allreduce_rmsnorm(
                                x, w, EPS, gname, residual=r, path="auto", gemma=gemma)
                            out["op_matches_backend"].append(
                                (case["dtype"], hidden, n,
                                 torch.equal(oy, y) and torch.equal(oh, h)))
                    out["sweep"].append(case)
                if chosen is gate.Path.UNFUSED or all(
                        triton_symm.LIMITS.supports(hidden, dtype, world, p) for p in paths):
                    # Through the op the call falls back to the reference: still right.
                    oy, oh = fusion_pass.fused_allreduce_rmsnorm(
                        x, w, EPS, gname, residual=r, path="auto", gemma=gemma)
                    out["sweep"].append(dict(dtype=str(dtype), hidden=hidden, tokens=n,
                                             path="op-fallback", declined=False,
                                             expected_decline=None,
                                             violation=float(violation(oy, oh, ref)),
                                             same_on_ranks=same_on_all_ranks(oy, oh),
                                             h_elements=oh.numel(),
                                             h_differs_from_unfused=int((oh != unfused_h).sum())))

    out["features"] = _features(rank, gname, be)
    out["back_to_back"] = _back_to_back(rank, gname)
    out["graph"] = _graph_replays(rank, gname)
    return out


def _features(rank: int, gname: str, be) -> list[dict[str, Any]]:
    """Epsilon as a device tensor, norm weight and output dtypes of their own, and
    every FP8 epilogue, on both kernels: outputs against float64 and codes against
    ``quant.quantize`` of the kernel's own ``y``, element by element."""
    from fusion_pass.gate import Path
    from fusion_pass.quant import QuantSpec
    from fusion_pass.testing.calls import make_call

    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    one, two = Path.ONE_STAGE, Path.TWO_STAGE
    stat, stat_r = QuantSpec("static"), QuantSpec("static", reciprocal=True)
    tok = QuantSpec("per_token", scale_floor=1.0 / (448.0 * 512.0), reciprocal=True)
    grp = QuantSpec("per_group", group=128)
    fnuz = QuantSpec("per_token", fp8_dtype="float8_e4m3fnuz", qmax=224.0)
    eps_t = torch.tensor(1e-5, device="cuda")
    cases = [  # (dtype, wdtype, out_dtype, eps, spec, emit_y, path, hidden, tokens)
        (bf16, f32, None, EPS, None, True, one, 4096, 8),
        (bf16, f32, None, EPS, None, True, two, 8192, 300),
        (bf16, None, f32, EPS, None, True, one, 7168, 3),
        (bf16, None, f32, EPS, None, True, two, 4096, 129),
        (f16, bf16, bf16, EPS, None, True, one, 2880, 80),
        (bf16, None, None, eps_t, None, True, one, 4096, 8),
        (bf16, None, None, eps_t.to(bf16), None, True, two, 4096, 200),
        (f32, None, None, eps_t, None, True, one, 8192, 2),
    ]
    for spec, scale in ((stat, 0.02), (stat_r, 0.013), (tok, None), (grp, None)):
        for path, hidden, n in ((one, 4096, 8), (one, 8192, 1), (two, 7168, 81), (two, 4096, 512)):
            cases.append((bf16, None, None, EPS, (spec, scale), True, path, hidden, n))
    # vLLM's block-FP8 GEMM scales: column-major, TMA-aligned (token counts not a
    # multiple of 4), UE8M0, as _C.per_token_group_fp8_quant's specs give them.
    col = QuantSpec("per_group", group=128, scale_floor=1e-10 / 448.0, scale_layout="col")
    tma = QuantSpec("per_group", group=128, scale_floor=1e-10 / 448.0, scale_layout="col_tma")
    ue8m0 = QuantSpec("per_group", group=128, scale_floor=1e-10, ue8m0=True)
    ue8m0_tma = QuantSpec("per_group", group=128, scale_floor=1e-10, scale_layout="col_tma",
                          ue8m0=True)
    cases += [
        (bf16, None, None, EPS, (col, None), True, one, 4096, 6),
        (bf16, None, None, EPS, (tma, None), True, one, 7168, 7),
        (bf16, None, None, EPS, (tma, None), False, two, 4096, 301),
        (bf16, None, None, EPS, (ue8m0, None), True, two, 7168, 81),
        (bf16, None, None, EPS, (ue8m0_tma, None), True, one, 4096, 5),
        (bf16, None, None, EPS, (ue8m0_tma, None), True, two, 8192, 130),
    ]
    cases += [
        (bf16, None, None, EPS, (grp, None), False, one, 8192, 1),
        (bf16, None, None, EPS, (tok, None), False, two, 4096, 512),
        (bf16, f32, f32, eps_t, (grp, None), True, one, 7168, 7),
        (f16, None, None, EPS, (tok, None), True, two, 2880, 200),
        (f32, None, None, EPS, (stat, 0.05), True, one, 4096, 8),
        (bf16, None, None, EPS, (fnuz, None), True, one, 4096, 8),
        (bf16, None, None, EPS, (fnuz, None), True, two, 4096, 200),
        (bf16, None, None, EPS, (grp, None), True, one, 16384, 2),
    ]
    results = []
    for i, (dtype, wdtype, out_dtype, eps, quant, emit_y, path, hidden, n) in enumerate(cases):
        x, r, w = inputs(n, hidden, dtype, 5000 + i, rank, wdtype=wdtype)
        spec, scale = quant if quant is not None else (None, None)
        scale_t = torch.tensor([scale], device="cuda") if scale is not None else None
        e = float(eps) if isinstance(eps, float) else float(eps.float())
        res = be.run(make_call(x, r, w, eps, gname, path, out_dtype=out_dtype, quant=spec,
                               scale=scale_t, emit_y=emit_y))
        case = dict(dtype=str(dtype), wdtype=str(wdtype or dtype),
                    out_dtype=str(out_dtype or dtype), eps_tensor=not isinstance(eps, float), quant=spec.encode() if spec else None,
                    emit_y=emit_y, path=path.value, hidden=hidden, tokens=n)
        if isinstance(res, str):
            case.update(declined=res)
            results.append(case)
            continue
        ref = reference(x, r, w, gname, False, eps=e)
        case.update(declined=None, violation=float(violation(res.y, res.h, ref)),
                    y_dtype_ok=res.y is None or res.y.dtype == (out_dtype or dtype),
                    y_emitted=res.y is not None)
        outs = [t for t in (res.y, res.h, res.q, res.scales) if t is not None]
        case["same_on_ranks"] = same_on_all_ranks(*outs)
        if spec is not None:
            y = res.y
            if y is None:  # the same call with y emitted gives the y these codes came from
                again = be.run(make_call(x, r, w, eps, gname, path, out_dtype=out_dtype,
                                         quant=spec, scale=scale_t))
                y = again.y
                case["codes_same_without_y"] = (torch.equal(again.q.view(torch.uint8),
                                                            res.q.view(torch.uint8))
                                                and torch.equal(again.scales, res.scales))
            case["fp8"] = fp8_check(res.q, res.scales, y, spec, scale_t)
        results.append(case)
    return results


def _back_to_back(rank: int, gname: str, calls: int = 1000) -> dict[str, Any]:
    """1000 calls, new data each, alternating shapes, paths and epilogues on one
    buffer, no host sync until the end."""
    import fusion_pass
    from fusion_pass.op import fused_allreduce_rmsnorm_quant
    from fusion_pass.quant import QuantSpec

    dtype = torch.bfloat16
    tok = QuantSpec("per_token", reciprocal=True)
    # (tokens, hidden, path, quant): one-stage calls of split and whole rows hand
    # their mailboxes to whatever comes next.
    cycle = ((8, 4096, "auto", None), (81, 4096, "auto", None), (200, 4096, "auto", None),
             (1, 8192, "auto", None), (80, 4096, "auto", None), (3, 16384, "one_stage", None),
             (8, 4096, "one_stage", tok), (5, 7168, "two_stage", None))
    ws = {h: inputs(1, h, dtype, 7000 + h, rank)[2] for h in {c[1] for c in cycle}}
    xs, rs, outs = [], [], []
    g = torch.Generator(device="cuda").manual_seed(100 + rank)
    gr = torch.Generator(device="cuda").manual_seed(99)
    for i in range(calls):
        n, hidden = cycle[i % len(cycle)][:2]
        xs.append(torch.randn(n, hidden, device="cuda", generator=g).to(dtype))
        rs.append(torch.randn(n, hidden, device="cuda", generator=gr).to(dtype))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i, (x, r) in enumerate(zip(xs, rs)):
        _, hidden, path, spec = cycle[i % len(cycle)]
        if spec is None:
            outs.append(fusion_pass.fused_allreduce_rmsnorm(x, ws[hidden], EPS, gname, residual=r,
                                                            path=path))
        else:
            y, h, q, s = fused_allreduce_rmsnorm_quant(
                x, ws[hidden], EPS, gname, spec, residual=r, path=path, emit_y=True)
            outs.append((y, h, q, s, spec))
    launch_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    worst = torch.zeros((), dtype=torch.float64, device="cuda")
    code_differ = 0
    for i, (x, r, o) in enumerate(zip(xs, rs, outs)):
        hidden = cycle[i % len(cycle)][1]
        ref = reference(x, r, ws[hidden], gname, False)
        worst = torch.maximum(worst, violation(o[0], o[1], ref))
        if len(o) > 2:
            code_differ += fp8_check(o[2], o[3], o[0], o[4], None)["differ_not_tie"]
    return {"calls": calls, "violation": float(worst), "fp8_codes_differ": code_differ,
            "host_launch_s": launch_s}


def _graph_replays(rank: int, gname: str, replays: int = 100) -> dict[str, Any]:
    """20 calls in one CUDA graph (both paths, an FP8 epilogue, epsilon on the
    device), replayed 100 times with new inputs each time, then after pauses
    (skewed between the ranks, then equal)."""
    import fusion_pass
    from fusion_pass.op import fused_allreduce_rmsnorm_quant
    from fusion_pass.quant import QuantSpec

    hidden, dtype = 2880, torch.bfloat16
    cycle = (1, 8, 80, 81, 512)
    shapes = [cycle[i % len(cycle)] for i in range(20)]
    _, _, w = inputs(1, hidden, dtype, 8000, rank)
    xs = [torch.empty(n, hidden, device="cuda", dtype=dtype) for n in shapes]
    rs = [torch.empty(n, hidden, device="cuda", dtype=dtype) for n in shapes]
    eps_t = torch.tensor(EPS, device="cuda")
    tok = QuantSpec("per_token", reciprocal=True)
    g = torch.Generator(device="cuda").manual_seed(200 + rank)
    gr = torch.Generator(device="cuda").manual_seed(199)

    def refill() -> None:
        for x, r in zip(xs, rs):
            x.copy_(torch.randn(x.shape, device="cuda", generator=g))
            r.copy_(torch.randn(r.shape, device="cuda", generator=gr))

    def calls():
        outs = []
        for i, (x, r) in enumerate(zip(xs, rs)):
            if i % 7 == 3:
                y, h, q, s = fused_allreduce_rmsnorm_quant(
                    x, w, eps_t, gname, tok, residual=r, emit_y=True)
                outs.append((y, h, q, s))
            else:
                outs.append(fusion_pass.fused_allreduce_rmsnorm(
                    x, w, eps_t if i % 5 == 1 else EPS, gname, residual=r))
        return outs

    def check(outs) -> tuple[torch.Tensor, int]:
        worst = torch.zeros((), dtype=torch.float64, device="cuda")
        differ = 0
        for x, r, o in zip(xs, rs, outs):
            worst = torch.maximum(worst, violation(o[0], o[1], reference(x, r, w, gname, False)))
            if len(o) > 2:
                differ += fp8_check(o[2], o[3], o[0], tok, None)["differ_not_tie"]
        return worst, differ

    refill()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up: compile, grow the buffer
        for _ in range(2):
            calls()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = calls()
    worst = torch.zeros((), dtype=torch.float64, device="cuda")
    differ = 0
    for _ in range(replays):
        refill()
        graph.replay()
        v, d = check(outs)
        worst, differ = torch.maximum(worst, v), differ + d
    result = {"replays": replays, "violation": float(worst), "fp8_codes_differ": differ}
    for name, pause in (("skewed_pause", 1.0 + 2.0 * rank), ("pause", 3.0)):
        refill()
        torch.cuda.synchronize()
        time.sleep(pause)
        graph.replay()
        result[name] = float(check(outs)[0])
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


LATE_BY_S = 7.0


def late_peer(rank: int, world: int) -> dict[str, Any]:
    """After one call, rank 0 sleeps 7 s, then both ranks call: with the default
    wait bound (the group's own timeout) rank 1's kernel waits and both finish right."""
    import torch.distributed as dist

    import fusion_pass
    from fusion_pass import backends

    gname = dist.group.WORLD.group_name
    x, r, w = inputs(8, 4096, torch.bfloat16, 9100, rank)
    y, h = fusion_pass.fused_allreduce_rmsnorm(x, w, EPS, gname, residual=r)
    before = float(violation(y, h, reference(x, r, w, gname, False)))
    x2, r2, _ = inputs(8, 4096, torch.bfloat16, 9101, rank)
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:
        time.sleep(LATE_BY_S)
    t0 = time.perf_counter()
    y, h = fusion_pass.fused_allreduce_rmsnorm(x2, w, EPS, gname, residual=r2)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    after = float(violation(y, h, reference(x2, r2, w, gname, False)))
    be = backends.get("triton")
    return {"violation_before": before, "violation": after, "call_seconds": seconds,
            "wait_bound_s": be.timeout_ns(gname) / 1e9,
            "env_override": os.environ.get("FUSION_PASS_TIMEOUT_S")}


def buffer_grown_behind_busy_default_stream(rank: int, world: int) -> dict[str, Any]:
    """A new buffer made on a side stream while the default stream is busy, as the
    hang was seen (pytorch/pytorch#181086: torch's allocator zeroes a new block on the
    legacy default stream, unordered with PyTorch's streams).  First torch's bare
    allocation, filled on the side stream: how many elements the late zeroing
    overwrote (all of them where the race exists).  Then ``buffers.get``: it must
    come back armed and hold only empty markers."""
    import torch.distributed as dist

    from fusion_pass.backends.triton_symm import buffers

    gname = dist.group.WORLD.group_name
    dev = torch.device("cuda", torch.cuda.current_device())
    empty = buffers.negative_zero_bits(16)
    side = torch.cuda.Stream()
    busy_cycles = 1 << 31  # about a second at the H200's clock

    with torch.cuda.stream(side):
        # Load the fill kernel first: its lazy loading waits for the device to idle.
        torch.empty(1, dtype=torch.int16, device=dev).fill_(empty)
    torch.cuda.synchronize()
    torch.cuda._sleep(busy_cycles)
    with torch.cuda.stream(side):
        t0 = time.perf_counter()
        bare = buffers._symmetric_empty(1 << 20, torch.int16, dev)
        bare_alloc_s = time.perf_counter() - t0  # about a second where it waited for the memset
        bare.fill_(empty)
    torch.cuda.synchronize()
    bare_overwritten = int((bare != empty).sum())
    del bare

    dist.barrier()
    torch.cuda._sleep(busy_cycles)
    with torch.cuda.stream(side):
        buf = buffers.get(gname, 16, dev, need=4 << 20, max_input_bytes=64 << 20)
    torch.cuda.synchronize()
    armed = isinstance(buf, buffers.SymmBuffer)
    return {"bare_overwritten": bare_overwritten, "bare_elements": 1 << 20,
            "bare_alloc_s": bare_alloc_s,
            "armed": armed, "why": None if armed else buf,
            "not_empty": int((buf.tensor != empty).sum()) if armed else None}


def ranks_sharing_a_gpu(rank: int, world: int) -> dict[str, Any]:
    """Every rank on GPU 0 (``spawn(share=True)``): the op computes through the
    reference and says why, instead of the rendezvous raising in a worker."""
    import logging

    import torch.distributed as dist

    import fusion_pass

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("fusion_pass").addHandler(handler)
    gname = dist.group.WORLD.group_name
    x, r, w = inputs(8, 4096, torch.bfloat16, 9200, rank)
    y, h = fusion_pass.fused_allreduce_rmsnorm(x, w, EPS, gname, residual=r)
    return {"violation": float(violation(y, h, reference(x, r, w, gname, False))),
            "said": said}


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

    # The 80-token rule, whatever the measured schedule says at 2880: 8 tokens
    # one-stage, 512 two-stage, so that the compiled graph runs both kernels.
    inductor_config.post_grad_custom_post_pass = AllReduceRMSNormFusionPass(threshold=80)
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
