"""Layout-only ops between an all-reduce and its norm, and which of them the matchers see through.

An all-reduce sums element by element, so a view of its result is the all-reduce
of the same view of its input.  A MoE block hands its sum back as
``reshape(wait_tensor, [batch, seq, hidden])`` before the residual add; the
matchers look through such ops when they keep the rows whole: the last dimension
unchanged and the elements in the same order.  The pass replays them on the
all-reduce's input (:func:`replay`), so the fused op sees the tensor in the shape
the norm did.  An op that moves or drops elements (a transpose, a slice) is not
looked through, and :func:`stops_at` says why in words a record can carry.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .fx_utils import aten, is_call, val

_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_DIM_OPS = (aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
_FLATTEN = (aten.flatten.using_ints,)
_COPIES = (aten.clone.default, aten.contiguous.default, aten.alias.default)
_MOVES = {
    aten.permute.default: "reorders dimensions", aten.transpose.int: "swaps dimensions",
    aten.t.default: "transposes", aten.slice.Tensor: "slices", aten.select.int: "selects",
    aten.narrow.default: "narrows", aten.index_select.default: "gathers rows",
    aten.expand.default: "broadcasts", aten.as_strided.default: "restrides",
    aten.split.Tensor: "splits", aten.split_with_sizes.default: "splits",
    aten.unbind.int: "unbinds", aten.diagonal.default: "takes a diagonal",
}


def _same_rows(src: torch.Tensor, out: torch.Tensor) -> bool:
    """Same last dimension, same number of elements, both laid out row-major."""
    return (src.dim() >= 1 and out.dim() >= 1
            and statically_known_true(src.shape[-1] == out.shape[-1])
            and statically_known_true(src.numel() == out.numel())
            and src.is_contiguous() and out.is_contiguous())


def sees_through(node: fx.Node, src: fx.Node) -> bool:
    """Whether ``node`` is a layout-only op of ``src`` that keeps its rows whole."""
    if not isinstance(node, fx.Node) or not node.args or node.args[0] is not src:
        return False
    a, b = val(src), val(node)
    if a is None or b is None or a.dtype != b.dtype or not _same_rows(a, b):
        return False
    if is_call(node, *_VIEWS):
        return True
    if is_call(node, *_DIM_OPS) or is_call(node, *_FLATTEN):
        return True  # _same_rows: the last dim was neither added, removed nor merged
    if is_call(node, *_COPIES):
        fmt = node.kwargs.get("memory_format")
        return fmt in (None, torch.contiguous_format, torch.preserve_format)
    return False


def stops_at(node: fx.Node, src: fx.Node) -> Optional[str]:
    """Why the layout op ``node`` of ``src`` is not looked through, or None if it is
    not a layout op at all."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    name = getattr(node.target, "__name__", str(node.target))
    if node.target in _MOVES:
        return (f"{node.name} ({name}) {_MOVES[node.target]}: the rows the norm sees are "
                "not the reduced rows, and the pass does not look through it")
    if is_call(node, *_VIEWS, *_DIM_OPS, *_FLATTEN, *_COPIES):
        a, b = val(src), val(node)
        shapes = f"{tuple(a.shape) if a is not None else '?'} -> {tuple(b.shape) if b is not None else '?'}"
        return (f"{node.name} ({name}, {shapes}) changes the last dimension or the element "
                "order: the pass looks only through views that keep the rows whole")
    return None


def through(node: fx.Node) -> tuple[fx.Node, list[fx.Node], Optional[str]]:
    """From ``node``, follow single users that are layout-only: the last node reached,
    the layout ops passed (in order), and why the walk stopped at a layout op it
    could not look through (None otherwise)."""
    chain: list[fx.Node] = []
    while len(node.users) == 1:
        (u,) = node.users
        if sees_through(u, node):
            chain.append(u)
            node = u
            continue
        return node, chain, stops_at(u, node)
    return node, chain, None


def replay(graph: fx.Graph, chain: list[fx.Node], src: fx.Node) -> fx.Node:
    """The ops of ``chain`` applied to ``src`` instead of their original input (at the
    graph's current insertion point)."""
    node = src
    for n in chain:
        prev = n.args[0]
        node = graph.node_copy(n, lambda a, prev=prev, node=node: node if a is prev else a)
    return node
