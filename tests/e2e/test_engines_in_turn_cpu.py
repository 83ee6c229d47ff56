"""Engines one after another in the same processes: plain torch.compile on gloo ranks.

A process that hosts engines in turn destroys its tensor-parallel group and
makes the next one, often under the same c10d name ("0"), of another size or
of the same size with new communicators.  Here four gloo rank processes run
four engines in turn, each a fresh compile of a small TP model under the
default group "0": of 2 ranks, 4 ranks, 2 ranks again and 2 ranks once more
(ranks 2 and 3 wait out the engines they are not part of).  Every engine: the model
compiled with the pass and without it, every all-reduce -> RMSNorm site fused
(counted from the model's structure: the embedding's all-reduce and one per
layer), the outputs equal to the unfused compile's.

Twice: with the reference backend (what the CPU runs), and with the Triton
backend's host side and kernels in Triton's interpreter, over the real
``buffers`` module (its topology agreement, allocation, rendezvous and
``arm``): torch's symmetric memory stood in for by shared-memory files every
rank maps (:class:`FileSymmetricMemory`).  There every call also checks that
the plan and buffer it got were made for the group registered under the name
now, with its size, and every engine checks that nothing of an earlier group
is kept: no plan, decline or wait bound in the backend, no buffer in the
buffers module's tables, the earlier groups ended, their buffers freed.
"""

from __future__ import annotations

import gc
import os
import weakref
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch

from fusion_pass.testing.spawn import free_port, run_ranks

SIZES = (2, 4, 2, 2)
"""The engines' group sizes, in turn: another size, back, and the same size again
(world sizes the gate fuses: 3 is not one of them, and its sites stay unfused)."""
RANKS = max(SIZES)
HIDDEN, TOKENS, LAYERS, EPS = 128, 4, 2, 1e-6
INTERPRETED = "triton-interpreted"


def expected_sites(layers: int) -> int:
    """The model's all-reduce -> RMSNorm sites: the embedding's all-reduce feeds the
    first norm (no residual), and each layer's row-parallel projection feeds the
    next norm (with the residual)."""
    return 1 + layers


class FileSymmetricMemory:
    """torch's symmetric memory for ranks that are processes of one machine, on
    the CPU: an allocation is a shared-memory file, and the rendezvous maps every
    rank's file (one collective over the group, to learn the files' names).  Its
    ``empty`` stands in for ``buffers._symmetric_empty``, its ``rendezvous`` for
    ``torch.distributed._symmetric_memory.rendezvous``."""

    def __init__(self, folder: str) -> None:
        self.folder, self.made, self.paths = folder, 0, {}

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.made += 1
        path = os.path.join(self.folder, f"p{os.getpid()}_{self.made}")
        with open(path, "wb") as f:
            f.truncate(numel * torch.tensor([], dtype=dtype).element_size())
        t = torch.from_file(path, shared=True, size=numel, dtype=dtype)
        self.paths[t.data_ptr()] = path
        return t

    def rendezvous(self, tensor: torch.Tensor, group_name: str) -> Any:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        group = distributed_c10d._resolve_process_group(group_name)
        mine = self.paths[tensor.data_ptr()]
        paths: list[Any] = [None] * group.size()
        dist.all_gather_object(paths, mine, group=group)
        maps = [tensor if p == mine else
                torch.from_file(p, shared=True, size=tensor.numel(), dtype=tensor.dtype)
                for p in paths]
        return SimpleNamespace(buffer_ptrs=[m.data_ptr() for m in maps], rank=group.rank(),
                               world_size=group.size(), maps=maps)


