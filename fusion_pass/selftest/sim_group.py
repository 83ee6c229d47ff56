"""A simulated group: N ranks of the Triton backend on one GPU, or in Triton's
interpreter on the CPU, for tests and benchmarks (not a backend users pick).

What runs as it does for real ranks: the backend (:class:`TritonBackend`, its
plan cache, ``_plan``, :class:`Plan` and its ``__call__``, the launchers, the
kernels), each rank's buffers armed by :func:`buffers.arm` (filled with the
empty marker, tagged, every rank's tags read back through the peer table,
cleared, with a collective between the simulated ranks) and grown as
``buffers.get`` grows them (never during graph capture).  What is made here
instead: the buffers (plain allocations, not symmetric memory) and the peer
tables (every rank's address, by hand: no rendezvous, no NCCL).  The backend
takes them through its seams: ``provider`` (:class:`RankBuffers`), ``group``
(the simulated group's :class:`~fusion_pass.groups.Group`, of N ranks) and
``sm_budget`` (below).

Two forms, one interface (``prepare``, ``launch``, ``finish``, ``remake``,
``inspect``, ``close``):

* :class:`GpuGroup`: N ranks in this process on one GPU, one CUDA stream per
  rank; CUDA graphs of each rank's calls (``capture``, ``replay``).
* :class:`InterpretedGroup`: one forked worker process per rank, Triton's
  interpreter running the kernels (``TRITON_INTERPRET=1`` when Triton is first
  imported), the buffers in shared-memory files that every rank maps, so that
  a rank really waits for its peers' stores.  Needs a Triton whose interpreter
  runs the project's kernels (3.9 does; 3.6's did not);
  :func:`prepare_interpreter` gives it the host's clock for the wait bound and
  turns its device assertions on.

Each form runs its ranks on a :class:`~fusion_pass.groups.Group` of its own
(``group`` seam of the backend).  ``remake(N)`` destroys it and makes another
under the same name, of N ranks and with new buffers (so new peer tables), as
a process that hosts engines in turn sees it: the ranks that stay keep their
backends and buffer providers, which must let go of the old group's plans and
buffers when it ends; ``inspect()`` says, per rank, what they keep
(:func:`kept`).

Co-residency
------------
A program that waits for another must not keep it off the GPU.  With a GPU per
rank a program waits for programs on other GPUs, and the backend's geometry
keeps the launches whose programs wait for each other within the SM count.
Here every rank shares the GPU, so every program of every rank must be
resident at once, or a spinning program holds an SM that the program it waits
for needs, until its timeout fires.  So one rank's launch may have at most
:func:`resident_cap` programs: ``N x grid x 2 <= SMs x CTAs per SM``, N ranks
with two launches each in flight (under programmatic dependent launch the next
kernel of a stream is made resident as soon as every program of the current
one has let it start, and waits there), and CTAs per SM the driver's occupancy
of the compiled kernel (:func:`ctas_per_sm`: its warps, registers and shared
memory), the worst of every kernel that can be in flight together: those of
one ``prepare``.

``GpuGroup.prepare`` plans with the device's own SM count first, so that the
layouts production uses run wherever they fit (a split row's parts have few
warps and many fit an SM: 8192 x 8 bf16 at N = 8 runs as 8 rows of 8 parts,
64 programs, if the driver says 16 fit an SM).  Where a launch does not fit,
it plans again with ``SMBudget(sms=cap, every_launch=True)``: two-stage grids
of at most ``cap`` programs, one-stage calls in row pieces whose splits keep
within ``cap`` (``geometry.resident_rows``), again while the new kernels'
occupancy lowers the cap.  Each case records the layout it ran.

The interpreter runs a launch's programs one after another in program order,
on every rank: a program may wait only for what the peers' programs at the
same place in that order store.  :data:`INTERPRETER_BUDGET` (one SM): rows are
not split (a part would wait for its sibling parts, which run after it), and
the two-stage grid is one program (a row it waits for may come from any of a
peer's programs).

Compile before launch: ``rank`` is a specialised argument, so ranks compile
kernels of their own, and a compile while a peer spins can outlast its
timeout; ``prepare`` compiles every rank's launchers (``launch`` refuses a call
that was not prepared).  A timeout leaves the CUDA context unusable: run
groups of cases in subprocesses (:mod:`.suite`).

The stack before launch: the kernels spill to a per-thread stack, and the
ranks' kernels differ in it (``rank`` specialised: on Triton 3.6 the one-stage
kernel of 16384 x fp32 rows in two parts at N = 8 needs 1208 bytes at rank 0,
1456 at rank 1).  A launch that needs more than the context's stack limit
(``CU_LIMIT_STACK_SIZE``, 1 KiB at first) makes the driver raise the limit,
and the launch waits for the device to go idle first: the rank launched before
spins until its timeout, waiting for the rank whose launch waits for it.
With a GPU per rank that is a one-time wait for the rank's own previous work;
here it is a deadlock.  So ``prepare`` raises the limit to the largest stack
of every kernel it compiled, while no rank runs, and ``finish`` reports a
limit that still grew during the ranks' launches.

CUDA gives streams a limited number of hardware queues
(``CUDA_DEVICE_MAX_CONNECTIONS``, 8 by default); streams beyond them share one,
and a spinning kernel then blocks a peer's kernel queued behind it.
:class:`GpuGroup` needs the variable set to at least N + 1 before CUDA starts.

Public API (what a host-cost benchmark needs; ``CUDA_DEVICE_MAX_CONNECTIONS=32``
set before CUDA starts)::

    group = GpuGroup(world=8)                  # N ranks on the current GPU
    calls = [make_call(x[r], residual, w, 1e-6, group.name, Path.ONE_STAGE) for r in range(8)]
    plans = group.prepare(calls)[0]            # each rank's Plan, compiled, within the cap
    outs = group.launch(calls)                 # every rank's Plan.__call__ on its stream
    group.finish()                             # wait for every rank; the error, if one failed
    for r in range(8):                         # or each rank's Plan.__call__ by hand, on its
        with torch.cuda.stream(group.streams[r]):  # stream: time any one of them
            plans[r](calls[r])

A rank's kernel ends only once every rank has made the same call, so every
rank must make every call (a lone rank's kernel waits until its timeout).
"""

