"""Launch geometry: how a call of a given shape is cut into launches and programs.

Pure arithmetic on the call's shape, the world size and the device's SM count:
how many rows one launch takes (larger calls run in row pieces), the
one-stage kernel's split of a row into parts and whether the parts own their
columns, and the warps of a program.  The timings behind the constants are in
docs/triton_backend.md.  Importing it needs torch alone.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...gate import ELEMENT_SIZE, FusionPath, dtype_name
from . import buffers
from .call_args import GROUP_QUANTS, QUANT_MODE

MAX_INPUT_BYTES = 32 << 20
"""Largest input one launch takes (2048 x 8192 bf16); a larger call runs as
launches of consecutive row pieces of at most this size, one after another on
the stream (each piece is a whole call of the protocol, so nothing else
changes).  Sets the largest symmetric slot (``buffers.max_slot_bytes``)."""

PART_BYTES = 2048
"""Bytes of a one-stage row part: a row leaves from ``row bytes / PART_BYTES``
SMs (at most :data:`MAX_SPLIT`), so that a wide row's push is not limited by
what one SM has in flight (timings: docs/triton_backend.md)."""

MAX_SPLIT = buffers.MAX_PARTS

OWN_MIN_BYTES = 12 << 10
"""Parts own their columns when each would otherwise read at least this many
bytes of other parts' columns (``row x (1 - 1 / split)``), and the row has at
least :data:`OWN_MIN_PARTS` parts: the exchange of sums of squares costs a local
round trip, reading the whole row costs more the wider it is (timings:
docs/triton_backend.md)."""

OWN_MIN_PARTS = 3
"""Fewest parts of a row that own their columns (:data:`OWN_MIN_BYTES`)."""

SPLIT_PROGRAMS = 32
"""Rows are split only while the grid stays this small (and the parts of a row
never number more than :data:`MAX_SPLIT`), or :data:`OWN_SPLIT_PROGRAMS`."""

OWN_SPLIT_PROGRAMS = 64
"""A larger grid for rows whose parts then own their columns: more parts per
token push a wide row from more SMs, and each part still reads its own
columns alone (timings: docs/triton_backend.md)."""

def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def slot_need(path: FusionPath, tokens: int, hidden: int, dtype: torch.dtype, world_size: int) -> int:
    row = hidden * ELEMENT_SIZE[dtype_name(dtype)]
    if path is FusionPath.ONE_STAGE:
        return buffers.one_stage_need(tokens, row, world_size)
    return buffers.two_stage_need(tokens, row, world_size)


ALIGN_ROWS = 4
"""Row pieces start at multiples of this many rows: every output of a piece then
starts 16-byte aligned, as the compiled kernel assumes (a row of ``x``, ``h``
or ``y`` is a multiple of 16 bytes, a row of FP8 codes a multiple of 4, a scale
4 bytes)."""


def rows_per_launch(path: FusionPath, hidden: int, elem_size: int, world_size: int) -> int:
    """Most rows one launch takes: :data:`MAX_INPUT_BYTES` of input whose slot
    fits the largest buffer, a multiple of 16 rows (so of :data:`ALIGN_ROWS`)."""
    row = hidden * elem_size
    rows = MAX_INPUT_BYTES // row
    if path is FusionPath.ONE_STAGE:
        rows = min(rows, buffers.max_slot_bytes(MAX_INPUT_BYTES) // (world_size * row))
    return max(16, rows // 16 * 16)


def resident_rows(programs: int) -> int:
    """Most rows of a one-stage launch whose programs must all be resident within
    ``programs`` (``environment.SMBudget.every_launch``): one program per row
    at least (a split row keeps its grid within the budget:
    :func:`one_stage_split`), a multiple of :data:`ALIGN_ROWS`, and at least
    that many (a budget below it is not kept)."""
    return max(ALIGN_ROWS, programs // ALIGN_ROWS * ALIGN_ROWS)


def num_warps(hidden: int, elem_size: int) -> int:
    """One 16-byte vector per thread per row (4 to 32 warps): a single row's
    exchange is latency-bound, so more threads in flight per program pay."""
    return min(32, max(4, next_pow2(hidden) * elem_size // (16 * 32)))


ONE_STAGE_MAX_WARPS = 16
"""Warps of a one-stage program whose block exceeds 8192 elements (32 warps
spill there), and of every one-stage program without an FP8 epilogue in a grid
larger than the SM count (more programs of 16 warps share an SM than of 32);
otherwise a row takes its 32 warps (timings: docs/triton_backend.md)."""


def one_stage_warps(warps: int, block: int, grid: int, sms: int, quant: int) -> int:
    """Warps of a one-stage launch of ``grid`` programs over ``block`` columns:
    ``warps`` (:func:`num_warps` of the block), capped at
    :data:`ONE_STAGE_MAX_WARPS` as its note says."""
    if block > 8192 or (grid > sms and not quant):
        return min(warps, ONE_STAGE_MAX_WARPS)
    return warps


def one_stage_split(tokens: int, hidden: int, elem_size: int, sms: int,
                    programs: Optional[int] = None) -> int:
    """Programs per token of the one-stage kernel: one per :data:`PART_BYTES`
    of the row, at most :data:`MAX_SPLIT`, while the grid has at most
    ``programs`` (:data:`SPLIT_PROGRAMS`) programs and fits the SMs (a program
    of a split row waits for its sibling parts on the peers, so they must be
    resident)."""
    per_token = min(programs or SPLIT_PROGRAMS, sms) // max(tokens, 1)
    return max(1, min(MAX_SPLIT, hidden * elem_size // PART_BYTES, per_token))


def one_stage_layout(tokens: int, hidden: int, elem_size: int, sms: int, quant: int,
                     group: int) -> tuple[int, int, bool]:
    """``(split, part columns, parts own their columns)`` of a one-stage launch:
    the grid of :data:`OWN_SPLIT_PROGRAMS` where its parts own their columns,
    else that of :data:`SPLIT_PROGRAMS`."""
    for programs in (OWN_SPLIT_PROGRAMS, SPLIT_PROGRAMS):
        split = one_stage_split(tokens, hidden, elem_size, sms, programs)
        part = part_elems(hidden, split, elem_size)
        own = (owns_columns(hidden, elem_size, split, part, quant, group)
               and tokens <= buffers.PART_ROWS)
        if own:
            break
    return split, part, own


def owns_columns(hidden: int, elem_size: int, split: int, part: int, quant: int,
                 group: int) -> bool:
    """Whether the parts of a split row finish their own columns: where it pays
    (:data:`OWN_MIN_BYTES`, :data:`OWN_MIN_PARTS`), and not with a per-token FP8
    scale (its amax needs the whole row) nor with groups that straddle parts."""
    pays = split >= OWN_MIN_PARTS and hidden * elem_size * (split - 1) >= OWN_MIN_BYTES * split
    return (split > 1 and pays and quant != QUANT_MODE["per_token"]
            and (quant not in GROUP_QUANTS or part % group == 0))


def part_elems(hidden: int, split: int, elem_size: int) -> int:
    """Columns of one part: whole 16-byte vectors, the last part may be shorter."""
    vec = 16 // elem_size
    return -(-hidden // (split * vec)) * vec
