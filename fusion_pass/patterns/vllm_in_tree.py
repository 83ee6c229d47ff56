"""Sites that vLLM's own all-reduce + RMSNorm fusion already fused.

vLLM 0.32 has in-tree passes for the same fusion (``pass_config.fuse_allreduce_rms``):
FlashInfer's TRT-LLM kernel on CUDA, AITER's on ROCm.  Its pass manager runs them
before a custom post-grad pass, so where both are enabled the graph reaching
:mod:`fusion_pass` holds vLLM's fused ops instead of all-reduce + norm.  Those sites
are recorded as fused by vLLM (path ``vllm_in_tree``), and the first one
says once which fusion the user gets.

Ops are recognised by name (``auto_functionalized`` unwrapped): the ROCm ops exist
only in ROCm builds of vLLM and FlashInfer's only where FlashInfer imports.
"""

from __future__ import annotations

import logging
from typing import Optional

from torch import fx

from .. import vllm_names as vn
from ..log import once
from .collectives import FusedElsewhere, register_fused_elsewhere
from .fx_utils import op_name, val

IN_TREE_OPS = {
    vn.FLASHINFER_AR_NORM: "FlashInfer TRT-LLM (CUDA)",
    vn.AITER_AR_NORM: "AITER (ROCm)",
    vn.AITER_AR_NORM_GROUP_QUANT: "AITER (ROCm) + per-group FP8",
    vn.AITER_AR_NORM_GROUP_QUANT_BF16: "AITER (ROCm) + per-group FP8, bf16 norm kept",
}
REASON = ("fused by vLLM's in-tree all-reduce fusion ({kernel}), which vLLM runs before "
          "custom passes; fusion_pass leaves it alone")


def _tp_group() -> tuple[int, str]:
    """The world size and c10d group name of vLLM's tensor-parallel group, whose
    all-reduces the in-tree fusion takes (its ops name no group)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, ""
    group = parallel_state.get_tp_group()
    return group.world_size, group.device_group.group_name


def _in_tree(node: fx.Node) -> Optional[FusedElsewhere]:
    name = op_name(node)
    kernel = IN_TREE_OPS.get(name)
    if kernel is None:
        return None
    inputs = [a for a in list(node.args) + list(node.kwargs.values()) if isinstance(a, fx.Node)]
    x = next((a for a in inputs if val(a) is not None and val(a).dim() >= 2), None)
    once("vllm-in-tree", f"fusion_pass: vLLM's in-tree all-reduce fusion ({kernel}) is enabled "
         "and fused all-reduce + RMSNorm sites before this pass: those run vLLM's kernel, "
         "fusion_pass fuses only what it left (see README, 'vLLM's in-tree fusion')",
         logging.WARNING)
    world_size, group = _tp_group()
    return FusedElsewhere(node=node, form="vllm_in_tree", inp=x, norm=name.split("::")[-1],
                          reason=REASON.format(kernel=kernel), world_size=world_size,
                          group_name=group, backend="vllm",
                          quant="per_group" if "quant_per_group" in name else None)


register_fused_elsewhere("vllm_in_tree", _in_tree, priority=0)
