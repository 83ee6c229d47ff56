"""What a fused call is, besides its tensors: :class:`NormSpec`, and the order of its outputs.

The fused ops take tensors (the all-reduce input ``x``, the residual, the norm
weight, and where the graph computes them, epsilon, the multiplier and the
static FP8 scale), the c10d group, the path, and one :class:`NormSpec`: every
other fact about the call.  Everything that has to agree on what a call is
reads it from here: the op's schema and fakes (:mod:`fusion_pass.op`), the
backends' :class:`~fusion_pass.backends.base.Call`, the Triton plan and its
kernels' constexprs, and the pass, which writes the spec of the site it
replaces.  A new fact about a call is a new field here.

The spec travels in the op call as a string (:meth:`NormSpec.encode`), as
:class:`~fusion_pass.quant.QuantSpec` does inside it: ``key=value`` pairs,
floats in ``repr`` (an exact round trip), the keys at their defaults left out.

A scalar (epsilon, the multiplier) is a literal in the spec, or :data:`TENSOR`:
the op's tensor argument of that name holds it, a 0-dim or one-element
floating tensor (``torch.compile(dynamic=True)`` passes a module's float
attribute as a graph input, and a buffer is a tensor).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .gate import ELEMENT_SIZE, MULTIPLIER
from .quant import QuantSpec

OUTPUTS = ("y", "h", "q", "scales")
"""The fused ops' outputs in the order they return them: ``allreduce_rmsnorm`` the
first two, ``allreduce_rmsnorm_quant`` all four."""

TENSOR = "tensor"
"""A scalar of the spec that the op's tensor argument of the same name holds."""

SCALARS = ("eps", "multiplier")
"""The spec's scalars: each a literal in the spec, or :data:`TENSOR` and the op's tensor
argument of its name (a field of the call, of the match)."""

Scalar = Union[float, str]
"""A literal, or :data:`TENSOR`."""

@dataclass(frozen=True)
class NormSpec:
    """Everything about a fused all-reduce + RMSNorm call that its tensors do not say.

    ``h = all_reduce(x) [* multiplier] [+ residual]`` rounded to ``x``'s dtype;
    ``y = h * rsqrt(mean(h^2) + eps) * w`` (``w + 1`` for Gemma) in fp32, rounded
    to ``out_dtype``; with ``quant``, ``q`` and ``scales`` quantize ``y``.
    """

    eps: Scalar
    multiplier: Optional[Scalar] = None
    """``c`` in ``c * all_reduce(x)``: applied in fp32 to the reduced value rounded to
    ``x``'s dtype, before the residual is added, with one rounding of the result (the
    product and the sum are one fused kernel in the graph, as Inductor computes them).
    A literal is rounded to fp32 first, as torch rounds a Python number it multiplies
    a tensor by."""
    gemma: bool = False
    """The weight is applied as ``1 + w`` (Gemma's norm)."""
    round_normed: bool = False
    """The normalised row is rounded to ``x``'s dtype before the weight multiplies it,
    as Hugging Face's ``weight * hidden.to(input_dtype)`` and vLLM's CUDA RMSNorm
    kernels do (``y = round(w * round(h * rstd))``); else ``y = round(h * rstd * w)``."""
    out_dtype: Optional[str] = None
    """The dtype of ``y`` by name (``float32``...), None for ``x``'s dtype; ``h`` is
    always in ``x``'s dtype."""
    quant: Optional[QuantSpec] = None
    """The FP8 quantization of ``y`` (``allreduce_rmsnorm_quant``)."""
    emit_y: bool = True
    """Whether ``y`` is returned beside its quantization (always, without one)."""

    def __post_init__(self) -> None:
        for name in SCALARS:
            v = getattr(self, name)
            if v is None and name == "multiplier" or v == TENSOR:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"fusion_pass: {name} must be a number or {TENSOR!r}, not {v!r}")
            object.__setattr__(self, name, float(v))
        if self.out_dtype is not None and self.out_dtype not in ELEMENT_SIZE:
            raise ValueError(f"fusion_pass: out_dtype must be one of {sorted(ELEMENT_SIZE)}, "
                             f"not {self.out_dtype!r}")
        if not self.emit_y and self.quant is None:
            raise ValueError("fusion_pass: y is left out only beside its quantization")
        # Made once, as a plain attribute (Dynamo traces a read of it; see QuantSpec).
        object.__setattr__(self, "_encoded", self._encode())

    # -- what the call needs ---------------------------------------------------

    def y_dtype(self, x_dtype: torch.dtype) -> torch.dtype:
        """The dtype of ``y`` for activations of ``x_dtype``."""
        return x_dtype if self.out_dtype is None else getattr(torch, self.out_dtype)

    def takes(self, name: str) -> bool:
        """Whether the op's tensor argument ``name`` (``eps``, ``multiplier``) holds a scalar."""
        return getattr(self, name) == TENSOR

    def features(self) -> frozenset[str]:
        """What a backend must be able to compute for this call beyond a plain fused
        norm (:attr:`fusion_pass.gate.BackendLimits.lacks` names what it cannot)."""
        return frozenset({MULTIPLIER}) if self.multiplier is not None else frozenset()

    # -- the op argument -----------------------------------------------------------

    def encode(self) -> str:
        return self._encoded  # type: ignore[attr-defined]

    def _encode(self) -> str:
        parts = [f"eps={self.eps!r}" if self.eps != TENSOR else f"eps={TENSOR}"]
        if self.multiplier is not None:
            parts.append(f"multiplier={self.multiplier!r}" if self.multiplier != TENSOR
                         else f"multiplier={TENSOR}")
        parts += [f"{k}=1" for k in ("gemma", "round_normed") if getattr(self, k)]
        if self.out_dtype is not None:
            parts.append(f"out_dtype={self.out_dtype}")
        if not self.emit_y:
            parts.append("emit_y=0")
        text = ",".join(parts)
        return text if self.quant is None else f"{text};{self.quant.encode()}"

    @staticmethod
    @functools.lru_cache(maxsize=1024)
    def decode(text: str) -> "NormSpec":
        try:
            norm, _, quant = text.partition(";")
            kv = dict(part.split("=", 1) for part in norm.split(","))
            scalar = lambda v: v if v == TENSOR else float(v)  # noqa: E731
            spec = NormSpec(eps=scalar(kv.pop("eps")),
                            multiplier=scalar(kv.pop("multiplier")) if "multiplier" in kv else None,
                            gemma=kv.pop("gemma", "0") == "1",
                            round_normed=kv.pop("round_normed", "0") == "1",
                            out_dtype=kv.pop("out_dtype", None),
                            quant=QuantSpec.decode(quant) if quant else None,
                            emit_y=kv.pop("emit_y", "1") == "1")
        except (KeyError, ValueError) as e:
            raise ValueError(f"fusion_pass: malformed norm spec {text!r}: {e}") from None
        if kv:
            raise ValueError(f"fusion_pass: malformed norm spec {text!r}: unknown {sorted(kv)}")
        return spec
