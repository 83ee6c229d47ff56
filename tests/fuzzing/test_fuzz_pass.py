"""Differential fuzzing of the pass (tests/fuzzing, its CLI fuzz_pass.py) on a fixed list of seeds.

Long runs: ``python tests/fuzzing/fuzz_pass.py --seed S --cases N``.
"""

from __future__ import annotations

import ast
from collections import Counter

from fuzzing import pair, report
from fuzzing.generator import MISSES, MULTIPLIER_MISSES, MULTIPLIERS, case_seeds, generate

CI_SEEDS = case_seeds(0, 16)
"""The generated cases this test compiles."""
SABOTAGE_SEED = 139
"""A case the generator aims at the pattern: fp32, a literal epsilon, static shapes, a
residual add, one all-reduce."""
REGRESSION_SEEDS = {56: {"x_layout": "column_major"}}
"""Generated cases kept for what they hold (asserted from their recipes): 56 all-reduces a
column-major x, a site no fused kernel reads in place, whose compile must not fail."""
SABOTAGED = -SABOTAGE_SEED
"""The same case run with a pass that raises every fused op's epsilon by 1."""
FAILS_AFTER = -SABOTAGE_SEED - 1
"""The same case run with a pass that makes the compiled graph raise after the fused
op's all-reduce: the peer has met it there and the pair goes on."""
DROPS_ALL_REDUCE = -SABOTAGE_SEED - 2
"""The same case run with a pass that drops the all-reduce: the peer waits for one that
never comes, so the pair must start again."""
DYING = -1
"""A case whose leader exits in the middle: its pair must start again for the rest."""


def test_cases_are_reproducible_python_from_their_seed() -> None:
    for seed in range(300):
        case = generate(seed)
        assert case.source == generate(seed).source
        ast.parse(case.source)
        assert f"SEED = {seed}\n" in case.source
    assert generate(1).source != generate(2).source


def test_generator_aims_at_the_pattern_and_at_every_near_miss() -> None:
    recipes = [generate(seed).recipe for seed in range(3000)]
    aims = Counter(r["aims_at"] == "pattern" for r in recipes)
    assert aims[True] >= 0.45 * len(recipes)
    drawn = {(k.split("#")[0], v) for r in recipes for k, v in r.items()}
    missing = {(k, v) for k, opts in MISSES.items() for v in opts} - drawn
    assert not missing, missing
    # Every multiplier, its near misses (a [hidden] factor, one that promotes the sum's
    # dtype) and the multiplier after the residual add.
    assert {("multiplier", m) for m in MULTIPLIERS} | {("residual", "scaled_after")} <= drawn
    # A case aimed at the pattern draws no near miss.
    for r in recipes:
        if r["aims_at"] == "pattern":
            assert not [(k, v) for k, v in r.items() if v in MISSES.get(k.split("#")[0], ())]
            assert r["multiplier"] not in MULTIPLIER_MISSES
    # vLLM's forms and the merge option are drawn too.
    assert {("ar_form", "vllm"), ("norm", "vllm_ir.fused_add_rms_norm"),
            ("merge_summed", "on"), ("x_layout", "column_major")} <= drawn


def _dying_source() -> str:
    source = generate(CI_SEEDS[0]).source
    return source.replace("def make_inputs(rank):\n",
                          "def make_inputs(rank):\n    if rank == 0:\n        import os\n"
                          "        os._exit(3)\n")


_RESULTS: dict = {}


def results() -> dict:
    """Every CI case, the sabotaged one and the dying one, on two pairs of ranks
    (compiled once for the whole module)."""
    if not _RESULTS:
        sources = {s: generate(s).source for s in CI_SEEDS + list(REGRESSION_SEEDS)}
        for s in (SABOTAGE_SEED, SABOTAGED, FAILS_AFTER, DROPS_ALL_REDUCE):
            sources[s] = generate(SABOTAGE_SEED).source
        sources[DYING] = _dying_source()
        # The dying case and the one that drops its all-reduce first in the two pairs'
        # shares: each pair must start again for the cases after it.
        seeds = [DYING, DROPS_ALL_REDUCE] + CI_SEEDS + list(REGRESSION_SEEDS) + [
            SABOTAGE_SEED, SABOTAGED, FAILS_AFTER]
        _RESULTS.update(zip(seeds, pair.run(seeds, sources, jobs=2, sabotage={
            SABOTAGED: "eps", FAILS_AFTER: "fail_after", DROPS_ALL_REDUCE: "no_all_reduce"})))
    return _RESULTS


