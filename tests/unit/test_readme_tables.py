"""The results tables (benchmarks/readme_tables.py): the target verdicts on synthetic bench rows
(each verdict and the shapes it names follow the ratios, computed here independently), and the
tables in README.md and docs/results.md against the committed JSON."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
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


RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def test_committed_tables_say_what_the_committed_json_says() -> None:
    """README.md and docs/results.md hold exactly the tables readme_tables prints from the JSON
    (run `python benchmarks/readme_tables.py --write` after new results)."""
    assert readme_tables.stale(str(RESULTS)) == []


def test_readme_headline_names_hardware_versions_and_commit() -> None:
    readme = readme_tables.blocks(str(RESULTS))["README.md"]
    for name in ("op", "model"):
        source = readme[name].splitlines()[-1]
        assert source.startswith("Source: 2 x NVIDIA H200, torch 2.11.0+cu130"), source
        assert "committed in " in source and "benchmarks/results/" in source, source
    assert "FlashInfer 0.7.4" in readme["op"]


def test_render_replaces_a_stale_block_and_refuses_a_missing_one(tmp_path: Path) -> None:
    text = "a\n<!-- table:op -->\n| old |\n<!-- /table:op -->\nb\n<!-- table:x -->\n<!-- /table:x -->\n"
    new = readme_tables.render(text, {"op": "| new |\n| row |", "x": "| x |"})
    assert new == ("a\n<!-- table:op -->\n| new |\n| row |\n<!-- /table:op -->\nb\n"
                   "<!-- table:x -->\n| x |\n<!-- /table:x -->\n")
    assert readme_tables.render(new, {"op": "| new |\n| row |", "x": "| x |"}) == new
    try:
        readme_tables.render("no blocks", {"op": "| t |"})
    except ValueError as e:
        assert "table:op" in str(e)
    else:
        raise AssertionError("a missing block must be an error")


def test_headline_rows_are_the_json_rows() -> None:
    """The headline op table's ratios are the JSON's fused / nccl and fused / flashinfer."""
    op = readme_tables.load(str(RESULTS), readme_tables.OP_JSON)
    rows = {(r["hidden"], r["tokens"]): r for r in op["rows"]}
    lines = readme_tables.op_headline(op).splitlines()[2:]
    assert len(lines) == len(readme_tables.OP_HEADLINE)
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        r = rows[(int(cells[0]), int(cells[1]))]
        assert cells[5] == f"{r['fused'] / r['nccl']:.2f}"
        assert cells[6] == f"{r['fused'] / r['flashinfer']:.2f}"


def test_fp8_summary_names_the_worst_small_shape_and_counts_the_slower_ones() -> None:
    rows = [{"hidden": 4096, "tokens": 8, "quant": "static", "fused": 3.0, "fused_noquant": 5.0,
             "unfused": 15.0},
            {"hidden": 8192, "tokens": 80, "quant": "group128", "fused": 9.0, "fused_noquant": 8.0,
             "unfused": 20.0},
            # 512 tokens: past the small-shape bound, though its ratio is the worst
            {"hidden": 8192, "tokens": 512, "quant": "group128", "fused": 40.0,
             "fused_noquant": 50.0, "unfused": 60.0}]
    text = readme_tables.fp8_summary({"rows": rows})
    assert "at most 0.450 x unfused (worst 8192 x 80 group128)" in text
    assert "faster than op + compiled quant at 2 of 3 shapes" in text
