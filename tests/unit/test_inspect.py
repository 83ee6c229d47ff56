"""``fusion-pass inspect`` on a real depyf dump (two gloo ranks) and on bad directories."""

from __future__ import annotations

import json
import os
import shutil
import textwrap

import pytest

from fusion_pass.tools import cli
from fusion_pass.testing.example_dump import make_example_dump
from fusion_pass.tools.inspect_dumps import find_all_reduces, find_fused, inspect_dir, parse_graph

# A static 4-token compile (one-stage) and a 2..1024 range compile (runtime).
CALLS = ((4, None), (7, (2, 1024)))


@pytest.fixture(scope="module")
def dump(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[list[float]]]:
    out = str(tmp_path_factory.mktemp("dump"))
    errors = make_example_dump(out, hidden=128, calls=CALLS)
    return out, errors


def test_compiled_model_matches_eager(dump):
    _, errors = dump
    assert len(errors) == 2 and all(len(e) == len(CALLS) for e in errors)
    # bf16 outputs of a 2-block model: a wrong reduction or norm is off by O(1).
    assert max(max(e) for e in errors) < 0.1


def test_report_per_rank_and_graph(dump):
    out, _ = dump
    report = inspect_dir(out)
    assert [r.rank for r in report.ranks] == [0, 1]
    assert report.warnings == []
    for rank in report.ranks:
        assert rank.dir == f"rank_{rank.rank}_dp_0"
        assert rank.transformed_code, "decompiled code was dumped"
        assert len(rank.graphs) == 2
        for g, want in zip(rank.graphs, ("one_stage", "runtime")):
            assert g.before_file.endswith(".Forward_graph.0.py")
            assert g.after_file.endswith(".AFTER_POST_GRAD.0.py")
            # Two blocks: two all-reduce sites before the pass, each with its record ...
            assert [s["collective"] for s in g.sites_before] == ["_c10d_functional.all_reduce"] * 2
            assert all(s["hidden"] == 128 and s["dtype"] == "bfloat16" for s in g.sites_before)
            assert [s["record"]["path"] for s in g.sites_before] == [want, "unfused"]
            # ... one fused (fp32 weight in the bf16 model) with the path the gate chose ...
            assert [f["path"] for f in g.fused] == [want]
            assert g.fused[0]["hidden"] == 128 and g.fused[0]["residual"] is not None
            assert g.fused[0]["eps"] == pytest.approx(1e-6)
            # ... that survived into Inductor's output code ...
            assert g.output_code_paths == [want]
            # ... and one left alone (its sum is also returned), with the pass's reason.
            assert g.record is not None and g.record["rank"] == rank.rank
            assert [s["path"] for s in g.decisions] == [want, "unfused"]
            assert len(g.unfused) == 1 and "users outside the pattern" in g.unfused[0]["reason"]
        assert rank.graphs[0].sites_before[0]["tokens"] == 4
        assert rank.graphs[1].sites_before[0]["tokens"] is None  # symbolic
    t = report.totals()
    assert (t["graphs"], t["sites_before"], t["fused"], t["unfused"]) == (4, 8, 4, 4)
    assert {r["path"] for r in report.decision_table()} == {"one_stage", "runtime", "unfused"}


