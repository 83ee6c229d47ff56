"""Device functions shared by the one-stage and two-stage kernels: the mailboxes.

Lamport mailboxes: a mailbox element holds negative zero (the element width's
sign bit alone) while empty.  A sender stores its data with every negative zero
turned into positive zero, so the data is its own ready flag: a receiver polls
its local mailbox with volatile loads until no element is negative zero.  No
barrier, no separate flag, one NVLink crossing per value.

Re-arming (writing negative zero back) happens in one of two ways:

* at once, by the single reader of a mailbox row (two-stage: every row has
  exactly one reader);
* deferred (one-stage: the parts of a split row may each read the whole row,
  so none of them may re-arm it; parts that own their columns clear the same
  deferred way): the slot counter records how many elements per
  source rank the call used, and the next call on the buffer clears that region
  of the previous slot before it waits (:func:`clear_previous`).  The previous
  slot is safe to clear: this rank finished reading it (the previous launch
  ended) and no peer writes it again before this rank's next push.

The values are handled through the integer view of their bits (``int16`` for
bf16/fp16, ``int32`` for fp32) so that the marker test is exact.

The slot counter is a device int32 array ``[elements per source to clear in
the previous slot << 2 | slot, programs arrived]`` on a 128-byte line of its own,
followed by the partial sums of each slot (:func:`exchange_sum`), a line per
row, empty while they hold the fp32 negative zero and cleared, like one-stage
mailboxes, by the next call (``buffers.partial_index``).
"""

import triton
import triton.language as tl

from . import buffers, ptx


@triton.jit
def encode(bits, NEG0: tl.constexpr):
    """Bits as a sender stores them: negative zero becomes positive zero."""
    return tl.where(bits == NEG0, tl.zeros_like(bits), bits)


EXPIRED = tl.constexpr(1 << 15)
"""Added per lane to the wait's count once the lane's thread is past the bound:
above any count of pending lanes (a row is at most 16384 lanes), so the one
block reduction carries both."""


CLOCK_POLLS = tl.constexpr(64)
"""The wait reads the clock on every this many polls, not on each: a clock read
inside the poll lengthens every wait, and a bound of seconds does not notice 64
polls (timings: docs/triton_backend.md)."""


@triton.jit
def wait_row(ptr, mask, timeout_ns, NEG0: tl.constexpr):
    """Poll a local mailbox row until every element has arrived; its bits.

    The common case (the peer pushed before we got here) costs one load and
    one block reduction.  A wait longer than ``timeout_ns`` fails a device
    assertion: the process gets a CUDA error instead of hanging forever.
    Each thread reads its own clock, so the bound enters the same reduction
    as the pending count: every warp leaves the loop on the same iteration.
    (With each warp testing its own clock, one warp of each waiting program
    left at the bound and asserted while the others waited for it at the
    reduction's barrier: 2 x H200, a 20 s bound.)  The clock is read on every
    :data:`CLOCK_POLLS`-th poll, a count every thread keeps alike.
    """
    bits = tl.load(ptr, mask=mask, other=0, volatile=True)
    pending = tl.sum((bits == NEG0).to(tl.int32), axis=0)
    if pending > 0:
        t0 = ptx.globaltimer()
        expired = pending - pending
        polls = pending - pending
        while (pending > 0) & (expired == 0):
            bits = tl.load(ptr, mask=mask, other=0, volatile=True)
            waiting = (bits == NEG0).to(tl.int32)
            polls += 1
            if polls % CLOCK_POLLS == 0:
                late = (ptx.globaltimer() - t0 >= timeout_ns).to(tl.int32)
                waiting += late * EXPIRED
            count = tl.sum(waiting, axis=0)
            pending = count % EXPIRED
            expired = count // EXPIRED
        tl.device_assert(pending == 0, "fusion_pass: timed out waiting for a peer rank "
                         "(FUSION_PASS_TIMEOUT_S); this process's communicator is unusable")
    return bits


