"""State kept per process group, found through the group and not its name (``fusion_pass.groups``).

In one rank process (c10d's default group "0" destroyed and made again, as a
process that hosts engines in turn does it):

- :func:`~fusion_pass.groups.group` keeps one :class:`~fusion_pass.groups.Group`
  while its ``ProcessGroup`` is registered under the name, and ends it (telling
  its watchers, once; bound methods held weakly) when the name names another;
  ``c10d_world_size`` follows.
- The Triton backend keeps plans, declines and wait bounds per group: the op's
  name check (``c10d_world_size``, what every eager call runs) is enough for
  the backend to drop the old group's, and the next call's plan has the new
  group's size and asks the buffers of the new group.
- The ``buffers`` module keeps a buffer per group: a group made again under the
  name gets a new buffer; the old group's buffer is held (``buffers.held``) while
  its ``ProcessGroup`` object lives, and freed at the next buffer request once it
  is gone.
- A name that names no group: the backend declines with the reason, and the
  wait bound is the default, never an exception.
"""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import torch

from fusion_pass import gate
from fusion_pass.testing.calls import make_call
from fusion_pass.testing.spawn import run_ranks


def _init(backend: str, size: int) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    store = FakeStore() if backend == "fake" else dist.HashStore()
    dist.init_process_group(backend, rank=0, world_size=size, store=store)