def test_cli_text_and_json(dump, capsys):
    out, _ = dump
    assert cli.main(["inspect", out]) == 0
    text = capsys.readouterr().out
    assert "2 rank(s), 4 compiled graph(s)" in text
    assert "path=one_stage" in text and "path=runtime" in text
    assert text.count("left unfused:") == 4
    assert cli.main(["inspect", out, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["totals"]["fused"] == 4
    paths = [f["path"] for r in data["ranks"] for g in r["graphs"] for f in g["fused"]]
    assert paths == ["one_stage", "runtime"] * 2
    assert all(len(g["unfused"]) == 1 for r in data["ranks"] for g in r["graphs"])


def test_records_only_and_depyf_only(dump, tmp_path):
    out, _ = dump
    recs = tmp_path / "records"
    recs.mkdir()
    for f in os.listdir(out):
        if f.endswith(".jsonl"):
            shutil.copy(os.path.join(out, f), recs / f)
    report = inspect_dir(str(recs))
    assert [r.dir for r in report.ranks] == [None, None]
    assert [len(r.graphs) for r in report.ranks] == [2, 2]
    assert report.totals()["unfused"] == 4 and report.totals()["fused"] == 0  # no graphs: no fused ops seen

    graphs = tmp_path / "graphs"
    shutil.copytree(os.path.join(out, "rank_0_dp_0"), graphs / "rank_0_dp_0")
    report = inspect_dir(str(graphs))
    assert len(report.ranks) == 1 and report.totals()["fused"] == 2
    assert all(g.record is None for g in report.ranks[0].graphs)


def test_vllm_plugin_worker_dirs_map_to_ranks(dump, tmp_path):
    """The plugin's per-process depyf dirs (``VllmWorker-<rank>-pid<pid>``) pair with records."""
    out, _ = dump
    for r in (0, 1):
        shutil.copytree(os.path.join(out, f"rank_{r}_dp_0"), tmp_path / "dumps" / f"VllmWorker-{r}-pid{100 + r}")
        shutil.copy(os.path.join(out, f"fusion_pass_records.rank{r}.jsonl"), tmp_path)
    report = inspect_dir(str(tmp_path))
    assert [r.rank for r in report.ranks] == [0, 1]
    assert all(g.record is not None for r in report.ranks for g in r.graphs)


def test_appended_records_use_the_last_run(dump, tmp_path):
    out, _ = dump
    shutil.copytree(out, tmp_path / "d")
    path = tmp_path / "d" / "fusion_pass_records.rank0.jsonl"
    path.write_text(path.read_text() * 2)
    report = inspect_dir(str(tmp_path / "d"))
    assert any("several runs" in w for w in report.warnings)
    assert all(g.record is not None for g in report.ranks[0].graphs)
    assert len(report.ranks[0].graphs) == 2


def _bad(tmp_path, capsys, target: str) -> str:
    assert cli.main(["inspect", target]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    assert cap.err.count("\n") == 1 and "Traceback" not in cap.err
    return cap.err


def test_bad_directories(tmp_path, capsys):
    assert "no such directory" in _bad(tmp_path, capsys, str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    assert "empty" in _bad(tmp_path, capsys, str(tmp_path / "empty"))
    (tmp_path / "file.txt").write_text("x")
    assert "not a directory" in _bad(tmp_path, capsys, str(tmp_path / "file.txt"))
    foreign = tmp_path / "foreign"
    (foreign / "sub").mkdir(parents=True)
    (foreign / "model.py").write_text("print('hi')\n")
    (foreign / "sub" / "notes.md").write_text("# notes\n")
    assert "not a graph dump" in _bad(tmp_path, capsys, str(foreign))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "fusion_pass_records.rank0.jsonl").write_text('{"graph": 0, "rank": 0\n')
    assert "unreadable fusion_pass record file" in _bad(tmp_path, capsys, str(broken))
    garbled = tmp_path / "garbled"
    garbled.mkdir()
    (garbled / "__compiled_fn_1.AFTER_POST_GRAD.0.py").write_text("class GraphModule(:\n")
    assert "not a parsable graph dump" in _bad(tmp_path, capsys, str(garbled))


VLLM_GRAPH = textwrap.dedent('''
    class GraphModule(torch.nn.Module):
        def forward(self, arg0_1: "bf16[s0, 2880]", arg1_1: "bf16[s0, 2880]", arg2_1: "bf16[2880]"):
            # File: /m/model.py:10 in forward, code: x = self.o_proj(x)
            all_reduce: "bf16[s0, 2880]" = torch.ops.vllm.all_reduce.default(arg0_1, 'tp:0')
            # File: /m/model.py:11 in forward, code: x, r = self.norm(x, r)
            fused_add_rms_norm = torch.ops.vllm_ir.fused_add_rms_norm.default(all_reduce, arg1_1, arg2_1, 1e-05, None)
            getitem: "bf16[s0, 2880]" = fused_add_rms_norm[0]
            mm: "bf16[s0, 2880]" = torch.ops.aten.mm.default(getitem, arg2_1)
            all_reduce_1: "bf16[s0, 2880]" = torch.ops.vllm.all_reduce.default(mm, 'tp:0')
            rsqrt: "f32[s0, 1]" = torch.ops.aten.rsqrt.default(all_reduce_1)
            allreduce_rmsnorm_quant_default = torch.ops.fusion_pass.allreduce_rmsnorm_quant.default(arg0_1, None, arg2_1, None, None, None, '3', 'two_stage', 'eps=1e-05,multiplier=0.5,gemma=1;mode=per_token,fp8=float8_e4m3fn,qmax=448.0,group=0,scale_floor=0.0,reciprocal=0')
            return (getitem, rsqrt, allreduce_rmsnorm_quant_default)
''')


def test_parser_on_vllm_forms(tmp_path):
    """vLLM's custom-op all-reduce and IR norms; the fused op's baked arguments, its spec
    decoded."""
    path = tmp_path / "__compiled_fn_1.post_grad.9.AllReduceRMSNormFusionPass.before.0.py"
    path.write_text(VLLM_GRAPH)
    nodes = parse_graph(str(path))
    sites = find_all_reduces(nodes)
    assert [s["all_reduce"] for s in sites] == ["all_reduce", "all_reduce_1"]
    assert sites[0]["hidden"] == 2880 and sites[0]["dtype"] == "bfloat16"
    assert sites[0]["source"].startswith("model.py:10")
    (fused,) = find_fused(nodes)
    assert (fused["path"], fused["group"], fused["gemma"], fused["residual"]) == ("two_stage", "3", True, None)
    assert (fused["eps"], fused["multiplier"], fused["quant"]) == (1e-5, 0.5, "per_token")
    assert fused["hidden"] == 2880