def test_oracle_calls_a_wrong_fusion_wrong() -> None:
    """The pass with each fused op's epsilon raised by 1: the same case is fused and
    right with the real pass, and wrong with this one."""
    case = generate(SABOTAGE_SEED)
    assert case.recipe["aims_at"] == "pattern" and case.recipe["eps"] == "literal"
    good, bad = results()[SABOTAGE_SEED], results()[SABOTAGED]
    assert good["status"] == "fused", good
    assert bad["status"] == "wrong" and "output 0" in bad["why"], bad
    assert "eager agrees with the compile without the pass" in bad["why"], bad


def test_a_rank_that_dies_makes_its_case_wrong_and_the_run_goes_on() -> None:
    dead = results()[DYING]
    assert dead["status"] == "wrong" and "exit codes [3," in dead["why"], dead
    # The same pair's later cases ran on a fresh pair of ranks.
    assert all(results()[s]["status"] in ("fused", "unfused") for s in CI_SEEDS[::2])


def test_a_graph_that_raises_after_its_collective_is_wrong() -> None:
    failed = results()[FAILS_AFTER]
    assert failed["status"] == "wrong", failed
    assert "compile with the pass raised" in failed["why"] and "fail_at_run" in failed["why"]


def test_a_graph_that_drops_a_collective_is_wrong_and_the_run_goes_on() -> None:
    dropped = results()[DROPS_ALL_REDUCE]
    assert dropped["status"] == "wrong", dropped
    assert "issued 0 all-reduce(s), the case has 1" in dropped["why"], dropped
    # The same pair's later cases ran on a fresh pair of ranks.
    assert all(results()[s]["status"] in ("fused", "unfused") for s in CI_SEEDS[1::2])


def test_fixed_seeds_give_no_wrong_result() -> None:
    for seed, holds in REGRESSION_SEEDS.items():
        assert holds.items() <= generate(seed).recipe.items(), (seed, generate(seed).recipe)
    found = [results()[s] for s in CI_SEEDS + list(REGRESSION_SEEDS)]
    wrong = [(r["seed"], r["status"], r["why"]) for r in found
             if r["status"] not in ("fused", "unfused")]
    assert not wrong, wrong
    assert all(r["sites"] >= 1 for r in found)  # every case has an all-reduce: a record
    fused = sum(r["status"] == "fused" for r in found)
    assert fused >= len(found) / 3, report.summary(found)
    assert SABOTAGE_SEED not in CI_SEEDS + list(REGRESSION_SEEDS)
    # vLLM's forms ran (vLLM is installed where this suite runs).
    assert any("NEEDS_VLLM = True" in generate(s).source for s in CI_SEEDS)
    print(report.summary(found))


def test_summary_line_counts_each_status() -> None:
    found = [dict(status=s) for s in ("fused", "fused", "unfused", "wrong", "invalid", "skipped")]
    assert report.summary(found) == "fuzz: 6 cases, 2 fused, 1 unfused, 1 wrong"
    assert report.aside(found).startswith("1 invalid") and "1 skipped" in report.aside(found)


def test_run_record_carries_the_counts_the_wrong_cases_and_the_provenance() -> None:
    found = [dict(seed=1, status="fused", why=""), dict(seed=2, status="wrong", why="output 0"),
             dict(seed=3, status="invalid", why="torch does not compile it")]
    record = report.run_record(found, 7, wall_s=3.0, jobs=2, argv=["tests/fuzzing/fuzz_pass.py"])
    assert record["summary"] == "fuzz: 3 cases, 1 fused, 0 unfused, 1 wrong"
    assert record["counts"]["invalid"] == 1 and record["fused_fraction"] == round(1 / 3, 4)
    assert record["wrong"] == [{"seed": 2, "why": "output 0"}]
    assert record["provenance"]["versions"]["torch"] and "git" in record["provenance"]