from __future__ import annotations

import copy
import ctypes
import io
import itertools
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Optional, Sequence, Union

import torch

from ..backends.base import Call, Outputs
from ..backends.triton_symm import buffers, geometry
from ..backends.triton_symm.backend import TritonBackend
from ..backends.triton_symm.environment import SMBudget
from ..backends.triton_symm.plan import Plan
from ..groups import Group

INTERPRETER_BUDGET = SMBudget(sms=1)
"""The interpreter's budget: one program at a time (see the module's note)."""

MAX_WORLD = 8
"""The most ranks an :class:`InterpretedGroup` runs."""

CONNECTIONS_VAR = "CUDA_DEVICE_MAX_CONNECTIONS"


class SimError(RuntimeError):
    """The simulated group cannot run what it was asked (not a kernel's fault)."""


def resident_cap(world: int, sms: int, ctas_per_sm: int) -> int:
    """Most programs of one rank's launch such that every program of every rank's
    two launches in flight is resident at once: ``world x grid x 2 <= sms x
    ctas_per_sm`` (the module's note)."""
    return sms * ctas_per_sm // (2 * world)


def fit_budget(world: int, sms: int, attempt: Callable[[SMBudget], tuple[Any, list[tuple[int, int]]]]
               ) -> tuple[SMBudget, Optional[int], Any]:
    """The budget whose launches all fit the co-residency cap, the cap, and what
    ``attempt(budget)`` returned for it (``attempt`` plans and compiles, and
    gives ``(grid, CTAs per SM)`` of every launch): the device's own SM count
    first, then ``SMBudget(sms=cap, every_launch=True)`` while a launch is wider
    than the cap of the kernels planned last (the module's note)."""
    budget = SMBudget()
    while True:
        result, launches = attempt(budget)
        if not launches:
            return budget, None, result
        ctas = min(n for _, n in launches)
        cap = resident_cap(world, sms, ctas)
        widest = max(grid for grid, _ in launches)
        if widest <= cap:
            return budget, cap, result
        if cap < geometry.ALIGN_ROWS or (budget.every_launch and cap >= budget.sms):
            raise SimError(f"{world} ranks of {widest} programs do not fit: the GPU holds "
                           f"{sms} x {ctas} of the kernels' programs")
        budget = SMBudget(sms=cap, every_launch=True)


_libcuda: Optional[ctypes.CDLL] = None


def _driver(name: str, *args: Any) -> None:
    """Call the CUDA driver's ``name``; a failure is the harness's error."""
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
    rc = getattr(_libcuda, name)(*args)
    if rc != 0:
        raise SimError(f"{name} failed (CUresult {rc})")


def ctas_per_sm(kernel: Any) -> int:
    """The driver's occupancy of a compiled Triton kernel: how many of its
    programs one SM holds at once (``cuOccupancyMaxActiveBlocksPerMultiprocessor``
    with its threads and dynamic shared memory; registers are the function's)."""
    kernel._init_handles()  # loads the module: the CUfunction
    meta = kernel.metadata
    threads = meta.num_warps * getattr(meta, "warp_size", 32)
    n = ctypes.c_int(0)
    _driver("cuOccupancyMaxActiveBlocksPerMultiprocessor", ctypes.byref(n),
            ctypes.c_void_p(kernel.function), ctypes.c_int(threads),
            ctypes.c_size_t(meta.shared))
    return n.value


CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3
CU_LIMIT_STACK_SIZE = 0


def stack_bytes(kernel: Any) -> int:
    """The per-thread local memory of a compiled Triton kernel, its spills' stack
    frame included (``CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES``): what the context's
    stack limit must hold for a launch of it not to raise the limit."""
    kernel._init_handles()
    n = ctypes.c_int(0)
    _driver("cuFuncGetAttribute", ctypes.byref(n), ctypes.c_int(CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES),
            ctypes.c_void_p(kernel.function))
    return n.value