def use_interpreted_triton(folder: str) -> dict[str, Any]:
    """In a rank process started with ``TRITON_INTERPRET=1``: the Triton backend,
    its kernels interpreted, selected for the CPU, over the real ``buffers``
    module with :class:`FileSymmetricMemory`; every rank says it has a GPU of its
    own that maps every other.  Returns the audit every call adds to."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from fusion_pass import backends, groups, topology
    from fusion_pass.backends import triton_symm
    from fusion_pass.backends.triton_symm import buffers
    from fusion_pass.selftest.sim_group import INTERPRETER_BUDGET, prepare_interpreter

    prepare_interpreter()
    files = FileSymmetricMemory(folder)
    buffers._symmetric_empty = files.empty
    symm_mem.rendezvous = files.rendezvous
    gpus = tuple(f"GPU-{r}" for r in range(8))
    topology.local_facts = lambda device: topology.RankFacts(
        "one-host", gpus[dist.get_rank()], dist.get_rank(), gpus)
    audit: dict[str, Any] = {"calls": 0, "stale": []}

    class Interpreted(triton_symm.TritonBackend):
        """The backend on CPU tensors (device -1: the interpreter), each call's plan
        audited against the group registered under its name now."""

        def run(self, call):
            plan = self.prepare(call, -1)
            if isinstance(plan, str):
                return plan
            live = groups.group(call.group_name)
            buf = buffers.current(live, 8 * call.x.element_size(), call.x.device)
            launchers = [lau for _, lau in plan.pieces]
            worlds = {lau.constexprs["WORLD"] for lau in launchers}
            tables = {id(runtime_args(lau)["peer_ptrs"]) for lau in launchers}
            audit["calls"] += 1
            if buf is None or worlds != {live.size} or tables != {id(buf.peer_ptrs)}:
                audit["stale"].append((live.size, sorted(worlds), buf is None))
            return plan(call)

    backends.register(INTERPRETED, lambda: Interpreted(sm_budget=INTERPRETER_BUDGET,
                                                       timeout_s=120.0))
    backends.set_backend(INTERPRETED)
    return audit


def runtime_args(launcher) -> dict[str, Any]:
    """A launcher's plan-fixed arguments that reach the kernel, by name."""
    from fusion_pass.backends.triton_symm.plan import PER_CALL

    rest = list(launcher.fn.arg_names)[len(PER_CALL):]
    return dict(zip([n for n in rest if n not in launcher.constexprs], launcher.runtime_tail))


def _model(rank: int, engine: int, name: str):
    """The TP model of engine ``engine`` as rank ``rank`` holds it, on the c10d group
    ``name``: a vocabulary-parallel embedding's partial sum (all-reduced, then the
    first norm), then ``LAYERS`` row-parallel projections (each all-reduced, plus
    the residual, then a norm); and the rank's input."""
    g = torch.Generator().manual_seed(1000 * engine + rank)
    shards = [torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN ** 0.5 for _ in range(LAYERS)]
    g.manual_seed(1000 * engine + 999)  # the norms' weights: the same on every rank
    norms = [1 + 0.1 * torch.randn(HIDDEN, generator=g) for _ in range(LAYERS + 1)]

    def block(embedded: torch.Tensor) -> torch.Tensor:
        def all_reduce(t):
            return torch.ops._c10d_functional.wait_tensor(
                torch.ops._c10d_functional.all_reduce(t, "sum", name))

        def norm(h, w):
            return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS))

        residual = all_reduce(embedded)
        x = norm(residual, norms[0])
        for shard, w in zip(shards, norms[1:]):
            residual = all_reduce(x @ shard) + residual
            x = norm(residual, w)
        return x

    g.manual_seed(1000 * engine + 500 + rank)
    return block, torch.randn(TOKENS, HIDDEN, generator=g)


def _compiled(block, x: torch.Tensor, fused: bool) -> tuple[torch.Tensor, list]:
    """``block(x)`` compiled anew (with the pass, or without), run twice; the
    second output and the sites the pass recorded."""
    from torch._inductor import config

    from fusion_pass import AllReduceRMSNormFusionPass, records

    torch._dynamo.reset()
    start = len(records.HISTORY)
    with config.patch(post_grad_custom_post_pass=AllReduceRMSNormFusionPass() if fused else None):
        compiled = torch.compile(block, dynamic=False)
        compiled(x)
        out = compiled(x)
    return out, [(s.path, s.reason) for rec in records.HISTORY[start:] for s in rec.sites]


def _state(engine_group, ended_groups: list, audit: Optional[dict]) -> dict[str, Any]:
    """What the Triton backend and the buffers module keep, against the group
    the engine runs on and the groups that ended before it."""
    from fusion_pass import backends
    from fusion_pass.backends.triton_symm import buffers

    be = backends.get(INTERPRETED)
    kept_groups = set(be._kept) | set(be._timeouts) | set(be._owner.values())
    table_groups = ({k[0] for k in buffers._current} | set(buffers._retired)
                    | set(buffers._decided))
    return {
        "backend_groups_other": [repr(g) for g in kept_groups if g is not engine_group],
        "buffer_groups_other": [repr(g) for g in table_groups if g is not engine_group],
        "plans": len(be.held(engine_group)),
        "plan_worlds": sorted({lau.constexprs["WORLD"] for p in be.held(engine_group)
                               if not isinstance(p, str) for _, lau in p.pieces}),
        "buffer_worlds": sorted({b.world_size for b in buffers.held(engine_group)}),
        "earlier_ended": all(g.ended for g in ended_groups),
        "ended_held": len(buffers._ended),
        "calls": audit["calls"], "stale": list(audit["stale"]),
    }


