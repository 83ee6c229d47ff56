"""Every notebook runs top to bottom, headless, on the CPU; the benchmark reader
takes the JSON layouts documented in docs/inspection.md."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
sys.path.insert(0, str(NOTEBOOKS))
import _helpers  # noqa: E402


def run_notebook(name: str, env: dict[str, str]) -> list[str]:
    """Execute; returns the text the code cells printed.  Figures go to ``env``'s dir."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        # "python3" runs this interpreter: jupyter_client swaps a bare "python" for sys.executable.
        nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return ["".join(o.get("text", "") for o in c.get("outputs", []) if o.get("output_type") == "stream")
            for c in nb.cells if c.cell_type == "code"]


def test_notebooks_are_committed_without_outputs():
    for path in NOTEBOOKS.glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        for c in nb.cells:
            if c.cell_type == "code":
                assert not c.outputs and c.execution_count is None, f"{path.name} has outputs"


def test_gate_explorer(tmp_path):
    out = run_notebook("gate_explorer.ipynb", {"FUSION_PASS_FIGURE_DIR": str(tmp_path)})
    assert "GPT-OSS 120B" in out[0] and "2880" in out[0]
    assert "two_stage" in out[1] and "one_stage" in out[1]
    assert "world size 8" in out[2] or "at world size 8" in out[2]
    assert {p.name for p in tmp_path.iterdir()} == {"gate_heatmap_kernel.png", "gate_heatmap_aiter.png"}


def test_graph_dump_inspection(tmp_path):
    dump = tmp_path / "dump"
    out = run_notebook("graph_dump_inspection.ipynb", {"FUSION_PASS_FIGURE_DIR": str(tmp_path),
                                                         "FUSION_PASS_NOTEBOOK_DUMP": str(dump)})
    text = "\n".join(out)
    for path in ("one_stage", "two_stage", "runtime", "unfused"):
        assert f"{path}" in text
    assert "torch.ops.fusion_pass.allreduce_rmsnorm.default" in text
    assert (tmp_path / "fusion_site_before_after.png").stat().st_size > 10_000
    assert (dump / "rank_1_dp_0").is_dir()


def test_benchmarks_without_results(tmp_path):
    (tmp_path / "results").mkdir()
    out = run_notebook("benchmarks.ipynb", {"FUSION_PASS_FIGURE_DIR": str(tmp_path / "fig"),
                                            "FUSION_PASS_BENCH_DIR": str(tmp_path / "results")})
    assert "No benchmark results" in out[0]
    assert not list((tmp_path / "fig").glob("*.png"))


def _records() -> list[dict]:
    rows = []
    for impl, scale in (("unfused", 1.0), ("triton_fused", 0.7)):
        for hidden in (2880, 4096):
            for tokens in (1, 8, 80, 512):
                rows.append({"impl": impl, "hidden": hidden, "tokens": tokens,
                             "us": scale * (10 + tokens * hidden / 100_000), "dtype": "bfloat16",
                             "world_size": 2})
    return rows


def test_benchmarks_with_results(tmp_path):
    res = tmp_path / "results"
    res.mkdir()
    (res / "op_h200x2.json").write_text(json.dumps({"device": "H200", "results": _records()}))
    out = run_notebook("benchmarks.ipynb", {"FUSION_PASS_FIGURE_DIR": str(tmp_path / "fig"),
                                            "FUSION_PASS_BENCH_DIR": str(res)})
    assert "16 measurements" in out[0]
    assert "ratios against 'unfused'" in out[2] and "0.70x" in out[2]
    assert {p.name for p in (tmp_path / "fig").iterdir()} == {"bench_latency_op_h200x2.png",
                                                              "bench_ratio_op_h200x2.png"}


def test_benchmark_reader_layouts(tmp_path):
    recs = _records()
    (tmp_path / "a_list.json").write_text(json.dumps(recs))
    by_impl: dict = {}
    for r in recs:
        by_impl.setdefault(r["impl"], []).append(
            {"hidden_size": r["hidden"], "num_tokens": r["tokens"], "latency_ms": r["us"] / 1000})
    (tmp_path / "b_by_impl.json").write_text(json.dumps({"world_size": 2, "dtype": "bfloat16", **by_impl}))
    wide: dict = {}
    for r in recs:
        wide.setdefault((r["hidden"], r["tokens"]), {"hidden": r["hidden"], "tokens": r["tokens"],
                                                     "gate_path": "one_stage"})[r["impl"]] = r["us"]
    (tmp_path / "e_wide.json").write_text(json.dumps({"meta": {"world_size": 2, "dtype": "bfloat16"},
                                                      "rows": list(wide.values())}))
    (tmp_path / "c_junk.json").write_text("{not json")
    (tmp_path / "d_other.json").write_text(json.dumps({"hello": 1}))
    rows, notes = _helpers.load_benchmarks(str(tmp_path))
    a = [r for r in rows if r["source"] == "a_list.json"]
    b = [r for r in rows if r["source"] == "b_by_impl.json"]
    key = lambda r: (r["impl"], r["hidden"], r["tokens"])  # noqa: E731
    assert sorted(map(key, a)) == sorted(map(key, b)) and len(a) == len(recs)
    e = [r for r in rows if r["source"] == "e_wide.json"]
    assert sorted(map(key, a)) == sorted(map(key, e))
    for ra, rb, re_ in zip(sorted(a, key=key), sorted(b, key=key), sorted(e, key=key)):
        assert rb["us"] == pytest.approx(ra["us"]) and rb["world_size"] == 2
        assert re_["us"] == ra["us"] and (re_["dtype"], re_["world_size"]) == ("bfloat16", 2)
    assert any("c_junk.json" in n for n in notes) and any("d_other.json" in n for n in notes)
    assert _helpers.baseline_of({"triton_fused", "unfused"}) == "unfused"
    rel = _helpers.ratios(a, "unfused")
    assert len(rel) == len(recs) // 2 and all(r["ratio"] == pytest.approx(0.7) for r in rel)
    assert _helpers.load_benchmarks(str(tmp_path / "missing"))[0] == []
