"""benchmarks/vllm/paired_ratios.py: how many rounds an A/A pair's spread needs before its
median stays inside the band, checked against medians of rounds drawn at random."""

from __future__ import annotations

import json
import random
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "vllm"))

import paired_ratios  # noqa: E402
import vllm_report  # noqa: E402

BAND = paired_ratios.BAND


def share_outside(ratios, k, draws=10000, seed=1):
    """The share of medians of ``k`` rounds drawn with replacement from ``ratios`` that fall
    outside the band: the bootstrap that :func:`paired_ratios.rounds_needed` computes in
    closed form."""
    rng = random.Random(seed)
    out = 0
    for _ in range(draws):
        med = statistics.median(rng.choice(ratios) for _ in range(k))
        out += not BAND[0] <= med <= BAND[1]
    return out / draws


def test_an_interval_needs_six_rounds_at_95_and_eight_at_99():
    assert paired_ratios.fewest_rounds(0.95) == 6
    assert paired_ratios.fewest_rounds(0.99) == 8
    # The interval of the median over six rounds is the rounds' range, with 1 - 2/64 coverage.
    assert paired_ratios.median_ci([1, 2, 3, 4, 5, 6])[2] == pytest.approx(1 - 2 / 64)


def test_rounds_all_inside_the_band_need_no_more_than_an_interval_does():
    assert paired_ratios.rounds_needed([0.995, 1.0, 1.004, 1.009, 0.991, 1.0]) == 6


@pytest.mark.parametrize("ratios", [
    [0.97] * 7 + [1.0] * 13,                   # a third of the rounds low (7 of 20)
    [0.97] * 5 + [1.02] * 5 + [1.0] * 10,      # a quarter low, a quarter high
    [0.985] * 2 + [1.0] * 10,                  # 1 in 6 low
])
def test_the_rounds_needed_are_where_drawn_medians_stay_inside_19_times_in_20(ratios):
    k = paired_ratios.rounds_needed(ratios)
    assert k is not None and k % 2 == 1 and k > 6
    # At k the drawn medians leave the band at most 1 time in 20; two rounds fewer (where
    # that still gives an interval), more often (a margin for the draws' own error, 10000 of
    # them: about 0.002).
    assert share_outside(ratios, k) <= 0.05 + 0.005
    if k - 2 >= 6:
        assert share_outside(ratios, k - 2) > 0.05 - 0.005


def test_half_or_more_of_the_rounds_on_one_side_is_an_offset_no_rounds_remove():
    assert paired_ratios.rounds_needed([0.98] * 5 + [1.0] * 5) is None
    assert paired_ratios.rounds_needed([1.02] * 6 + [1.0] * 4) is None
    assert paired_ratios.rounds_needed([]) is None


def test_wanted_names_the_metrics_whose_rounds_are_too_few_for_their_spread():
    stats = {
        "median_tpot_c8": {"per_round": [0.97] * 7 + [1.0] * 13, "rounds": 20},
        "median_itl_c8": {"per_round": [1.0] * 20, "rounds": 20},
        "output_throughput_c8": {"per_round": [1.02] * 10 + [1.0] * 10, "rounds": 20},
        # Too few rounds to say: not named, however wide.
        "median_tpot_c32": {"per_round": [0.9, 1.1, 1.0, 1.0], "rounds": 4},
        # Not a primary metric.
        "median_ttft_c8": {"per_round": [0.9] * 20, "rounds": 20},
    }
    k = paired_ratios.rounds_needed(stats["median_tpot_c8"]["per_round"])
    assert paired_ratios.wanted(stats, vllm_report.SERVING_PRIMARY) == {
        "median_tpot_c8": f"{k} rounds (20 measured)",
        "output_throughput_c8": "no number of rounds (20 measured)"}
    line, = paired_ratios.wanted_line("m off_aa/off", stats, vllm_report.SERVING_PRIMARY)
    assert line.startswith("  m off_aa/off: rounds for its median to fall inside the band")
    assert f"median_tpot_c8 {k} rounds (20 measured)" in line
    assert paired_ratios.wanted_line("m", {"median_itl_c8": stats["median_itl_c8"]},
                                     vllm_report.SERVING_PRIMARY) == []


def test_the_serving_run_of_twenty_rounds_on_one_h100_names_the_tpot_at_8_short():
    """The committed run that served the GPT-OSS stand-in alone for 20 rounds: its median
    TPOT at concurrency 8 fell below the band in 7 of 20 rounds; that spread wants more
    rounds than 20 for 19 medians in 20 inside, its median ITL none."""
    path = ROOT / "benchmarks/results/dev/gpu_vllm_h100x1_serve_only/serve_gpu_tp1.json"
    model, = json.loads(path.read_text())["models"]
    pair = model["comparisons"][model["aa"]["pair"]]
    tpot = pair["median_tpot_c8"]["per_round"]
    assert sum(r < BAND[0] for r in tpot) == 7 and len(tpot) == 20
    lines = paired_ratios.aa_lines("serving", [model], vllm_report.SERVING_PRIMARY)
    wanted, = [x for x in lines if "rounds for its median" in x]
    k = paired_ratios.rounds_needed(tpot)
    assert k > 20 and f"median_tpot_c8 {k} rounds (20 measured)" in wanted
    assert "median_itl" not in wanted
    assert share_outside(tpot, 19) > 0.05