def engines_in_turn(rank: int, world: int, ports: list[int], backend: str,
                    folder: str) -> list[Optional[dict]]:
    """Every engine of :data:`SIZES` this rank is part of (None for the others)."""
    import torch.distributed as dist

    from fusion_pass import groups

    dist.destroy_process_group()  # the spawn's own group: each engine makes its own
    audit = use_interpreted_triton(folder) if backend == INTERPRETED else None
    ended: list = []
    buffers_before: list = []
    out: list[Optional[dict]] = []
    for engine, (size, port) in enumerate(zip(SIZES, ports)):
        if rank >= size:
            out.append(None)
            continue
        dist.init_process_group("gloo", rank=rank, world_size=size,
                                init_method=f"tcp://127.0.0.1:{port}")
        name = dist.group.WORLD.group_name
        block, x = _model(rank, engine, name)
        want, unfused_sites = _compiled(block, x, fused=False)
        got, sites = _compiled(block, x, fused=True)
        group = groups.group(name)
        result: dict[str, Any] = {
            "name": name, "size": group.size, "sites": sites, "unfused_sites": unfused_sites,
            "max_diff": float((got - want).abs().max()), "scale": float(want.abs().max())}
        if audit is not None:
            from fusion_pass.backends.triton_symm import buffers

            result.update(_state(group, ended, audit))
            gc.collect()
            result["earlier_buffers_freed"] = all(r() is None for r in buffers_before)
            buffers_before = [weakref.ref(b) for b in buffers.held(group)]
        ended.append(group)
        dist.destroy_process_group()
        out.append(result)
    return out


def _run(backend: str, tmp_path) -> list[list[Optional[dict]]]:
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1", "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
           "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
    if backend == INTERPRETED:
        env["TRITON_INTERPRET"] = "1"
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    import tempfile

    folder = tempfile.mkdtemp(prefix="fusion_pass_engines_", dir=shm)
    try:
        return run_ranks(engines_in_turn, RANKS, [free_port() for _ in SIZES], backend, folder,
                         env=env, timeout=900)
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def _check_engines(ranks: list[list[Optional[dict]]]) -> None:
    for engine, size in enumerate(SIZES):
        mine = [ranks[r][engine] for r in range(RANKS)]
        assert all(m is None for m in mine[size:])
        for r, res in enumerate(mine[:size]):
            assert res["name"] == ranks[0][0]["name"], "every engine's group has the first's name"
            assert res["size"] == size
            assert res["unfused_sites"] == []
            assert len(res["sites"]) == expected_sites(LAYERS), (engine, r, res["sites"])
            assert all(path != "unfused" for path, _ in res["sites"]), (engine, r, res["sites"])
            assert res["max_diff"] <= 1e-5 * max(1.0, res["scale"]), (engine, r, res)


@pytest.fixture(scope="module")
def reference_ranks(tmp_path_factory):
    return _run("reference", tmp_path_factory.mktemp("ref"))


@pytest.fixture(scope="module")
def interpreted_ranks(tmp_path_factory):
    pytest.importorskip("triton")
    return _run(INTERPRETED, tmp_path_factory.mktemp("interp"))


@pytest.mark.slow
def test_reference_engines_fuse_every_site_under_a_reused_name(reference_ranks):
    _check_engines(reference_ranks)


@pytest.mark.slow
def test_interpreted_triton_engines_fuse_every_site_under_a_reused_name(interpreted_ranks):
    _check_engines(interpreted_ranks)


@pytest.mark.slow
def test_no_state_of_an_earlier_group_is_kept_or_used(interpreted_ranks):
    for engine, size in enumerate(SIZES):
        for r in range(size):
            res = interpreted_ranks[r][engine]
            assert res["calls"] > 0 and res["stale"] == [], (engine, r, res)
            assert res["backend_groups_other"] == [], (engine, r, res)
            assert res["buffer_groups_other"] == [], (engine, r, res)
            assert res["plans"] > 0 and res["plan_worlds"] == [size], (engine, r, res)
            assert res["buffer_worlds"] == [size], (engine, r, res)
            assert res["earlier_ended"] and res["ended_held"] == 0, (engine, r, res)
            assert res["earlier_buffers_freed"], (engine, r, res)