def stack_limit() -> int:
    """The current context's per-thread stack limit (``CU_LIMIT_STACK_SIZE``)."""
    n = ctypes.c_size_t(0)
    _driver("cuCtxGetLimit", ctypes.byref(n), ctypes.c_int(CU_LIMIT_STACK_SIZE))
    return n.value


def raise_stack_limit(need: int) -> int:
    """The stack limit made at least ``need`` bytes (the driver waits for the
    device's work first; never lowered); the limit now (the module's note)."""
    if need > stack_limit():
        _driver("cuCtxSetLimit", ctypes.c_int(CU_LIMIT_STACK_SIZE), ctypes.c_size_t(need))
    return stack_limit()


def layout(plan: Union[Plan, str], budget: SMBudget) -> dict[str, Any]:
    """What a plan launches, for the record: pieces, grids, the one-stage split
    and whether parts own their columns, warps, and the budget it was made with."""
    if isinstance(plan, str):
        return {"declined": plan}
    launchers = [lau for _, lau in plan.pieces]
    first = launchers[0]
    return {"pieces": len(launchers), "grid": max(lau.grid for lau in launchers),
            "split": first.constexprs.get("SPLIT", 1), "own": bool(first.constexprs.get("OWN")),
            "warps": first.options.get("num_warps"), "budget_sms": budget.sms,
            "capped": budget.every_launch}


def kept(backends: Sequence[TritonBackend], provider: "RankBuffers",
         group: Group) -> dict[str, Any]:
    """What one rank's backends and buffer provider keep, for the record, with
    ``group`` the group the rank runs on now: the groups the backends keep plans
    or wait bounds for (name, size, ended), how many plans they keep for
    ``group`` and for groups that ended (none may be), the world sizes those
    plans launch with, whether the provider serves ``group``, and its current
    buffers' world sizes and peer tables (their length and addresses), and which
    provider that is (:attr:`RankBuffers.uid`): a table is stale only where the
    same provider had it before, since a new rank's fresh buffer may land at an
    address an ended rank freed (a new worker process maps its files as the one
    before it did)."""
    seen: set[tuple[str, int, bool]] = set()
    mine = stale = timeouts_stale = 0
    worlds: set[int] = set()
    for be in backends:
        for g in list(be._kept) + list(be._timeouts):
            seen.add((g.name, g.size, g.ended))
        timeouts_stale += sum(1 for g in be._timeouts if g.ended)
        for key, owner in be._owner.items():
            plan = be._plans.get(key)
            if owner.ended:
                stale += 1
            elif owner is group:
                mine += 1
                if isinstance(plan, Plan):
                    worlds.update(lau.constexprs["WORLD"] for _, lau in plan.pieces)
    bufs = list(provider.current.values())
    return {"groups": sorted(seen), "plans": mine, "plans_of_ended": stale,
            "timeouts_of_ended": timeouts_stale, "plan_worlds": sorted(worlds),
            "provider_serves_group": provider.group is group,
            "buffer_worlds": sorted({b.world_size for b in bufs}), "provider": provider.uid,
            "tables": [b.peer_ptrs.tolist() for b in bufs],
            "ended_buffers": len(provider.ended), "generation": provider.generation}


# ---------------------------------------------------------------- buffers


_PROVIDERS = itertools.count()


class RankBuffers:
    """One simulated rank's buffer provider (``TritonBackend(provider=...)``):
    what ``buffers.get`` is to a real rank, per element width, with buffers made
    by ``grow(rank, elem_bits, slot_bytes)`` (a :class:`SymmBuffer`, or why one
    was refused).  Replaced buffers are kept: graphs captured earlier hold
    their addresses.  The buffers are the group's that ``get`` was last asked
    for: asked for another group (one made again under the name), the provider
    puts the old group's buffers aside in ``ended`` and grows the new one's,
    as ``buffers.get`` does for a real rank."""

    def __init__(self, rank: int, grow: Callable[[int, int, int], Union[buffers.SymmBuffer, str]]):
        self.rank, self._grow = rank, grow
        self.uid = (os.getpid(), next(_PROVIDERS))
        """This provider among every one of the run (a worker's pid, a serial in it)."""
        self.group: Any = None
        self.current: dict[int, buffers.SymmBuffer] = {}
        self.retired: list[buffers.SymmBuffer] = []
        self.ended: list[buffers.SymmBuffer] = []
        self.generation = 0

    def switch(self, group: Any) -> None:
        """Serve ``group`` from now on: the buffers of the one before go to ``ended``."""
        if group != self.group:
            if self.group is not None:
                self.ended += list(self.current.values()) + self.retired
                self.current, self.retired = {}, []
                self.generation += 1
            self.group = group

    def get(self, group: Any, elem_bits: int, device: torch.device, need: int,
            max_input_bytes: int) -> Union[buffers.SymmBuffer, str, None]:
        self.switch(group)
        buf = self.current.get(elem_bits)
        if buf is not None and need <= buf.slot_bytes:
            return buf
        slot_bytes = buffers.growth(need, max_input_bytes)
        if slot_bytes is None:
            return None
        made = self._grow(self.rank, elem_bits, slot_bytes)
        if isinstance(made, str):
            return made
        self.install(elem_bits, made)
        return made

    def install(self, elem_bits: int, buf: buffers.SymmBuffer, group: Any = None) -> None:
        if group is not None:
            self.switch(group)
        if self.current.get(elem_bits) is buf:
            return
        if elem_bits in self.current:
            self.retired.append(self.current[elem_bits])
        self.current[elem_bits] = buf
        self.generation += 1


