"""Two all-reduces summed: ``all_reduce(a) + all_reduce(b)`` rewritten to ``all_reduce(a + b)``.

A DeepSeek-V3-style MoE layer reduces its routed experts and its shared experts
separately and adds the sums (then the residual) before the next norm.  Summing
before reducing is one collective less and leaves an ordinary all-reduce ->
residual -> RMSNorm site; the price is one different rounding: each rank rounds
``a + b`` before the sum over ranks instead of each sum after it.  The pass does
this only when asked (``merge_summed_all_reduces``), before it matches sites.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import fx

from .collectives import AllReduceSite, find_site
from .fx_utils import aten, is_call, val


@dataclass
class Merged:
    """What a rewrite left: the all-reduce that remains and those merged into it."""

    out: fx.Node
    """The reduced value of the new all-reduce of the summed inputs."""
    kept: str
    """The name of the first operand's collective (the record names it)."""
    removed: tuple[str, ...]
    """The names of the other collectives, now gone: one per merge, so that a sum of
    three all-reduces, merged twice, names both."""
    form: str


def _operand_site(node: object) -> Optional[AllReduceSite]:
    if not isinstance(node, fx.Node):
        return None
    site = find_site(node)
    if not isinstance(site, AllReduceSite) or len(site.out.users) != 1:
        return None
    inner = set(site.nodes) - {site.out}
    if any(u not in site.nodes for n in inner for u in n.users):
        return None
    return site


def _pair(add: fx.Node) -> Optional[tuple[AllReduceSite, AllReduceSite]]:
    if not is_call(add, aten.add.Tensor) or len(add.args) != 2 or add.kwargs:
        return None
    a, b = (_operand_site(x) for x in add.args)
    if a is None or b is None or a.out is b.out or a.form != b.form or a.group_name != b.group_name:
        return None
    va, vb, vs = val(a.inp), val(b.inp), val(add)
    if va is None or vb is None or vs is None:
        return None
    if va.shape != vb.shape or va.dtype != vb.dtype or vs.shape != va.shape or vs.dtype != va.dtype:
        return None
    return a, b


def merge_summed(graph: fx.Graph) -> list[Merged]:
    """Rewrite every ``all_reduce(a) + all_reduce(b)`` (same form and group, each sum
    read only by the add) into ``all_reduce(a + b)``: the first all-reduce's nodes
    are copied onto ``a + b`` at the add, and both old collectives are erased.  An
    operand that an earlier rewrite made carries what that one merged."""
    done: dict[fx.Node, Merged] = {}
    for add in list(graph.nodes):
        if add._erased:
            continue
        pair = _pair(add)
        if pair is None:
            continue
        a, b = pair
        with graph.inserting_before(add):
            total = graph.call_function(aten.add.Tensor, (a.inp, b.inp))
            total.meta["val"] = val(a.inp) + val(b.inp)
            copies = {a.inp: total}
            for n in a.nodes:
                copies[n] = graph.node_copy(n, lambda x: copies.get(x, x))
        out = copies[a.out]
        add.replace_all_uses_with(out)
        graph.erase_node(add)
        # An operand made by an earlier merge names the collectives it stands for.
        ma, mb = done.pop(a.out, None), done.pop(b.out, None)
        kept = ma.kept if ma is not None else a.nodes[0].name
        removed = ((ma.removed if ma is not None else ())
                   + ((mb.kept,) + mb.removed if mb is not None else (b.nodes[0].name,)))
        for site in (a, b):
            for n in reversed(site.nodes):
                graph.erase_node(n)
        done[out] = Merged(out=out, kept=kept, removed=removed, form=a.form)
    return list(done.values())
