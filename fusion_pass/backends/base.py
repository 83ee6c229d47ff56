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

from ..gate import BackendLimits, Path, tokens_of
from ..quant import QuantSpec


class Call:
    """One call of the fused op, as the op hands it to a backend.

    ``eps`` is a float, or a 0-dim tensor on the input's device when the graph
    computes epsilon there (a CPU tensor is read into the float by the op).
    ``out_dtype`` is the dtype of ``y``; ``h`` is always in ``x.dtype``.  With
    ``quant`` set, ``y`` is quantized by that spec (``scale``: the static scale)
    and kept only when ``emit_y``.  ``round_normed``: the normalised row is
    rounded to ``x.dtype`` before the weight multiplies it, as Hugging Face's
    ``weight * hidden.to(input_dtype)`` and vLLM's CUDA RMSNorm kernels do
    (``y = round(w * round(h * rstd))``); else ``y = round(h * rstd * w)``.
    """

    __slots__ = ("x", "residual", "weight", "eps", "group_name", "path", "gemma", "out_dtype",
                 "quant", "scale", "emit_y", "round_normed")

    def __init__(self, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                 eps: Union[float, torch.Tensor], group_name: str, path: Path,
                 gemma: bool = False, out_dtype: Optional[torch.dtype] = None,
                 quant: Optional[QuantSpec] = None, scale: Optional[torch.Tensor] = None,
                 emit_y: bool = True, round_normed: bool = False) -> None:
        self.x, self.residual, self.weight, self.eps = x, residual, weight, eps
        self.group_name, self.path, self.gemma = group_name, path, gemma
        self.out_dtype = x.dtype if out_dtype is None else out_dtype
        self.quant, self.scale, self.emit_y = quant, scale, emit_y
        self.round_normed = round_normed

    @property
    def hidden(self) -> int:
        return self.x.shape[-1]

    @property
    def tokens(self) -> int:
        return tokens_of(self.x.shape)

    def without_quant(self) -> "Call":
        """The same call with the quantization epilogue left to the caller."""
        return Call(self.x, self.residual, self.weight, self.eps, self.group_name, self.path,
                    self.gemma, self.out_dtype, round_normed=self.round_normed)


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
