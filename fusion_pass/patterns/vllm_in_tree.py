"""Sites that vLLM's own all-reduce + RMSNorm fusion already fused.

vLLM 0.32 has in-tree passes for the same fusion (``pass_config.fuse_allreduce_rms``):
FlashInfer's TRT-LLM kernel on CUDA, AITER's on ROCm.  Its pass manager runs them
before a custom post-grad pass, so where both are enabled the graph reaching
:mod:`fusion_pass` holds vLLM's fused ops instead of all-reduce + norm.  Those sites
are recorded as fused by vLLM (path :data:`records.IN_TREE`), and the first one
says once which fusion the user gets.

Ops are recognised by name (``auto_functionalized`` unwrapped): the ROCm ops exist
only in ROCm builds of vLLM and FlashInfer's only where FlashInfer imports.
"""

from __future__ import annotations

import logging
from typing import Optional

from torch import fx

from .. import gate, records
from .. import vllm_names as vn
from ..log import once
from .collectives import register_fused_elsewhere
from .fx_utils import op_name, val

IN_TREE_OPS = {
    vn.FLASHINFER_AR_NORM: "FlashInfer TRT-LLM (CUDA)",
    vn.AITER_AR_NORM: "AITER (ROCm)",
    vn.AITER_AR_NORM_GROUP_QUANT: "AITER (ROCm) + per-group FP8",
    vn.AITER_AR_NORM_GROUP_QUANT_BF16: "AITER (ROCm) + per-group FP8, bf16 norm kept",
}
REASON = ("fused by vLLM's in-tree all-reduce fusion ({kernel}), which vLLM runs before "
          "custom passes; fusion_pass leaves it alone")


def _tp_world_size() -> int:
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_world_size()
    return 0


def _in_tree(node: fx.Node) -> Optional[records.SiteRecord]:
    name = op_name(node)
    kernel = IN_TREE_OPS.get(name)
    if kernel is None:
        return None
    inputs = [a for a in list(node.args) + list(node.kwargs.values()) if isinstance(a, fx.Node)]
    x = next((val(a) for a in inputs if val(a) is not None and val(a).dim() >= 2), None)
    once("vllm-in-tree", f"fusion_pass: vLLM's in-tree all-reduce fusion ({kernel}) is enabled "
         "and fused all-reduce + RMSNorm sites before this pass: those run vLLM's kernel, "
         "fusion_pass fuses only what it left (see README, 'vLLM's in-tree fusion')",
         logging.WARNING)
    tokens = None
    if x is not None:
        n = gate.tokens_of(x.shape)
        tokens = n if isinstance(n, int) else None
    return records.SiteRecord(
        collective="vllm_in_tree", norm=name.split("::")[-1],
        hidden=x.shape[-1] if x is not None and isinstance(x.shape[-1], int) else None,
        dtype=gate.dtype_name(x.dtype) if x is not None else None,
        world_size=_tp_world_size(), tokens="unknown" if tokens is None else str(tokens),
        path=records.IN_TREE, reason=REASON.format(kernel=kernel), backend="vllm", group="tp",
        quant="per_group" if "quant_per_group" in name else None)


register_fused_elsewhere("vllm_in_tree", _in_tree)
