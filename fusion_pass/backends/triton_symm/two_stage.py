"""Two-stage fused all-reduce + residual + RMSNorm (+ FP8), one persistent launch.

Rank ``r`` owns the token slice ``[r * chunk, min(n, (r + 1) * chunk))`` with
``chunk = ceil(n / world)`` (a slice may be empty when ``n < world``).

1. reduce-scatter push: every row goes (Lamport-encoded) to its owner's
   mailbox ``(this rank, row - owner start)``; the own slice stays in place;
2. own slice: sum the ranks in rank order in fp32, multiply the sum rounded
   to the dtype and add the residual (:func:`norm.add_residual`), round ``h``,
   normalise, write ``y`` and ``h``, and push ``h`` to every peer;
3. other slices: wait for the owner's ``h`` row and normalise it here.

Step 3 gathers ``h`` only, not ``y`` (nor ``q`` and its scales): they are
functions of ``h``, the weight, epsilon and the static scale alone (the
multiplier is in ``h`` already);
recomputing them from the received row costs no memory traffic (the row is
already in registers) and saves NVLink bytes.  The owner finishes its rows with
the same device function (:func:`norm.finish_row`), so the outputs are bitwise
the same on every rank; ``h`` is sent with negative zeros turned positive, and
the owner writes that same form.

Every mailbox row has one reader, which re-arms it at once; the kernel also
clears what a one-stage call before it left in the previous slot.

The grid never exceeds the SM count, so all programs are resident: step 1
never waits, step 2 waits only for peers' step 1, step 3 for peers' step 2;
no cycle, no deadlock whatever order the programs run in.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import lamport, norm, ptx


@triton.jit(debug=True, do_not_specialize=["n", "chunk", "timeout_ns", "s_row", "s_group"])
def two_stage_kernel(x_ptr, res_ptr, w_ptr, eps, mult, y_ptr, h_ptr, q_ptr, s_ptr, scale_ptr,
                     local_ptr, peer_ptrs, state_ptr, rank, n, chunk, timeout_ns, slot_elems,
                     s_row, s_group,
                     HIDDEN: tl.constexpr, BLOCK: tl.constexpr, WORLD: tl.constexpr,
                     HAS_RES: tl.constexpr, GEMMA: tl.constexpr, NEG0: tl.constexpr,
                     SLOTS: tl.constexpr, EPS_PTR: tl.constexpr, EMIT_Y: tl.constexpr,
                     QUANT: tl.constexpr, GROUP: tl.constexpr, QMAX: tl.constexpr,
                     INV_QMAX: tl.constexpr, FLOOR: tl.constexpr, RECIP: tl.constexpr,
                     FNUZ: tl.constexpr, PDL: tl.constexpr, ROUND_N: tl.constexpr,
                     MUL: tl.constexpr):
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    IT: tl.constexpr = local_ptr.dtype.element_ty
    DT: tl.constexpr = x_ptr.dtype.element_ty
    VEC: tl.constexpr = 128 // IT.primitive_bitwidth
    ptx.wait_for_previous_kernel(PDL)
    word, slot, dirty = lamport.load_state(state_ptr, VEC)
    base = slot.to(tl.int64) * slot_elems
    gather = base + (WORLD * chunk).to(tl.int64) * HIDDEN
    start = rank * chunk
    owned = tl.maximum(tl.minimum(n, start + chunk) - start, 0)
    w = norm.load_weight(w_ptr, offs, mask, GEMMA)
    e = norm.load_eps(eps, EPS_PTR)
    m = norm.load_multiplier(mult, MUL)
    scale = norm.load_scale(scale_ptr, QUANT)

    # 1. reduce-scatter push of the rows other ranks own.
    for t in range(pid, n, grid):
        owner = t // chunk
        if owner != rank:
            bits = tl.load(x_ptr + tl.cast(t, tl.int64) * HIDDEN + offs, mask=mask, other=0)
            peer = tl.multiple_of(tl.load(peer_ptrs + owner).to(tl.pointer_type(IT)), 16)
            box = base + (rank * chunk + t - owner * chunk).to(tl.int64) * HIDDEN
            tl.store(peer + box + offs, lamport.encode(bits.to(IT, bitcast=True), NEG0), mask=mask)
    lamport.clear_previous(local_ptr, state_ptr, slot, dirty, rank, pid, grid, slot_elems,
                           WORLD, SLOTS, BLOCK, NEG0)
    lamport.advance_slot(state_ptr, word, 0, SLOTS)
    ptx.let_next_kernel_start(PDL)

    # 2. reduce, add, normalise the own slice; all-gather push of h.
    for i in range(pid, owned, grid):
        t = start + i
        row_off = tl.cast(t, tl.int64) * HIDDEN
        if HAS_RES:  # loaded before the waits, added after them (the ranks' sum first)
            res = tl.load(res_ptr + row_off + offs, mask=mask, other=0).to(tl.float32)
        acc = tl.zeros([BLOCK], tl.float32)
        for s in tl.static_range(WORLD):
            if s == rank:
                bits = lamport.encode(
                    tl.load(x_ptr + row_off + offs, mask=mask, other=0).to(IT, bitcast=True), NEG0)
            else:
                ptr = local_ptr + base + (s * chunk + i).to(tl.int64) * HIDDEN + offs
                bits = lamport.wait_row(ptr, mask, timeout_ns, NEG0)
                lamport.rearm(ptr, mask, BLOCK, NEG0)
            acc += bits.to(DT, bitcast=True).to(tl.float32)
        if HAS_RES:
            acc = norm.add_residual(acc, res, m, DT, MUL)
        else:
            acc = norm.scale_reduced(acc, m, DT, MUL)
        hbits = lamport.encode(acc.to(DT).to(IT, bitcast=True), NEG0)
        for p in tl.static_range(WORLD):
            if p != rank:
                peer = tl.multiple_of(tl.load(peer_ptrs + p).to(tl.pointer_type(IT)), 16)
                tl.store(peer + gather + row_off + offs, hbits, mask=mask)
        h = hbits.to(DT, bitcast=True)
        tl.store(h_ptr + row_off + offs, h, mask=mask)
        norm.finish_row(h, w, norm.rstd(norm.sum_squares(h), e, HIDDEN), scale, t, row_off,
                        offs, 0, BLOCK, 0, y_ptr, q_ptr, s_ptr, s_row, s_group, HIDDEN, BLOCK,
                        EMIT_Y, QUANT, GROUP, QMAX, INV_QMAX, FLOOR, RECIP, FNUZ, ROUND_N)

    # 3. receive h of the other slices and finish it here.
    for t in range(pid, n, grid):
        if t // chunk != rank:
            row_off = tl.cast(t, tl.int64) * HIDDEN
            ptr = local_ptr + gather + row_off + offs
            hbits = lamport.wait_row(ptr, mask, timeout_ns, NEG0)
            lamport.rearm(ptr, mask, BLOCK, NEG0)
            h = hbits.to(DT, bitcast=True)
            tl.store(h_ptr + row_off + offs, h, mask=mask)
            norm.finish_row(h, w, norm.rstd(norm.sum_squares(h), e, HIDDEN), scale, t,
                            row_off, offs, 0, BLOCK, 0, y_ptr, q_ptr, s_ptr, s_row, s_group,
                            HIDDEN, BLOCK, EMIT_Y, QUANT, GROUP, QMAX, INV_QMAX, FLOOR, RECIP,
                            FNUZ, ROUND_N)
