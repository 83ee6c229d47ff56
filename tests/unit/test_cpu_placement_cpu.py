"""Where the benchmarks pin an engine's processes: the host's topology read from a /sys
tree, the plan (one physical core per role, siblings left free, near the GPU first), the
roles read from vLLM's process titles, and real processes pinned, every thread."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# The vllm benchmark's modules, and the ones the benchmarks share (bench_common.py).
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path[:0] = [str(BENCHMARKS / "vllm"), str(BENCHMARKS)]

import cpu_placement as cp  # noqa: E402


def _sys_tree(tmp_path: Path, cores: list[list[int]], gpu_local: str | None):
    """A /sys/devices/system/cpu and /sys/bus/pci/devices with ``cores`` (each the CPUs of
    one physical core, package 0) and one GPU whose local CPUs are ``gpu_local``."""
    cpu, pci = tmp_path / "cpu", tmp_path / "pci"
    for core_id, cpus in enumerate(cores):
        for c in cpus:
            t = cpu / f"cpu{c}" / "topology"
            t.mkdir(parents=True)
            (t / "physical_package_id").write_text("0\n")
            (t / "core_id").write_text(f"{core_id}\n")
    if gpu_local is not None:
        (pci / "0000:19:00.0").mkdir(parents=True)
        (pci / "0000:19:00.0" / "local_cpulist").write_text(gpu_local + "\n")
    return cpu, pci


@pytest.fixture
def smt16(tmp_path, monkeypatch):
    """16 CPUs, 8 physical cores (CPU c and c + 8 siblings), the GPU near CPUs 4-7, 12-15."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    cpu, pci = _sys_tree(tmp_path, [[c, c + 8] for c in range(8)], "4-7,12-15")
    return cp.topology(["0000:19:00.0"], cpu, pci)


def test_cpu_lists_parse_as_the_kernel_writes_them() -> None:
    assert cp.parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert cp.parse_cpu_list("5") == [5]


def test_topology_groups_siblings_and_reads_the_gpus_local_cpus(smt16) -> None:
    assert smt16.smt_visible
    assert smt16.cores[0] == [0, 8] and len(smt16.cores) == 8
    assert smt16.gpu_local == [4, 5, 6, 7, 12, 13, 14, 15]


def test_plan_tp1_one_core_per_role_near_the_gpu_siblings_free(smt16) -> None:
    pl, why = cp.plan(1, smt16, 1, 1)
    assert pl is not None and why == ""
    assert pl.frontend == [4] and pl.core == [5] and pl.workers == []
    # The next core near the GPU, both its CPUs, parks the engines not measured.
    assert pl.park == [6, 14]
    used = {4, 5, 12, 13}  # the two cores given, both their CPUs
    assert not (used | set(pl.park)) & set(pl.driver)
    assert set(pl.driver) == set(range(16)) - used - set(pl.park)


def test_plan_tp2_gives_each_worker_its_own_core_and_the_first_core_last(smt16) -> None:
    pl, _ = cp.plan(2, smt16, 2, 2)
    assert pl is not None
    roles = [*pl.frontend, *pl.core, *(w[0] for w in pl.workers)]
    assert len(set(roles)) == 6 and len(pl.workers) == 2
    # Four cores near the GPU, then the far ones; CPU 0's core only if nothing else is left.
    assert roles[:4] == [4, 5, 6, 7] and 0 not in roles
    cores = {c: i for i, core in enumerate(smt16.cores) for c in core}
    assert len({cores[c] for c in roles}) == 6  # no two roles on one physical core


def test_plan_without_enough_cores_leaves_the_engines_unpinned(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    cpu, pci = _sys_tree(tmp_path, [[0], [1]], None)
    topo = cp.topology([], cpu, pci)
    assert not topo.smt_visible and topo.gpu_local is None
    pl, why = cp.plan(1, topo)
    assert pl is None and "2 physical core(s)" in why
    # Cores for the roles and the driver, none left to park: pinned without parking.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    cpu, pci = _sys_tree(tmp_path / "three", [[0], [1], [2]], None)
    pl, _ = cp.plan(1, cp.topology([], cpu, pci))
    assert pl is not None and pl.park == [] and pl.driver == [0]


def test_a_gpu_local_list_naming_every_cpu_chooses_nothing(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)))
    cpu, pci = _sys_tree(tmp_path, [[0], [1], [2], [3]], "0-3")
    assert cp.topology(["0000:19:00.0"], cpu, pci).gpu_local is None


