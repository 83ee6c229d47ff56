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


def fused_fields(node) -> dict:
    """A fused op's call as plain data: its arguments by name (graph values by their
    node names) and its spec's fields (``eps`` a literal or ``"tensor"``, the tensor
    being the argument ``eps_arg``; ``out_dtype`` a dtype name or None)."""
    import dataclasses

    from torch import fx

    from fusion_pass import op
    from fusion_pass.spec import NormSpec

    named = {k: v.name if isinstance(v, fx.Node) else v
             for k, v in op.arguments(node.args, node.kwargs).items()}
    spec = NormSpec.decode(named.pop("spec"))
    for scalar in ("eps", "multiplier"):
        named[f"{scalar}_arg"] = named.pop(scalar)
    return {**named, **{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}}
