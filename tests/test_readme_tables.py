"""The README's target table (benchmarks/readme_tables.py) on synthetic bench rows: each
target's verdict and the shapes it names follow the ratios, computed here independently."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import readme_tables  # noqa: E402


def op(fused_128: float, eager_us: float) -> dict[str, Any]:
    """8192 at 1, 80 and 128 tokens: barrier 3.0, NCCL 10.0, FlashInfer 10.0 us."""
    rows = []
    for tokens, fused in ((1, 3.6), (80, 3.2), (128, fused_128)):
        rows.append({"hidden": 8192, "tokens": tokens, "gate_path": "one_stage", "fused": fused,
                     "one_stage": fused, "two_stage": fused * 2, "nccl": 10.0, "barrier": 3.0,
                     "flashinfer": 10.0, "fused_vs_faster_kernel": 1.0})
    return {"rows": rows, "eager": {"fused_us_per_call": eager_us, "nccl_eager_us_per_call": 300.0,
                                    "torch_add_us_per_call": 12.0}}


def verdicts(table: str) -> dict[str, tuple[str, str]]:
    """Target text -> (result, met), for every row of the table."""
    out = {}
    for line in table.splitlines()[2:]:
        target, result, met = (c.strip() for c in line.strip("|").split("|"))
        out[target] = (result, met)
    return out


def test_flashinfer_target_names_the_worst_shape_and_every_shape_over() -> None:
    over = verdicts(readme_tables.targets(op(fused_128=9.5, eager_us=41.0)))
    result, met = over["1..512 tokens: <= 0.90 x FlashInfer's best"]
    assert met == "no"
    assert result == "2 of 3 shapes; worst 8192 x 128 at 0.950; over: 8192 x 128 (0.95)"
    assert over["eager <= 40 us per call at 8 x 4096"][1] == "no"
    # 3.6 / 3.0 = 1.2: within 1.25 x barrier at one token.
    assert over["1-8 tokens <= 1.25 x barrier, hidden 2880/4096/7168/8192"][1] == "yes"

    held = verdicts(readme_tables.targets(op(fused_128=8.8, eager_us=39.0)))
    result, met = held["1..512 tokens: <= 0.90 x FlashInfer's best"]
    assert met == "yes"
    assert result == "3 of 3 shapes; worst 8192 x 128 at 0.880; over: none"
    assert held["eager <= 40 us per call at 8 x 4096"][1] == "yes"
    assert held["8192 x 80: <= 0.35 x NCCL + compiled"] == ("0.320", "yes")