class _Recorder:
    """A watcher whose calls are recorded."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def ended(self, group) -> None:
        self.calls.append(group.size)


def _groups_case(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from fusion_pass import groups

    dist.destroy_process_group()
    out: dict = {}
    _init("gloo", 1)
    name = dist.group.WORLD.group_name
    first = groups.group(name)
    out["same_while_live"] = groups.group(name) is first and groups.c10d_world_size(name) == 1
    calls: list = []
    kept, dropped = _Recorder(calls), _Recorder(calls)
    first.watch(kept.ended)
    first.watch(dropped.ended)
    gone = weakref.ref(dropped)
    del dropped
    out["watcher_held_weakly"] = gone() is None
    functions: list = []
    first.watch(lambda g: functions.append(g.name))
    dist.destroy_process_group()
    out["freed_at_destroy"] = first.freed
    out["ended_before_asked"] = first.ended
    _init("fake", 4)
    out["same_name"] = dist.group.WORLD.group_name == name
    out["size_after"] = groups.c10d_world_size(name)
    second = groups.group(name)
    out["ended"] = first.ended and not second.ended and second is not first
    out["told"] = (list(calls), list(functions))
    first.end()  # once only
    out["told_again"] = (list(calls), list(functions))
    late: list = []
    first.watch(lambda g: late.append(g.size))  # an ended group tells at once
    out["late"] = late
    dist.destroy_process_group()
    try:
        groups.group(name)
        out["unknown"] = "resolved"
    except Exception:
        out["unknown"] = "raised"
    out["second_ended_unresolved"] = second.ended
    return out


def test_a_group_ends_when_its_name_names_another():
    res = run_ranks(_groups_case, 1, timeout=120)[0]
    assert res["same_while_live"] and res["same_name"]
    assert res["watcher_held_weakly"]
    # Destroyed and let go: freed at once, ended when next asked for by name.
    assert res["freed_at_destroy"] and not res["ended_before_asked"]
    assert res["size_after"] == 4 and res["ended"]
    assert res["told"] == ([1], ["0"]) and res["told_again"] == res["told"]
    assert res["late"] == [1]
    assert res["unknown"] == "raised" and res["second_ended_unresolved"]


class _Buffers:
    """A buffer provider recording the groups it is asked for, answering one
    stand-in buffer per group (of that group's size)."""

    generation = 0

    def __init__(self) -> None:
        self.asked: list = []

    def get(self, group, elem_bits, device, need, max_input_bytes):
        from fusion_pass.backends.triton_symm import buffers

        self.asked.append(group)
        return buffers.SymmBuffer(tensor=torch.zeros(8, dtype=torch.int16),
                                  peer_ptrs=torch.zeros(group.size, dtype=torch.int64),
                                  state=torch.zeros(1, dtype=torch.int32), handle=None, rank=0,
                                  world_size=group.size, slot_bytes=1 << 30)


def _call(name: str, hidden: int = 128):
    """A bf16 call of 4 tokens (rows of 100 elements: declined, not 16-byte rows)."""
    x = torch.zeros(4, hidden, dtype=torch.bfloat16)
    return make_call(x, x, torch.ones(hidden, dtype=torch.bfloat16), 1e-6, name,
                     gate.Path.ONE_STAGE)


def _worlds(plan) -> set:
    return {lau.constexprs["WORLD"] for _, lau in plan.pieces}


def _backend_case(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from fusion_pass import groups
    from fusion_pass.backends import triton_symm

    dist.destroy_process_group()
    out: dict = {}
    provider = _Buffers()
    be = triton_symm.TritonBackend(provider=provider, sm_budget=triton_symm.SMBudget(sms=132))
    _init("fake", 2)
    name = dist.group.WORLD.group_name
    a = groups.group(name)
    plan = be.prepare(_call(name), -1)
    declined = be.prepare(_call(name, hidden=100), -1)  # a decline, kept for the group
    out["a"] = (sorted(_worlds(plan)), be.prepare(_call(name), -1) is plan, len(be.held(a)),
                isinstance(declined, str), provider.asked == [a])
    out["a_timeout"] = be.timeout_ns(name)
    dist.destroy_process_group()
    _init("fake", 4)
    groups.c10d_world_size(name)  # the op's check on its next call
    out["a_dropped"] = (a.ended, len(be.held(a)), a in be._kept, a in be._timeouts,
                        len(be._plans))
    b = groups.group(name)
    plan_b = be.prepare(_call(name), -1)
    out["b"] = (sorted(_worlds(plan_b)), plan_b is not plan, provider.asked[-1] is b,
                len(be.held(b)))
    # Same size, same name, new communicators: a new group all the same.
    dist.destroy_process_group()
    _init("fake", 4)
    groups.c10d_world_size(name)
    c = groups.group(name)
    plan_c = be.prepare(_call(name), -1)
    out["c"] = (b.ended, c is not b, plan_c is not plan_b, provider.asked[-1] is c,
                len(be.held(b)))
    dist.destroy_process_group()
    # No group under the name: a reason, and the default wait bound, no exception.
    unknown = be.prepare(_call("no-such-group"), -1)
    out["unknown"] = unknown
    out["unknown_again"] = be.prepare(_call("no-such-group"), -1) == unknown
    from fusion_pass.backends.triton_symm import environment

    out["timeout_unknown"] = environment.group_timeout_s("no-such-group")
    return out


def test_the_backend_keeps_plans_per_group_and_drops_an_ended_groups():
    res = run_ranks(_backend_case, 1, timeout=120)[0]
    assert res["a"] == ([2], True, 2, True, True)
    assert res["a_dropped"] == (True, 0, False, False, 0)
    assert res["b"] == ([4], True, True, 1)
    assert res["c"] == (True, True, True, True, 0)
    assert "no process group is registered under 'no-such-group'" in res["unknown"]
    assert res["unknown_again"]
    assert res["timeout_unknown"] > 0


def _buffers_case(rank: int, world: int) -> dict:
    """The real ``buffers`` module on a gloo group of one, its allocation, rendezvous
    and arming stood in for (no GPU)."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from fusion_pass import groups, topology
    from fusion_pass.backends.triton_symm import buffers

    dist.destroy_process_group()
    topology.local_facts = lambda device: topology.RankFacts("h", "GPU-0", 0, ("GPU-0",))
    buffers._symmetric_empty = lambda numel, dtype, device: torch.zeros(numel, dtype=dtype)
    symm_mem.rendezvous = lambda t, name: SimpleNamespace(buffer_ptrs=[t.data_ptr()], rank=0,
                                                          world_size=1)
    buffers.arm = lambda *args: None
    cpu = torch.device("cpu")
    out: dict = {}
    _init("gloo", 1)
    name = dist.group.WORLD.group_name
    held_pg = dist.group.WORLD  # a user's reference: the group object outlives its destroy
    a = groups.group(name)
    buf_a = buffers.get(name, 16, cpu, 1000, 1 << 25)
    grown = buffers.get(a, 16, cpu, 3 << 20, 1 << 25)  # a larger one: the first is retired
    out["a"] = (buffers.get(a, 16, cpu, 1000, 1 << 25) is grown, len(buffers.held(a)))
    refs = [weakref.ref(buf_a), weakref.ref(grown)]
    del buf_a, grown
    dist.destroy_process_group()
    _init("gloo", 1)
    b = groups.group(name)  # the check: a ends
    buf_b = buffers.get(name, 16, cpu, 1000, 1 << 25)
    gc.collect()
    out["b"] = (a.ended, b is not a, buffers.current(b, 16, cpu) is buf_b,
                buffers.current(name, 16, cpu) is buf_b, len(buffers.held(b)))
    out["a_kept_while_its_group_object_lives"] = (len(buffers.held(a)),
                                                  all(r() is not None for r in refs),
                                                  a in buffers._ended)
    del held_pg
    gc.collect()
    out["a_freed_object"] = a.freed
    out["released"] = buffers.release_freed()
    gc.collect()
    out["a_gone"] = (len(buffers.held(a)), all(r() is None for r in refs), a in buffers._ended)
    return out


def test_an_ended_groups_buffers_are_held_until_its_group_object_is_freed():
    res = run_ranks(_buffers_case, 1, timeout=120)[0]
    assert res["a"] == (True, 2)
    assert res["b"] == (True, True, True, True, 1)
    assert res["a_kept_while_its_group_object_lives"] == (2, True, True)
    assert res["a_freed_object"]
    assert res["released"] == 2 and res["a_gone"] == (0, True, False)
