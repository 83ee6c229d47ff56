"""The registries' contract (fusion_pass.patterns) and the layout ops the matchers see through."""

from __future__ import annotations

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from fusion_pass.patterns import Miss, NormMiss, QuantMiss, SiteMiss, most_specific
from fusion_pass.patterns import layout


def _graph(fn, *args) -> dict[str, fx.Node]:
    gm = make_fx(fn, tracing_mode="fake")(*args)
    return {n.name: n for n in gm.graph.nodes}


def test_the_latest_stop_in_graph_order_is_the_most_specific() -> None:
    nodes = _graph(lambda x: (x + 1).relu().neg(), torch.randn(4, 8))
    add, relu, neg = nodes["add"], nodes["relu"], nodes["neg"]
    early, late = NormMiss("stopped at the add", add), NormMiss("stopped at the neg", neg)
    assert most_specific([early, None, late]) is late
    assert most_specific([late, early]) is late
    # Equals, and misses that name no node: the first one.
    a, b = QuantMiss("a", relu), QuantMiss("b", relu)
    assert most_specific([a, b]) is a
    assert most_specific([Miss("no node"), NormMiss("at relu", relu)]).reason == "at relu"
    assert most_specific([Miss("first"), Miss("second")]).reason == "first"
    assert most_specific([None, None]) is None
    # Every registry's miss is one kind of thing, truthy (told from matches by type).
    assert all(isinstance(m, Miss) and m for m in (early, a, SiteMiss("s", add, "c10d_functional")))


def test_layout_ops_that_keep_rows_whole_are_seen_through() -> None:
    def fn(x):
        return (x.reshape(1, -1, 8), x.unsqueeze(0), x.view(2, 2, 8), x.clone(),
                x.t(), x.unsqueeze(-1), x.reshape(8, 4), x[:, :4], x.flatten())

    nodes = _graph(fn, torch.randn(4, 8))
    x = nodes["x_1"]
    seen = {n.name for n in x.users if layout.sees_through(n, x)}
    kept = {n.name for n in x.users} - seen
    # reshape(1, -1, 8), unsqueeze(0), view(2, 2, 8), clone: rows of 8 kept in order.
    assert {str(nodes[s].target) for s in seen} == {
        "aten.view.default", "aten.unsqueeze.default", "aten.clone.default"}
    assert len(seen) == 4, seen
    # t, unsqueeze(-1), reshape(8, 4), a slice, flatten: rows moved, split or merged.
    assert len(kept) == 5, kept
    for name in kept:
        why = layout.stops_at(nodes[name], x)
        assert why is not None and name in why, (name, why)
    t = next(n for n in x.users if n.target is torch.ops.aten.t.default)
    assert "(t.default) transposes" in layout.stops_at(t, x)
