"""One-stage fused all-reduce + residual + RMSNorm (+ FP8): one launch, ``SPLIT``
programs per token.

Program ``(row, part)`` pushes its part of the row (Lamport-encoded) into the
mailbox ``(this rank, row)`` of every peer's current slot; the ``SPLIT`` parts
of a row leave from as many SMs, so a wide row crosses NVLink in parallel.
Then, with ``OWN`` (the usual split row), each part reads its own columns of
every peer's row from its mailboxes, sums the ranks in rank order in fp32 (so
every rank gets the same bits), multiplies that sum rounded as the graph's
all-reduce output is by the multiplier and adds the residual
(:func:`norm.add_residual`), rounds ``h`` to the input dtype, and exchanges
its sum of squares with its sibling parts
(:func:`lamport.exchange_sum`: the same total, in part order, in every part)
before it normalises its columns.  Without ``OWN`` (a whole row, or a
per-token FP8 scale, whose amax needs the whole row) every part reads and
normalises the whole row and stores its own columns.  The mailboxes are read
by the parts without re-arming; the next call clears them
(:func:`lamport.clear_previous`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import lamport, norm, ptx


@triton.jit(debug=True, do_not_specialize=["n", "timeout_ns", "s_row", "s_group"])
def one_stage_kernel(x_ptr, res_ptr, w_ptr, eps, mult, y_ptr, h_ptr, q_ptr, s_ptr, scale_ptr,
                     local_ptr, peer_ptrs, state_ptr, rank, n, timeout_ns, slot_elems,
                     s_row, s_group,
                     HIDDEN: tl.constexpr, BLOCK: tl.constexpr, WORLD: tl.constexpr,
                     HAS_RES: tl.constexpr, GEMMA: tl.constexpr, NEG0: tl.constexpr,
                     SLOTS: tl.constexpr, SPLIT: tl.constexpr, PART: tl.constexpr,
                     EPS_PTR: tl.constexpr, EMIT_Y: tl.constexpr, QUANT: tl.constexpr,
                     GROUP: tl.constexpr, QMAX: tl.constexpr, INV_QMAX: tl.constexpr,
                     FLOOR: tl.constexpr, RECIP: tl.constexpr, FNUZ: tl.constexpr,
                     PDL: tl.constexpr, OWN: tl.constexpr, ROUND_N: tl.constexpr,
                     MUL: tl.constexpr):
    pid = tl.program_id(0)
    row = pid // SPLIT
    IT: tl.constexpr = local_ptr.dtype.element_ty
    # Parts start on 16-byte vectors; saying so keeps the masked stores 16 bytes
    # wide (2-byte output stores cost 1-2 us at 8192 x bf16).
    VEC: tl.constexpr = 128 // IT.primitive_bitwidth
    lo = tl.multiple_of((pid % SPLIT) * PART, VEC)
    hi = tl.multiple_of(lo + PART, VEC)
    if OWN:  # this part's columns alone (BLOCK >= PART)
        first = lo
        offs = lo + tl.arange(0, BLOCK)
        mask = (offs < hi) & (offs < HIDDEN)
    else:  # the whole row
        first = 0
        offs = tl.arange(0, BLOCK)
        mask = offs < HIDDEN
    DT: tl.constexpr = x_ptr.dtype.element_ty
    ptx.wait_for_previous_kernel(PDL)
    word, slot, dirty = lamport.load_state(state_ptr, VEC)
    base = slot.to(tl.int64) * slot_elems
    row_off = row.to(tl.int64) * HIDDEN

    # Every operand is loaded before the exchange: after the wait only arithmetic
    # and the output stores remain on the critical path.
    mine = lamport.encode(tl.load(x_ptr + row_off + offs, mask=mask, other=0).to(IT, bitcast=True),
                          NEG0)
    w = norm.load_weight(w_ptr, offs, mask, GEMMA)
    e = norm.load_eps(eps, EPS_PTR)
    m = norm.load_multiplier(mult, MUL)
    scale = norm.load_scale(scale_ptr, QUANT)
    if HAS_RES:
        res = tl.load(res_ptr + row_off + offs, mask=mask, other=0).to(tl.float32)
    box = base + (rank * n + row).to(tl.int64) * HIDDEN
    push = mask & (offs >= lo) & (offs < hi)
    for p in tl.static_range(WORLD):
        if p != rank:
            peer = tl.multiple_of(tl.load(peer_ptrs + p).to(tl.pointer_type(IT)), 16)
            tl.store(peer + box + offs, mine, mask=push)
    lamport.clear_previous(local_ptr, state_ptr, slot, dirty, rank, pid, tl.num_programs(0),
                           slot_elems, WORLD, SLOTS, BLOCK, NEG0)
    lamport.advance_slot(state_ptr, word, n * HIDDEN, SLOTS)
    ptx.let_next_kernel_start(PDL)

    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(WORLD):
        if s == rank:
            bits = mine
        else:
            ptr = local_ptr + base + (s * n + row).to(tl.int64) * HIDDEN + offs
            bits = lamport.wait_row(ptr, mask, timeout_ns, NEG0)
        acc += bits.to(DT, bitcast=True).to(tl.float32)
    if HAS_RES:
        acc = norm.add_residual(acc, res, m, DT, MUL)
    else:
        acc = norm.scale_reduced(acc, m, DT, MUL)
    h = acc.to(DT)
    tl.store(h_ptr + row_off + offs, h, mask=push)
    ss = norm.sum_squares(h)
    if OWN:
        ss = lamport.exchange_sum(state_ptr, slot, row, pid % SPLIT, ss, timeout_ns, SPLIT)
    norm.finish_row(h, w, norm.rstd(ss, e, HIDDEN), scale, row, row_off, offs, lo, hi, first,
                    y_ptr, q_ptr, s_ptr, s_row, s_group, HIDDEN, BLOCK, EMIT_Y, QUANT, GROUP,
                    QMAX, INV_QMAX, FLOOR, RECIP, FNUZ, ROUND_N)
