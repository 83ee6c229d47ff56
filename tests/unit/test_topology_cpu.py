"""Topologies decided together: ``fusion_pass.topology`` and the buffers' agreement, on the CPU.

- :func:`~fusion_pass.topology.group_decline`'s rules on hand-made facts, and
  what :func:`~fusion_pass.topology.local_facts`, :func:`~fusion_pass.topology.gpus`
  and :func:`~fusion_pass.topology.p2p_matrix` read of a machine (this one, and
  a stand-in ``torch.cuda`` of three GPUs, two of which map each other).
- Four gloo ranks calling the fused op with the Triton backend's host side
  (CPU tensors, the real ``buffers`` module): a group whose ranks report
  different hosts (injected), a GPU pair that cannot map each other (injected),
  two ranks on one GPU, an allocation that raises on one rank only, a
  rendezvous that raises on one rank only.  Every rank declines with the same
  reason, says it once, and returns the reference backend's outputs; no rank
  is left in a collective (the spawn's timeout would fail the test), a rank
  whose allocation went through never reaches the rendezvous when a peer's
  failed, and a later call of another shape declines without a collective.
"""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import pytest
import torch

from fusion_pass import topology
from fusion_pass.testing.spawn import run_ranks
from fusion_pass.topology import RankFacts, group_decline

GPUS = ("GPU-a", "GPU-b", "GPU-c", "GPU-d")


def _facts(**changes) -> list[RankFacts]:
    """Four ranks on one host, each on a GPU of its own, every GPU mapping every other;
    ``changes``: rank -> field -> value."""
    out = []
    for r, gpu in enumerate(GPUS):
        f = dict(host="h1/boot", gpu=gpu, device=r, can_map=GPUS)
        f.update(changes.get(f"r{r}", {}))
        out.append(RankFacts(**f))
    return out


def test_a_group_on_one_host_with_a_mapped_gpu_each_is_taken():
    assert group_decline(_facts()) is None
    assert group_decline(_facts()[:2]) is None


def test_ranks_on_two_hosts_are_declined_naming_them():
    why = group_decline(_facts(r2=dict(host="h2/boot"), r3=dict(host="h2/boot")))
    assert why is not None and "spans 2 hosts" in why
    assert "rank 0 on h1/boot" in why and "rank 2 on h2/boot" in why


def test_the_same_hostname_after_another_boot_is_another_host():
    why = group_decline(_facts(r1=dict(host="h1/other-boot")))
    assert why is not None and "spans 2 hosts" in why


def test_a_rank_without_a_gpu_is_declined():
    why = group_decline(_facts(r3=dict(gpu="", device=-1, can_map=())))
    assert why == "rank 3 has no CUDA GPU: symmetric memory needs one per rank"


def test_two_ranks_on_one_gpu_are_declined_naming_them():
    why = group_decline(_facts(r2=dict(gpu="GPU-a")))
    assert why is not None and why.startswith("ranks 0 and 2 share one GPU"), why


@pytest.mark.parametrize("rank,missing,pair", [
    (0, "GPU-d", "rank 0's GPU GPU-a cannot map rank 3's"),
    (2, "GPU-b", "rank 2's GPU GPU-c cannot map rank 1's")])
def test_a_gpu_pair_without_peer_access_is_declined_whichever_side_sees_it(rank, missing, pair):
    can_map = tuple(g for g in GPUS if g != missing)
    why = group_decline(_facts(**{f"r{rank}": dict(can_map=can_map)}))
    assert why is not None and why.startswith(pair), why


def test_hosts_are_checked_before_gpus():
    """Ranks on two machines may well both be on their machine's GPU 0: the reason
    given is the hosts, which is what a user must change."""
    why = group_decline(_facts(r1=dict(host="h2/boot", gpu="GPU-a", can_map=("GPU-a",))))
    assert why is not None and "hosts" in why


def test_local_facts_of_a_machine_without_cuda():
    facts = topology.local_facts(0)
    assert facts.gpu == "" and facts.device == -1 and facts.can_map == ()
    assert facts.host.startswith(socket.gethostname())
    if os.path.exists(topology.BOOT_ID):
        with open(topology.BOOT_ID) as f:
            assert facts.host == f"{socket.gethostname()}/{f.read().strip()}"
    assert topology.gpus() == [] and topology.p2p_matrix() == []


