"""Differential fuzzing of the pass (tests/fuzz_pass.py) on a fixed list of seeds.

Long runs: ``python tests/fuzz_pass.py --seed S --cases N``.
"""

from __future__ import annotations

import ast
from collections import Counter

import fuzz_pass as fp

CI_SEEDS = fp.case_seeds(0, 12)
"""The cases this test compiles (12 of them: about 3 minutes on 2 CPU cores)."""
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


def test_oracle_calls_a_wrong_fusion_wrong() -> None:
    """The pass with each fused op's epsilon raised by 1: the same case must be fused
    and right with the real pass, and wrong with this one."""
    case = fp.generate(SABOTAGE_SEED)
    assert case.recipe["aims_at"] == "pattern" and case.recipe["eps"] == "literal"
    (bad,) = fp.run([SABOTAGE_SEED], sabotage=True)
    assert bad["status"] == "wrong" and "output 0" in bad["why"], bad


def test_fixed_seeds_give_no_wrong_result() -> None:
    results = fp.run(CI_SEEDS)
    wrong = [(r["seed"], r["status"], r["why"]) for r in results
             if r["status"] not in ("fused", "unfused")]
    assert not wrong, wrong
    assert all(r["sites"] >= 1 for r in results)  # every case has an all-reduce: a record
    fused = sum(r["status"] == "fused" for r in results)
    assert fused >= len(results) / 3, fp.summary(results)
    assert SABOTAGE_SEED not in CI_SEEDS
    print(fp.summary(results))
