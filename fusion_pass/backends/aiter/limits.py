"""The shapes AITER's fused all-reduce + RMSNorm kernels take: its rules for the gate.

Pure Python (the gate's vocabulary and no torch), so that the gate table and
tests state an AITER release's limits without AITER installed.  The rules are
those of AITER's ``csrc/include/custom_all_reduce.cuh``
(``dispatchFusedAllReduceRMSNorm`` and its launchers) since ROCm/aiter#2453;
:mod:`.releases` says which release has which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...gate import MULTIPLIER, BackendLimits, Path, pack_size


@dataclass(frozen=True, eq=False)
class AiterLimits(BackendLimits):
    """:class:`~fusion_pass.gate.BackendLimits` with AITER's own kernel rules.

    The one-stage kernel gives a row one block of 1024 threads, a 16-byte pack
    each (the default ``one_stage_row_bytes``).
    ``hidden_sizes``: when set, the only hidden sizes that may fuse at all
    (releases before 0.1.12 ran template sizes only).
    ``two_stage_packs``: when set, the ``(min, max)`` 16-byte packs per row the
    two-stage kernel takes (64..2048: it throws "n too small/large" outside).
    ``two_stage_exact_split``: the two-stage kernel splits ``tokens * packs``
    evenly over the ranks and drops a remainder, so counts that do not divide
    must run another way.
    """

    hidden_sizes: Optional[frozenset[int]] = None
    two_stage_packs: Optional[tuple[int, int]] = None
    two_stage_exact_split: bool = False
    lacks: tuple[tuple[str, str], ...] = (
        (MULTIPLIER, "applies no multiplier to the reduced value: its kernels add the "
                     "residual to the ranks' sum in the same step"),)

    def row_reason(self, hidden: int, dt: str, path: Path) -> Optional[str]:
        if self.hidden_sizes is not None and hidden not in self.hidden_sizes:
            return f"backend {self.name} fuses only hidden sizes {sorted(self.hidden_sizes)}"
        if path is Path.TWO_STAGE and self.two_stage_packs is not None:
            lo_p, hi_p = self.two_stage_packs
            if not lo_p <= hidden // pack_size(dt) <= hi_p:
                return (f"hidden {hidden} is outside backend {self.name}'s two-stage row range "
                        f"{self.two_stage_packs} packs")
        return super().row_reason(hidden, dt, path)

    def count_reason(self, hidden: int, dt: str, world_size: int, lo: int, hi: Optional[int],
                     path: Path) -> Optional[str]:
        if path is not Path.TWO_STAGE or not self.two_stage_exact_split:
            return None
        packs = hidden // pack_size(dt)
        if packs % world_size == 0:
            return None
        counts = range(lo, (hi if hi is not None else lo + world_size) + 1)
        if all(n * packs % world_size == 0 for n in counts):
            return None
        return (f"tokens x packs ({packs} per row) not divisible by world size {world_size}: "
                f"backend {self.name}'s two-stage would drop the remainder")
