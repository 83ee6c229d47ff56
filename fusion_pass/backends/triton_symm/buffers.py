"""Symmetric buffers for the Triton kernels: allocated once per size class, reused.

One :class:`SymmBuffer` per (group, element width, device) holds three
rotating slots of Lamport-style mailboxes (see ``lamport.py``).  Every element
of an idle slot holds the element width's negative zero, the "empty" marker,
which is why bf16 and fp16 (both ``0x8000``) share a buffer and fp32
(``0x80000000``) has its own.  The group is a :class:`~fusion_pass.groups.Group`,
never a name: a group destroyed and made again under its name gets buffers of
its own.

Before a group's first buffer its ranks exchange what each can see
(:func:`agree`): a group over several hosts, with two ranks on one GPU, or
with two GPUs that cannot map each other gets no symmetric memory, on every
rank alike, and every call of it falls back with the reason.

A call needs ``slot_need_bytes`` per slot.  When that exceeds the current
buffer, a larger one is made (a collective: every rank of a tensor-parallel
group sees the same shapes in the same order, so all ranks grow together) --
but never while a CUDA graph is being captured, where allocating and
rendezvousing are impossible; the call is then declined and the op falls back.
A step of the allocation that fails on one rank fails it on every rank
(:func:`_allocate`).  A new buffer is filled and proven through the kernels'
own peer addresses before any kernel uses it (:func:`arm`); one that fails is
refused on every rank, and the op falls back with the reason.

A replaced buffer is kept alive because graphs captured earlier hold its
addresses; power-of-two classes bound what the kept ones cost to about the
size of the current one.  A group that ends (its name names another group, or
it is gone) leaves its buffers in :data:`_ended`, which holds them until its
``ProcessGroup`` is freed; the next buffer request after that frees them
(:func:`release_freed`).
"""

from __future__ import annotations

import math
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar, Union

import torch

from ... import groups, topology
from ...groups import Group

T = TypeVar("T")

SLOTS = 3
"""Rotating slots: a fast peer may push call k+1 while this rank still reads
call k, and the slot of call k-1 is re-armed by the time call k+2 reuses it."""

MIN_SLOT_BYTES = 1 << 20

MAX_PARTS = 8
"""Most programs a one-stage row is split into."""

HEADER_WORDS = 32
"""The state array's first 128-byte line: the slot and the elements to clear
in one word, programs arrived (the rest unused), apart from the partial sums
that parts poll."""

ROW_WORDS = 32
"""Words of the state array per row of partial sums: a 128-byte line of its
own, so that the parts of one row poll a line no other row's parts store to."""

PART_ROWS = 32
"""Rows per slot with partial sums (a one-stage call whose parts own their
columns has at least three parts per row and at most
``triton_symm.OWN_SPLIT_PROGRAMS`` = 64 programs)."""

PARTIALS = PART_ROWS * ROW_WORDS
"""Words of partial sums per slot (fp32 bits; one per (row, part))."""

STATE_WORDS = HEADER_WORDS + SLOTS * PARTIALS


def state_word(slot: int, dirty: int) -> int:
    """The state array's first word: ``dirty`` elements per source to clear
    in the previous slot, and the slot."""
    return dirty << 2 | slot


def partial_index(slot: int, row: int, part: int) -> int:
    """Where the state array holds a row's part's sum of squares in a slot."""
    return HEADER_WORDS + slot * PARTIALS + row * ROW_WORDS + part


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def one_stage_need(tokens: int, row_bytes: int, world_size: int) -> int:
    """Slot bytes of a one-stage call: one mailbox row per (source rank, token)."""
    return world_size * tokens * row_bytes


def two_stage_need(tokens: int, row_bytes: int, world_size: int) -> int:
    """Slot bytes of a two-stage call: the reduce-scatter mailboxes (one chunk
    of ``ceil(tokens / world)`` rows per source) and the all-gather rows."""
    return (world_size * ceil_div(tokens, world_size) + tokens) * row_bytes


