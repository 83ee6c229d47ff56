"""One-stage fused all-reduce + residual + RMSNorm: one launch, one program per token.

Each program pushes its row (Lamport-encoded) into the mailbox ``(this rank,
row)`` of every peer's current slot, then reads the rows the peers pushed into
its own mailboxes, sums the ranks in rank order in fp32 (so every rank gets the
same bits), adds the residual, rounds ``h`` to the input dtype and normalises.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import lamport


@triton.jit(debug=True, do_not_specialize=["n", "timeout_ns"])
def one_stage_kernel(x_ptr, res_ptr, w_ptr, y_ptr, h_ptr, local_ptr, peer_ptrs, state_ptr,
                     rank, n, eps, timeout_ns, slot_elems,
                     HIDDEN: tl.constexpr, BLOCK: tl.constexpr, WORLD: tl.constexpr,
                     HAS_RES: tl.constexpr, GEMMA: tl.constexpr, NEG0: tl.constexpr,
                     SLOTS: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    IT: tl.constexpr = local_ptr.dtype.element_ty
    DT: tl.constexpr = x_ptr.dtype.element_ty
    slot = tl.load(state_ptr, volatile=True)
    base = slot.to(tl.int64) * slot_elems
    row_off = row.to(tl.int64) * HIDDEN

    # Every operand is loaded before the exchange: after the wait only arithmetic
    # and the output stores remain on the critical path.
    mine = lamport.encode(tl.load(x_ptr + row_off + offs, mask=mask, other=0).to(IT, bitcast=True),
                          NEG0)
    w = lamport.load_weight(w_ptr, offs, mask, GEMMA)
    if HAS_RES:
        res = tl.load(res_ptr + row_off + offs, mask=mask, other=0).to(tl.float32)
    box = base + (rank * n + row).to(tl.int64) * HIDDEN
    for p in tl.static_range(WORLD):
        if p != rank:
            peer = tl.multiple_of(tl.load(peer_ptrs + p).to(tl.pointer_type(IT)), 16)
            tl.store(peer + box + offs, mine, mask=mask)
    lamport.advance_slot(state_ptr, slot, SLOTS)

    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(WORLD):
        if s == rank:
            bits = mine
        else:
            ptr = local_ptr + base + (s * n + row).to(tl.int64) * HIDDEN + offs
            bits = lamport.wait_row(ptr, mask, timeout_ns, NEG0)
            lamport.rearm(ptr, mask, BLOCK, NEG0)
        acc += bits.to(DT, bitcast=True).to(tl.float32)
    if HAS_RES:
        acc += res
    h = acc.to(DT)
    y = lamport.rms_norm_row(h.to(tl.float32), w, eps, HIDDEN)
    tl.store(h_ptr + row_off + offs, h, mask=mask)
    tl.store(y_ptr + row_off + offs, y.to(DT), mask=mask)
