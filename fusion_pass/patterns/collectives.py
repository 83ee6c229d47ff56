"""All-reduce anchors: the forms in which a graph sums a tensor across ranks.

Each finder looks at one node and returns an :class:`AllReduceSite` when that
node is the reduced value, a :class:`SiteMiss` when it is an all-reduce of the
finder's form that the pass cannot take (the pass records it, unfused), or None
(the contract of :mod:`fusion_pass.patterns`).  The torch functional-collective form lives here;
vLLM's forms register themselves from :mod:`fusion_pass.patterns.vllm_forms`
when vLLM is importable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch
from torch import fx

from ..groups import c10d_world_size
from .fx_utils import is_call
from .miss import Miss, most_specific
from .registry import Registry


@dataclass
class AllReduceSite:
    out: fx.Node
    """The node whose value is the sum over ranks."""
    inp: fx.Node
    """The tensor each rank contributes."""
    group_name: str
    """The c10d group name the fused op reduces over."""
    world_size: int
    form: str
    nodes: list[fx.Node] = field(default_factory=list)
    """The collective's own nodes, removed with the match (``out`` last)."""


@dataclass
class SiteMiss(Miss):
    """An all-reduce of a finder's form that is not a site the pass can fuse."""

    form: str = ""
    world_size: int = 0


SiteFinder = Callable[[fx.Node], Union[AllReduceSite, SiteMiss, None]]

_finders: Registry[SiteFinder] = Registry()


def register_finder(form: str, finder: SiteFinder, priority: int) -> None:
    """Add an all-reduce form; forms are tried in ascending ``priority`` (then by name)."""
    _finders.register(form, finder, priority)


def find_site(node: fx.Node) -> Union[AllReduceSite, SiteMiss, None]:
    """The site whose reduced value is ``node``, else the most specific miss, else None."""
    misses = []
    for finder in _finders:
        site = finder(node)
        if isinstance(site, AllReduceSite):
            return site
        misses.append(site)
    return most_specific(misses)


@dataclass
class FusedElsewhere:
    """An all-reduce + RMSNorm site that another pass fused before this one ran."""

    node: fx.Node
    """The other pass's fused op."""
    form: str
    """Whose fusion it is, for the record's ``collective``."""
    inp: Optional[fx.Node]
    """The activation it reduces, where the graph shows which."""
    norm: str
    """What it fused, for the record (the op's name)."""
    reason: str
    world_size: int
    group_name: str
    backend: str
    """Whose kernel runs it."""
    quant: Optional[str] = None
    """The FP8 mode fused with it."""


ElsewhereFinder = Callable[[fx.Node], Optional[FusedElsewhere]]

_elsewhere: Registry[ElsewhereFinder] = Registry()


def register_fused_elsewhere(form: str, finder: ElsewhereFinder, priority: int) -> None:
    """A finder of all-reduce + norm sites that another pass already fused (vLLM's
    in-tree fusion): it returns the site, or None."""
    _elsewhere.register(form, finder, priority)


def fused_elsewhere(node: fx.Node) -> Optional[FusedElsewhere]:
    for finder in _elsewhere:
        found = finder(node)
        if found is not None:
            return found
    return None


def _functional_all_reduce(node: fx.Node) -> Optional[AllReduceSite]:
    """``wait_tensor(_c10d_functional.all_reduce(x, "sum", group))``."""
    c10d = torch.ops._c10d_functional
    if not is_call(node, c10d.wait_tensor.default):
        return None
    ar = node.args[0]
    if not is_call(ar, c10d.all_reduce.default):
        return None
    x, op, group_name = ar.args[:3]
    if op != "sum":
        return SiteMiss(f"{ar.name} reduces by {op!r}, not a sum: not an all-reduce a norm "
                        "of the sum can take", ar, "c10d_functional")
    if len(ar.users) != 1 or not isinstance(x, fx.Node):
        return SiteMiss(f"{ar.name} is read other than by one wait_tensor", ar, "c10d_functional")
    return AllReduceSite(out=node, inp=x, group_name=group_name,
                         world_size=c10d_world_size(group_name),
                         form="c10d_functional", nodes=[ar, node])


register_finder("c10d_functional", _functional_all_reduce, priority=0)
