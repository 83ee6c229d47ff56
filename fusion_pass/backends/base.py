"""What a backend of the fused op is: the call it gets, what it returns, its protocol.

A backend computes :class:`Outputs` for a :class:`Call` on the path the gate
chose, or returns the reason it declines the call; the op then runs the
reference backend and says why once.  Which shapes a backend's kernels take is
its ``limits`` (:class:`~fusion_pass.gate.BackendLimits`), which the gate reads
at compile time and the op at run time; a backend itself checks only what
belongs to one call (contiguity, alignment, devices, buffers under capture).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Protocol, Union

import torch

from ..gate import BackendLimits, FusionPath, tokens_of
from ..spec import NormSpec


class Call:
    """One call of the fused op, as the op hands it to a backend: the tensors, the
    :class:`~fusion_pass.spec.NormSpec` that says what to compute with them, the
    group and the path.

    ``eps`` and ``multiplier`` are the call's scalars: the spec's literal, or the
    tensor the op was given (a 0-dim or one-element tensor on the input's device;
    the op reads a CPU one into a float).  ``out_dtype`` is the dtype of ``y``; ``h``
    is always in ``x.dtype``.  ``scale`` is the static FP8 scale.
    """

    __slots__ = ("x", "residual", "weight", "spec", "group_name", "path", "eps", "multiplier",
                 "scale", "out_dtype")

    def __init__(self, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                 spec: NormSpec, group_name: str, path: FusionPath = FusionPath.UNFUSED,
                 eps: Union[float, torch.Tensor, None] = None,
                 multiplier: Union[float, torch.Tensor, None] = None,
                 scale: Optional[torch.Tensor] = None) -> None:
        self.x, self.residual, self.weight, self.spec = x, residual, weight, spec
        self.group_name, self.path, self.scale = group_name, path, scale
        self.eps = spec.eps if eps is None else eps
        self.multiplier = spec.multiplier if multiplier is None else multiplier
        self.out_dtype = spec.y_dtype(x.dtype)

    @property
    def hidden(self) -> int:
        return self.x.shape[-1]

    @property
    def tokens(self) -> int:
        return tokens_of(self.x.shape)


class Outputs(NamedTuple):
    """What a backend computed: ``y`` (None when quantized and not emitted), ``h``,
    and for a quantizing call ``q`` and ``scales`` (None when the backend fused
    the norm but left the quantization to the op)."""

    y: Optional[torch.Tensor]
    h: torch.Tensor
    q: Optional[torch.Tensor] = None
    scales: Optional[torch.Tensor] = None


class Backend(Protocol):
    """A backend: its name, what its kernels can run (``limits``: the gate decides
    from it, the op checks each call against it) and the call itself."""

    name: str
    limits: BackendLimits

    def run(self, call: Call) -> Union[Outputs, str]:
        """The fused result, or the reason this call is declined (the op then runs
        the reference and logs the reason once)."""
        ...


def _contiguous(t: torch.Tensor) -> bool:
    try:
        return bool(t.is_contiguous())
    except Exception:  # a symbolic layout the shape environment cannot decide
        return False


def unfit_layout(x: torch.Tensor, residual: Optional[torch.Tensor],
                 weight: Optional[torch.Tensor]) -> Optional[str]:
    """Why no fused kernel can take these tensors as they are, or None: every fused
    backend reads the rows of ``x`` and the residual, and the weight, in place.  The
    op asks it of real tensors, the pass of the graph's fake ones (a layout the shape
    environment cannot decide counts as not contiguous)."""
    if not _contiguous(x) or (residual is not None and not _contiguous(residual)):
        return "non-contiguous input"
    if weight is not None and not _contiguous(weight):
        return "non-contiguous weight"
    return None