class _ThreeGpus:
    """``torch.cuda`` as a machine of three GPUs shows it: 0 and 1 map each other,
    2 maps none (a PCIe card without P2P)."""

    def device_count(self):
        return 3

    def get_device_properties(self, i):
        return SimpleNamespace(uuid=f"GPU-{i}", name="H100", major=9, minor=0,
                               multi_processor_count=132, total_memory=80 << 30)

    def can_device_access_peer(self, i, j):
        return {i, j} == {0, 1}


def test_facts_of_a_machine_with_gpus(monkeypatch):
    monkeypatch.setattr(topology, "_cuda", lambda: _ThreeGpus())
    assert topology.p2p_matrix() == [[True, True, False], [True, True, False],
                                     [False, False, True]]
    assert [(g.index, g.uuid, g.capability, g.sms) for g in topology.gpus()] == [
        (i, f"GPU-{i}", (9, 0), 132) for i in range(3)]
    f0, f1, f2 = (topology.local_facts(i) for i in range(3))
    assert (f0.gpu, f0.device, f0.can_map) == ("GPU-0", 0, ("GPU-0", "GPU-1"))
    assert f2.can_map == ("GPU-2",)
    assert group_decline([f0, f1]) is None
    assert "rank 0's GPU GPU-0 cannot map rank 1's GPU GPU-2" in group_decline([f0, f2])


# ---------------------------------------------------------------- four gloo ranks

CASES = ("hosts", "p2p", "shared", "facts", "allocation", "rendezvous")
"""What goes wrong in each case (:func:`_inject`)."""
WORLD = 4
HIDDEN, TOKENS = 128, 3


def _inject(case: str, rank: int, seen: dict) -> None:
    """Patch this rank's view for ``case``: the facts every rank reports, the
    allocation and the rendezvous (each recording that it ran)."""
    import torch.distributed._symmetric_memory as symm_mem

    from fusion_pass.backends.triton_symm import buffers

    facts = RankFacts("one-host/boot", GPUS[rank], rank, GPUS)
    if case == "hosts" and rank == 3:
        facts = RankFacts("other-host/boot", GPUS[rank], 0, GPUS)
    if case == "p2p" and rank == 1:
        facts = RankFacts("one-host/boot", GPUS[rank], rank, GPUS[:2])
    if case == "shared" and rank == 2:
        facts = RankFacts("one-host/boot", GPUS[0], 0, GPUS)
    topology.local_facts = lambda device: facts
    if case == "facts" and rank == 3:
        def unreadable(device):
            raise RuntimeError("CUDA driver error: unknown error")

        topology.local_facts = unreadable

    def empty(numel, dtype, device):
        seen["allocated"] += 1
        if case == "allocation" and rank == 1:
            raise RuntimeError("CUDA out of memory. Tried to allocate 6.00 MiB")
        return torch.zeros(numel, dtype=dtype)

    def rendezvous(tensor, group_name):
        seen["rendezvous"] += 1
        if case == "rendezvous" and rank == 2:
            raise RuntimeError("CUDA driver error: invalid device ordinal")
        return SimpleNamespace(buffer_ptrs=[tensor.data_ptr()] * WORLD, rank=rank,
                               world_size=WORLD)

    buffers._symmetric_empty = empty
    symm_mem.rendezvous = rendezvous