def max_slot_bytes(max_input_bytes: int) -> int:
    """Largest slot ever made: a two-stage call of the largest input needs
    twice its bytes plus up to a row per rank of rounding, which 1 MiB covers
    for every row the kernels take (<= 64 KiB, world <= 8)."""
    return 2 * max_input_bytes + MIN_SLOT_BYTES


def size_class(need: int, max_input_bytes: int) -> Optional[int]:
    """Slot bytes to allocate for ``need``: the next power of two (>= 1 MiB),
    capped at :func:`max_slot_bytes`; None if ``need`` exceeds that cap."""
    cap = max_slot_bytes(max_input_bytes)
    if need > cap:
        return None
    return min(cap, max(MIN_SLOT_BYTES, 1 << max(0, math.ceil(math.log2(max(need, 1))))))


@dataclass
class SymmBuffer:
    """One rendezvoused allocation of ``SLOTS`` slots and its device-side state."""

    tensor: torch.Tensor
    """This rank's slots, typed as the integer view of the element width."""
    peer_ptrs: torch.Tensor
    """int64 device array: every rank's address of its ``tensor``."""
    state: torch.Tensor
    """int32 device array ``[elements per source the previous call left to
    clear << 2 | slot, programs arrived]`` (see ``lamport.py``): the counter
    lives on the device so that graph replays advance it like eager calls do;
    from :data:`HEADER_WORDS` on, :data:`PARTIALS` words of fp32 partial sums
    per slot (as int32 bits, empty: the fp32 negative zero), see
    :func:`lamport.exchange_sum`."""
    handle: object
    rank: int
    world_size: int
    slot_bytes: int

    @property
    def slot_elems(self) -> int:
        return self.slot_bytes // self.tensor.element_size()


def new_state(device: torch.device) -> torch.Tensor:
    """A fresh state array: slot 0, nobody arrived, nothing to clear, no partial sums."""
    state = torch.full((STATE_WORDS,), negative_zero_bits(32), dtype=torch.int32, device=device)
    state[:HEADER_WORDS] = 0
    return state


def negative_zero_bits(elem_bits: int) -> int:
    """The "empty" marker as a signed integer of ``elem_bits`` bits."""
    return -(1 << (elem_bits - 1))


def int_dtype(elem_bits: int) -> torch.dtype:
    return {16: torch.int16, 32: torch.int32}[elem_bits]


_lock = threading.RLock()
"""Held while a buffer is made or released (a group ending inside, through its
watchers, takes it again)."""
_current: dict[tuple[Group, int, int], SymmBuffer] = {}
"""The buffer calls use, per (group, element width, device)."""
_retired: dict[Group, list[SymmBuffer]] = {}
"""Per live group: its buffers that a larger one replaced (graphs captured
earlier hold their addresses)."""
_ended: dict[Group, list[SymmBuffer]] = {}
"""Per ended group: every buffer it had, until its ``ProcessGroup`` is freed."""
_decided: dict[Group, Optional[str]] = {}
"""Per group whose ranks have agreed on its topology: None, or why it gets no
symmetric memory (the same on every rank, for every later call)."""
generation = 0
"""Bumped whenever a buffer is made: launch plans cached with an older value
look their buffer up again (one integer compare per call instead of a lookup)."""


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else -1


