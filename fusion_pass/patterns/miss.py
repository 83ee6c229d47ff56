"""The miss every pattern registry returns, and how the most specific one is chosen.

See the contract in :mod:`fusion_pass.patterns`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, TypeVar

from torch import fx


@dataclass
class Miss:
    """A form that applies at a node but does not hold: the node the matcher stopped
    at, and why, as torch's ``pattern_matcher.FailedMatch`` carries a reason.  Unlike
    it, a miss is truthy: registries tell matches from misses by type."""

    reason: str
    at: Optional[fx.Node] = None
    """The node the matcher stopped at; None where no one node is to blame."""


M = TypeVar("M", bound=Miss)


def most_specific(misses: Iterable[Optional[M]]) -> Optional[M]:
    """The miss that got furthest: the one stopped at the latest node in graph order
    (matchers walk from their anchor toward its users, so a later stop is a longer
    partial match).  Among equals, and misses with no node, the first one."""
    found = [m for m in misses if m is not None]
    placed = [m for m in found if m.at is not None and m.at.graph is not None]
    if not placed:
        return found[0] if found else None
    order = {n: i for i, n in enumerate(placed[0].at.graph.nodes)}
    best = max(placed, key=lambda m: order.get(m.at, -1))  # max keeps the first of equals
    return best
