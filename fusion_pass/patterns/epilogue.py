"""Quantization epilogues after the norm: the hook the FP8 matchers plug into.

After a norm matches, the pass asks every registered quant matcher whether the
norm output ``y`` feeds a quantization the fused op can take over.  A matcher
returns a :class:`QuantMatch` (merged into the norm match: the pass then emits
``fusion_pass::allreduce_rmsnorm_quant``), a :class:`QuantMiss` (a quantization
is there but cannot be fused: the norm still fuses, and the reason is
recorded), or None (not its form): the contract of :mod:`fusion_pass.patterns`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Union

from torch import fx

from ..quant import QuantSpec
from .miss import Miss, most_specific
from .registry import Registry
from .rms_norm import NormMatch


@dataclass
class QuantMatch:
    form: str
    spec: QuantSpec
    scale: Optional[fx.Node] = None
    """The static scale tensor (``static`` mode)."""
    outputs: dict[fx.Node, str] = field(default_factory=dict)
    """Nodes whose uses take ``q`` or ``scales``."""
    nodes: set[fx.Node] = field(default_factory=set)
    """Every node the quantization replaces, outputs included."""
    private: set[fx.Node] = field(default_factory=set)
    """Intermediates whose users must all be inside the match."""


class QuantMiss(Miss):
    """A quantization after the norm that the fused op cannot take (:class:`.miss.Miss`)."""


QuantMatcher = Callable[[NormMatch, fx.Node], Optional[Union[QuantMatch, QuantMiss]]]

_matchers: Registry[QuantMatcher] = Registry()


def register_quant_matcher(name: str, matcher: QuantMatcher, priority: int) -> None:
    """Add a quantization form; forms are tried in ascending ``priority`` (then by name)."""
    _matchers.register(name, matcher, priority)


def first_match(found: Iterable[Optional[Union[QuantMatch, QuantMiss]]],
                ) -> Optional[Union[QuantMatch, QuantMiss]]:
    """The first match among ``found`` (evaluated lazily), else the most specific miss
    (:func:`.miss.most_specific`), else None."""
    misses = []
    for m in found:
        if isinstance(m, QuantMatch):
            return m
        misses.append(m)
    return most_specific(misses)


def match_quant(norm: NormMatch) -> Optional[Union[QuantMatch, QuantMiss]]:
    """The quantization fed by the norm's ``y``: a match, the first miss, or None."""
    y = norm.y
    if y is None:
        return None
    return first_match(matcher(norm, y) for matcher in _matchers)


def merge(norm: NormMatch, quant: QuantMatch) -> NormMatch:
    """The norm match extended by its quantization epilogue."""
    norm.quant = quant
    norm.outputs.update(quant.outputs)
    norm.nodes |= quant.nodes
    norm.private |= quant.private
    return norm
