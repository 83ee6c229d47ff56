"""Shrinking a wrong generated case (tests/fuzzing/shrink.py) to the lines it needs."""

from __future__ import annotations

from fuzzing.generator import generate
from fuzzing.shrink import _Case, shrink

SEED = 131
"""A pattern case with a second layer after the norm: two sites, three outputs."""


def test_cases_parse_and_render_back_to_their_source() -> None:
    for seed in range(300):
        source = generate(seed).source
        assert _Case.parse(source).render() == source


def test_a_wrong_case_shrinks_to_the_site_that_makes_it_wrong() -> None:
    """With every fused op's epsilon raised by 1, each site is wrong: what is left is the
    first all-reduce, its residual add and its norm, returning y alone."""
    case = generate(SEED)
    assert case.recipe["extra#0"] == "second_layer" and case.recipe["aims_at"] == "pattern"
    small, verdict = shrink(case.source, sabotage="eps", jobs=2)
    assert verdict["status"] == "wrong" and "output 0" in verdict["why"]
    body = small[small.index("def f("):].splitlines()[1:]
    assert len(body) == 8, small  # 7 lines from the all-reduce to y, and the return
    assert body[-1].strip() == "return (y7,)"
    assert "ALL_REDUCES = 1\n" in small and "fc.all_reduce" not in small
