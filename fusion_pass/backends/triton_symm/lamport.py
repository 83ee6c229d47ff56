"""Device functions shared by the one-stage and two-stage kernels.

Lamport mailboxes: a mailbox element holds negative zero (the element width's
sign bit alone) while empty.  A sender stores its data with every negative zero
turned into positive zero, so the data is its own ready flag: a receiver polls
its local mailbox with volatile loads until no element is negative zero, uses
the values, and writes negative zero back (re-arming the slot for a later call).
No barrier, no separate flag, one NVLink crossing per value.

The values are handled through the integer view of their bits (``int16`` for
bf16/fp16, ``int32`` for fp32) so that the marker test is exact.
"""

import triton
import triton.language as tl

from . import ptx


@triton.jit
def encode(bits, NEG0: tl.constexpr):
    """Bits as a sender stores them: negative zero becomes positive zero."""
    return tl.where(bits == NEG0, tl.zeros_like(bits), bits)


@triton.jit
def wait_row(ptr, mask, timeout_ns, NEG0: tl.constexpr):
    """Poll a local mailbox row until every element has arrived; its bits.

    The common case (the peer pushed before we got here) costs one load and
    one block reduction.  A wait longer than ``timeout_ns`` fails a device
    assertion: the process gets a CUDA error instead of hanging forever.
    """
    bits = tl.load(ptr, mask=mask, other=0, volatile=True)
    pending = tl.sum((bits == NEG0).to(tl.int32), axis=0)
    if pending > 0:
        t0 = ptx.globaltimer()
        waited = t0 - t0
        while (pending > 0) & (waited < timeout_ns):
            bits = tl.load(ptr, mask=mask, other=0, volatile=True)
            pending = tl.sum((bits == NEG0).to(tl.int32), axis=0)
            waited = ptx.globaltimer() - t0
        tl.device_assert(pending == 0, "fusion_pass: timed out waiting for a peer rank "
                         "(FUSION_PASS_TIMEOUT_S); this process's communicator is unusable")
    return bits


@triton.jit
def rearm(ptr, mask, BLOCK: tl.constexpr, NEG0: tl.constexpr):
    tl.store(ptr, tl.full([BLOCK], NEG0, ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_weight(w_ptr, offs, mask, GEMMA: tl.constexpr):
    """The norm weight in fp32 (``w + 1`` for Gemma); loaded before any wait so
    that its latency hides behind the exchange."""
    w = tl.load(w_ptr + offs, mask=mask, other=0).to(tl.float32)
    if GEMMA:
        w = w + 1.0
    return w


@triton.jit
def rms_norm_row(hf, w, eps, HIDDEN: tl.constexpr):
    """``hf * rsqrt(mean(hf^2) + eps) * w`` in fp32; masked lanes of ``hf`` must be zero."""
    rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / HIDDEN + eps)
    return hf * rstd * w


@triton.jit
def advance_slot(state_ptr, slot, SLOTS: tl.constexpr):
    """The last program to arrive moves the slot counter on.  Every program has
    read ``slot`` before it arrives and the next launch starts after this one
    ends, so programs call this as soon as their pushes are issued: the atomic's
    round trip then overlaps the wait for the peers instead of ending the kernel."""
    arrived = tl.atomic_add(state_ptr + 1, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:
        tl.store(state_ptr + 1, 0)
        tl.store(state_ptr, (slot + 1) % SLOTS)
