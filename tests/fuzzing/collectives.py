"""The ranks' all-reduces: synchronous, and counted.

Inductor (torch 2.13, CPU) can emit a kernel that reads an all-reduce's result
before that all-reduce's ``wait_tensor``: a graph that reduces twice and reads the
first sum in two places (``z = rms_norm(h); hh = all_reduce(y @ m) + h``) gets
``hh``'s add fused into ``z``'s kernel, which runs before the wait.  With gloo the
sum is then read while it is still being formed, and the result changes from run
to run, with or without the pass.  :func:`install` makes ``_c10d_functional``'s
all-reduces (what compiled graphs, the fused op's reference and eager functional
collectives call) complete before they return, so the order of the wait is moot;
the graphs compiled are the same.  It also counts them, so that the leader knows
whether a run that raised had already met its peer in a collective.
"""

from __future__ import annotations

from typing import Any

_issued = [0]


def issued() -> int:
    """All-reduces this process has started."""
    return _issued[0]


def install() -> Any:
    """Replace the CPU kernels of ``_c10d_functional.all_reduce`` and ``all_reduce_``;
    returns the library that holds them (they last as long as it does)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
           "product": dist.ReduceOp.PRODUCT}

    def all_reduce_(t, op, group_name):
        _issued[0] += 1
        dist.all_reduce(t, op=ops[op.lower()], group=_resolve_process_group(group_name))
        return t

    def all_reduce(t, op, group_name):
        return all_reduce_(t.clone(memory_format=torch.contiguous_format), op, group_name)

    lib = torch.library.Library("_c10d_functional", "IMPL")
    lib.impl("all_reduce_", all_reduce_, "CPU")
    lib.impl("all_reduce", all_reduce, "CPU")
    return lib


def count(fn: Any) -> Any:
    """``fn`` (an all-reduce of another library) counted as :func:`install`'s are."""
    def counted(*args, **kwargs):
        _issued[0] += 1
        return fn(*args, **kwargs)

    return counted