@pytest.mark.parametrize("title,role", [
    ("VLLM::EngineCore", ("core", None)),
    ("VLLM::EngineCore_DP0", ("core", None)),
    ("VLLM::Worker_TP1", ("worker", 1)),
    ("VLLM::Worker_PP0_TP3", ("worker", 3)),
    ("VLLM::Worker", ("worker", None)),
    ("/usr/bin/python3 -m vllm.entrypoints.openai.api_server --model m", ("frontend", None)),
])
def test_roles_come_from_vllms_process_titles(title, role) -> None:
    assert cp.role_of(title) == role


def _allowed(pid: int) -> set[int]:
    return set(os.sched_getaffinity(pid))


def _thread_cpus(pid: int) -> list[set[int]]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        text = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        line = next(ln for ln in text.splitlines() if ln.startswith("Cpus_allowed_list"))
        out.append(set(cp.parse_cpu_list(line.split(":", 1)[1])))
    return out


# A frontend and its processes as vLLM's are at TP=2 (TP=1: no workers): the engine core
# a child of the frontend, the workers children of the engine core, each with vLLM's title
# and a second thread; every process ends with its parent.
_TREE = textwrap.dedent("""
    import ctypes, multiprocessing as mp, signal, threading, time, sys
    def hold(title):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # ends with its parent
        import setproctitle
        setproctitle.setproctitle(title)
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    def worker(title):
        hold(title)
        time.sleep(60)
    def core(tp):
        hold("VLLM::EngineCore_DP0")
        ctx = mp.get_context("spawn")
        for r in range(tp if tp > 1 else 0):
            ctx.Process(target=worker, args=(f"VLLM::Worker_TP{r}",)).start()
        time.sleep(60)
    if __name__ == "__main__":
        mp.get_context("spawn").Process(target=core, args=(int(sys.argv[1]),)).start()
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        print("up", flush=True)
        time.sleep(60)
""")