class ThreadExchange:
    """``every_rank`` for ranks that are threads of one process (``buffers.arm``'s
    collective): each rank's value, in rank order, once every rank has given one."""

    def __init__(self, world: int, timeout_s: float = 120.0) -> None:
        self.values: list[Any] = [None] * world
        self.barrier = threading.Barrier(world, timeout=timeout_s)

    def every_rank(self, rank: int) -> Callable[[Any], list[Any]]:
        def exchange(value: Any) -> list[Any]:
            self.values[rank] = value
            self.barrier.wait()
            out = list(self.values)
            self.barrier.wait()
            return out
        return exchange


class ProcessExchange:
    """``every_rank`` for ranks that are forked processes: integers through shared
    memory and a process barrier (made before the fork)."""

    def __init__(self, world: int, ctx: Any, timeout_s: float = 300.0) -> None:
        self.values = ctx.Array("q", world)
        self.barrier = ctx.Barrier(world, timeout=timeout_s)

    def every_rank(self, rank: int) -> Callable[[int], list[int]]:
        def exchange(value: int) -> list[int]:
            self.values[rank] = int(value)
            self.barrier.wait()
            out = list(self.values)
            self.barrier.wait()
            return out
        return exchange


def buffer_set(world: int, elem_bits: int, slot_bytes: int, device: torch.device,
               arm: bool = True) -> Union[list[buffers.SymmBuffer], str]:
    """Every rank's buffer on ``device`` in this process, each rank with its own
    peer table of every rank's address; armed by ``buffers.arm`` on N threads
    (``arm=False``: filled with the empty marker only), or why it was refused."""
    numel = buffers.SLOTS * slot_bytes // (elem_bits // 8)
    dtype = buffers.int_dtype(elem_bits)
    tensors = [torch.empty(numel, dtype=dtype, device=device) for _ in range(world)]
    table = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=device)
    tables = [table.clone() for _ in range(world)]
    if arm:
        why = _arm_threads(tensors, tables, elem_bits)
        if why is not None:
            return why
    else:
        for t in tensors:
            t.fill_(buffers.negative_zero_bits(elem_bits))
    return [buffers.SymmBuffer(tensor=t, peer_ptrs=tables[r], state=buffers.new_state(device),
                               handle=None, rank=r, world_size=world, slot_bytes=slot_bytes)
            for r, t in enumerate(tensors)]


