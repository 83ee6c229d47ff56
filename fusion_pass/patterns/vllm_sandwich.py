"""vLLM 0.34's sandwich norm: the norm after an all-reduce, taken by AITER's
``fused_rmsnorm_add_rmsnorm`` before this pass runs.

On ROCm gfx950 with AITER, for bf16 Muse Glimmer models, vLLM's
``MuseSandwichNormFusionPass`` (on whenever those hold; no ``pass_config`` switch) replaces
``rms_norm(x, 1 + w_post) -> + residual -> rms_norm(., 1 + w_pre)`` by one AITER kernel
before custom passes.  There ``x`` is the all-reduced attention or MLP output, so the graph
reaching this pass holds ``all_reduce -> fused_rmsnorm_add_rmsnorm``.  The kernel
(``_fused_rmsnorm_add_rmsnorm_kernel``) normalises ``x`` in fp32, adds the residual in fp32,
stores that sum rounded to bf16 and normalises it again: two norms around a residual add,
where the fused op has one norm with the add before it.  The fused op cannot compute the
kernel's outputs, so the site is recorded unfused with a reason naming the op.

AITER has shipped the function both as a registered op (``torch.ops.aiter``, mutating its
``residual_out``) and as a plain Python launch of the Triton kernel (in the graph: a Triton
kernel call of that kernel); both are recognised.  Loaded by
:func:`fusion_pass.patterns.load_vllm_forms` once vLLM is imported.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import fx

from .. import vllm_names as vn
from .fx_utils import op_name
from .rms_norm import Matched, NormMiss, Reduced, register_norm_matcher

_TRITON_CALLS = tuple(getattr(torch.ops.higher_order, name) for name in (
    "triton_kernel_wrapper_functional", "triton_kernel_wrapper_mutation")
    if hasattr(torch.ops.higher_order, name))

REASON = ("{node} ({what}) is vLLM's sandwich norm ({pass_}: RMSNorm, residual add, RMSNorm "
          "in one AITER kernel, fused before custom passes on ROCm gfx950): two norms around "
          "a residual add, where the fused op has one norm after the add")


def _kernel_name(node: fx.Node) -> Optional[str]:
    """The name of the Triton kernel a Triton-kernel call node launches."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    try:
        kernel: Any = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
    except (KeyError, AssertionError, IndexError):
        return None
    while not hasattr(kernel, "__name__") and hasattr(kernel, "fn"):
        kernel = kernel.fn  # an Autotuner or JITFunction around the Python function
    return getattr(kernel, "__name__", None)


def sandwich_op(node: fx.Node) -> Optional[str]:
    """How ``node`` runs AITER's sandwich norm (for the reason), or None if it does not."""
    if op_name(node) == vn.SANDWICH_NORM:
        return vn.SANDWICH_NORM
    if node.op == "call_function" and node.target in _TRITON_CALLS and \
            _kernel_name(node) == vn.SANDWICH_NORM_KERNEL:
        return f"Triton kernel {vn.SANDWICH_NORM_KERNEL}"
    return None


def match_sandwich(red: Reduced) -> Optional[Matched]:
    """A miss naming the sandwich-norm op when the reduced value feeds one; None otherwise."""
    for node in red.value.users:
        what = sandwich_op(node)
        if what is not None:
            return NormMiss(REASON.format(node=node.name, what=what, pass_=vn.SANDWICH_NORM_PASS),
                            node)
    return None


register_norm_matcher("vllm_sandwich", match_sandwich, priority=30)
