"""The benchmarks' shared checks on 2 gloo CPU ranks."""

from __future__ import annotations

import sys
from pathlib import Path

from fusion_pass.testing.spawn import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def _worst(rank: int, world: int) -> dict:
    from bench_common import worst_over_ranks

    # Rank 1 alone holds the bad error and the mismatches; rank 0's scale error is worse.
    mine = ({"rel_err": 1e-3, "q_mismatch": 0, "scales": 0.5} if rank == 0
            else {"rel_err": 0.25, "q_mismatch": 7, "scales": 0.125})
    return worst_over_ranks(mine)


def test_worst_over_ranks_reports_the_rank_that_is_wrong():
    ranks = run_ranks(_worst, 2)
    for got in ranks:
        assert got == {"rel_err": 0.25, "q_mismatch": 7, "scales": 0.5}
        assert isinstance(got["q_mismatch"], int)