def _engine_tree(tmp_path: Path, tp: int):
    """A running :data:`_TREE` whose processes all carry their titles."""
    import psutil

    script = tmp_path / "tree.py"
    script.write_text(_TREE)
    proc = subprocess.Popen([sys.executable, str(script), str(tp)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "up"
    want = 1 + (tp if tp > 1 else 0)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the children start and set their titles
        titles = [cp._title(p.pid) for p in psutil.Process(proc.pid).children(recursive=True)]
        if sum(t.startswith("VLLM::") for t in titles) == want:
            return proc
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"the tree's titles did not appear: {titles}")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_an_engine_tree_is_pinned_by_role_every_thread(tmp_path) -> None:
    proc = _engine_tree(tmp_path, 2)
    try:
        a, b = sorted(os.sched_getaffinity(0))[:2]
        # Each worker on the CPU the engine core does not have (two CPUs here).
        pl = cp.Placement(frontend=[a], core=[b], workers=[[a], [a]], driver=[a, b])
        found = cp.pin_engine(proc.pid, pl)
        assert found[str(proc.pid)]["role"] == "frontend"
        # Other children (multiprocessing's resource tracker) go with the frontend.
        roles = {v["role"]: int(pid) for pid, v in found.items() if v["role"] != "frontend"}
        roles["frontend"] = proc.pid
        # The workers are found below the engine core, as vLLM starts them.
        assert {"core", "worker0", "worker1"} <= set(roles)
        for role, want in (("frontend", {a}), ("core", {b}), ("worker0", {a}),
                           ("worker1", {a})):
            cpus = _thread_cpus(roles[role])
            assert len(cpus) >= 2 and all(c == want for c in cpus), (role, cpus)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_an_engine_whose_roles_are_not_all_found_is_left_to_the_scheduler(tmp_path,
                                                                          monkeypatch) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    a, b = allowed[0], allowed[-1]
    monkeypatch.setattr(cp, "plan", lambda tp, topo, f, c: (cp.Placement(
        frontend=[a], core=[b], workers=[], driver=allowed), ""))
    full = _engine_tree(tmp_path, 1)
    # A process with no engine core below it: vLLM's titles unreadable, say.
    bare = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        out = cp.apply(1, [("m/off", full.pid), ("m/bare", bare.pid)])
        assert out["mode"] == "scheduler" and "m/bare: no core found" in out["why"]
        assert out["engines"]["m/off"]["roles"] == ["core", "frontend"]
        # Both engines pinned while their roles were read, then every one of them back.
        for pid in (full.pid, bare.pid):
            assert all(c == set(allowed) for c in _thread_cpus(pid))
        assert _allowed(os.getpid()) == set(allowed)
    finally:
        for p in (full, bare):
            p.kill()
            p.wait()


def test_apply_on_a_host_too_small_pins_nothing_and_says_why(monkeypatch) -> None:
    monkeypatch.setattr(cp, "topology", lambda bus_ids: cp.Topology(
        allowed=[0, 1], cores=[[0], [1]], gpu_local=None, smt_visible=False))
    before = _allowed(os.getpid())
    # An engine whose CPUs someone chose: left as they are.
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        one = {min(before)}
        os.sched_setaffinity(engine.pid, one)
        out = cp.apply(1, [("m/off", engine.pid)])
        assert out["mode"] == "scheduler" and "left unpinned" in out["why"]
        assert _allowed(os.getpid()) == before and _allowed(engine.pid) == one
    finally:
        engine.kill()
        engine.wait()


def test_the_summary_says_where_the_engines_ran() -> None:
    import vllm_report

    pinned = {"mode": "pinned", "no_halt": list(range(16)),
              "placement": {"frontend": [1, 2], "core": [3, 4], "workers": [[5], [6]],
                            "driver": [0, *range(7, 16)]},
              "engines": {"m/off": {"roles": ["core", "frontend", "worker0"],
                                    "missing": ["worker1"]}}}
    line = vllm_report.overlap_lines({"cpu_placement": pinned})[0]
    assert "frontend [1, 2], engine core [3, 4], workers [[5], [6]]" in line
    assert "benchmark 10 CPUs" in line and "16 kept busy" in line
    assert "not found {'m/off': ['worker1']}" in line
    line = vllm_report.overlap_lines({"cpu_placement": {"mode": "scheduler", "why": "2 cores"}})
    assert line == ["CPUs: left to the scheduler (2 cores)"]
    line = vllm_report.overlap_lines({"cpu_placement": {
        "mode": "scheduler", "no_halt": [0], "no_halt_failed": {"7": "OSError: [Errno 22]"}}})
    assert line == ["CPUs: left to the scheduler; no CPU halts (1 kept busy); WARNING: busy "
                    "loops not started: {'7': 'OSError: [Errno 22]'}"]
    assert vllm_report.overlap_lines({}) == []


def test_the_probe_compares_the_scheduler_pinned_and_no_halt_placements(smt16) -> None:
    pytest.importorskip("vllm", reason="the probe builds its engines as bench_vllm.py does")
    import placement_probe

    got = placement_probe.placements(smt16)
    assert got["scheduler"] == (None, False) and got["scheduler, no halt"] == (None, True)
    one, _ = cp.plan(1, smt16, 1, 1)
    assert got["pinned 1+1"] == (one, False) and got["pinned 1+1, no halt"] == (one, True)
    assert got["pinned 2+2"][0].core == [6, 7]
    # Both roles on the engine core's CPU; then the two siblings of one core.
    assert got["one CPU"][0].frontend == got["one CPU"][0].core == one.core
    sib = got["SMT siblings"][0]
    assert sib.frontend[0] + 8 == sib.core[0] and not {*sib.frontend, *sib.core} & set(sib.driver)


def test_cpus_kept_busy_are_those_the_plan_gave_out_and_only_where_asked(monkeypatch) -> None:
    a, b = sorted(os.sched_getaffinity(0))[0], sorted(os.sched_getaffinity(0))[-1]
    # b stands for the idle SMT sibling of a pinned CPU: the plan gave it to nobody.
    placed = {"mode": "pinned", "placement": {"frontend": [a], "core": [a], "workers": [],
                                              "driver": [a]}}
    s = cp.keep_awake("on", placed, [a, b])
    try:
        assert s.cpus == [a] and placed["no_halt"] == [a] and len(s.procs) == 1
    finally:
        s.stop()
    unpinned = {"mode": "scheduler"}
    s = cp.keep_awake("on", unpinned, sorted({a, b}))
    try:
        assert unpinned["no_halt"] == sorted({a, b})
    finally:
        s.stop()
    monkeypatch.setattr(cp, "virtual_machine", lambda: False)
    assert cp.keep_awake("auto", {"mode": "scheduler"}, [a]) is None
    assert cp.keep_awake("off", {"mode": "scheduler"}, [a]) is None
    monkeypatch.setattr(cp, "virtual_machine", lambda: True)
    s = cp.keep_awake("auto", unpinned, [a])
    try:
        assert s is not None and s.cpus == [a]
    finally:
        s.stop()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_at_tp2_the_cpus_of_the_polling_processes_get_no_busy_loop() -> None:
    a, b = sorted(os.sched_getaffinity(0))[0], sorted(os.sched_getaffinity(0))[-1]
    pl = {"frontend": [a], "core": [b], "workers": [[b], [b]], "driver": [a]}
    placed = {"mode": "pinned", "placement": pl}
    s = cp.keep_awake("on", placed, [a, b], tp=2)
    try:
        assert s.cpus == [a] and placed["no_halt"] == [a]
    finally:
        s.stop()
    placed = {"mode": "pinned", "placement": pl}
    s = cp.keep_awake("on", placed, [a, b], tp=1)  # the same CPUs at TP=1: all of them
    try:
        assert s.cpus == [a, b]
    finally:
        s.stop()
    # Unpinned at TP=2, the polling processes may be on any CPU: no loop at all.
    unpinned = {"mode": "scheduler"}
    assert cp.keep_awake("on", unpinned, [a, b], tp=2) is None
    assert "no_halt" not in unpinned and "TP > 1" in unpinned["no_halt_why"]


def test_a_loop_that_cannot_start_is_left_out_and_says_why() -> None:
    import psutil

    a = sorted(os.sched_getaffinity(0))[0]
    absent = 1 << 14  # no such CPU
    placed = {"mode": "scheduler"}
    s = cp.keep_awake("on", placed, [a, absent])
    try:
        assert s.cpus == [a] and placed["no_halt"] == [a] and len(s.procs) == 1
        assert "Invalid argument" in placed["no_halt_failed"][str(absent)]
        # The loop that started runs on its CPU at the idle priority.
        p = psutil.Process(s.procs[0].pid)
        assert p.cpu_affinity() == [a] and os.sched_getscheduler(p.pid) == os.SCHED_IDLE
    finally:
        s.stop()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_the_engine_measured_sits_on_its_cpus_and_the_others_are_parked(tmp_path) -> None:
    a, b = sorted(os.sched_getaffinity(0))[:2]
    (tmp_path / "1").mkdir()
    (tmp_path / "2").mkdir()
    one, two = _engine_tree(tmp_path / "1", 2), _engine_tree(tmp_path / "2", 2)
    try:
        pl = cp.Placement(frontend=[a], core=[a], workers=[[a], [a]], driver=[a], park=[b])
        seats = cp.Seats({"mode": "pinned", "placement": pl.describe()},
                         {"m/off": one.pid, "m/off_aa": two.pid})
        assert seats.parks
        import psutil

        def cpus(proc):  # every thread of every process of an engine
            return {frozenset(c) for p in [proc.pid, *(q.pid for q in psutil.Process(
                proc.pid).children(recursive=True))] for c in _thread_cpus(p)}

        seats.park_all()
        assert cpus(one) == cpus(two) == {frozenset({b})}
        seats.take("m/off")
        assert cpus(one) == {frozenset({a})} and cpus(two) == {frozenset({b})}
        seats.leave("m/off")
        seats.take("m/off_aa")
        assert cpus(one) == {frozenset({b})} and cpus(two) == {frozenset({a})}
        # Nothing pinned, or no core left to park: nothing moves.
        for placed in ({"mode": "scheduler"},
                       {"mode": "pinned", "placement": {**pl.describe(), "park": []}}):
            still = cp.Seats(placed, {"m/off": one.pid})
            still.leave("m/off")
            assert not still.parks and cpus(one) == {frozenset({b})}
        # An engine gone meanwhile is passed over.
        gone = cp.Seats({"mode": "pinned", "placement": pl.describe()}, {"m/x": 2 ** 22 + 7})
        gone.take("m/x")
        gone.leave("m/x")
    finally:
        for proc in (one, two):
            proc.kill()
            proc.wait()
