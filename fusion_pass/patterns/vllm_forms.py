"""vLLM's forms: ``vllm.all_reduce`` and the ``vllm_ir`` RMSNorm ops.

Imported only when vLLM is (see :func:`fusion_pass.patterns.load_vllm_forms`):
a graph can only contain these ops if vLLM registered them.
"""

from __future__ import annotations

import operator
from typing import Any, Optional, Union

import torch
from torch import fx

from .. import vllm_names as vn
from .collectives import AllReduceSite, SiteMiss, register_finder
from .fx_utils import dtype_of, is_call, op_name, val
from .rms_norm import (Matched, NormMatch, NormMiss, Reduced, eps_operand, register_norm_matcher,
                       unwrap_weight)

_ALL_REDUCE = vn.ALL_REDUCE
_RMS_NORM = vn.RMS_NORM
_FUSED_ADD_RMS_NORM = vn.FUSED_ADD_RMS_NORM


def _target(node: fx.Node) -> str:
    """The schema name of a direct call (``vllm::all_reduce``); these ops are functional,
    so a call seen through ``auto_functionalized`` is not one of them."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return ""
    return op_name(node)


def vllm_group(group_name: str) -> Any:
    """vLLM's GroupCoordinator registered as ``group_name`` (e.g. ``tp:0``)."""
    from vllm.distributed import parallel_state

    ref = parallel_state._groups.get(group_name)
    group = ref() if ref is not None else None
    if group is None:
        raise LookupError(f"vLLM group {group_name!r} is not initialised in this process")
    return group


def _vllm_all_reduce(node: fx.Node) -> Union[AllReduceSite, SiteMiss, None]:
    """``torch.ops.vllm.all_reduce(x, "tp:0")``."""
    if _target(node) != _ALL_REDUCE or not isinstance(node.args[0], fx.Node):
        return None
    try:
        group = vllm_group(node.args[1])
    except LookupError as e:  # not a group of this process: leave the site alone
        return SiteMiss(str(e), node, "vllm")
    return AllReduceSite(out=node, inp=node.args[0], group_name=group.device_group.group_name,
                         world_size=group.world_size, form="vllm", nodes=[node])


def _match_vllm_ir(red: Reduced) -> Optional[Matched]:
    """``vllm_ir.rms_norm(ar, w, eps)`` or ``vllm_ir.fused_add_rms_norm(ar, r, w, eps)``
    of the reduced value ``ar``; None when it feeds neither."""
    ar = red.value
    v = val(ar)
    if v is None or v.dim() < 1:
        return None
    hidden = v.shape[-1]
    miss: Optional[NormMiss] = None
    for norm in ar.users:
        target = _target(norm)
        if target == _RMS_NORM and norm.args[0] is ar:
            x_args, rest = 1, norm.args[1:]
        elif target == _FUSED_ADD_RMS_NORM and ar in norm.args[:2] and norm.args[0] is not norm.args[1]:
            x_args, rest = 2, norm.args[2:]
        else:
            continue
        weight, eps = rest[0], eps_operand(rest[1])
        variance_size = rest[2] if len(rest) > 2 else norm.kwargs.get("variance_size")
        found = unwrap_weight(weight, hidden)
        if found is None:
            miss = NormMiss(f"{norm.name} has no [hidden] floating weight", norm)
            continue
        if variance_size not in (None, hidden):
            miss = NormMiss(f"{norm.name} normalises over the first {variance_size} of "
                            f"{hidden} elements (a partial-row variance)", norm)
            continue
        if isinstance(eps, str):
            miss = NormMiss(eps, norm)
            continue
        # The ops compute x.to(weight.dtype) * weight: a weight in the input's 16-bit dtype
        # multiplies the normalised row rounded to it (vLLM's CUDA kernels do the same);
        # the fused op rounds it to the input's dtype or not at all.
        w_dtype = dtype_of(weight)
        if w_dtype not in (v.dtype, torch.float32):
            miss = NormMiss(f"{norm.name}'s weight is {w_dtype} and its input {v.dtype}: the "
                            f"normalised row is rounded to {w_dtype}, which the fused op does "
                            "not do", norm)
            continue
        round_normed = w_dtype == v.dtype and v.dtype != torch.float32
        if x_args == 1:
            return NormMatch(form="vllm_ir_rms_norm", weight=found[0], eps=eps,
                             out_dtype=v.dtype, gemma=found[1], round_normed=round_normed,
                             outputs={norm: "y", ar: "h"}, nodes={norm, ar})
        residual = norm.args[1] if norm.args[0] is ar else norm.args[0]
        outs = [u for u in norm.users if is_call(u, operator.getitem)]
        if len(outs) != len(norm.users):
            miss = NormMiss(f"{norm.name}'s outputs are used other than by indexing", norm)
            continue
        return NormMatch(form="vllm_ir_fused_add_rms_norm", weight=found[0], eps=eps,
                         out_dtype=v.dtype, residual=residual, gemma=found[1],
                         round_normed=round_normed,
                         outputs={g: ("y", "h")[g.args[1]] for g in outs},
                         nodes={norm, ar, *outs}, private={ar, norm})
    return miss


register_finder("vllm", _vllm_all_reduce, priority=10)
register_norm_matcher("vllm_ir", _match_vllm_ir, priority=10)
