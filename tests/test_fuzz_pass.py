"""Differential fuzzing of the pass (tests/fuzz_pass.py) on a fixed list of seeds.

Long runs: ``python tests/fuzz_pass.py --seed S --cases N``.
"""

from __future__ import annotations

import ast
from collections import Counter

import fuzz_pass as fp

CI_SEEDS = fp.case_seeds(0, 8)
"""The generated cases this test compiles."""
SABOTAGE_SEED = 67
"""A case the generator aims at the pattern: fp32, a literal epsilon, static shapes."""


def test_cases_are_reproducible_python_from_their_seed() -> None:
    for seed in range(300):
        case = fp.generate(seed)
        assert case.source == fp.generate(seed).source
        ast.parse(case.source)
        assert f"SEED = {seed}\n" in case.source
    assert fp.generate(1).source != fp.generate(2).source


def test_generator_aims_at_the_pattern_and_at_every_near_miss() -> None:
    recipes = [fp.generate(seed).recipe for seed in range(3000)]
    aims = Counter(r["aims_at"] == "pattern" for r in recipes)
    assert aims[True] >= 0.45 * len(recipes)
    drawn = {(k.split("#")[0], v) for r in recipes for k, v in r.items()}
    missing = {(k, v) for k, opts in fp.MISSES.items() for v in opts} - drawn
    assert not missing, missing
    # A case aimed at the pattern draws no near miss.
    for r in recipes:
        if r["aims_at"] == "pattern":
            assert not [(k, v) for k, v in r.items() if v in fp.MISSES.get(k.split("#")[0], ())]


SABOTAGED = -SABOTAGE_SEED
"""The same case run with the sabotaged pass, in the same two processes."""
_RESULTS: dict = {}


def results() -> dict:
    """Every CI case and the sabotaged one, on one pair of ranks (compiled once)."""
    if not _RESULTS:
        sources = {s: fp.generate(s).source for s in CI_SEEDS}
        sources[SABOTAGE_SEED] = sources[SABOTAGED] = fp.generate(SABOTAGE_SEED).source
        seeds = CI_SEEDS + [SABOTAGE_SEED, SABOTAGED]
        _RESULTS.update(zip(seeds, fp.run(seeds, sources, sabotage={SABOTAGED})))
    return _RESULTS


def test_oracle_calls_a_wrong_fusion_wrong() -> None:
    """The pass with each fused op's epsilon raised by 1: the same case is fused and
    right with the real pass, and wrong with this one."""
    case = fp.generate(SABOTAGE_SEED)
    assert case.recipe["aims_at"] == "pattern" and case.recipe["eps"] == "literal"
    good, bad = results()[SABOTAGE_SEED], results()[SABOTAGED]
    assert good["status"] == "fused", good
    assert bad["status"] == "wrong" and "output 0" in bad["why"], bad


def test_fixed_seeds_give_no_wrong_result() -> None:
    found = [results()[s] for s in CI_SEEDS]
    wrong = [(r["seed"], r["status"], r["why"]) for r in found
             if r["status"] not in ("fused", "unfused")]
    assert not wrong, wrong
    assert all(r["sites"] >= 1 for r in found)  # every case has an all-reduce: a record
    fused = sum(r["status"] == "fused" for r in found)
    assert fused >= len(found) / 3, fp.summary(found)
    assert SABOTAGE_SEED not in CI_SEEDS
    print(fp.summary(found))
