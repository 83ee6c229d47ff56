"""The simulated group (``fusion_pass.selftest.sim_group``) and its suite on the CPU.

The suite's interpreter form runs the kernels at N = 2, 4 and 8 ranks, one
forked process per rank, in Triton's interpreter (CI's Triton 3.9 runs the
project's kernels there; 3.6's interpreter did not), with real waits between
the processes: the GPU suite's cases, smaller (``scripts/gpu_check_1gpu.sh``
runs them on one GPU).  The other tests here check the harness itself: the
co-residency cap, the budget it chooses with the backend's own geometry, the
launch arguments it compiles with, and the buffer provider.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from fusion_pass import gate
from fusion_pass.backends import Call, triton_symm
from fusion_pass.backends.triton_symm import SMBudget, buffers
from fusion_pass.groups import Group
from fusion_pass.testing.calls import make_call
from fusion_pass.quant import QuantSpec
from fusion_pass.selftest import sim_group
from fusion_pass.selftest.sim_group import SimError, fit_budget, resident_cap

ONE, TWO = gate.Path.ONE_STAGE, gate.Path.TWO_STAGE


def test_resident_cap_counts_every_rank_and_two_launches_in_flight():
    # 132 SMs holding one 32-warp program each: 8 ranks x 8 programs x 2 launches = 128.
    assert resident_cap(8, 132, 1) == 8
    assert 8 * resident_cap(8, 132, 1) * 2 <= 132 < 8 * (resident_cap(8, 132, 1) + 1) * 2
    assert resident_cap(2, 132, 4) == 132
    assert resident_cap(4, 114, 2) == 28


def _stand_in_provider(world: int, rank: int = 0) -> sim_group.RankBuffers:
    """A rank's provider whose buffers (CPU, never launched on) hold any call."""
    buf = buffers.SymmBuffer(tensor=torch.zeros(8, dtype=torch.int16),
                             peer_ptrs=torch.zeros(world, dtype=torch.int64),
                             state=torch.zeros(1, dtype=torch.int32), handle=None, rank=rank,
                             world_size=world, slot_bytes=1 << 30)
    provider = sim_group.RankBuffers(rank, lambda *a: "no growth here")
    provider.install(16, buf)
    provider.install(32, buf)
    return provider