def _arm_threads(tensors: list[torch.Tensor], tables: list[torch.Tensor],
                 elem_bits: int) -> Optional[str]:
    from ..backends.triton_symm import probe

    world = len(tensors)
    # Compile the probe kernel before the ranks wait on each other.
    probe.read_ends(tables[0], tensors[0].numel(), tensors[0].dtype)
    exchange = ThreadExchange(world)
    whys: list[Optional[str]] = [None] * world
    errors: list[str] = []

    def arm_rank(rank: int) -> None:
        try:
            if tensors[rank].is_cuda:  # a thread starts on device 0
                torch.cuda.set_device(tensors[rank].device)
            whys[rank] = buffers.arm(tensors[rank], tables[rank], rank, elem_bits,
                                     exchange.every_rank(rank))
        except BaseException:
            errors.append(f"rank {rank}: {traceback.format_exc()}")
            exchange.barrier.abort()

    threads = [threading.Thread(target=arm_rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SimError("arming the buffers failed:\n" + "\n".join(errors))
    return whys[0]


def _callers(world: int, late: Optional[tuple[int, float]], skip: Sequence[int],
             send: Optional[Callable[[int], None]] = None) -> Any:
    """The ranks that make a call, in order (``send(rank)`` made for each): the
    ``late = (rank, s)`` one last, ``s`` seconds after the others; none of ``skip``."""
    order = [r for r in range(world) if r not in skip and (late is None or r != late[0])]
    if late is not None:
        order.append(late[0])
    for r in order:
        if late is not None and r == late[0]:
            time.sleep(late[1])
        if send is not None:
            send(r)
        yield r


# ---------------------------------------------------------------- one GPU


class _Recorder:
    """Stands in for a launcher to record the arguments a plan launches it with."""

    ready = False

    def __init__(self) -> None:
        self.heads: list[tuple] = []

    def __call__(self, device: int, head: tuple, aligned: bool) -> None:
        self.heads.append(head)


def launch_heads(plan: Plan, call: Call) -> list[tuple[Any, tuple]]:
    """``(launcher, per-call arguments)`` of each launcher of ``plan`` for
    ``call``, as ``Plan.__call__`` passes them (a twin of the plan with recording
    launchers is called: its outputs are allocated, nothing is launched)."""
    twin = copy.copy(plan)
    recorders = {id(lau): _Recorder() for _, lau in plan.pieces}
    twin.pieces = tuple((first, recorders[id(lau)]) for first, lau in plan.pieces)
    twin.launcher = None
    why = twin(call)
    if isinstance(why, str):
        raise SimError(f"the plan declines the call: {why}")
    seen: dict[int, Any] = {id(lau): lau for _, lau in plan.pieces}
    return [(seen[k], rec.heads[0]) for k, rec in recorders.items()]


def compile_launcher(launcher: Any, head: tuple) -> Any:
    """Compile (or find in Triton's caches) the kernel ``launcher`` launches for
    arguments like ``head``, without launching it; the compiled kernel."""
    kernel = launcher.fn.warmup(*head, *launcher.runtime_tail, grid=(launcher.grid,),
                                **launcher.constexprs, **launcher.options)
    return kernel.result() if hasattr(kernel, "result") else kernel


class GpuGroup:
    """N ranks on one GPU (the module's note): one stream, one backend (per
    budget) and one :class:`RankBuffers` per rank."""

    def __init__(self, world: int, device: Optional[int] = None, timeout_s: float = 10.0,
                 name: str = "sim") -> None:
        connections = int(os.environ.get(CONNECTIONS_VAR, "8"))
        if connections < world + 1:
            raise SimError(f"{CONNECTIONS_VAR}={connections}: {world} ranks need at least "
                           f"{world + 1} hardware queues (set it before CUDA starts)")
        self.world, self.name, self.timeout_s = world, name, timeout_s
        self.group = Group(name, world)
        """The group the ranks run on (:meth:`remake` ends it and makes another)."""
        self.device = torch.cuda.current_device() if device is None else device
        self.sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.streams = [torch.cuda.Stream(self.device) for _ in range(world)]
        self.buffers = [RankBuffers(r, self._grow) for r in range(world)]
        self.budget = SMBudget()
        self.cap: Optional[int] = None
        self.stack: Optional[int] = None
        """The context's stack limit as ``prepare`` left it (the module's note)."""
        self._stack_grew: Optional[str] = None
        self._backends: dict[tuple[SMBudget, float], list[TritonBackend]] = {}
        self._compiled: dict[int, tuple[Any, int, int]] = {}

    def _grow(self, rank: int, elem_bits: int, slot_bytes: int) -> Union[buffers.SymmBuffer, str]:
        """Every rank's buffers grow together, as a real group's do (every rank
        sees the same shapes in the same order): the first rank to ask makes the set."""
        made = buffer_set(self.world, elem_bits, slot_bytes, torch.device("cuda", self.device))
        if isinstance(made, str):
            return made
        for r, buf in enumerate(made):
            if r != rank:
                self.buffers[r].install(elem_bits, buf, self.group)
        return made[rank]

    def backend(self, rank: int, budget: Optional[SMBudget] = None) -> TritonBackend:
        """Rank ``rank``'s backend for ``budget`` (default: the one ``prepare``
        chose) and the group's current ``timeout_s``."""
        key = (self.budget if budget is None else budget, self.timeout_s)
        ranks = self._backends.setdefault(key, [])
        while len(ranks) < self.world:
            ranks.append(TritonBackend(provider=self.buffers[len(ranks)],
                                       group=lambda g: self.group, sm_budget=key[0],
                                       timeout_s=key[1]))
        return ranks[rank]

    def remake(self, world: int) -> None:
        """The group destroyed and made again under its name with ``world`` ranks,
        as a process that hosts engines in turn sees it: every rank that is still
        there keeps its backends and buffer provider (the group's old buffers and
        plans must go through the group's end, not through new objects), a rank
        past the new size goes with its objects, a new rank comes with new ones."""
        connections = int(os.environ.get(CONNECTIONS_VAR, "8"))
        if connections < world + 1:
            raise SimError(f"{CONNECTIONS_VAR}={connections}: {world} ranks need at least "
                           f"{world + 1} hardware queues (set it before CUDA starts)")
        self.finish()
        self.group.end()
        self.group = Group(self.name, world)
        keep = min(world, self.world)
        self.streams = self.streams[:keep] + [torch.cuda.Stream(self.device)
                                              for _ in range(keep, world)]
        self.buffers = self.buffers[:keep] + [RankBuffers(r, self._grow)
                                              for r in range(keep, world)]
        for ranks in self._backends.values():
            del ranks[keep:]
        self.world = world

    def inspect(self) -> list[dict[str, Any]]:
        """What each rank's objects keep, per rank (:func:`kept`)."""
        return [kept([b[r] for b in self._backends.values() if len(b) > r], self.buffers[r],
                     self.group) for r in range(self.world)]

    def generations(self) -> list[int]:
        """Each rank's buffer provider's generation (it grows when a buffer does)."""
        return [b.generation for b in self.buffers]

    def _compile(self, plan: Plan, call: Call) -> list[tuple[Any, int, int]]:
        """Every launcher of ``plan`` compiled; ``(launcher, CTAs per SM, stack
        bytes)`` each."""
        out = []
        for launcher, head in launch_heads(plan, call):
            if id(launcher) not in self._compiled:
                kernel = compile_launcher(launcher, head)
                self._compiled[id(launcher)] = (launcher, ctas_per_sm(kernel),
                                                stack_bytes(kernel))
            out.append(self._compiled[id(launcher)])
        return out

    def prepare(self, *call_sets: Sequence[Call]) -> list[list[Union[Plan, str]]]:
        """Each rank's plan of each call set (a plan, or why it was declined), every
        launcher compiled, every launch within the co-residency cap (the module's
        note); later ``launch``/``call`` use the budget chosen here."""
        def attempt(budget: SMBudget) -> tuple[list[list[Union[Plan, str]]], list[tuple[int, int]]]:
            plans = [[self.backend(r, budget).prepare(c, self.device) for r, c in enumerate(cs)]
                     for cs in call_sets]
            launches = [(lau.grid, ctas) for cs, ps in zip(call_sets, plans)
                        for c, p in zip(cs, ps) if not isinstance(p, str)
                        for lau, ctas, _ in self._compile(p, c)]
            return plans, launches

        self.budget, self.cap, plans = fit_budget(self.world, self.sms, attempt)
        # Every rank's kernels, the largest stack among them set while no rank runs.
        stacks = [self._compiled[id(lau)][2] for ps in plans for p in ps
                  if not isinstance(p, str) for _, lau in p.pieces]
        self.stack = raise_stack_limit(max(stacks, default=0))
        return plans

    def call(self, rank: int, call: Call) -> Union[Outputs, str]:
        """Rank ``rank``'s ``Plan.__call__`` on the current stream (its plan must be
        prepared), or why the backend declines the call."""
        plan = self.backend(rank).prepare(call, self.device)
        if isinstance(plan, str):
            return plan
        if any(id(lau) not in self._compiled for _, lau in plan.pieces):
            raise SimError(f"rank {rank}'s call was not prepared (a compile while the peers "
                           "wait could outlast their timeout)")
        return plan(call)

    def launch(self, calls: Sequence[Call], late: Optional[tuple[int, float]] = None,
               skip: Sequence[int] = ()) -> list[Union[Outputs, str, None]]:
        """Every rank's call on its own stream, after the current stream's work;
        ``late = (rank, s)``: that rank's call is made ``s`` seconds after the
        others'; ``skip``: ranks that make no call (None in their place)."""
        current = torch.cuda.current_stream(self.device)
        for s in self.streams:
            s.wait_stream(current)
        outs: list[Union[Outputs, str, None]] = [None] * self.world
        before = stack_limit()
        for r in _callers(self.world, late, skip):
            with torch.cuda.stream(self.streams[r]):
                outs[r] = self.call(r, calls[r])
        self._note_stack(before)
        return outs

    def _note_stack(self, before: int) -> None:
        """Note a stack limit that grew from ``before`` during the ranks' launches
        (a launch then waited for the device while the ranks launched before it
        spun: the module's note); ``finish`` reports it."""
        now = stack_limit()
        if now != before and self._stack_grew is None:
            self._stack_grew = (f"the CUDA stack limit grew from {before} to {now} bytes "
                                "during the ranks' launches (a launch waited for the device "
                                "while the ranks launched before it spun)")

    def finish(self) -> Optional[str]:
        """Wait for every rank's stream; the CUDA error if a kernel failed (the
        context is unusable after it), or a stack limit that grew during the
        launches, else None."""
        current = torch.cuda.current_stream(self.device)
        grew, self._stack_grew = self._stack_grew, None
        try:
            for s in self.streams:
                current.wait_stream(s)
            torch.cuda.synchronize(self.device)
        except RuntimeError as e:
            return f"{type(e).__name__}: {e}" + (f"; {grew}" if grew else "")
        return grew

    def capture(self, step: Callable[[int], Any]) -> tuple[list[Any], list[Any]]:
        """One CUDA graph per rank of ``step(rank)``, captured on the rank's stream
        (nothing runs); ``(graphs, what step returned per rank)``."""
        graphs, results = [], []
        for r in range(self.world):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self.streams[r]):
                results.append(step(r))
            graphs.append(graph)
        return graphs, results

    def replay(self, graphs: Sequence[Any], order: Optional[Sequence[int]] = None,
               gap_s: float = 0.0) -> None:
        """Every rank's graph on its stream after the current stream's work, in
        ``order`` with ``gap_s`` seconds between ranks."""
        current = torch.cuda.current_stream(self.device)
        for s in self.streams:
            s.wait_stream(current)
        before = stack_limit()
        for i, r in enumerate(range(self.world) if order is None else order):
            if i and gap_s:
                time.sleep(gap_s)
            with torch.cuda.stream(self.streams[r]):
                graphs[r].replay()
        self._note_stack(before)

    def close(self) -> None:
        self.finish()


# ---------------------------------------------------------------- the interpreter


def prepare_interpreter() -> None:
    """Make Triton's interpreter run the kernels as a GPU does where it differs
    in ways the protocol depends on: the wait bound reads the host's clock
    (``ptx.globaltimer`` becomes an interpreted function returning
    ``time.monotonic_ns()``: the interpreter has no inline assembly), and
    device assertions fire (the interpreter ignores ``triton.jit(debug=True)``
    and asserts only with its builder's ``debug`` option).  Then every kernel
    function is rewritten for the interpreter (:func:`_warm_interpreter`): in
    every process that runs the kernels interpreted, before its first launch."""
    import dataclasses

    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    from ..backends.triton_symm import ptx

    builder = interpreter.interpreter_builder
    builder.options = dataclasses.replace(builder.options, debug=True)
    if not getattr(ptx.globaltimer, "host_clock", False):
        def host_ns():
            return tl.full((), time.monotonic_ns(), tl.int64)

        clock = triton.jit(host_ns)
        clock.host_clock = True
        ptx.globaltimer = clock
    _warm_interpreter()


def _warm_interpreter() -> None:
    """Rewrite every interpreted kernel function once, before any launch (and
    before an :class:`InterpretedGroup`'s workers fork: each would otherwise do
    it on its first call while its peers wait; in a process of its own, a kernel
    rewritten lazily fails to see ``triton.language``)."""
    from ..backends.triton_symm import lamport, norm, one_stage, probe, ptx, two_stage

    for module in (one_stage, two_stage, lamport, norm, ptx, probe):
        for value in list(vars(module).values()):
            rewrite = getattr(value, "rewrite", None)
            if callable(rewrite) and hasattr(value, "rewritten_fn"):
                rewrite()


def _send(conn: Any, value: Any) -> None:
    buf = io.BytesIO()
    torch.save(value, buf)
    conn.send_bytes(buf.getvalue())


def _recv(conn: Any) -> Any:
    return torch.load(io.BytesIO(conn.recv_bytes()), weights_only=False)


class RankFailed(str):
    """A worker's error in place of its outputs (the traceback's text)."""


class _WorkerGroup:
    """A worker's group: the :class:`Group` its backend and buffers serve, the
    exchange of the group's size, and the epoch and count that name its buffer
    files (every rank names the same file alike)."""

    def __init__(self, name: str, world: int, epoch: int,
                 exchanges: dict[int, ProcessExchange]) -> None:
        self.name, self.exchanges = name, exchanges
        self.start(world, epoch)

    def start(self, world: int, epoch: int) -> None:
        self.group = Group(self.name, world)
        self.world, self.epoch, self.grown = world, epoch, 0
        self.exchange = self.exchanges[world]


def _grow_files(folder: str, state: _WorkerGroup, rank: int, elem_bits: int,
                slot_bytes: int) -> Union[buffers.SymmBuffer, str]:
    """A new buffer for this worker, collectively with the others: each rank
    makes a shared-memory file, every rank maps every rank's file (its own
    addresses: the peer table), and ``buffers.arm`` proves the table."""
    state.grown += 1
    world, exchange = state.world, state.exchange
    numel = buffers.SLOTS * slot_bytes // (elem_bits // 8)
    names = [os.path.join(folder, f"e{state.epoch}_g{state.grown}_r{r}") for r in range(world)]
    with open(names[rank], "wb") as f:
        f.truncate(numel * elem_bits // 8)
    exchange.every_rank(rank)(slot_bytes)  # every rank's file exists
    maps = [torch.from_file(n, shared=True, size=numel, dtype=buffers.int_dtype(elem_bits))
            for n in names]
    table = torch.tensor([m.data_ptr() for m in maps], dtype=torch.int64)
    why = buffers.arm(maps[rank], table, rank, elem_bits, exchange.every_rank(rank))
    if why is not None:
        return why
    return buffers.SymmBuffer(tensor=maps[rank], peer_ptrs=table,
                              state=buffers.new_state(torch.device("cpu")), handle=maps,
                              rank=rank, world_size=world, slot_bytes=slot_bytes)


def _worker(rank: int, world: int, name: str, epoch: int, folder: str,
            exchanges: dict[int, ProcessExchange], conn: Any, timeout_s: float) -> None:
    torch.set_num_threads(1)
    state = _WorkerGroup(name, world, epoch, exchanges)
    provider = RankBuffers(rank, lambda r, bits, size: _grow_files(folder, state, r, bits, size))

    def backend_of(timeout: float) -> TritonBackend:
        return TritonBackend(provider=provider, group=lambda g: state.group,
                             sm_budget=INTERPRETER_BUDGET, timeout_s=timeout)

    backend = backend_of(timeout_s)
    while True:
        op, payload = _recv(conn)
        if op == "exit":
            break
        try:
            if op == "prepare":
                result: Any = [layout(backend.prepare(c, -1), INTERPRETER_BUDGET) for c in payload]
            elif op == "timeout":
                backend = backend_of(payload)
                result = None
            elif op == "generation":
                result = provider.generation
            elif op == "remake":  # the same objects, another group under the name
                ended = state.group
                state.start(*payload)
                ended.end()
                result = None
            elif op == "inspect":
                result = kept([backend], provider, state.group)
            else:
                result = backend.run_on(payload, -1)
            _send(conn, ("ok", result))
        except BaseException:
            _send(conn, ("error", traceback.format_exc()))
    conn.close()


class InterpretedGroup:
    """N ranks as forked worker processes running the kernels in Triton's
    interpreter (the module's note).  ``prepare`` returns each plan's
    :func:`layout` (plans stay in the workers)."""

    def __init__(self, world: int, timeout_s: float = 60.0, name: str = "sim",
                 answer_s: float = 600.0) -> None:
        from triton import knobs

        if not knobs.runtime.interpret:
            raise SimError("InterpretedGroup needs TRITON_INTERPRET=1 before Triton is imported")
        self.world, self.name, self._timeout_s, self.answer_s = world, name, timeout_s, answer_s
        self.device = -1
        self.budget = INTERPRETER_BUDGET
        prepare_interpreter()
        if world > MAX_WORLD:
            raise SimError(f"at most {MAX_WORLD} interpreted ranks, not {world}")
        torch.set_num_threads(1)  # no thread pool may run while the workers fork
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self._folder = tempfile.mkdtemp(prefix="fusion_pass_sim_", dir=shm)
        self._ctx = multiprocessing.get_context("fork")
        # One exchange per group size, made before any worker forks: a remade group's
        # ranks, old workers and new, share the one of its size.
        self._exchanges = {w: ProcessExchange(w, self._ctx) for w in range(1, MAX_WORLD + 1)}
        self._epoch = 0
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        for r in range(world):
            self._start(r)

    def _start(self, rank: int) -> None:
        """Fork rank ``rank``'s worker for the group as it is now."""
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker, args=(
            rank, self.world, self.name, self._epoch, self._folder, self._exchanges, child,
            self._timeout_s), daemon=True)
        proc.start()
        child.close()
        self._conns.append(parent)
        self._procs.append(proc)

    def remake(self, world: int) -> None:
        """The group destroyed and made again under its name with ``world`` ranks
        (:meth:`GpuGroup.remake`): a worker still in the group keeps its process,
        backend and buffer provider; a worker past the new size exits; a new rank
        gets a new worker."""
        if world > MAX_WORLD:
            raise SimError(f"at most {MAX_WORLD} interpreted ranks, not {world}")
        self._epoch += 1
        keep = min(world, self.world)
        for r in range(keep):
            _send(self._conns[r], ("remake", (world, self._epoch)))
        for r in range(keep):
            answer = self._answer(r)
            if isinstance(answer, RankFailed):
                raise SimError(f"rank {r} failed at remake:\n{answer}")
        for conn, proc in zip(self._conns[keep:], self._procs[keep:]):
            _send(conn, ("exit", None))
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        del self._conns[keep:], self._procs[keep:]
        self.world = world
        for r in range(keep, world):
            self._start(r)

    def inspect(self) -> list[dict[str, Any]]:
        """What each rank's objects keep, per rank (:func:`kept`)."""
        return self._ask("inspect")

    def _ask(self, op: str, payload: Any = None) -> list[Any]:
        for conn in self._conns:
            _send(conn, (op, payload))
        answers = [self._answer(r) for r in range(self.world)]
        for r, a in enumerate(answers):
            if isinstance(a, RankFailed):
                raise SimError(f"rank {r} failed at {op}:\n{a}")
        return answers

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        """Every worker's wait bound (a new backend in each; plans are made again)."""
        if value != self._timeout_s:
            self._ask("timeout", value)
            self._timeout_s = value

    def generations(self) -> list[int]:
        return self._ask("generation")

    def _answer(self, rank: int) -> Any:
        conn = self._conns[rank]
        if not conn.poll(self.answer_s):
            return RankFailed(f"rank {rank} gave no answer within {self.answer_s} s")
        status, value = _recv(conn)
        return value if status == "ok" else RankFailed(value)

    def prepare(self, *call_sets: Sequence[Call]) -> list[list[Any]]:
        """Each rank's plan layout per call set (every rank prepares at once: a
        buffer grows collectively)."""
        for r in range(self.world):
            _send(self._conns[r], ("prepare", [cs[r] for cs in call_sets]))
        answers = [self._answer(r) for r in range(self.world)]
        for r, a in enumerate(answers):
            if isinstance(a, RankFailed):
                raise SimError(f"rank {r} failed at prepare:\n{a}")
        return [[answers[r][i] for r in range(self.world)] for i in range(len(call_sets))]

    def launch(self, calls: Sequence[Call], late: Optional[tuple[int, float]] = None,
               skip: Sequence[int] = ()) -> list[Any]:
        """Every rank's call (``late``, ``skip``: as :meth:`GpuGroup.launch`); the
        outputs, the reason a call was declined, or :class:`RankFailed`."""
        order = list(_callers(self.world, late, skip, send=lambda r: _send(
            self._conns[r], ("run", calls[r]))))
        outs: list[Any] = [None] * self.world
        for r in order:
            outs[r] = self._answer(r)
        return outs

    def finish(self) -> Optional[str]:
        return None  # launch waited for every rank

    def close(self) -> None:
        for conn in self._conns:
            try:
                _send(conn, ("exit", None))
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        shutil.rmtree(self._folder, ignore_errors=True)
