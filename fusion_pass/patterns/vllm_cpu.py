"""The CPU build of vLLM: its shared-memory all-reduce, as it appears in graphs.

On x86 CPUs with the AVX-512 kernels, vLLM's tensor-parallel group sums with
``torch.ops._C.shm_allreduce(handle, x)``, an in-place op.  Functionalization
turns it into ``getitem(auto_functionalized(_C.shm_allreduce, handle=h,
input=x), 1)``, with the shared-memory handle ``h`` baked in as an integer.
The finder maps ``h`` back to the vLLM group that owns it, so that the fused op
reduces over that group's c10d (gloo) group instead.

Where the SHM kernels are absent (AVX2 builds) vLLM falls back to
``torch.distributed.all_reduce``, which Dynamo traces as the c10d functional
form that :mod:`.collectives` already matches.

Registered by :func:`fusion_pass.patterns.load_vllm_forms` once vLLM is
imported: the op exists only when vLLM's CPU kernels are loaded.
"""

from __future__ import annotations

import operator
from typing import Any, Optional, Union

import torch
from torch import fx

from .. import vllm_names as vn
from .collectives import AllReduceSite, SiteMiss, register_finder
from .fx_utils import is_call, mutated_index, op_name

SHM_ALLREDUCE = vn.SHM_ALLREDUCE
FORM = "vllm_cpu_shm"


def shm_group(handle: int) -> Optional[Any]:
    """The vLLM GroupCoordinator whose SHM communicator owns ``handle``, if any."""
    from vllm.distributed import parallel_state

    for ref in list(parallel_state._groups.values()):
        group = ref()
        comm = getattr(group, "device_communicator", None)
        if getattr(getattr(comm, "dist_module", None), "handle", None) == handle:
            return group
    return None


def _shm_all_reduce(node: fx.Node) -> Union[AllReduceSite, SiteMiss, None]:
    if not is_call(node, operator.getitem):
        return None
    af, idx = node.args
    if not is_call(af, torch.ops.higher_order.auto_functionalized) or len(af.users) != 1:
        return None
    op = af.args[0]
    if op_name(af) != SHM_ALLREDUCE:
        return None
    tensors = {k: v for k, v in af.kwargs.items() if isinstance(v, fx.Node)}
    handles = [v for v in af.kwargs.values() if isinstance(v, int) and not isinstance(v, bool)]
    if len(tensors) != 1 or len(handles) != 1:
        return None
    (name, x), = tensors.items()
    if mutated_index(op._schema, name) != idx:
        return None
    group = shm_group(handles[0])
    if group is None:  # not a group of this process: leave the site alone
        return SiteMiss(f"{node.name}: no vLLM group of this process owns SHM handle "
                        f"{handles[0]}", af, FORM)
    return AllReduceSite(out=node, inp=x, group_name=group.device_group.group_name,
                         world_size=group.world_size, form=FORM, nodes=[af, node])


register_finder(FORM, _shm_all_reduce, priority=20)
