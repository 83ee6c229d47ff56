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
    # The band's edges are inside it, as for the verdict.
    assert paired_ratios.rounds_needed([0.99, 1.01] * 3) == 6
    with pytest.raises(ValueError):
        paired_ratios.fewest_rounds(1.0)


CASES = [
    [0.97] * 7 + [1.0] * 13,                        # a third of the rounds low (7 of 20)
    [0.97] * 5 + [1.02] * 5 + [1.0] * 10,           # a quarter low, a quarter high
    [0.98] + [1.0] * 5,                             # one stray round in six
    # Low by different amounts, so that with an even number of rounds the mean of the
    # middle two decides where exactly half are low.
    [0.985, 0.97, 0.989, 1.0, 1.0, 1.02, 1.005, 0.995, 1.011, 1.0],
]


@pytest.mark.parametrize("ratios", CASES)
@pytest.mark.parametrize("k", [6, 7, 8, 11, 14])
def test_the_closed_form_is_the_bootstrap_of_the_rounds_medians(ratios, k):
    p = paired_ratios.outside_share(ratios, k)
    draws = 20000
    # Four standard errors of the draws' share, and a little for rounding at the edges.
    assert share_outside(ratios, k, draws) == pytest.approx(
        p, abs=4 * (max(p, 0.01) * (1 - p) / draws) ** 0.5 + 1e-3)


@pytest.mark.parametrize("ratios", CASES)
def test_the_rounds_needed_are_the_fewest_from_which_medians_stay_inside(ratios):
    k = paired_ratios.rounds_needed(ratios)
    assert k is not None and k >= 6
    assert paired_ratios.outside_share(ratios, k) <= 0.05
    assert paired_ratios.outside_share(ratios, k + 1) <= 0.05
    if k > 6:  # one round fewer: it, or the number after it, misses more often
        assert paired_ratios.outside_share(ratios, k - 1) > 0.05
    # Further on, the chance only shrinks.
    assert all(paired_ratios.outside_share(ratios, j) <= 0.05 for j in range(k, k + 40))


def test_an_even_number_of_rounds_and_the_odd_one_after_it_differ():
    # One stray round in six: six rounds miss less often than seven, whose median is the
    # fourth round (low once four of seven are), while six need both middle rounds low.
    r = CASES[2]
    assert paired_ratios.outside_share(r, 6) < paired_ratios.outside_share(r, 7) < 0.05
    assert paired_ratios.rounds_needed(r) == 6


def test_half_or_more_of_the_rounds_on_one_side_is_an_offset_no_rounds_remove():
    assert paired_ratios.rounds_needed([0.98] * 5 + [1.0] * 5) is None
    assert paired_ratios.rounds_needed([1.02] * 6 + [1.0] * 4) is None
    assert paired_ratios.rounds_needed([]) is None
    # Just under half is no offset, but more rounds than the search goes to.
    assert paired_ratios.rounds_needed([0.98] * 9 + [1.0] * 11) is None


def test_wanted_names_the_metrics_whose_rounds_are_too_few_for_their_spread():
    stats = {
        "median_tpot_c8": {"per_round": [0.97] * 7 + [1.0] * 13, "rounds": 20},
        "median_itl_c8": {"per_round": [1.0] * 20, "rounds": 20},
        "output_throughput_c8": {"per_round": [1.02] * 10 + [1.0] * 10, "rounds": 20},
        "median_tpot_c32": {"per_round": [0.98] * 9 + [1.0] * 11, "rounds": 20},
        # Too few rounds to say: not named, however wide.
        "median_itl_c32": {"per_round": [0.9, 1.1, 1.0, 1.0], "rounds": 4},
        # Not a primary metric.
        "median_ttft_c8": {"per_round": [0.9] * 20, "rounds": 20},
    }
    k = paired_ratios.rounds_needed(stats["median_tpot_c8"]["per_round"])
    assert paired_ratios.wanted(stats, vllm_report.SERVING_PRIMARY) == {
        "median_tpot_c8": f"{k} rounds (20 measured)",
        "output_throughput_c8": "no number of rounds (an offset: 10 of 20 rounds above the band)",
        "median_tpot_c32": "more than 200 rounds (20 measured)"}
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


def test_the_verdict_keeps_the_rounds_each_primary_metric_needs():
    base = [5.0] * 20
    twin = [x * r for x, r in zip(base, [0.97] * 7 + [1.0] * 13)]
    cmp = paired_ratios.compare({"off": {"t": base, "u": base},
                                 "off_aa": {"t": twin, "u": base}}, "off", ("off_aa", "off"))
    v = paired_ratios.aa_verdict(cmp, "off_aa/off", ("t",))
    assert set(v["rounds_needed"]) == {"t"}  # "u" is not a primary metric
    assert v["rounds_needed"]["t"] > 20 and v["within"] is True
