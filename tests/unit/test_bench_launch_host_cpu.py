"""benchmarks/op/bench_launch_host.py without a GPU: its arguments, the children's
environment, a child that refuses a Triton folder it does not import from, the
summary's arithmetic, and a ``--dry-run`` end to end (its JSON's fields).
Behaviour only: no timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "op" / "bench_launch_host.py"
# The op benchmarks' modules, and the ones the benchmarks share (bench_common.py).
sys.path[:0] = [str(ROOT / "benchmarks" / "op"), str(ROOT / "benchmarks")]

import bench_launch_host as blh  # noqa: E402


def _installed_triton() -> Path:
    spec = importlib.util.find_spec("triton")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent


@pytest.fixture
def triton_copy(tmp_path: Path) -> Path:
    """A folder holding the installed Triton under its own name (a link): a
    Triton that only ``PYTHONPATH`` can make Python find there."""
    folder = tmp_path / "other_triton"
    folder.mkdir()
    (folder / "triton").symlink_to(_installed_triton(), target_is_directory=True)
    return folder


@pytest.fixture
def not_a_package(tmp_path: Path) -> Path:
    """A folder whose ``triton`` is an empty directory: a namespace portion,
    which the installed package shadows."""
    folder = tmp_path / "empty_triton"
    (folder / "triton").mkdir(parents=True)
    return folder


def test_arguments(tmp_path: Path, triton_copy: Path, capsys) -> None:
    args = blh.parse_args([str(tmp_path), "--triton-path", str(triton_copy), "--rounds", "3"])
    assert args.triton_path == [str(triton_copy)] and args.rounds == 3 and args.limit == 1.10
    assert not args.dry_run and args.child is None
    for bad, why in (([], "OUTDIR is required"),
                     ([str(tmp_path), "--triton-path", str(tmp_path)], "no triton package"),
                     ([str(tmp_path), "--calls", "0"], "at least 1")):
        with pytest.raises(SystemExit) as e:
            blh.parse_args(bad)
        assert e.value.code == 2 and why in capsys.readouterr().err


def test_child_environment(monkeypatch, triton_copy: Path, not_a_package: Path) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(not_a_package), "/somewhere/else"]))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(blh.CONNECTIONS_VAR, raising=False)
    given = [str(triton_copy), str(not_a_package)]
    env = blh.child_env(str(triton_copy), given)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(triton_copy), blh.ROOT, "/somewhere/else"]
    assert "TRITON_INTERPRET" not in env and int(env[blh.CONNECTIONS_VAR]) >= blh.WORLD + 1
    # The reference's child finds none of the given folders.
    assert blh.child_env(None, given)["PYTHONPATH"].split(os.pathsep) == [blh.ROOT,
                                                                         "/somewhere/else"]


def test_a_child_refuses_a_folder_triton_is_not_imported_from(tmp_path: Path,
                                                              not_a_package: Path) -> None:
    args = blh.parse_args([str(tmp_path / "out"), "--triton-path", str(not_a_package),
                           "--dry-run", "--rounds", "1", "--calls", "1"])
    run = blh.run_child("--triton-path", str(not_a_package), args, str(tmp_path), 0)
    assert run["result"] is None
    assert run["error"].startswith("exit status 3") and str(not_a_package) in run["error"]


def _run(label: str, path, plan_ns: float, base_ns: float = 1000.0, error=None) -> dict:
    result = None if error else {
        "triton": "3.8.0" if path else "3.6.0", "generation": "generic" if path else "flat",
        "ns_per_call": {blh.MEASURED: {"median": plan_ns}, blh.ITEMS[1]: {"median": base_ns}}}
    return {"label": label, "triton_path": path, "error": error, "result": result}


def test_summary() -> None:
    runs = [_run("reference", None, 4000.0), _run("other", "/t", 4600.0),
            _run("reference again", None, 4400.0)]
    s = blh.summarize(runs, 1.10)
    assert s["reference"] == {"triton": "3.6.0", "generation": "flat", "median_ns": 4200.0,
                              "runs": 2}
    assert s["aa_ratio"] == pytest.approx(1.1)
    (c,) = s["compared"]
    assert c["ratio"] == pytest.approx(4600 / 4200) and c["passed"] and s["passed"]
    assert c["generation"] == "generic" and c["ratio_beyond_baseline"] == pytest.approx(3.6 / 3.2)
    assert not blh.summarize(runs, 1.05)["passed"]
    runs[1] = _run("other", "/t", 0.0, error="exit status 1")
    s = blh.summarize(runs, 1.10)
    assert not s["passed"] and s["failed_runs"] == ["other"] and s["compared"] == []
    s = blh.summarize([_run("reference", None, 0.0, error="x")], 1.10)
    assert not s["passed"] and "reference" not in s


def test_dry_run_end_to_end(tmp_path: Path, triton_copy: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(SCRIPT), str(out), "--dry-run", "--triton-path",
                           str(triton_copy), "--rounds", "2", "--calls", "3"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode in (0, 1), done.stdout + done.stderr
    data = json.loads((out / blh.RESULT).read_text())
    prov = data["provenance"]
    assert prov["git"]["commit"] and prov["versions"]["torch"] and prov["devices"]
    assert "--triton-path" in prov["command"] and data["dry_run"] is True
    runs = data["runs"]
    assert [r["label"] for r in runs] == ["reference", f"--triton-path {triton_copy}",
                                          "reference again (A/A)"]
    assert all(r["error"] is None for r in runs)
    origins = [os.path.realpath(r["result"]["triton_from"]) for r in runs]
    assert origins[1] == os.path.realpath(triton_copy)
    assert origins[0] == origins[2] != origins[1]
    for r in runs:
        res = r["result"]
        assert res["triton"] and res["dry_run"] and res["world"] == 2 and res["shape"] == [8, 4096]
        assert set(res["ns_per_call"]) == set(blh.ITEMS)
        assert all(len(t["rounds"]) == 2 and t["min"] <= t["median"]
                   for t in res["ns_per_call"].values())
    s = data["summary"]
    ref = (runs[0]["result"]["ns_per_call"][blh.MEASURED]["median"]
           + runs[2]["result"]["ns_per_call"][blh.MEASURED]["median"]) / 2
    (c,) = s["compared"]
    assert c["ratio"] == pytest.approx(
        runs[1]["result"]["ns_per_call"][blh.MEASURED]["median"] / ref)
    assert s["passed"] == (done.returncode == 0) == (c["ratio"] <= s["limit"])
