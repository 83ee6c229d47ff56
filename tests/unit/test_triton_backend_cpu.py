"""The Triton backend without a GPU: import, limits, size classes, decline rules, fallback."""

from __future__ import annotations

import subprocess
import sys
from typing import Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusion_pass.selftest import kernel_checks
from fusion_pass.testing.spawn import run_ranks
from fusion_pass import backends, gate
from fusion_pass.backends import triton_symm
from fusion_pass.backends.triton_symm import buffers
from fusion_pass.spec import NormSpec
from fusion_pass.testing.calls import make_call

MiB = 1 << 20


def test_imports_without_cuda_or_triton_kernels():
    code = ("import sys, fusion_pass.backends.triton_symm as t; b = t.TritonBackend(); "
            "print(b.name, 'fusion_pass.backends.triton_symm.one_stage' in sys.modules, "
            "'fusion_pass.backends.triton_symm.two_stage' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}, check=True)
    assert out.stdout.split() == ["triton", "False", "False"]


def test_registry_builds_the_backend_with_its_limits():
    be = backends.get("triton")
    assert isinstance(be, triton_symm.TritonBackend)
    assert be.name == "triton" and be.limits is triton_symm.LIMITS
    assert be.limits.world_sizes == {2, 4, 8}
    assert be.limits.dtypes == {"bfloat16", "float16", "float32"}
    assert be.limits.max_bytes is None  # larger calls run as row pieces (test_triton_pieces_cpu)


def test_empty_marker_is_each_dtypes_negative_zero():
    for dtype, bits in ((torch.bfloat16, 16), (torch.float16, 16), (torch.float32, 32)):
        neg0 = torch.tensor([-0.0], dtype=dtype).view(buffers.int_dtype(bits))
        assert int(neg0) == buffers.negative_zero_bits(bits)
        assert int(torch.tensor([0.0], dtype=dtype).view(buffers.int_dtype(bits))) == 0


@pytest.mark.parametrize("hidden,dtype,world,path,fragment", [
    (4096, torch.float64, 2, gate.Path.ONE_STAGE, "dtype"),
    (4096, torch.bfloat16, 3, gate.Path.ONE_STAGE, "world size 3"),
    (4096, torch.bfloat16, 2, gate.Path.UNFUSED, "not a kernel path"),
    (100, torch.bfloat16, 2, gate.Path.TWO_STAGE, "16-byte"),
    (20000, torch.bfloat16, 2, gate.Path.TWO_STAGE, "16384-element"),
])
def test_decline_reasons(hidden, dtype, world, path, fragment):
    why = triton_symm.LIMITS.supports(hidden, dtype, world, path)
    assert why is not None and fragment in why


@pytest.mark.parametrize("hidden,dtype", [
    (128, torch.bfloat16), (2880, torch.float16), (8192, torch.bfloat16), (4096, torch.float32),
    (16384, torch.bfloat16), (8192, torch.float32)])
def test_kernel_rows_are_taken(hidden, dtype):
    for world in (2, 4, 8):
        for path in (gate.Path.ONE_STAGE, gate.Path.TWO_STAGE):
            assert triton_symm.LIMITS.supports(hidden, dtype, world, path) is None


def test_run_declines_cpu_tensors():

    x = torch.randn(4, 128)
    why = triton_symm.TritonBackend().run(
        make_call(x, None, torch.ones(128), 1e-6, "0", gate.Path.ONE_STAGE))
    assert isinstance(why, str) and "CUDA device" in why


class _Provider:
    """A buffer provider (``TritonBackend(provider=...)``) answering ``answer``
    and recording what it was asked."""

    generation = 0

    def __init__(self, answer) -> None:
        self.answer, self.asked = answer, []

    def get(self, *args):
        self.asked.append(args)
        return self.answer


def test_a_refused_buffer_declines_the_shape_once():
    """A buffer that failed ``buffers.arm`` on some rank: the call declines with
    that reason, and later calls of the shape do not try to allocate again
    (every rank refused together, so every rank falls back alike)."""

    refused = "a new symmetric buffer failed its check on some rank: " + buffers.FAULTS[2]
    provider = _Provider(refused)
    asked = provider.asked
    be = triton_symm.TritonBackend(provider=provider, world_size=lambda name: 2)
    call = make_call(torch.randn(4, 128), None, torch.ones(128), 1e-6, "0", gate.Path.ONE_STAGE)
    assert be.run_on(call, -1) == refused
    assert be.run_on(call, -1) == refused
    assert len(asked) == 1


def _plan_of(tokens: int, hidden: int, path, budget, world: int = 8, quant=None):
    """The plan a backend with ``budget`` makes for a bf16 call (nothing launched)."""
    buf = buffers.SymmBuffer(tensor=torch.zeros(8, dtype=torch.int16),
                             peer_ptrs=torch.zeros(world, dtype=torch.int64),
                             state=torch.zeros(1, dtype=torch.int32), handle=None, rank=3,
                             world_size=world, slot_bytes=1 << 30)
    be = triton_symm.TritonBackend(provider=_Provider(buf), world_size=lambda g: world,
                                   sm_budget=budget, timeout_s=1.0)
    x = torch.zeros(tokens, hidden, dtype=torch.bfloat16)
    plan = be.prepare(make_call(x, x, torch.ones(hidden, dtype=torch.bfloat16), 1e-6, "g", path,
                                quant=quant), -1)
    assert isinstance(plan, triton_symm.Plan), plan
    return plan


def test_sm_budget_sizes_the_grids():
    """The budget's SMs take the place of the device's in every grid rule: the
    two-stage grid, a split row's parts."""
    one, two = gate.Path.ONE_STAGE, gate.Path.TWO_STAGE
    budget = triton_symm.SMBudget(sms=12)
    assert budget.count(0) == 12
    assert [lau.grid for _, lau in _plan_of(80, 4096, two, budget).pieces] == [12]
    assert [lau.grid for _, lau in _plan_of(2, 8192, one, budget).pieces] == [12]  # split 6
    # Without every_launch a one-stage call of whole rows is one launch of any size.
    assert [lau.grid for _, lau in _plan_of(80, 4096, one, budget).pieces] == [80]


def test_sm_budget_every_launch_cuts_one_stage_calls_into_resident_pieces():
    """``every_launch``: no launch exceeds the budget; pieces start at multiples of
    ALIGN_ROWS rows (FP8 codes and scales stay 16-byte aligned) and cover every row."""
    from fusion_pass.quant import QuantSpec

    one = gate.Path.ONE_STAGE
    for sms, tokens, quant in ((12, 81, None), (9, 7, QuantSpec("per_token")), (64, 200, None),
                               (4, 5, QuantSpec("per_group", group=128))):
        plan = _plan_of(tokens, 4096, one, triton_symm.SMBudget(sms=sms, every_launch=True),
                        quant=quant)
        firsts = [first for first, _ in plan.pieces]
        rows = triton_symm.resident_rows(sms)
        assert firsts == list(range(0, tokens, rows)), (sms, tokens, firsts)
        assert rows % triton_symm.ALIGN_ROWS == 0 and rows <= sms
        assert all(lau.grid <= sms for _, lau in plan.pieces), (sms, tokens)
    # A small call keeps the layout the budget allows it: 2 rows of 6 parts in 12 programs.
    plan = _plan_of(2, 8192, one, triton_symm.SMBudget(sms=12, every_launch=True))
    assert [(lau.grid, lau.constexprs["SPLIT"]) for _, lau in plan.pieces] == [(12, 6)]


def test_gate_with_the_backend_limits():
    lim = triton_symm.LIMITS
    assert gate.decide(8192, torch.bfloat16, 2, 8, limits=lim).path is gate.Path.ONE_STAGE
    assert gate.decide(8192, torch.bfloat16, 2, 2048, limits=lim,
                       threshold=80).path is gate.Path.TWO_STAGE
    assert gate.decide(8192, torch.bfloat16, 2, 4096, limits=lim).fused  # in row pieces
    assert gate.decide(4096, torch.bfloat16, 3, 8, limits=lim).path is gate.Path.UNFUSED
    # One block holds 16384 elements: wide rows take one-stage, wider ones two-stage.
    assert gate.decide(16384, torch.bfloat16, 2, 1, limits=lim,
                       threshold=80).path is gate.Path.ONE_STAGE


def test_the_committed_schedule_is_what_the_gate_reads():
    """``fusion_pass/data/triton_schedule.json`` (written by benchmarks/op/crossover.py from a
    bench_op.py run) is the backend's schedule wherever no threshold is forced."""
    import json

    from fusion_pass import schedules

    table = json.loads(schedules.path_of("triton").read_text())
    assert schedules.parse(table) == triton_symm.LIMITS.schedules != ()
    for entry in table["schedules"]:
        last = 0
        for up, path in entry["steps"]:
            n, last = (up, up) if up is not None else (last + 1, last)
            d = gate.decide(entry["hidden"], entry["dtype"], entry["world_size"], n,
                            limits=triton_symm.LIMITS)
            assert d.path.value == path and "measured schedule" in d.reason, (entry["hidden"], n, d)


def test_slot_needs():
    row = 4096 * 2
    assert buffers.one_stage_need(80, row, 2) == 2 * 80 * row
    # 7 tokens on 4 ranks: chunks of 2 rows (the last rank owns 1), 4 mailbox chunks + 7 rows.
    assert buffers.two_stage_need(7, row, 4) == (4 * 2 + 7) * row
    assert buffers.two_stage_need(1, row, 8) == (8 + 1) * row  # ranks 1..7 own nothing


def test_size_classes():
    cap = buffers.max_slot_bytes(triton_symm.MAX_INPUT_BYTES)
    assert buffers.size_class(1, triton_symm.MAX_INPUT_BYTES) == MiB
    assert buffers.size_class(MiB + 1, triton_symm.MAX_INPUT_BYTES) == 2 * MiB
    assert buffers.size_class(64 * MiB, triton_symm.MAX_INPUT_BYTES) == 64 * MiB
    assert buffers.size_class(64 * MiB + 1, triton_symm.MAX_INPUT_BYTES) == cap
    assert buffers.size_class(cap + 1, triton_symm.MAX_INPUT_BYTES) is None


@settings(max_examples=300, deadline=None)
@given(hidden_packs=st.integers(1, 2048), tokens=st.integers(1, 4096),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       world=st.sampled_from([2, 4, 8]),
       path=st.sampled_from([gate.Path.ONE_STAGE, gate.Path.TWO_STAGE]))
def test_every_taken_call_fits_a_slot(hidden_packs, tokens, dtype, world, path):
    """Whatever passes the decline rules gets a buffer: one launch's rows fit a slot."""
    hidden = hidden_packs * (16 // torch.tensor([], dtype=dtype).element_size())
    if triton_symm.LIMITS.supports(hidden, dtype, world, path) is not None:
        return
    rows = min(tokens, triton_symm.rows_per_launch(path, hidden, dtype.itemsize, world))
    need = triton_symm.slot_need(path, rows, hidden, dtype, world)
    cls = buffers.size_class(need, triton_symm.MAX_INPUT_BYTES)
    assert cls is not None and need <= cls
    assert cls % (16 * 4) == 0  # whole 16-byte vectors of either element width


def test_one_stage_warps_by_shape_class():
    w = triton_symm.one_stage_warps
    cap = triton_symm.ONE_STAGE_MAX_WARPS
    assert cap < 32
    assert w(32, 8192, 128, 132, 0) == 32      # 8192 x 128: one wave keeps 32
    assert w(32, 8192, 512, 132, 0) == cap     # 8192 x 512: waves of 32 lose
    assert w(32, 8192, 512, 132, 1) == 32      # ... but not with an FP8 epilogue
    assert w(32, 16384, 1, 132, 0) == cap      # wide rows spill with 32
    assert w(32, 16384, 1, 132, 3) == cap
    assert w(8, 2048, 512, 132, 0) == 8        # never raised


def test_num_warps():
    assert triton_symm.num_warps(128, 2) == 4
    assert triton_symm.num_warps(4096, 2) == 16
    assert triton_symm.num_warps(8192, 2) == 32
    assert triton_symm.num_warps(8192, 4) == 32


def test_one_stage_split_and_parts():
    # About 2 KiB per part, at most 8, while the grid stays small and within the SMs.
    assert triton_symm.one_stage_split(1, 2880, 2, 132) == 2
    assert triton_symm.one_stage_split(1, 8192, 2, 132) == 8
    assert triton_symm.one_stage_split(1, 16384, 2, 132) == 8
    assert triton_symm.one_stage_split(8, 16384, 2, 132) == 4
    assert triton_symm.one_stage_split(3, 7168, 2, 132) == 7
    assert triton_symm.one_stage_split(80, 8192, 2, 132) == 1
    assert triton_symm.one_stage_split(1, 512, 2, 132) == 1
    assert triton_symm.one_stage_split(2, 8192, 2, 4) == 2
    for hidden, split, elem in ((7168, 5, 2), (7168, 7, 2), (12288, 8, 2), (384, 4, 2),
                                (8192, 4, 4)):
        part = triton_symm.part_elems(hidden, split, elem)
        assert part % (16 // elem) == 0  # parts start on 16-byte vectors
        assert (split - 1) * part < hidden <= split * part  # every part holds columns


def test_parts_own_their_columns_where_it_was_measured_to_pay():
    def layout(hidden, tokens, quant=0, group=128, elem=2):
        return triton_symm.one_stage_layout(tokens, hidden, elem, 132, quant, group)

    # Rows split over up to 64 programs where the parts then own their columns...
    assert layout(8192, 1)[::2] == (8, True) and layout(16384, 1)[::2] == (8, True)
    assert layout(7168, 4)[::2] == (7, True)
    assert layout(7168, 8)[::2] == (7, True) and layout(16384, 8)[::2] == (8, True)
    assert layout(8192, 16)[::2] == (4, True) and layout(12288, 16)[::2] == (4, True)
    # ...else over up to 32, reading the whole row.
    assert layout(4096, 1)[::2] == (4, False)  # 6 KiB of other columns per part
    assert layout(4096, 16)[::2] == (2, False)
    assert layout(7168, 16)[::2] == (2, False)  # 4 parts: 10.5 KiB each
    assert layout(8192, 80)[::2] == (1, False)  # a whole row per program
    assert layout(8192, 1, quant=2)[::2] == (8, False)  # a per-token scale needs the amax
    assert layout(8192, 1, quant=3, group=128)[2]
    assert not layout(8192, 1, quant=3, group=4096)[2]  # groups straddling parts
    for hidden, tokens in ((7168, 8), (16384, 8), (8192, 16), (4096, 16), (2880, 1)):
        split, part, own = layout(hidden, tokens)
        assert tokens * split <= (64 if own else 32)


def test_quant_the_kernels_cannot_compute_goes_to_the_op():
    from fusion_pass.quant import QuantSpec

    assert triton_symm.quant_decline(QuantSpec("per_group", group=128), 7168) is None
    assert triton_symm.quant_decline(QuantSpec("per_token"), 2880) is None
    assert "power of two" in triton_symm.quant_decline(QuantSpec("per_group", group=96), 2880)
    assert "240" in triton_symm.quant_decline(
        QuantSpec("per_token", fp8_dtype="float8_e4m3fnuz", qmax=448.0), 4096)
    assert triton_symm.quant_decline(
        QuantSpec("per_token", fp8_dtype="float8_e4m3fnuz", qmax=224.0), 4096) is None


def test_quant_constants_are_torchs_fp32_values():
    from fusion_pass.quant import QuantSpec

    c = triton_symm.quant_constexprs(QuantSpec("per_token", scale_floor=1 / (448 * 512),
                                               reciprocal=True))
    assert c["QUANT"] == 2 and c["RECIP"] is True and c["FNUZ"] is False
    assert c["INV_QMAX"] == float(torch.tensor(1.0) / torch.tensor(448.0))
    assert c["FLOOR"] == float(torch.tensor(1 / (448 * 512), dtype=torch.float32))
    assert triton_symm.quant_constexprs(None)["QUANT"] == 0
    # UE8M0 group scales are a mode of their own; the layout is in the strides alone.
    ue8m0 = QuantSpec("per_group", group=128, scale_floor=1e-10, scale_layout="col_tma",
                      ue8m0=True)
    assert triton_symm.quant_constexprs(ue8m0)["QUANT"] == 4
    assert triton_symm.quant_constexprs(QuantSpec("per_group", group=128,
                                                  scale_layout="col"))["QUANT"] == 3


def _timeouts(rank: int, world: int):
    import datetime
    import os

    import torch.distributed as dist

    g = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=77))
    os.environ.pop("FUSION_PASS_TIMEOUT_S", None)
    default = triton_symm.TritonBackend().timeout_ns(g.group_name)
    os.environ["FUSION_PASS_TIMEOUT_S"] = "1.5"
    override = triton_symm.TritonBackend().timeout_ns(g.group_name)
    return default, override


def test_wait_bound_is_the_groups_timeout_unless_overridden():
    for default, override in run_ranks(_timeouts, 2):
        assert default == 77_000_000_000
        assert override == 1_500_000_000


def _offsets_of_every_rank(rank: int, world: int):
    import torch.distributed as dist

    # Rank r's buffer sits 4096 * (r + 1) bytes past its own base.
    offsets = buffers.all_ranks(4096 * (rank + 1), dist.group.WORLD.group_name)
    bases = [1 << 40, 2 << 40, 3 << 40][:world]  # as rendezvous reports them here
    return buffers.peer_addresses(bases, offsets)


def test_peer_addresses_use_each_ranks_own_offset():
    """Every rank computes the same table, each peer at its base plus the
    offset that peer published (not this rank's own)."""
    got = run_ranks(_offsets_of_every_rank, 3)
    want = [(1 << 40) + 4096, (2 << 40) + 8192, (3 << 40) + 12288]
    assert got == [want] * 3, got


def test_ranks_sharing_a_gpu_get_no_buffer_and_are_told_which():
    from fusion_pass.topology import RankFacts, group_decline

    gpus = ["GPU-a", "GPU-b", "GPU-c"]
    facts = [RankFacts("h", g, i, tuple(gpus)) for i, g in enumerate(gpus)]
    assert group_decline(facts) is None
    why = group_decline(facts + [RankFacts("h", "GPU-b", 1, tuple(gpus))])
    assert why is not None and why.startswith("ranks 1 and 3 share one GPU"), why


def test_launcher_splits_arguments_by_kind():
    from fusion_pass.backends.triton_symm.launch import Launcher
    from fusion_pass.backends.triton_symm.one_stage import one_stage_kernel

    names = list(one_stage_kernel.arg_names)
    k = len(triton_symm.PER_CALL)
    per_call = tuple(names[:k])
    assert per_call == triton_symm.PER_CALL  # the kernels' leading parameters, in order
    values = {name: i for i, name in enumerate(names[k:])}
    values["local_ptr"] = torch.zeros(2)
    lau = Launcher(one_stage_kernel, 4, per_call, values, {})
    assert lau.tail[0] == values["local_ptr"].data_ptr()  # plan tensors go as addresses
    assert len(lau.tail) == len(names) - k
    assert set(lau.constexprs) == {k for k in names if k.isupper()}
    assert len(lau.runtime_tail) + len(lau.constexprs) == len(lau.tail)
    with pytest.raises(AssertionError):
        Launcher(one_stage_kernel, 4, ("y_ptr",), values, {})


def _forced_triton_on_cpu(rank: int, world: int):
    import logging

    import torch.distributed as dist

    import fusion_pass
    from fusion_pass.backends import reference

    fusion_pass.backends.set_backend("triton")
    records = []
    handler = logging.Handler()
    handler.emit = lambda rec: records.append(rec.getMessage())
    logging.getLogger("fusion_pass").addHandler(handler)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(3, 64, generator=g)
    r = torch.randn(3, 64, generator=torch.Generator().manual_seed(9))
    w = torch.randn(64, generator=torch.Generator().manual_seed(8))
    gname = dist.group.WORLD.group_name
    y, h = fusion_pass.fused_allreduce_rmsnorm(x, w, 1e-6, gname, residual=r, path="one_stage")
    ry, rh = reference.add_rms_norm(reference.all_reduce(x, gname), r, w, NormSpec(eps=1e-6))
    return torch.equal(y, ry) and torch.equal(h, rh), records


def test_op_falls_back_once_when_triton_declines():
    for ok, logs in run_ranks(_forced_triton_on_cpu, 2):
        assert ok
        assert len([m for m in logs if "triton backend falls back" in m]) == 1, logs


# ---------------------------------------------------------------- the kernels, interpreted
#
# Triton's interpreter runs the kernels on the CPU.  Here one simulated rank's
# launch runs with its peers' pushes already in its mailboxes, and its own pushes
# land in its peers' buffers: indexing, encoding, the deferred and immediate
# re-arming, the slot counter, the norm and every FP8 epilogue are checked,
# through the backend's own plan and launcher, and split rows whose parts
# exchange sums of squares (the interpreter runs a launch's programs one after
# another, so live ranks cannot split rows: tests/unit/test_sim_group_cpu.py runs
# every rank live, whole rows).


def _scale_oracle(y: torch.Tensor, spec) -> torch.Tensor:
    """Group scales in float64 from ``y``: ``max(amax / qmax, floor)``, for UE8M0 the
    next power of two (exact in float64); ``[tokens, groups]``."""
    amax = y.double().unflatten(-1, (-1, spec.group)).abs().amax(-1)
    s = (amax / spec.qmax).clamp(min=spec.scale_floor)
    return torch.exp2(torch.ceil(torch.log2(s))) if spec.ue8m0 else s


class _SimRank:
    """Rank ``rank`` of ``world`` simulated ranks (``sim_group.buffer_set``): its
    buffer, and its peers' buffers, into which its kernels push."""

    SLOT = 8192

    def __init__(self, world: int, rank: int, dtype: torch.dtype) -> None:
        from fusion_pass.selftest import sim_group

        bits = 8 * torch.tensor([], dtype=dtype).element_size()
        self.world, self.rank, self.neg0 = world, rank, buffers.negative_zero_bits(bits)
        self.int_dtype = buffers.int_dtype(bits)
        bufs = sim_group.buffer_set(world, bits, self.SLOT * bits // 8, torch.device("cpu"),
                                    arm=False)
        self.buf = bufs[rank]
        self.local = self.buf.tensor
        self.peers = {p: bufs[p].tensor for p in range(world) if p != rank}
        self.provider = sim_group.RankBuffers(rank, lambda *a: "one buffer only")
        self.provider.install(bits, self.buf)

    def enc(self, t: torch.Tensor) -> torch.Tensor:
        b = t.contiguous().view(self.int_dtype).flatten().clone()
        b[b == self.neg0] = 0
        return b

    def run(self, call, **patches):
        """``call`` through a fresh backend's plan and launcher on this rank's buffers,
        with the attributes ``patches`` of ``triton_symm``'s geometry set
        meanwhile: (outputs, backend)."""
        from fusion_pass.backends.triton_symm import geometry

        be = triton_symm.TritonBackend(provider=self.provider, world_size=lambda g: self.world,
                                       sm_budget=triton_symm.SMBudget(sms=132), timeout_s=1.0)
        saved = {k: getattr(geometry, k) for k in patches}
        try:
            for k, v in patches.items():
                setattr(geometry, k, v)
            out = be.run_on(call, -1)
        finally:
            for k, v in saved.items():
                setattr(geometry, k, v)
        assert not isinstance(out, str), out
        return out, be

    def prefill(self, path, slot: int, xs: list, h_exp: torch.Tensor, split: int = 1) -> None:
        """What the peers push for one launch of ``xs[s]``'s rows into ``slot`` (and,
        one-stage, the sibling parts' sums of squares exchange_sum reads: the
        interpreter runs one part at a time, so none of them could wait for another)."""
        W, r = self.world, self.rank
        n, H = xs[0].shape
        base = slot * self.SLOT
        if path is gate.Path.ONE_STAGE:
            for s in self.peers:
                self.local[base + s * n * H:base + (s + 1) * n * H] = self.enc(xs[s])
            part = triton_symm.part_elems(H, split, xs[0].element_size())
            for t in range(n):
                for p in range(split):
                    hp = h_exp[t, p * part:(p + 1) * part].float()
                    self.buf.state[buffers.partial_index(slot, t, p)] = \
                        (hp * hp).sum().view(torch.int32)
            return
        chunk = -(-n // W)
        start = r * chunk
        owned = max(min(n, start + chunk) - start, 0)
        for i in range(owned):
            for s in self.peers:
                o = base + (s * chunk + i) * H
                self.local[o:o + H] = self.enc(xs[s][start + i])
        gather = base + W * chunk * H
        for t in range(n):
            if not start <= t < start + owned:
                self.local[gather + t * H:gather + (t + 1) * H] = self.enc(h_exp[t])


def _expected_h(xs: list[torch.Tensor], res: Optional[torch.Tensor],
                multiplier=None) -> torch.Tensor:
    """``h`` with the graph's roundings, as the interpreter rounds; a multiplier by its
    fp32 value (a literal rounded to it, as torch rounds a Python number)."""
    if isinstance(multiplier, torch.Tensor):
        multiplier = float(multiplier.float())
    elif multiplier is not None:
        multiplier = float(torch.tensor(multiplier, dtype=torch.float32))
    return kernel_checks.rank_order_h(xs, res, interpreted=True, multiplier=multiplier)


def _interpret_case(sim: _SimRank, path, n, hidden, dtype, seed, split=1, residual=True,
                    gemma=False, eps=1e-6, wdtype=None, out_dtype=None, quant=None, scale=None,
                    emit_y=True, own=False, round_normed=False, multiplier=None) -> dict:
    """One call on ``sim``; ``own``: a split row's parts own their columns however
    narrow the row and however few its parts (the backend does that from
    ``OWN_MIN_BYTES`` of other columns and ``OWN_MIN_PARTS`` parts)."""
    from fusion_pass.quant import quantize

    W, r, H = sim.world, sim.rank, hidden
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, H, generator=g).to(dtype) for _ in range(W)]
    xs[0][0, :3] = torch.tensor([-0.0, 0.0, 1.0])  # negative zero must travel as zero
    res = torch.randn(n, H, generator=g).to(dtype) if residual else None
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(wdtype or dtype)
    h_exp = _expected_h(xs, res, multiplier)

    slot = int(sim.buf.state[0]) & 3
    base = slot * sim.SLOT
    sim.prefill(path, slot, xs, h_exp, split)

    call = make_call(xs[r], res, w, eps, "sim", path, gemma=gemma, out_dtype=out_dtype,
                     quant=quant, scale=scale, emit_y=emit_y, round_normed=round_normed,
                     multiplier=multiplier)
    out, be = sim.run(call, one_stage_split=lambda *a: split,
                      OWN_MIN_BYTES=0 if own else triton_symm.OWN_MIN_BYTES,
                      OWN_MIN_PARTS=0 if own else triton_symm.OWN_MIN_PARTS)
    ran = next(iter(be._plans.values())).pieces[0][1]
    own_ran = bool(ran.constexprs.get("OWN", False))

    case = dict(path=path.value, seed=seed, n=n, hidden=H, dtype=str(dtype), split=split,
                rank=r, world=W, multiplied=multiplier is not None, grid=ran.grid,
                quant=quant.mode if quant else None, own=own_ran, h_ok=torch.equal(out.h, h_exp))
    if multiplier is not None:  # h against float64: the rounded sum times c (+ r)
        c = float(multiplier.float()) if isinstance(multiplier, torch.Tensor) else multiplier
        h64 = sum(x.double() for x in xs) * c + (res.double() if res is not None else 0)
        mag = sum(x.double().abs() for x in xs) * abs(c) + (res.double().abs() if res is not None else 0)
        tol = torch.finfo(dtype).eps * (h64.abs() + mag) + 1e-30
        case["h_float64_ok"] = bool(((out.h.double() - h64).abs() <= tol).all())
    hd = out.h.double()
    wd = w.double() + 1.0 if gemma else w.double()
    e = float(eps) if not isinstance(eps, torch.Tensor) else float(eps.float())
    y_ref = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + e) * wd
    od = out_dtype or dtype
    if out.y is not None:
        tol = 2 * torch.finfo(od).eps * y_ref.abs() + 1e-5 * (y_ref.abs() + 1)
        case["y_ok"] = out.y.dtype == od and bool(((out.y.double() - y_ref).abs() <= tol).all())
        # The share of y equal to the round-before-the-weight spelling of the same h
        # (torch's fp32 reduction order may move rstd by an ulp, hence a share).
        hf = out.h.float()
        normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + e)).to(dtype).float()
        wf = w.float() + 1.0 if gemma else w.float()
        case["round_normed"] = round_normed
        case["y_as_rounded_first"] = float((out.y == (normed * wf).to(od)).float().mean())
    else:
        case["y_ok"] = not emit_y and quant is not None
    if quant is not None:
        if out.y is not None:
            q_exp, s_exp, v = kernel_checks.fp8_device_math(out.y, quant, scale)
            case["q_ok"] = out.q.dtype == quant.dtype and bool(
                kernel_checks.same_codes_but_interpreter(out.q, q_exp, v).all())
            case["s_ok"] = torch.equal(out.scales, s_exp)
            q_ref, s_ref = quantize(out.y, quant, scale)  # the reference, CPU division
            ulps = (out.scales - s_ref).abs() / (s_ref.abs() * 2 ** -23 + 1e-45)
            case["s_ulps_vs_oracle"] = float(ulps.max()) if s_ref.numel() else 0.0
            if quant.mode == "per_group":
                case["layout"], case["ue8m0"] = quant.scale_layout, quant.ue8m0
                want = kernel_checks.vllm_strides(quant, torch.Size([n, H]))
                case["strides_ok"] = out.scales.stride() == s_ref.stride() == want
                oracle = _scale_oracle(out.y, quant)
                if quant.ue8m0:  # a power of two: the float64 one, exactly
                    case["s_float64_ok"] = torch.equal(out.scales.double(), oracle)
                else:
                    rel = ((out.scales.double() - oracle).abs() / oracle).max()
                    case["s_float64_ok"] = float(rel) <= 2 ** -23
        case["out"] = out
    # What this rank pushed, and what it left in its own buffer.
    if path is gate.Path.ONE_STAGE:
        pushed = all(torch.equal(p[base + r * n * H:base + (r + 1) * n * H], sim.enc(xs[r]))
                     for p in sim.peers.values())
        kept = all(torch.equal(sim.local[base + s * n * H:base + (s + 1) * n * H], sim.enc(xs[s]))
                   for s in sim.peers)
        case["state_ok"] = sim.buf.state[:2].tolist() == [
            buffers.state_word((slot + 1) % 3, n * H), 0] and kept
    else:
        chunk = -(-n // W)
        gather = base + W * chunk * H
        pushed = True
        for t in range(n):
            o = t // chunk
            if o != r:
                a = base + (r * chunk + t - o * chunk) * H
                pushed &= torch.equal(sim.peers[o][a:a + H], sim.enc(xs[r][t]))
            else:
                for p in sim.peers.values():
                    pushed &= torch.equal(p[gather + t * H:gather + (t + 1) * H], sim.enc(out.h[t]))
        case["state_ok"] = sim.buf.state[:2].tolist() == [buffers.state_word((slot + 1) % 3, 0), 0]
    case["pushed"] = bool(pushed)
    prev = ((slot + 2) % 3) * sim.SLOT
    partials = sim.buf.state[buffers.partial_index(prev // sim.SLOT, 0, 0):][:buffers.PARTIALS]
    case["previous_slot_clear"] = bool((sim.local[prev:prev + sim.SLOT] == sim.neg0).all()
                                       and (partials == buffers.negative_zero_bits(32)).all())
    case["current_slot_clear"] = bool((sim.local[base:base + sim.SLOT] == sim.neg0).all())
    return case


def _interpret_cases() -> list[dict]:
    from fusion_pass.quant import QuantSpec

    one, two = gate.Path.ONE_STAGE, gate.Path.TWO_STAGE
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    out = []
    # A sequence on one buffer: one-stage calls leave their mailboxes to the next
    # call, a two-stage call clears them and re-arms its own.
    sim = _SimRank(2, 0, f16)
    out.append(_interpret_case(sim, one, 3, 384, f16, 1, split=1))
    out.append(_interpret_case(sim, one, 2, 384, f16, 2, split=4))
    out.append(_interpret_case(sim, one, 1, 256, f16, 3, split=2, residual=False, gemma=True))
    out.append(_interpret_case(sim, two, 3, 384, f16, 4))
    out.append(dict(buffer_clean_after_two_stage=bool((sim.local == sim.neg0).all())))
    out.append(_interpret_case(sim, two, 5, 256, f16, 5))
    sim = _SimRank(2, 1, f32)
    out.append(_interpret_case(sim, one, 2, 128, f32, 6, split=2))
    out.append(_interpret_case(sim, two, 3, 128, f32, 7))
    out.append(_interpret_case(sim, two, 1, 128, f32, 8))  # rank 1 owns nothing
    sim = _SimRank(4, 2, bf16)
    out.append(_interpret_case(sim, one, 2, 256, bf16, 9, split=2))
    out.append(_interpret_case(sim, two, 7, 256, bf16, 10))
    # Epsilon as a device value, norm weight and output dtypes of their own.
    sim = _SimRank(2, 0, bf16)
    out.append(_interpret_case(sim, one, 2, 256, bf16, 11, eps=torch.tensor(1e-5),
                               wdtype=f32, out_dtype=f32))
    out.append(_interpret_case(sim, two, 3, 256, bf16, 12,
                               eps=torch.tensor(1e-5, dtype=bf16), wdtype=f16, out_dtype=f16))
    # FP8 epilogues on both kernels.
    sim = _SimRank(2, 0, f16)
    stat = QuantSpec("static")
    tok = QuantSpec("per_token", scale_floor=1.0 / (448 * 512), reciprocal=True)
    grp = QuantSpec("per_group", group=64)
    fnuz = QuantSpec("per_token", fp8_dtype="float8_e4m3fnuz", qmax=240.0)
    scale = torch.tensor([0.013])
    out.append(_interpret_case(sim, one, 3, 384, f16, 13, split=2, quant=stat, scale=scale))
    out.append(_interpret_case(sim, one, 2, 384, f16, 14, split=4,
                               quant=QuantSpec("static", reciprocal=True), scale=scale))
    out.append(_interpret_case(sim, one, 3, 384, f16, 15, split=2, quant=tok))
    out.append(_interpret_case(sim, one, 2, 384, f16, 16, split=4, quant=grp))
    # Parts of 80 columns: groups of 64 straddle them, every part stores its columns.
    out.append(_interpret_case(sim, one, 3, 384, f16, 21, split=5, quant=grp))
    out.append(_interpret_case(sim, two, 3, 384, f16, 17, quant=grp, out_dtype=bf16))
    out.append(_interpret_case(sim, two, 3, 256, f16, 18, quant=tok, out_dtype=f32))
    out.append(_interpret_case(sim, one, 2, 256, f16, 19, quant=fnuz))
    # Column-major and TMA-aligned scales (5 tokens: the padded stride is 8), and
    # UE8M0 scales, on both kernels and a split row.
    col = QuantSpec("per_group", group=64, scale_floor=1e-10 / 448, scale_layout="col")
    tma = QuantSpec("per_group", group=64, scale_floor=1e-10 / 448, scale_layout="col_tma")
    ue8m0 = QuantSpec("per_group", group=128, scale_floor=1e-10, ue8m0=True)
    ue8m0_tma = QuantSpec("per_group", group=64, scale_floor=1e-10, scale_layout="col_tma",
                          ue8m0=True, reciprocal=True)
    out.append(_interpret_case(sim, one, 3, 384, f16, 22, split=2, quant=col))
    out.append(_interpret_case(sim, two, 5, 256, f16, 23, quant=tma))
    out.append(_interpret_case(sim, one, 5, 384, f16, 24, split=5, quant=tma))
    out.append(_interpret_case(sim, one, 3, 256, f16, 25, quant=ue8m0))
    out.append(_interpret_case(sim, two, 5, 384, f16, 26, quant=ue8m0_tma, out_dtype=bf16))
    # Split rows whose parts own their columns and exchange sums of squares.
    sim = _SimRank(2, 0, f16)
    out.append(_interpret_case(sim, one, 2, 384, f16, 27, split=4, own=True))
    out.append(_interpret_case(sim, one, 1, 256, f16, 28, split=2, residual=False, gemma=True,
                               own=True))
    out.append(_interpret_case(sim, one, 3, 384, f16, 29, split=2, quant=stat, scale=scale,
                               own=True))
    out.append(_interpret_case(sim, one, 3, 384, f16, 30, split=2, quant=col, own=True))
    out.append(_interpret_case(sim, one, 2, 512, f16, 31, split=4, quant=ue8m0, own=True))
    out.append(_interpret_case(sim, one, 3, 384, f16, 32, split=2, quant=tok, own=True))
    sim = _SimRank(4, 3, bf16)
    out.append(_interpret_case(sim, one, 2, 256, bf16, 33, split=2, own=True))
    # The normalised row rounded before the weight (Hugging Face's spelling), in fp16:
    # the interpreter rounds fp32 to bf16 its own way.
    sim = _SimRank(2, 1, f16)
    out.append(_interpret_case(sim, one, 3, 256, f16, 34, round_normed=True))
    out.append(_interpret_case(sim, two, 5, 256, f16, 35, round_normed=True))
    out.append(_interpret_case(sim, one, 2, 512, f16, 36, split=4, quant=stat, scale=scale,
                               own=True, round_normed=True))
    out.append(_interpret_case(sim, one, 3, 256, f16, 37))
    # y not emitted: the same codes as with it.
    a = _interpret_case(sim, one, 2, 256, f16, 20, quant=grp)
    b = _interpret_case(sim, one, 2, 256, f16, 20, quant=grp, emit_y=False)
    out += [a, b]
    same = torch.equal(a["out"].q.view(torch.uint8), b["out"].q.view(torch.uint8))
    out.append(dict(no_y_same_codes=same
                    and torch.equal(a["out"].scales, b["out"].scales) and b["out"].y is None))
    # A scalar multiplier of the reduced value (Granite's literal; Gemma's buffer, no
    # residual; an fp32 tensor), on both kernels, split rows, an FP8 epilogue.
    sim = _SimRank(2, 0, bf16)
    out.append(_interpret_case(sim, one, 3, 256, bf16, 38, multiplier=0.22))
    out.append(_interpret_case(sim, two, 5, 256, bf16, 39, multiplier=0.22))
    out.append(_interpret_case(sim, one, 2, 384, bf16, 40, split=2, own=True, residual=False,
                               gemma=True, multiplier=torch.tensor(16.0, dtype=bf16)))
    out.append(_interpret_case(sim, two, 3, 256, bf16, 41, residual=False,
                               multiplier=torch.tensor(0.7)))
    sim = _SimRank(2, 1, f32)
    out.append(_interpret_case(sim, one, 3, 128, f32, 42, multiplier=torch.tensor(0.7),
                               quant=tok))
    out.append(_interpret_case(sim, two, 3, 128, f32, 43, multiplier=0.22))
    # N = 8, rows in two parts that each wait for and normalise the whole row (the
    # layout of 7 x 16384 fp32 rows on 16 SMs, narrower), rank 7 (the last mailboxes
    # of the slot); the second call clears what the first left over its 14 programs.
    sim = _SimRank(8, 7, f32)
    out.append(_interpret_case(sim, one, 7, 128, f32, 44, split=2, residual=False))
    out.append(_interpret_case(sim, one, 7, 128, f32, 45, split=2))
    for c in out:
        c.pop("out", None)
    return out + _arm_cases()


def _arm_cases() -> list[dict]:
    """``buffers.arm`` on rank 1 of 3 simulated ranks (the peers' buffers already
    tagged, the collective a stand-in that records what it was told): the
    verdict with every address right, with a peer's address one element off,
    and with a peer's address at a buffer tagged by another rank."""
    def peers(numel: int) -> dict[int, torch.Tensor]:
        bufs = {}
        for p in (0, 2):
            bufs[p] = torch.full((numel,), -(1 << 15), dtype=torch.int16)
            bufs[p][0] = bufs[p][-1] = p + 1
        return bufs

    cases = []
    for fault in ("none", "offset", "other_rank"):
        numel = 3 * 1024
        bufs, own = peers(numel), torch.randint(-5, 5, (numel,), dtype=torch.int16)
        ptrs = [bufs[0].data_ptr(), own.data_ptr(), bufs[2].data_ptr()]
        if fault == "offset":
            ptrs[2] += 2
        if fault == "other_rank":
            ptrs[2] = bufs[0].data_ptr()
        told: list[int] = []
        why = buffers.arm(own, torch.tensor(ptrs, dtype=torch.int64), 1, 16,
                          lambda v: told.append(v) or [0, v, 0])
        cases.append(dict(arm=fault, why=why, told=told,
                          all_empty=bool((own == -(1 << 15)).all())))
    return cases


def interpret(script: str) -> list:
    """Run ``script`` with Triton's interpreter (chosen when Triton is imported, hence a
    process of its own); the JSON list it prints last."""
    import json
    import os

    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def interpreted():
    return interpret(__file__)


def test_interpreted_arm_refuses_a_buffer_a_peer_address_misses(interpreted):
    """A new buffer is filled and proven before use: every rank's tags read back
    through the peer addresses, the buffer left all empty; an address one
    element off, or at another rank's buffer, refuses it on every rank."""
    arm = {c["arm"]: c for c in interpreted if "arm" in c}
    assert arm["none"]["why"] is None and arm["none"]["told"] == [0, 0, 0]
    assert arm["none"]["all_empty"]
    for fault in ("offset", "other_rank"):
        assert "a peer address reads another rank's tag or none" in arm[fault]["why"], arm[fault]
        assert arm[fault]["told"] == [0, 1, 1]


def test_interpreted_kernels_compute_the_outputs(interpreted):
    cases = [c for c in interpreted if "path" in c]
    assert len(cases) == 46
    # Every own-columns case ran so, but the per-token scale's (its amax needs the row).
    own = [c for c in cases if 27 <= c["seed"] <= 33]
    assert [c["own"] for c in own] == [True] * 5 + [False, True], own
    assert not any(c["own"] for c in cases if c["seed"] < 27)
    bad = [c for c in cases if not (c["h_ok"] and c["y_ok"])]
    assert not bad, bad


def test_interpreted_split_rows_at_eight_ranks(interpreted):
    """At N = 8, 7 rows in two parts reading the whole row (14 programs): every
    part pushes its columns into every peer's mailbox of (rank 7, row), reads
    the peers' whole rows, and the next call clears the 7 sources' rows."""
    cases = [c for c in interpreted if c.get("world") == 8]
    assert [(c["seed"], c["grid"], c["own"]) for c in cases] == [(44, 14, False), (45, 14, False)]
    assert all(c["h_ok"] and c["y_ok"] and c["pushed"] and c["state_ok"]
               and c["previous_slot_clear"] for c in cases), cases


def test_interpreted_kernels_apply_the_multiplier(interpreted):
    """``h`` is the multiplied sum's bits as the kernels round it (the sum rounded to the
    dtype, times ``c`` and plus the residual in one fused multiply-add, then rounded), and
    within an ulp of float64; ``y`` is the norm of that ``h``."""
    cases = [c for c in interpreted if c.get("multiplied")]
    assert sorted(c["seed"] for c in cases) == list(range(38, 44))
    bad = [c for c in cases if not (c["h_ok"] and c["h_float64_ok"] and c["y_ok"])]
    assert not bad, bad


def test_interpreted_kernels_round_before_the_weight_when_asked(interpreted):
    cases = {c["seed"]: c for c in interpreted if 34 <= c.get("seed", 0) <= 37}
    assert all(cases[s]["round_normed"] and cases[s]["y_as_rounded_first"] >= 0.99
               for s in (34, 35, 36)), cases
    assert cases[37]["y_as_rounded_first"] < 0.9, cases[37]  # rounded once: other bits


def test_interpreted_kernels_push_and_rearm(interpreted):
    cases = [c for c in interpreted if "path" in c]
    bad = [c for c in cases if not (c["pushed"] and c["state_ok"] and c["previous_slot_clear"])]
    assert not bad, bad
    # One-stage leaves its mailboxes to the next call; two-stage re-arms its own.
    assert all(not c["current_slot_clear"] for c in cases if c["path"] == "one_stage")
    assert all(c["current_slot_clear"] for c in cases if c["path"] == "two_stage")
    assert {"buffer_clean_after_two_stage": True} in interpreted


def test_interpreted_fp8_epilogues_match_torch_bitwise(interpreted):
    cases = [c for c in interpreted if c.get("quant") and "q_ok" in c]
    assert {c["quant"] for c in cases} == {"static", "per_token", "per_group"}
    bad = [c for c in cases if not (c["q_ok"] and c["s_ok"] and c["s_ulps_vs_oracle"] <= 1.0)]
    assert not bad, bad
    assert {"no_y_same_codes": True} in interpreted


def test_interpreted_group_scales_in_vllms_layouts_and_ue8m0(interpreted):
    cases = [c for c in interpreted if "layout" in c]
    assert {(c["layout"], c["ue8m0"]) for c in cases} == {
        ("row", False), ("col", False), ("col_tma", False), ("row", True), ("col_tma", True)}
    bad = [c for c in cases if not (c["strides_ok"] and c["s_float64_ok"])]
    assert not bad, bad


if __name__ == "__main__":
    import json

    print(json.dumps(_interpret_cases()))
