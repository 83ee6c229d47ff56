"""The fused op ``torch.ops.fusion_pass.allreduce_rmsnorm`` and its Python entry point.

Functional (no mutated arguments) so that Inductor needs no
``auto_functionalized`` copies around it.  The path is a string argument baked
in by the pass; ``runtime`` (or ``auto``) asks the gate per call with the
concrete token count.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import backends, gate
from .backends import reference
from .groups import c10d_world_size
from .log import once

PATHS = ("auto",) + tuple(p.value for p in gate.Path)


def _check(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
           path: str) -> None:
    """Errors a caller must fix: they would be wrong on every backend."""
    if path not in PATHS:
        raise ValueError(f"fusion_pass: path must be one of {PATHS}, not {path!r}")
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"fusion_pass: weight of shape {tuple(weight.shape)} does not "
                         f"match input of shape {tuple(x.shape)} (needs [hidden])")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"fusion_pass: residual {tuple(residual.shape)} {residual.dtype} "
                         f"does not match input {tuple(x.shape)} {x.dtype}")


def _unfit(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor) -> Optional[str]:
    """Why no fused kernel can take these tensors as they are, or None."""
    if not x.is_contiguous() or (residual is not None and not residual.is_contiguous()):
        return "non-contiguous input"
    if not weight.is_contiguous():
        return "non-contiguous weight"
    return None


def choose_path(x: torch.Tensor, group_name: str, path: str,
                limits: gate.BackendLimits) -> gate.Decision:
    """The path for this call: the baked one, or the gate's per-call choice."""
    if path in ("auto", gate.Path.RUNTIME.value):
        tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return gate.decide(x.shape[-1], x.dtype, c10d_world_size(group_name), tokens,
                           limits=limits)
    return gate.Decision(gate.Path(path), "chosen at compile time")


@torch.library.custom_op("fusion_pass::allreduce_rmsnorm", mutates_args=())
def allreduce_rmsnorm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                      eps: float, group_name: str, path: str,
                      gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = all_reduce(x) (+ residual)``, ``y = rmsnorm(h) * w``; returns ``(y, h)``."""
    _check(x, residual, weight, path)
    backend = backends.select(x.device.type)
    if backend.name != "reference" and path != gate.Path.UNFUSED.value:
        decision = choose_path(x, group_name, path, backend.limits)
        why = _unfit(x, residual, weight) if decision.fused else decision.reason
        if why is None:
            out = backend.run(x, residual, weight, eps, group_name, decision.path, gemma)
            if out is not None:
                return out
            why = "the backend declined the input"
        # Keyed without the token count, so that a long run says it once per shape class.
        once(f"fallback:{backend.name}:{x.shape[-1]}:{x.dtype}:{decision.path}:{why[:24]}",
             f"fusion_pass: {backend.name} backend falls back to the reference for "
             f"{tuple(x.shape)} {x.dtype}: {why}")
    return reference.ReferenceBackend().run(x, residual, weight, eps, group_name,
                                            gate.Path.UNFUSED, gemma)


@allreduce_rmsnorm.register_fake
def _(x, residual, weight, eps, group_name, path, gemma=False):
    _check(x, residual, weight, path)
    return torch.empty_like(x), torch.empty_like(x)


def fused_allreduce_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, group_name: str,
                            residual: Optional[torch.Tensor] = None, path: str = "auto",
                            gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """All-reduce ``x`` over the c10d group ``group_name``, add ``residual``, RMSNorm.

    Returns ``(y, h)``: the normalised output and the pre-norm sum, both in
    ``x.dtype``.  ``path`` is ``auto`` (the gate decides per call) or one of
    ``one_stage``, ``two_stage``, ``unfused``.
    """
    return torch.ops.fusion_pass.allreduce_rmsnorm(x, residual, weight, eps, group_name,
                                                   str(path), gemma)
