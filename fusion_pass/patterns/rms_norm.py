"""RMSNorm (with or without a residual add) written in native aten ops.

Recognises, from the reduced value ``ar`` of an all-reduce site, every form
the graphs we target contain once decomposed:

* Hugging Face style: ``h = ar + r`` in the model dtype, ``hf = h.float()``,
  ``hf * rsqrt(mean(hf^2) + eps)``, back to the model dtype, ``w * (.)``;
* ``torch.nn.functional.rms_norm``: the weight multiply in fp32, then the cast;
* vLLM's native form: the residual added in fp32 (``ar.float() + r.float()``)
  and ``h`` a cast of that sum back to the model dtype;
* fp32 models, where all casts vanish; the weight on either side of the
  multiply; ``x * x`` for the square; Gemma's ``(1 + w)``.

Epsilon is read from the graph, so one matcher serves every value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .fx_utils import aten, cast_target, dtype_of, is_call, other_operand, val

_ADD = (aten.add.Tensor, aten.add.Scalar)


@dataclass
class NormMatch:
    """How an all-reduce site's value flows into an RMSNorm."""

    form: str
    weight: fx.Node
    eps: float
    residual: Optional[fx.Node] = None
    gemma: bool = False
    outputs: dict[fx.Node, int] = field(default_factory=dict)
    """Nodes whose uses take the fused op's output ``i`` (0: y, 1: h)."""
    nodes: set[fx.Node] = field(default_factory=set)
    """Every node the fused op replaces, outputs included."""
    private: set[fx.Node] = field(default_factory=set)
    """Nodes whose users must all be inside ``nodes`` (intermediates)."""


def _cast_user(node: fx.Node, dtype: torch.dtype) -> Optional[fx.Node]:
    for u in node.users:
        if cast_target(u) == dtype:
            return u
    return None


def _residual_add(ar: fx.Node) -> Optional[tuple[fx.Node, fx.Node]]:
    """``ar + r`` (either order) as the only user of ``ar``: (add node, r)."""
    users = list(ar.users)
    if len(users) != 1 or not is_call(users[0], aten.add.Tensor):
        return None
    add = users[0]
    r = other_operand(add, ar)
    if not isinstance(r, fx.Node) or val(r) is None or val(ar) is None:
        return None
    if val(r).shape != val(ar).shape or val(r).dtype != val(ar).dtype:
        return None
    return add, r


def _roots(ar: fx.Node) -> list[tuple[str, fx.Node, Optional[fx.Node], Optional[fx.Node], set[fx.Node]]]:
    """Candidate (form, fp32 root, h, residual, private nodes) for the norm's input."""
    dt = dtype_of(ar)
    f32 = torch.float32
    out = []
    added = _residual_add(ar)
    if added is not None:
        add, r = added
        root = add if dt == f32 else _cast_user(add, f32)
        if root is not None:
            out.append(("residual", root, add, r, {ar} | ({root} if root is not add else set())))
    elif dt != f32 and len(ar.users) == 1:
        # vLLM's native form: the add happens in fp32 on casts of both operands.
        arf = _cast_user(ar, f32)
        add = next(iter(arf.users)) if arf is not None and len(arf.users) == 1 else None
        if is_call(add, aten.add.Tensor):
            rf = other_operand(add, arf)
            if isinstance(rf, fx.Node) and cast_target(rf) == f32 and dtype_of(rf.args[0]) == dt:
                out.append(("residual_fp32", add, _cast_user(add, dt), rf.args[0],
                            {ar, arf, add}))
    root = ar if dt == f32 else _cast_user(ar, f32)
    if root is not None:
        out.append(("plain", root, ar, None, {root} if root is not ar else set()))
    return out


def _square(root: fx.Node) -> Optional[fx.Node]:
    for u in root.users:
        if is_call(u, aten.pow.Tensor_Scalar) and u.args[1] == 2:
            return u
        if is_call(u, aten.mul.Tensor) and u.args[0] is root and u.args[1] is root:
            return u
    return None


def _weight_operand(mul: fx.Node, known: fx.Node, hidden: Any) -> Optional[tuple[fx.Node, bool]]:
    """The norm weight in ``known * w`` (any side)."""
    return unwrap_weight(other_operand(mul, known), hidden)