def _occupancy(launcher) -> int:
    """A stand-in for the driver's answer: 2048 threads and 64K registers an SM,
    64 registers a thread (128 for rows of more than 16 elements a thread)."""
    threads = launcher.options["num_warps"] * 32
    regs = 64 if launcher.constexprs["BLOCK"] // threads <= 16 else 128
    return max(0, min(32, 2048 // threads, 65536 // (threads * regs)))


def _fit(world: int, call: Call, occupancy=_occupancy):
    """The budget fit_budget chooses for ``call`` with the backend's own geometry on
    132 SMs (nothing launched or compiled); its plan, the cap, the budget."""
    provider = _stand_in_provider(world)

    def attempt(budget):
        seen = budget if budget.sms is not None else SMBudget(sms=132)  # no device here
        be = triton_symm.TritonBackend(provider=provider, world_size=lambda g: world,
                                       sm_budget=seen, timeout_s=1.0)
        plan = be.prepare(call, -1)
        return plan, [(lau.grid, occupancy(lau)) for _, lau in plan.pieces]

    budget, cap, plan = fit_budget(world, 132, attempt)
    return plan, cap, budget


def _call(tokens: int, hidden: int, path, dtype=torch.bfloat16, quant=None) -> Call:
    x = torch.empty(tokens, hidden, dtype=dtype)
    return make_call(x, x, torch.ones(hidden, dtype=dtype), 1e-6, "sim", path, quant=quant)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("tokens,hidden,path", [
    (1, 8192, ONE), (8, 8192, ONE), (16, 8192, ONE), (80, 4096, ONE), (2048, 16384, ONE),
    (7, 2880, ONE), (2048, 8192, TWO), (81, 7168, TWO), (1, 128, TWO)])
def test_every_launch_fits_the_cap(world, tokens, hidden, path):
    """Whatever the shape, each launch of the chosen plan is within the cap of its
    own kernels, and the rows are all there (pieces cover the call)."""
    plan, cap, budget = _fit(world, _call(tokens, hidden, path))
    grids = [lau.grid for _, lau in plan.pieces]
    occupancy = min(_occupancy(lau) for _, lau in plan.pieces)
    assert max(grids) <= cap == resident_cap(world, 132, occupancy), (grids, cap, budget)
    firsts = [first for first, _ in plan.pieces]
    assert firsts[0] == 0 and firsts == sorted(set(firsts)) and firsts[-1] < tokens
    if budget.every_launch and path is ONE:
        assert all(f % triton_symm.ALIGN_ROWS == 0 for f in firsts)


def test_production_layouts_run_where_they_fit():
    """The layout the backend chooses for a GPU of its own is kept wherever every
    rank's programs fit: split rows whose parts own their columns, several tokens,
    at N = 8 (their parts have few warps, and many fit an SM)."""
    plan, cap, budget = _fit(8, _call(8, 8192, ONE))
    launcher = plan.pieces[0][1]
    assert not budget.every_launch and budget.sms is None
    assert (launcher.grid, launcher.constexprs["SPLIT"], launcher.constexprs["OWN"]) == (64, 8, True)
    # Whole rows of 32 warps do not fit at N = 8: pieces of the cap's rows.
    plan, cap, budget = _fit(8, _call(80, 8192, ONE))
    assert budget.every_launch and budget.sms == cap == 8
    assert [first for first, _ in plan.pieces] == list(range(0, 80, 8))


def test_a_gpu_too_small_for_the_group_is_refused():
    with pytest.raises(SimError, match="do not fit"):
        _fit(8, _call(80, 8192, ONE), occupancy=lambda lau: 0)


class _StackLimit:
    """A CUDA context's per-thread stack limit as the driver keeps it: 1 KiB at
    first, raised (never lowered) to what is asked."""

    def __init__(self) -> None:
        self.limit = 1024

    def get(self) -> int:
        return self.limit

    def raise_to(self, need: int) -> int:
        self.limit = max(self.limit, need)
        return self.limit


def _rank_of(launcher) -> int:
    """The ``rank`` argument a launcher passes its kernel."""
    rest = list(launcher.fn.arg_names)[len(triton_symm.PER_CALL):]
    runtime = [n for n in rest if n not in launcher.constexprs]
    return dict(zip(runtime, launcher.runtime_tail))["rank"]


def _group_without_cuda(world: int, monkeypatch) -> sim_group.GpuGroup:
    """A GpuGroup whose device is a stand-in: 132 SMs, CPU buffers that hold any
    call (no stream, nothing launched)."""
    from fusion_pass.backends.triton_symm import environment

    monkeypatch.setitem(environment._sm_count, -1, 132)
    group = object.__new__(sim_group.GpuGroup)
    group.world, group.name, group.timeout_s, group.device, group.sms = world, "sim", 10.0, -1, 132
    group.buffers = [_stand_in_provider(world, r) for r in range(world)]
    group.budget, group.cap, group.stack, group._stack_grew = SMBudget(), None, None, None
    group.group = Group("sim", world)
    group._backends, group._compiled = {}, {}
    return group


def test_prepare_sets_the_stack_every_ranks_kernel_needs_before_any_launch(monkeypatch):
    """Ranks' kernels differ in their per-thread stack (``rank`` is specialised),
    and a launch that needs more than the context's limit waits for the device
    while the ranks launched before it spin: n8-sweep-113 (7 x 16384 fp32 rows
    in two parts at N = 8) timed out so.  Its kernels' stacks compiled by
    Triton 3.6 for sm_90: 1208 bytes, rank 1's 1456; two programs of them fit an
    SM.  ``prepare`` leaves a limit that every rank's kernel fits, so no launch
    raises it."""
    stacks = {1: 1456}
    monkeypatch.setattr(sim_group, "compile_launcher", lambda launcher, head: launcher)
    monkeypatch.setattr(sim_group, "ctas_per_sm", lambda launcher: 2)
    context = _StackLimit()
    for name, stand_in in (("stack_bytes", lambda launcher: stacks.get(_rank_of(launcher), 1208)),
                           ("stack_limit", context.get), ("raise_stack_limit", context.raise_to)):
        monkeypatch.setattr(sim_group, name, stand_in, raising=False)
    group = _group_without_cuda(8, monkeypatch)
    x = torch.empty(7, 16384, dtype=torch.float32)
    calls = [make_call(x, None, torch.ones(16384), 1e-6, "sim", ONE) for _ in range(8)]
    plans = group.prepare(calls, calls)[0]
    first = plans[0].pieces[0][1]
    assert (first.grid, first.constexprs["SPLIT"], first.constexprs["OWN"]) == (14, 2, False)
    assert group.cap == 16 and group.budget == SMBudget(sms=16, every_launch=True)
    launched = [lau for plan in plans for _, lau in plan.pieces]
    assert [_rank_of(lau) for lau in launched] == list(range(8))
    assert all(stacks.get(_rank_of(lau), 1208) <= context.limit for lau in launched)
    assert group.stack == context.limit == 1456
    group._note_stack(1456)
    assert group._stack_grew is None
    context.limit = 2048  # a kernel the harness did not prepare raised it during the launches
    group._note_stack(1456)
    assert "grew from 1456 to 2048" in group._stack_grew


def test_a_case_whose_group_dies_keeps_what_it_was_launching(capsys):
    """A case announces its layout, cap and stack before its first launch: a group
    that dies in the launch (a device assertion) still tells what ran."""
    from fusion_pass.selftest import suite as sim_suite

    ran = {"layout": {"grid": 14, "split": 2, "own": False}, "cap": 16, "stack_bytes": 1456}
    sim_suite.announce("n8-sweep-113", ran)
    output = ("compiling\n" + capsys.readouterr().out
              + "lamport.py:85: block: [9,0,0] Assertion `timed out waiting` failed.\n")
    assert sim_suite.launched(output, "n8-sweep-113") == ran
    assert sim_suite.launched(output, "n8-sweep-112") == {}


def test_launch_heads_are_what_the_plan_passes():
    """The arguments the harness compiles with are those Plan.__call__ launches
    with: the call's own x, residual and weight, outputs of the plan's dtypes,
    each row piece's tensors starting at its first row."""
    spec = QuantSpec("per_token", reciprocal=True)
    provider = _stand_in_provider(2)
    be = triton_symm.TritonBackend(provider=provider, world_size=lambda g: 2,
                                   sm_budget=SMBudget(sms=12, every_launch=True), timeout_s=1.0)
    x = torch.randn(20, 256, dtype=torch.bfloat16)
    res = torch.randn(20, 256, dtype=torch.bfloat16)
    w = torch.ones(256, dtype=torch.float32)
    call = make_call(x, res, w, 1e-6, "sim", ONE, quant=spec, out_dtype=torch.float16)
    plan = be.prepare(call, -1)
    heads = sim_group.launch_heads(plan, call)
    launchers = {id(lau) for _, lau in plan.pieces}
    assert {id(lau) for lau, _ in heads} == launchers and len(heads) == len(launchers)
    first_of = {}
    for first, lau in plan.pieces:
        first_of.setdefault(id(lau), first)
    for lau, head in heads:
        first = first_of[id(lau)]
        assert len(head) == len(triton_symm.PER_CALL)
        xh, rh, wh, eps, mult, y, h, q, s, scale = head
        assert xh.data_ptr() == x.data_ptr() + first * 256 * 2
        assert rh.data_ptr() == res.data_ptr() + first * 256 * 2
        assert wh.data_ptr() == w.data_ptr() and eps == 1e-6 and mult == 1.0  # none: unread
        assert (y.dtype, h.dtype, q.dtype, s.dtype) == (
            torch.float16, torch.bfloat16, spec.dtype, torch.float32)


def test_rank_buffers_grow_as_the_real_provider_does():
    made = []

    def grow(rank, bits, slot_bytes):
        made.append((rank, bits, slot_bytes))
        return buffers.SymmBuffer(tensor=torch.zeros(1), peer_ptrs=torch.zeros(1),
                                  state=torch.zeros(1), handle=None, rank=rank, world_size=2,
                                  slot_bytes=slot_bytes)

    p = sim_group.RankBuffers(1, grow)
    mib = 1 << 20
    a = p.get("g", 16, torch.device("cpu"), 1000, 32 * mib)
    assert a.slot_bytes == mib and p.generation == 1
    assert p.get("g", 16, torch.device("cpu"), mib, 32 * mib) is a  # fits: no growth
    b = p.get("g", 16, torch.device("cpu"), mib + 1, 32 * mib)
    assert b.slot_bytes == 2 * mib and p.generation == 2 and p.retired == [a]
    assert p.get("g", 32, torch.device("cpu"), 10, 32 * mib).slot_bytes == mib  # fp32's own
    assert p.get("g", 16, torch.device("cpu"), 1 << 40, 32 * mib) is None  # above any slot
    assert made == [(1, 16, mib), (1, 16, 2 * mib), (1, 32, mib)]


def test_a_gpu_group_needs_a_hardware_queue_per_stream(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    with pytest.raises(SimError, match="at least 9"):
        sim_group.GpuGroup(8)


# ---------------------------------------------------------------- the suite, interpreted


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    out = tmp_path_factory.mktemp("sim")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
         os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "fusion_pass.selftest.suite", str(out),
                           "--interpret", "--worlds", "2", "4", "8"],
                          capture_output=True, text=True, env=env, timeout=900)
    with open(out / "sim_interpreted.json") as f:
        result = json.load(f)
    result["stdout"] = proc.stdout[-5000:] + proc.stderr[-5000:]
    return result


@pytest.mark.slow
def test_interpreted_suite_passes_at_2_4_and_8_ranks(interpreted):
    failed = [(c["id"], c["problems"]) for c in interpreted["cases"] if not c["pass"]]
    assert not failed, (failed, interpreted["stdout"])
    assert interpreted["provenance"]["versions"]["triton"]
    for world in (2, 4, 8):
        mine = [c for c in interpreted["cases"] if c["world"] == world]
        kinds = {c["kind"] for c in mine}
        assert kinds == {"call", "back_to_back", "growth", "late", "never", "remake"}, kinds
        calls = [c for c in mine if c["kind"] == "call"]
        assert {c["path"] for c in calls} == {"one_stage", "two_stage"}
        quant = {QuantSpec.decode(c["quant"]).mode for c in calls if c["quant"]}
        assert quant == {"static", "per_token", "per_group"}
        assert all(c["max_error"] <= 1.0 for c in mine)
    # A scalar multiplier (a literal, a tensor of the model dtype, an fp32 one) at N = 2.
    multipliers = {c.get("multiplier") for c in interpreted["cases"] if c["world"] == 2}
    assert {"literal", "tensor", "tensor32"} <= multipliers, multipliers


@pytest.mark.slow
def test_interpreted_suite_waits_for_a_late_rank_and_fails_a_missing_one(interpreted):
    for c in interpreted["cases"]:
        if c["kind"] == "late":
            assert c["seconds"] >= c["late_by_s"], c
        if c["kind"] == "never":
            assert c["seconds"] >= c["wait_bound_s"] and "timed out waiting" in c["error"], c
        if c["kind"] == "growth":
            before, after = c["generations"]
            assert all(b > a for a, b in zip(before, after)), c


# ---------------------------------------------------------------- a group made again


def test_rank_buffers_serve_the_group_asked_for():
    """A provider asked for another group (one made again under the name) puts the
    old group's buffers aside and grows the new one's, as ``buffers.get`` does."""
    made = []

    def grow(rank, bits, slot_bytes):
        made.append(slot_bytes)
        return buffers.SymmBuffer(tensor=torch.zeros(1), peer_ptrs=torch.zeros(1),
                                  state=torch.zeros(1), handle=None, rank=rank, world_size=2,
                                  slot_bytes=slot_bytes)

    old, new = Group("sim", 2), Group("sim", 4)
    p = sim_group.RankBuffers(0, grow)
    mib = 1 << 20
    a = p.get(old, 16, torch.device("cpu"), 1000, 32 * mib)
    assert p.get(old, 16, torch.device("cpu"), 1000, 32 * mib) is a and p.generation == 1
    b = p.get(new, 16, torch.device("cpu"), 1000, 32 * mib)
    assert b is not a and p.ended == [a] and p.current == {16: b} and p.group is new
    assert p.generation == 3 and len(made) == 2


def _stale_state(size: int) -> dict:
    return {"groups": [("sim", 2, True), ("sim", size, False)], "plans": 1,
            "plans_of_ended": 2, "timeouts_of_ended": 1, "plan_worlds": [2, size],
            "provider_serves_group": False, "buffer_worlds": [2], "tables": [[11, 12]],
            "ended_buffers": 0, "generation": 1, "provider": (1, 0)}


def test_the_remake_checks_name_what_an_ended_group_left():
    from fusion_pass.selftest import remake

    problems = remake.state_problems(4, [_stale_state(4)] * 4, [((1, 0), [11, 12])])
    text = "\n".join(problems)
    for fragment in ("keeps 2 plans and 1 wait bounds of an ended group",
                     "keeps state of other groups", "of world sizes [2, 4]",
                     "buffers of world sizes [2], for another group",
                     "a peer table of 2 addresses", "a peer table of the group before"):
        assert fragment in text, (fragment, problems)
    clean = dict(_stale_state(4), groups=[("sim", 4, False)], plans_of_ended=0,
                 timeouts_of_ended=0, plan_worlds=[4], provider_serves_group=True,
                 buffer_worlds=[4], tables=[[21, 22, 23, 24]])
    assert remake.state_problems(4, [clean] * 4, [((1, 0), [11, 12])]) == []
    # The same addresses in another provider (a new rank's worker) are a fresh buffer.
    again = dict(clean, tables=[[11, 12, 13, 14]])
    assert remake.state_problems(4, [again] * 4, [((1, 1), [11, 12, 13, 14])]) == []
    assert "a peer table of the group before" in "\n".join(
        remake.state_problems(4, [again] * 4, [((1, 0), [11, 12, 13, 14])]))
    assert "3 ranks answered, not 4" in remake.state_problems(4, [clean] * 3, [])[0]


def test_remake_cases_follow_the_suites_contract():
    from fusion_pass.selftest import remake, suite

    for form in ("gpu", "interpret"):
        for world in (2, 4, 8):
            cs = remake.cases(form, world)
            assert [c["id"] for c in cs] == [f"n{world}-remake-{i}" for i in range(len(cs))]
            for c in cs:
                assert c["kind"] == "remake" and c["world"] == world
                assert c["sizes"][0] == c["sizes"][-1] == world and len(c["sizes"]) >= 2
                assert set(c["sizes"]) <= triton_symm.LIMITS.world_sizes
                assert suite.describe(c)["kind"] == "remake"
            assert {len(set(c["sizes"])) for c in cs} == {1, 2}  # same size, another size


_REMAKE_SCRIPT = """
import json, sys
from fusion_pass.selftest import remake
from fusion_pass.selftest.sim_group import InterpretedGroup

out = []
world = int(sys.argv[1])
group = InterpretedGroup(world, timeout_s=30.0)
try:
    for case in remake.cases("interpret", world):
        out.append({"id": case["id"], "sizes": case["sizes"],
                    "result": remake.run_remake(group, case, True)})
    out.append({"world_after": group.world, "kept": group.inspect()})
finally:
    group.close()
print(json.dumps(out, default=str))
"""


@pytest.fixture(scope="module")
def remade():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _REMAKE_SCRIPT, "2"], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_interpreted_group_remade_with_another_size_and_the_same(remade):
    """N = 2 remade with 4 ranks and back, and with 2 ranks again: every call right
    on every rank, each rank keeping nothing of the groups that ended, the
    buffers new (new peer tables) at every remake."""
    runs = [r for r in remade if "result" in r]
    assert [r["sizes"] for r in runs] == [[2, 4, 2], [2, 2]]
    for r in runs:
        res = r["result"]
        assert res["problems"] == [] and res["max_error"] <= 1.0, r
        assert [lay.get("declined") for lay in res["layouts"]] == [None] * len(r["sizes"])
        for st in res["kept"]:
            assert st["groups"] == [["sim", 2, False]] and st["plan_worlds"] == [2], st
            assert st["ended_buffers"] > 0  # the ended groups' buffers put aside
    last = remade[-1]
    assert last["world_after"] == 2 and len(last["kept"]) == 2
