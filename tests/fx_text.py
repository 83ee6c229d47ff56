"""Reading printed FX graphs in tests: which ops a graph calls, not which words it contains
(a fused op's ``site`` argument carries its record as JSON, with op and form names in it)."""

from __future__ import annotations

import re
from collections import Counter

_TARGET = re.compile(r"call_function\[target=(?:torch\.ops\.)?([^\]]+)\]")


def targets(graph: str) -> Counter:
    """``Counter`` of the call targets in a printed graph (``torch.ops.`` prefix dropped)."""
    return Counter(_TARGET.findall(graph))


def calls(graph: str, prefix: str) -> int:
    """How many calls target something whose name starts with ``prefix``."""
    return sum(n for t, n in targets(graph).items() if t.startswith(prefix))