def unwrap_weight(w: object, hidden: Any) -> Optional[tuple[fx.Node, bool]]:
    """``(weight, gemma)`` from ``w``, ``w.float()`` or ``w.float() + 1``; None if no weight."""
    if not isinstance(w, fx.Node):
        return None
    gemma = False
    if is_call(w, *_ADD) and len(w.args) == 2 and 1.0 in w.args:
        w, gemma = next(a for a in w.args if a != 1.0), True
        if not isinstance(w, fx.Node):
            return None
    if cast_target(w) is not None:
        w = w.args[0]
    v = val(w)
    if v is None or v.dim() != 1 or not statically_known_true(v.shape[0] == hidden):
        return None
    return w, gemma


def match_native(ar: fx.Node) -> Optional[NormMatch]:
    """An RMSNorm in native ops fed by ``ar`` (optionally through a residual add)."""
    dt = dtype_of(ar)
    v = val(ar)
    if v is None or v.dim() < 1:
        return None
    hidden = v.shape[-1]
    for form, root, h, residual, private in _roots(ar):
        m = _match_chain(root, dt, hidden)
        if m is None:
            continue
        y, weight, eps, gemma, chain = m
        casts = {u for u in root.users if cast_target(u) == dt} if form == "residual_fp32" else set()
        nodes = chain | private | casts | {root} | ({h} if h is not None else set())
        outputs = {y: 0}
        outputs.update({c: 1 for c in casts})
        if h is not None:
            outputs[h] = 1
        # The fp32 root has the square, the normalise and (vLLM) the cast as users.
        priv = (chain - {y}) | (private - {h}) | ({root} if root is not h else set())
        return NormMatch(form=f"native_{form}", weight=weight, eps=eps, residual=residual,
                         gemma=gemma, outputs=outputs, nodes=nodes, private=priv)
    return None


def _match_chain(root: fx.Node, dt: torch.dtype, hidden: Any):
    """``root * rsqrt(mean(root^2, -1) + eps)``, then the weight and casts."""
    sq = _square(root)
    if sq is None or len(sq.users) != 1:
        return None
    mean = next(iter(sq.users))
    if not is_call(mean, aten.mean.dim) or len(mean.args) < 3 or mean.args[2] is not True:
        return None
    ndim = val(root).dim()
    if list(mean.args[1]) not in ([-1], [ndim - 1]) or len(mean.users) != 1:
        return None
    add_eps = next(iter(mean.users))
    if not is_call(add_eps, *_ADD) or add_eps.args[0] is not mean:
        return None
    eps = add_eps.args[1]
    if not isinstance(eps, (int, float)) or len(add_eps.users) != 1:
        return None
    rs = next(iter(add_eps.users))
    if not is_call(rs, aten.rsqrt.default) or len(rs.users) != 1:
        return None
    norm = next(iter(rs.users))
    if not is_call(norm, aten.mul.Tensor) or other_operand(norm, rs) is not root:
        return None
    chain = {sq, mean, add_eps, rs, norm}
    # Tail: the weight multiply and at most one cast on each side of it.
    node, weight, gemma = norm, None, False
    for _ in range(3):
        if len(node.users) != 1:
            break
        nxt = next(iter(node.users))
        if cast_target(nxt) is not None:
            node = nxt
        elif weight is None and is_call(nxt, aten.mul.Tensor):
            found = _weight_operand(nxt, node, hidden)
            if found is None:
                break
            weight, gemma = found
            node = nxt
        else:
            break
        chain.add(node)
    if weight is None or dtype_of(node) != dt:
        return None
    return node, weight, float(eps), gemma, chain


NormMatcher = Callable[[fx.Node], Optional[NormMatch]]

_matchers: dict[str, NormMatcher] = {"native": match_native}


def register_norm_matcher(name: str, matcher: NormMatcher) -> None:
    _matchers[name] = matcher


def match_norm(ar: fx.Node) -> Optional[NormMatch]:
    """The first registered norm form that ``ar`` flows into."""
    for matcher in _matchers.values():
        m = matcher(ar)
        if m is not None:
            return m
    return None
