"""``fusion-pass selftest``: the kernels' suite from the command line, its verdict
and its exit status.

End to end on the CPU (no GPU: Triton's interpreter, N = 2, the quick subset) as
a user runs it; the verdict and the exit status on results made by hand (a
failed case, none run, a case that did not run, the committed GPU run); how a
group that ended early is recorded; the quick subset against what it claims; a
case source registered from another module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from fusion_pass.quant import QuantSpec
from fusion_pass.selftest import suite
from fusion_pass.tools import selftest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------- end to end, on the CPU


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("selftest")
    path = out / "results" / "selftest.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(
        [ROOT] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "fusion_pass.tools.cli", "selftest", "--quick",
                           "--json", str(path)], capture_output=True, text=True, env=env,
                          cwd=str(out), timeout=600)
    seconds = time.perf_counter() - t0
    result = json.loads(path.read_text()) if path.exists() else None
    return proc, result, path, seconds


def test_quick_run_on_the_cpu_passes_and_says_what_it_ran(quick_run):
    proc, result, path, seconds = quick_run
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    assert "no NVIDIA GPU here" in output and "Triton's interpreter" in output
    ids = [c["id"] for c in result["cases"]]
    assert ids and all(i.startswith("n2-") for i in ids)
    verdict = output[output.index("== fusion-pass selftest: PASSED"):]
    assert f"PASSED: {len(ids)} of {len(ids)} cases" in verdict
    assert "N = 2 ranks" in verdict
    for i in ids:  # each case named, by the id --only takes
        assert i in verdict
    assert f"results:  {path}" in verdict
    # One progress line for the one group, as it ended.
    assert f"N=2 quick     {len(ids)}/{len(ids)} passed" in output
    print(f"CPU quick run: {seconds:.1f} s")


def test_quick_run_covers_both_kernels_and_writes_the_whole_result(quick_run):
    proc, result, path, seconds = quick_run
    assert {c["path"] for c in result["cases"]} == {"one_stage", "two_stage"}
    assert all(c["outcome"] == "passed" and c["pass"] and c["max_error"] <= 1.0
               for c in result["cases"])
    assert result["form"] == "interpret" and result["worlds"] == [2]
    sel = result["selection"]
    assert sel["quick"] and sel["cases"] == len(result["cases"]) < sel["of"]
    prov = result["provenance"]
    assert prov["versions"]["triton"] and prov["versions"]["torch"]
    assert "interpreter" in prov["device"]
    assert prov["command"][:3] == ["fusion-pass", "selftest", "--quick"]
    assert result["summary"].startswith(f"{len(result['cases'])} of {len(result['cases'])} cases")
    assert result["tally"]["2"]["one_stage"]["passed"] >= 1
    assert result["failed"] == [] and result["not_run"] == []
    # The groups' output beside the JSON.
    assert (path.parent / "sim_groups" / "n2_quick.log").exists()


# ---------------------------------------------------------------- verdict and exit status


def _case(cid: str, path="one_stage", **kw) -> dict:
    rec = dict(id=cid, kind="call", world=int(cid[1]), path=path, dtype="bfloat16", hidden=4096,
               tokens=7, max_error=0.4, problems=[], **{"pass": True}, outcome="passed")
    rec.update(kw)
    return rec


def _result(cases: list[dict], **kw) -> dict:
    res = dict(provenance={"versions": {"torch": "2.11.0+cu130", "triton": "3.6.0",
                                        "cuda": "13.0"},
                           "device": "NVIDIA H100 80GB HBM3", "triton_from": "an installed package",
                           "gpu": {"name": "NVIDIA H100 80GB HBM3", "capability": "9.0",
                                   "sms": 132, "memory_gib": 79.2},
                           "commit": "0123456789abcdef", "dirty": False},
               form="gpu", worlds=[2, 8], cases=cases, seconds=41.0,
               selection={"quick": True, "only": None, "cases": len(cases), "of": 338,
                          "left_out_by": ["--quick"]})
    res.update(kw)
    return res


def test_every_case_passed_exits_0_and_names_the_machine():
    res = _result([_case("n2-sweep-1"), _case("n2-sweep-2", "two_stage"),
                   _case("n8-protocol-1", path=None, kind="graph", max_error=0.49)])
    text = selftest.verdict(res)
    assert selftest.exit_code(res) == 0
    assert "PASSED: 3 of 3 cases" in text
    assert "NVIDIA H100 80GB HBM3" in text and "torch 2.11.0+cu130" in text
    assert "Triton 3.6.0" in text and "CUDA 13.0" in text
    assert "worst error: 0.490 of the tolerance (n8-protocol-1)" in text
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()
            if line.strip()[:1].isdigit()}
    assert rows == {"2": ["1/1", "1/1", "-"], "8": ["-", "-", "1/1"]}
    assert "left out: 335 cases" in text and "NVLink" in text


def test_a_failed_case_exits_1_and_is_named_with_its_problem():
    bad = _case("n8-sweep-52", "two_stage", max_error=1.7, outcome="failed",
                problems=["error 1.7 x tolerance", "h differs between ranks"], **{"pass": False})
    res = _result([_case("n2-sweep-52", "two_stage"), bad])
    text = selftest.verdict(res)
    assert selftest.exit_code(res) == 1
    assert "FAILED: 1 of 2 cases passed, 1 failed" in text
    assert "failed:   n8-sweep-52: error 1.7 x tolerance" in text
    assert "0/1 (1 failed)" in text


def test_a_record_without_an_outcome_counts_by_its_pass():
    """Results written before ``outcome`` (the committed JSON) read as passed or failed."""
    old = _case("n2-sweep-3", **{"pass": False})
    del old["outcome"]
    assert suite.outcome(old) == "failed"
    assert selftest.exit_code(_result([old])) == 1


def test_no_case_run_exits_1():
    res = _result([], selection={"quick": False, "only": ["n2-nothing-0"], "cases": 0, "of": 525,
                                 "left_out_by": ["--only"]})
    assert selftest.exit_code(res) == 1
    assert "FAILED: no case ran" in selftest.verdict(res)
    assert selftest.exit_code({}) == 1


def test_a_case_that_did_not_run_is_named_with_the_reason_and_fails_the_run():
    why = "the suite's deadline (420 s) passed before its group"
    skipped = [_case(f"n8-protocol-{i}", path=None, kind="growth", max_error=None,
                     outcome="not run", reason=why, **{"pass": False}) for i in range(5)]
    res = _result([_case("n2-sweep-1")] + skipped)
    text = selftest.verdict(res)
    assert selftest.exit_code(res) == 1
    assert "FAILED: 1 of 6 cases passed, 5 did not run" in text
    assert (f"not run: n8-protocol-0, n8-protocol-1, n8-protocol-2 and 2 more: {why}"
            in " ".join(text.split()))  # wrapped at 100 columns
    assert "0/5 (5 not run)" in text


@pytest.mark.parametrize("triton", ["3.6", "3.8"])
def test_the_committed_gpu_runs_cover_every_case_of_the_suite_and_passed(triton):
    run = os.path.join(ROOT, "benchmarks", "results", f"selftest_h100x1_triton{triton.replace('.', '')}")
    with open(os.path.join(run, "gpu_tests_1gpu_sim.json")) as f:
        res = json.load(f)
    # Every case the suite defines today at N = 2, 4, 8, counted from the suite's own lists.
    want = {c["id"] for n in (2, 4, 8) for cs in suite.groups("gpu", n).values() for c in cs}
    assert {c["id"] for c in res["cases"]} == want
    text = selftest.verdict(res)
    assert selftest.exit_code(res) == 0
    assert f"PASSED: {len(want)} of {len(want)} cases" in text and "NVIDIA H100" in text
    assert f"Triton {triton}" in text
    for n in ("2", "4", "8"):
        assert any(line.split()[:1] == [n] for line in text.splitlines())
    assert len(text.splitlines()) <= 24  # one screen
    # The doctor of the same machine and Python beside it.
    with open(os.path.join(run, "doctor.json")) as f:
        doc = json.load(f)
    assert doc["versions"]["triton"]["version"].startswith(triton)
    assert doc["versions"]["torch"]["version"] == res["provenance"]["versions"]["torch"]


def test_progress_lines():
    line = selftest.progress_line({"event": "group", "world": 8, "group": "sweep", "total": 120,
                                   "passed": 118, "failed": 1, "not run": 1,
                                   "status": "timed out after 200 s", "seconds": 200.4})
    assert line == ("N=8 sweep     118/120 passed   200.4 s  "
                    "(1 failed; 1 not run; group timed out after 200 s)")


def test_world_sizes_the_kernels_do_not_take_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        selftest.main(["--worlds", "2", "3"])
    assert e.value.code == 2 and "not [3]" in capsys.readouterr().err


# ---------------------------------------------------------------- a group that ended early


def test_a_group_that_ends_during_a_case_fails_it_and_names_the_rest_not_run():
    cs = [dict(kind="call", id=f"n4-sweep-{i}", world=4, path="one_stage") for i in range(4)]
    done = {"n4-sweep-0": dict(cs[0], max_error=0.3, problems=[], **{"pass": True})}
    output = "".join(f"{suite.STARTING}n4-sweep-{i}\n" for i in range(2)) + "...assert...\n"
    recs = suite.group_records(cs, "sweep", "timed out after 200 s", done, output)
    assert [r["outcome"] for r in recs] == ["passed", "failed", "not run", "not run"]
    assert recs[1]["problems"][0].startswith("did not finish: group timed out after 200 s")
    assert recs[2]["reason"] == "group sweep timed out after 200 s during n4-sweep-1"
    assert not any(r["pass"] for r in recs[1:])


def test_a_group_that_dies_before_its_first_case_says_why():
    cs = [dict(kind="call", id="n8-quick-0", world=8, path="two_stage")]
    output = ("Traceback (most recent call last):\n  ...\nfusion_pass.selftest.sim_group."
              "SimError: CUDA_DEVICE_MAX_CONNECTIONS must be at least 9\n")
    rec, = suite.group_records(cs, "quick", "exit 1", {}, output)
    assert rec["outcome"] == "not run" and not rec["pass"]
    assert rec["reason"] == ("group quick exit 1 before its first case: fusion_pass.selftest."
                             "sim_group.SimError: CUDA_DEVICE_MAX_CONNECTIONS must be at least 9")


def test_a_group_past_the_deadline_did_not_run():
    cs = [dict(kind="late", id="n8-protocol-3", world=8)]
    rec, = suite.group_records(cs, "protocol", "not run: the suite's deadline (420 s) passed "
                                               "before its group", {}, "")
    assert (rec["outcome"], rec["reason"]) == ("not run", "the suite's deadline (420 s) passed "
                                                          "before its group")


# ---------------------------------------------------------------- the quick subset


@pytest.mark.parametrize("form,worlds", [("gpu", (2, 4, 8)), ("interpret", (2, 4, 8))])
def test_each_quick_choice_names_one_case_at_every_n(form, worlds):
    """A case the suite no longer has (or a field that now matches two) fails here,
    not silently in --quick."""
    for world in worlds:
        every = suite.cases(form, world)
        here = [(g, f) for g, f in suite.QUICK[form] if f.get("world", world) == world]
        for group, fields in here:
            hits = [c for c in every[group] if all(c.get(k) == v for k, v in fields.items())]
            assert len(hits) == 1, (form, world, group, fields, [c["id"] for c in hits])
        quick = suite.groups(form, world, quick=True)
        assert list(quick) == [suite.QUICK_GROUP]
        assert len(quick[suite.QUICK_GROUP]) == len(here)


def test_the_gpu_quick_subset_covers_what_it_claims():
    """Both paths, bf16 and fp32, an FP8 mode, a CUDA graph, odd token counts; no
    case that ends a CUDA context (the missing rank) or waits seconds (the late one)."""
    assert suite.QUICK_WORLDS["gpu"] == (2, 8)
    n2, n8 = (suite.groups("gpu", w, quick=True)[suite.QUICK_GROUP] for w in (2, 8))
    for chosen in (n2, n8):
        calls = [c for c in chosen if c["kind"] == "call"]
        assert {c["path"] for c in calls} == {"one_stage", "two_stage"}
        assert {"bfloat16", "float32"} <= {c["dtype"] for c in calls}
        assert {QuantSpec.decode(c["quant"]).mode for c in calls if c["quant"]} == {
            "per_group", "per_token"}
        assert any(c["tokens"] % 2 for c in calls)
    assert {c["kind"] for c in n2} == {"call", "graph"}
    assert {c["kind"] for c in n8} == {"call"}
    # The same calls at both N.
    assert ({c["id"].split("-", 1)[1] for c in n2 if c["kind"] == "call"}
            == {c["id"].split("-", 1)[1] for c in n8})


def test_the_interpreter_quick_subset_runs_both_kernels():
    chosen = suite.groups("interpret", 2, quick=True)[suite.QUICK_GROUP]
    assert {c["path"] for c in chosen} == {"one_stage", "two_stage"}


# ---------------------------------------------------------------- another module's cases


def test_a_registered_case_source_runs_in_a_group_of_its_own(monkeypatch):
    """How ``remake``'s cases join: a source, its runners, its group before the
    missing rank's (which ends a CUDA context), its first case in --quick."""
    made = []

    def source(form, world):
        made.append((form, world))
        return [dict(kind="remake", seed=40 + i, hidden=256, tokens=3) for i in range(3)]

    def run_remake(group, case, interpreted):
        return {"max_error": 0.1, "problems": []}

    monkeypatch.setattr(suite, "EXTRA", [suite.Extra("remake", source, {"remake": run_remake})])
    gpu = suite.cases("gpu", 4)
    assert list(gpu) == ["sweep", "features", "protocol", "remake", "never"]
    assert [c["id"] for c in gpu["remake"]] == ["n4-remake-0", "n4-remake-1", "n4-remake-2"]
    assert all(c["world"] == 4 for c in gpu["remake"])
    assert list(suite.cases("interpret", 2)) == ["all", "remake"]
    assert made == [("gpu", 4), ("interpret", 2)]
    assert suite.runner("remake") is run_remake and suite.runner("call") is suite.run_call
    with pytest.raises(KeyError, match="no runner"):
        suite.runner("nothing")
    quick = suite.groups("gpu", 8, quick=True)[suite.QUICK_GROUP]
    assert quick[-1]["id"] == "n8-remake-0" and quick[-2]["id"] == "n8-features-35"
    monkeypatch.setattr(suite, "EXTRA", [suite.Extra("sweep", source, {"remake": run_remake})])
    with pytest.raises(ValueError, match="'sweep'"):
        suite.cases("gpu", 2)