def _allocate(group: Group, elem_bits: int, device: torch.device,
              slot_bytes: int) -> Union[SymmBuffer, str]:
    """A new buffer for ``group``, made collectively (every rank calls this for
    the same call), or why there is none: the same answer on every rank.

    The ranks first agree on the group's topology (:func:`agree`, once per
    group); then each step that can fail on one rank alone (the allocation, the
    rendezvous and its offsets) runs inside a ``try`` and is followed by an
    exchange of every rank's outcome, so that a rank whose step failed never
    leaves its peers in the next collective or in the fused kernel.  A group
    whose allocation or rendezvous failed on any rank gets no symmetric memory
    from then on (:data:`_decided`); a buffer that fails :func:`arm` is refused
    for that call alone."""
    why = agree(group, device)
    if why is not None:
        return why
    dtype = int_dtype(elem_bits)
    elem = elem_bits // 8
    tensor: Optional[torch.Tensor] = None
    error: Optional[str] = None
    try:
        error = _enable(group)
        if error is None:
            tensor = _symmetric_empty(SLOTS * slot_bytes // elem, dtype, device)
            # torch's CUDA symmetric allocator zeroes a new block with a cudaMemset on
            # the legacy default stream (pytorch/pytorch#181086, moved to the current
            # stream by #192308): that memset does not order with PyTorch's streams, so
            # only a device-wide synchronize makes sure it is done before the fill.
            _finish(tensor)
    except Exception as e:  # told to every rank below, not raised into the model
        error = f"allocating {SLOTS * slot_bytes} bytes raised {e!r}"
    why = _refuse_if_any(group, all_ranks(error, group.name))
    if why is not None:
        return why
    assert tensor is not None
    handle: Any = None
    offset = 0
    try:
        import torch.distributed._symmetric_memory as symm_mem

        handle = symm_mem.rendezvous(tensor, group.name)
        offset = tensor.data_ptr() - handle.buffer_ptrs[handle.rank]
        error = None
    except Exception as e:
        error = f"the rendezvous raised {e!r}"
    answers = all_ranks((error, offset), group.name)
    why = _refuse_if_any(group, [e for e, _ in answers])
    if why is not None:
        return why
    peer_ptrs = torch.tensor(peer_addresses(list(handle.buffer_ptrs), [o for _, o in answers]),
                             dtype=torch.int64, device=device)
    why = arm(tensor, peer_ptrs, handle.rank, elem_bits,
              lambda value: all_ranks(value, group.name))
    if why is not None:
        return why
    state = new_state(device)
    return SymmBuffer(tensor=tensor, peer_ptrs=peer_ptrs, state=state, handle=handle,
                      rank=handle.rank, world_size=handle.world_size, slot_bytes=slot_bytes)


def agree(group: Group, device: torch.device) -> Optional[str]:
    """Why ``group`` gets no symmetric memory, or None: decided once per group,
    before its first buffer, from every rank's :class:`~fusion_pass.topology.RankFacts`
    (one collective) by :func:`fusion_pass.topology.group_decline`, so that
    every rank decides alike."""
    if group in _decided:
        return _decided[group]
    try:
        mine: Any = topology.local_facts(_device_index(device))
    except Exception as e:  # told to every rank below: a peer never waits in a collective alone
        mine = f"reading its GPU's facts raised {e!r}"
    facts = all_ranks(mine, group.name)
    why = _refuse_if_any(group, [f if isinstance(f, str) else None for f in facts])
    if why is None:
        why = topology.group_decline(facts)
        _decided[group] = None if why is None else f"symmetric memory: {why}"
    group.watch(_group_ended)
    return _decided[group]


def _refuse_if_any(group: Group, errors: list[Optional[str]]) -> Optional[str]:
    """The first rank's error of a step every rank ran (``errors`` in rank order),
    recorded as why the group gets no symmetric memory; None if every rank's
    step went through."""
    for rank, error in enumerate(errors):
        if error is not None:
            why = f"symmetric memory failed on rank {rank} of {len(errors)}: {error}"
            _decided[group] = why
            return why
    return None


_enabled: dict[str, Group] = {}
"""Per group name: the group ``enable_symm_mem_for_group`` was called for."""


def _enable(group: Group) -> Optional[str]:
    """Register the group with torch's symmetric memory where torch needs that
    (``enable_symm_mem_for_group`` not deprecated), or why it cannot be: that
    function keeps what it registers by the group's name and never replaces it,
    so a group made again under a name registered for an earlier group would
    rendezvous over the earlier group's store."""
    import torch.distributed._symmetric_memory as symm_mem

    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    # Deprecated, the rendezvous resolves the group by itself; a call would still
    # register the group's store under its name for good.
    if enable is None or getattr(enable, "__deprecated__", None) is not None:
        return None
    earlier = _enabled.get(group.name)
    if earlier is not None and earlier is not group:
        return (f"this torch registers symmetric memory's groups by name, and {group.name!r} "
                "was registered for a group destroyed since")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        enable(group.name)
    _enabled[group.name] = group
    return None


def _group_ended(group: Group) -> None:
    """``group`` is no longer the one its name names: its buffers leave the
    tables that calls read and wait in :data:`_ended` until its ``ProcessGroup``
    is freed (:func:`release_freed`)."""
    with _lock:
        kept = _retired.pop(group, [])
        for key in [k for k in _current if k[0] is group]:
            kept.append(_current.pop(key))
        _decided.pop(group, None)
        if kept:
            _ended.setdefault(group, []).extend(kept)
        release_freed()


def release_freed() -> int:
    """Free the buffers of every group whose ``ProcessGroup`` has been freed
    (ending first a group that nobody had found gone); how many buffers went.

    A graph captured on a group replays only while the group lives: its peers
    replay theirs with it, over the group's communicators, and whatever can
    still replay it holds the group (destroying a group frees its
    ``ProcessGroup`` unless something else holds it).  So an ended group's
    buffers are kept, its plans gone, until its ``ProcessGroup`` is freed, and
    then freed once the device has finished what was queued on them."""
    with _lock:
        for group in {k[0] for k in _current} | set(_retired):
            if group.freed:
                group.end()  # its watchers, this module's included, let go of it
        freed = 0
        for group in [g for g in _ended if g.freed]:
            bufs = _ended.pop(group)
            for buf in bufs:
                _finish(buf.tensor)
            freed += len(bufs)
        return freed


def held(group: Group) -> list[SymmBuffer]:
    """Every buffer kept for ``group``: current, replaced, or waiting for its
    ``ProcessGroup`` to be freed."""
    with _lock:
        return ([b for k, b in _current.items() if k[0] is group] + _retired.get(group, [])
                + _ended.get(group, []))


FAULTS = ("", "a peer address reads another rank's tag or none",
          "the buffer changed after it was filled",
          "reading the peers' buffers through their addresses raised")
"""Why :func:`arm` refuses a buffer, by the code each rank reports."""


def arm(tensor: torch.Tensor, peer_ptrs: torch.Tensor, rank: int, elem_bits: int,
        every_rank: Callable[[int], list[int]]) -> Optional[str]:
    """Fill this rank's new buffer with the empty marker and prove, before any
    kernel trusts it, that every address of ``peer_ptrs`` reaches its rank's
    buffer; None, or why the buffer is refused (the same on every rank).

    The fill must land after the allocator's own zeroing of the block (see
    :func:`_allocate`): on torch 2.11 a fill on a side stream while the default
    stream was busy was overwritten, every element of it (recreated on 1 and
    2 x H200 by the GPU test of a buffer grown behind a busy default stream),
    and the kernels took the zeros for a peer's data (a rank ran ahead: wrong
    rows, then a hang).  The check below catches any write that still lands
    after the fill.
    Each rank then tags the first and the last element of its buffer with
    ``rank + 1`` and reads both ends of every rank's through ``peer_ptrs``.
    ``every_rank(value)`` is a collective returning each rank's ``value``: it
    orders the tagging before the reads, the reads before the tags are
    cleared, and every rank's clearing before any rank's first push."""
    from . import probe

    empty = negative_zero_bits(elem_bits)
    world = peer_ptrs.numel()
    tensor.fill_(empty)
    tensor[0] = tensor[-1] = rank + 1
    _finish(tensor)
    every_rank(0)
    try:
        seen = probe.read_ends(peer_ptrs, tensor.numel(), tensor.dtype)
        want = torch.arange(1, world + 1, dtype=seen.dtype, device=seen.device)
        fault = 0 if bool((seen == want.unsqueeze(1)).all()) else 1
    except Exception:  # a rank that raised here would leave its peers in the exchange
        fault = 3
    every_rank(fault)
    tensor[0] = tensor[-1] = empty
    if fault == 0 and bool((tensor != empty).any()):
        fault = 2
    _finish(tensor)
    worst = max(every_rank(fault))
    if worst:
        return f"a new symmetric buffer failed its check on some rank: {FAULTS[worst]}"
    return None


def _finish(tensor: torch.Tensor) -> None:
    """Wait for everything queued on ``tensor``'s device, on any stream: this
    rank's stores before a collective tells the peers, the allocator's zeroing
    of a new block before the fill."""
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def _symmetric_empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A symmetric allocation of its own.  ``symm_mem.empty`` of torch 2.10 and
    newer places tensors in a pool shared with every other symmetric tensor of
    the process, where each rank reuses freed blocks by its own address order
    (pytorch/pytorch#190977: ranks can then pair different blocks); a block of
    its own keeps each buffer one rendezvous of its own."""
    from torch._C._distributed_c10d import _SymmetricMemory

    p2p = getattr(_SymmetricMemory, "empty_strided_p2p", None)
    if p2p is None:
        import torch.distributed._symmetric_memory as symm_mem

        return symm_mem.empty(numel, dtype=dtype, device=device)
    return p2p((numel,), (1,), dtype, device)


def peer_addresses(bases: list[int], offsets: list[int]) -> list[int]:
    """Every rank's buffer in this process's address space: the base that
    rendezvous reports for the rank plus that rank's own offset of the buffer
    from its base (rendezvous maps the allocation around the buffer; nothing
    in torch's contract makes the offset the same on every rank)."""
    return [b + o for b, o in zip(bases, offsets)]


def all_ranks(value: T, group_name: str) -> list[T]:
    """``value`` (any picklable) of every rank of the group, in rank order: one
    collective over whatever backend the group has (buffers grow outside graph
    capture, where a collective is allowed)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    group = distributed_c10d._resolve_process_group(group_name)
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, value, group=group)
    return every


def growth(need: int, max_input_bytes: int) -> Optional[int]:
    """Slot bytes of a new buffer for a call that needs ``need`` bytes, or None
    to decline the call: never while a CUDA graph is being captured (no
    allocation or rendezvous there), nor above the largest slot."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None
    return size_class(need, max_input_bytes)


def get(group: Union[Group, str], elem_bits: int, device: torch.device, need: int,
        max_input_bytes: int) -> Union[SymmBuffer, str, None]:
    """The buffer of ``group`` (a :class:`~fusion_pass.groups.Group`, or a name:
    the group registered under it now) for this call, grown if needed and
    allowed; None to decline (growth during graph capture), or why a new buffer
    was refused."""
    global generation
    if type(group) is str:
        group = groups.group(group)
    key = (group, elem_bits, _device_index(device))
    buf = _current.get(key)
    if buf is not None and need <= buf.slot_bytes:
        return buf
    why = _decided.get(group)
    if why is not None:
        return why
    slot_bytes = growth(need, max_input_bytes)
    if slot_bytes is None:
        return None
    with _lock:
        buf = _current.get(key)
        if buf is not None and need <= buf.slot_bytes:
            return buf
        release_freed()
        new = _allocate(group, elem_bits, device, slot_bytes)
        if isinstance(new, str):
            return new
        if buf is not None:
            _retired.setdefault(group, []).append(buf)
        _current[key] = new
        generation += 1
        return new


def current(group: Union[Group, str], elem_bits: int,
            device: torch.device) -> Optional[SymmBuffer]:
    """The buffer calls of ``group`` (or of the group last found under a name) use now."""
    if type(group) is str:
        group = groups.known(group)
    return _current.get((group, elem_bits, _device_index(device)))