def _every_case(rank: int, world: int) -> dict:
    import logging

    import torch.distributed as dist

    import fusion_pass
    from fusion_pass import backends
    from fusion_pass.backends import reference, triton_symm
    from fusion_pass.backends.triton_symm import buffers
    from fusion_pass.spec import NormSpec

    class OnTheCpu(triton_symm.TritonBackend):
        """The backend's host side on CPU tensors (device -1), as on a GPU."""

        name = "triton-cpu"

        def run(self, call):
            return self.run_on(call, -1)

    backends.register("triton-cpu", OnTheCpu)
    backends.set_backend("triton-cpu")
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("fusion_pass").addHandler(handler)
    exchanges = [0]
    real_all_ranks = buffers.all_ranks

    def counted(value, group_name):
        exchanges[0] += 1
        return real_all_ranks(value, group_name)

    buffers.all_ranks = counted
    out = {}
    for case in CASES:
        group = dist.new_group(list(range(world)))  # a group of its own: decided anew
        name = group.group_name
        seen = {"allocated": 0, "rendezvous": 0}
        _inject(case, rank, seen)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(TOKENS, HIDDEN, generator=g)
        r = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(9))
        w = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(8))
        start, before = len(said), exchanges[0]
        y, h = fusion_pass.fused_allreduce_rmsnorm(x, w, 1e-6, name, residual=r,
                                                   path="one_stage")
        first = exchanges[0] - before
        ry, rh = reference.add_rms_norm(reference.all_reduce(x, name), r, w, NormSpec(eps=1e-6))
        # Another shape (a new plan, a larger buffer): the group's answer, no collective.
        x2 = torch.randn(2 * TOKENS, HIDDEN, generator=g)
        before = exchanges[0]
        y2, _ = fusion_pass.fused_allreduce_rmsnorm(x2, w, 1e-6, name, path="two_stage")
        ry2, _ = reference.add_rms_norm(reference.all_reduce(x2, name), None, w,
                                        NormSpec(eps=1e-6))
        out[case] = {"equal": bool(torch.equal(y, ry) and torch.equal(h, rh)
                                   and torch.equal(y2, ry2)),
                     "said": [m for m in said[start:] if "falls back" in m],
                     "decided": buffers._decided.get(fusion_pass.groups.group(name)),
                     "exchanges_first": first, "exchanges_later": exchanges[0] - before,
                     **seen}
    return out


@pytest.fixture(scope="module")
def cases():
    return run_ranks(_every_case, WORLD, timeout=300)


@pytest.mark.parametrize("case", CASES)
def test_every_rank_declines_alike_and_computes_the_reference(cases, case):
    mine = [cases[r][case] for r in range(WORLD)]
    reasons = {m["decided"] for m in mine}
    assert len(reasons) == 1 and None not in reasons, reasons
    (reason,) = reasons
    assert reason.startswith("symmetric memory"), reason
    for r, m in enumerate(mine):
        assert m["equal"], (r, m)
        # Said once per shape's fallback line, with the reason the group got.
        assert len(m["said"]) == 2 and all(reason[:40] in line for line in m["said"]), m["said"]
        assert m["exchanges_later"] == 0, m


def test_the_reasons_name_what_went_wrong(cases):
    reason = {c: cases[0][c]["decided"] for c in CASES}
    assert "spans 2 hosts" in reason["hosts"] and "rank 3 on other-host/boot" in reason["hosts"]
    assert "rank 1's GPU GPU-b cannot map rank 2's GPU GPU-c" in reason["p2p"]
    assert "ranks 0 and 2 share one GPU" in reason["shared"]
    assert reason["facts"].startswith("symmetric memory failed on rank 3 of 4: reading its "
                                      "GPU's facts raised RuntimeError")
    assert reason["allocation"].startswith("symmetric memory failed on rank 1 of 4: allocating")
    assert "CUDA out of memory" in reason["allocation"]
    assert reason["rendezvous"].startswith("symmetric memory failed on rank 2 of 4: the "
                                           "rendezvous raised")


def test_a_declined_topology_allocates_nothing(cases):
    for case in ("hosts", "p2p", "shared", "facts"):
        for r in range(WORLD):
            m = cases[r][case]
            assert m["allocated"] == m["rendezvous"] == 0, (case, r, m)
            assert m["exchanges_first"] == 1, (case, r, m)  # the facts, nothing else


def test_a_failed_allocation_stops_every_rank_before_the_rendezvous(cases):
    for r in range(WORLD):
        m = cases[r]["allocation"]
        assert m["allocated"] == 1 and m["rendezvous"] == 0, (r, m)
        assert m["exchanges_first"] == 2, (r, m)  # the facts, the allocations' outcomes


def test_a_failed_rendezvous_is_every_ranks_decline(cases):
    for r in range(WORLD):
        m = cases[r]["rendezvous"]
        assert m["allocated"] == 1 and m["rendezvous"] == 1, (r, m)
        assert m["exchanges_first"] == 3, (r, m)  # facts, allocations, rendezvous