# ---------------------------------------------------------------- what main asks the suite for


@pytest.mark.parametrize("form,args,worlds,quick", [
    ("gpu", [], [2, 4, 8], False),
    ("gpu", ["--quick"], [2, 8], True),
    ("gpu", ["--quick", "--worlds", "4"], [4], True),
    ("interpret", [], [2], True),  # without a GPU: always the quick subset, N = 2
    ("interpret", ["--only", "n2-all-5"], [2], False),
    ("gpu", ["--only", "n8-sweep-3", "n4-never-0"], [4, 8], False),  # the N the ids name
])
def test_main_runs_the_form_and_subset_it_says(monkeypatch, capsys, tmp_path, form, args, worlds,
                                               quick):
    asked = {}

    def run_suite(outdir, form_, worlds_, **kw):
        asked.update(outdir=outdir, form=form_, worlds=worlds_, **kw)
        return _result([_case("n2-sweep-1")], form=form_, worlds=worlds_)

    monkeypatch.setattr(selftest, "choose_form", lambda: (form, "a reason"))
    monkeypatch.setattr(suite, "run_suite", run_suite)
    monkeypatch.setattr(selftest.tempfile, "mkdtemp", lambda prefix: str(tmp_path / "tmp"))
    assert selftest.main(args) == 0
    out = capsys.readouterr().out
    assert (asked["form"], asked["worlds"], asked["quick"]) == (form, worlds, quick)
    # Without --json the results go to a temporary folder, and its path is printed.
    assert asked["outdir"] == str(tmp_path / "tmp")
    assert asked["json_path"] == str(tmp_path / "tmp" / suite.RESULT[form])
    assert f"results go to {asked['json_path']}" in out
    assert ("no NVIDIA GPU here (a reason)" in out) == (form == "interpret")
    assert asked["command"] == ["fusion-pass", "selftest", *args]


def test_main_exits_1_when_a_case_failed(monkeypatch, tmp_path):
    bad = _case("n2-sweep-1", outcome="failed", problems=["error 2 x tolerance"], **{"pass": False})
    monkeypatch.setattr(selftest, "choose_form", lambda: ("gpu", "a GPU"))
    monkeypatch.setattr(suite, "run_suite", lambda outdir, form, worlds, **kw: _result([bad]))
    assert selftest.main(["--quick", "--json", str(tmp_path / "r.json")]) == 1
