"""The shapes the Triton kernels take: their rules for the gate.

Pure Python with the gate's vocabulary, no torch: both kernels hold a whole row
in one program's registers, so a row may be at most :data:`MAX_BLOCK` elements
on either path; any token count runs (in row pieces above one launch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ... import schedules
from ...gate import ELEMENT_SIZE, BackendLimits, FusionPath, Schedule

MAX_BLOCK = 16384
"""Largest row, in elements, one program holds in registers."""


@dataclass(frozen=True, eq=False)
class TritonLimits(BackendLimits):
    """:class:`~fusion_pass.gate.BackendLimits` with the Triton kernels' row rule."""

    one_stage_row_bytes: Optional[int] = None
    max_row: int = MAX_BLOCK

    def row_reason(self, hidden: int, dt: str, path: FusionPath) -> Optional[str]:
        if hidden > self.max_row:
            return f"hidden {hidden} exceeds the {self.max_row}-element row a program holds"
        return super().row_reason(hidden, dt, path)


def limits(measured: Optional[tuple[Schedule, ...]] = None) -> TritonLimits:
    """The backend's limits with ``measured`` schedules (default: the committed table)."""
    return TritonLimits(name="triton", world_sizes=frozenset({2, 4, 8}),
                        dtypes=frozenset(ELEMENT_SIZE),
                        schedules=schedules.load("triton") if measured is None else measured)


LIMITS = limits()