@triton.jit
def rearm(ptr, mask, BLOCK: tl.constexpr, NEG0: tl.constexpr):
    tl.store(ptr, tl.full([BLOCK], NEG0, ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_state(state_ptr, VEC: tl.constexpr):
    """``(state word, slot, elements per source left to clear in the previous
    slot)``: one word holds both (``dirty << 2 | slot``), so one load, made by
    every thread, gives a program all it reads of the counter (see
    :func:`advance_slot`).  Rows are whole 16-byte vectors of ``VEC`` elements,
    so is the count: saying so keeps the clearing stores 16 bytes wide (the
    hint has to sit where the value is made, not in a callee)."""
    word = tl.load(state_ptr, volatile=True)
    dirty = tl.multiple_of(word >> 2, VEC)
    return word, word & 3, dirty


HEADER_WORDS = tl.constexpr(buffers.HEADER_WORDS)
ROW_WORDS = tl.constexpr(buffers.ROW_WORDS)
PARTIALS = tl.constexpr(buffers.PARTIALS)
MAX_PARTS = tl.constexpr(buffers.MAX_PARTS)
NEG0_F32 = tl.constexpr(buffers.negative_zero_bits(32))


@triton.jit
def exchange_sum(state_ptr, slot, row, part, value, timeout_ns, SPLIT: tl.constexpr):
    """The sum over the ``SPLIT`` parts of a row of each part's ``value`` (fp32,
    never negative zero), in part order, so that every part gets the same bits.

    Each part publishes its value in this slot's partials and polls the row's
    ``SPLIT`` entries until none is empty: the parts of a row are resident
    together (the grid fits the SMs), a local round trip through L2.  No part
    may re-arm the entries (its siblings may still read them): the next call
    clears them (:func:`clear_previous`)."""
    base = state_ptr + HEADER_WORDS + slot * PARTIALS + row * ROW_WORDS
    tl.store(base + part, value.to(tl.int32, bitcast=True))
    offs = tl.arange(0, MAX_PARTS)
    bits = wait_row(base + offs, offs < SPLIT, timeout_ns, NEG0_F32)
    vals = tl.where(offs < SPLIT, bits.to(tl.float32, bitcast=True), 0.0)
    return tl.sum(vals, axis=0)


@triton.jit
def clear_previous(local_ptr, state_ptr, slot, dirty, rank, pid, programs, slot_elems,
                   WORLD: tl.constexpr, SLOTS: tl.constexpr, BLOCK: tl.constexpr,
                   NEG0: tl.constexpr):
    """Re-arm what the previous call left in its slot: ``dirty`` elements per
    source rank, laid out source after source (one-stage mailboxes), spread over
    this launch's programs, and the slot's partial sums.  Local stores only,
    issued before any wait."""
    prev = (slot + SLOTS - 1) % SLOTS
    if pid == 0:
        p = tl.arange(0, PARTIALS)
        tl.store(state_ptr + HEADER_WORDS + prev * PARTIALS + p,
                 tl.full([PARTIALS], NEG0_F32, tl.int32))
    base = prev.to(tl.int64) * slot_elems
    offs = tl.arange(0, BLOCK)
    empty = tl.full([BLOCK], NEG0, local_ptr.dtype.element_ty)
    for b in range(pid, tl.cdiv(dirty, BLOCK), programs):
        o = tl.cast(b, tl.int64) * BLOCK + offs
        for s in tl.static_range(WORLD):
            if s != rank:
                tl.store(local_ptr + base + s * dirty.to(tl.int64) + o, empty, mask=o < dirty)


@triton.jit
def advance_slot(state_ptr, word, leaves, SLOTS: tl.constexpr):
    """Arrive at the slot counter; the last program to arrive moves it on and
    records what this call leaves for the next one to clear (``leaves``
    elements per source).

    Called once every thread of the program has used the state ``word`` it
    read (:func:`load_state`) in a branch or an address (the pushes, the
    clearing of the previous slot): the barrier then holds the arrival until
    every thread has its value, so the last program cannot change the word
    under a thread still reading it.  The arrival itself is a relaxed atomic
    whose operand is computed from the word (always 1).  An acquire-release
    arrival would order all that too, but its fence first waits until the
    program's pushes are acknowledged over NVLink, with the whole program
    waiting on it: 2 x H200, bf16, one-stage, 7168 x 128 11.04 against 9.43 us
    relaxed, 8192 x 80 9.01 / 7.78, 2880 x 256 9.71 / 8.06.  The next launch
    starts after this one ends, so arriving before the wait for the peers
    hides the atomic's round trip behind it."""
    tl.debug_barrier()
    arrived = tl.atomic_add(state_ptr + 1, (word >= 0).to(tl.int32), sem="relaxed")
    if arrived == tl.num_programs(0) - 1:
        tl.store(state_ptr + 1, 0)
        tl.store(state_ptr, (leaves << 2) | (((word & 3) + 1) % SLOTS))
