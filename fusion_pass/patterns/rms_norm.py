"""RMSNorm (with or without a residual add) written in native aten ops.

Recognises, from the reduced value ``ar`` of an all-reduce site, every form
the graphs we target contain once decomposed:

* Hugging Face style (Llama, Qwen3): ``h = ar + r`` in the model dtype,
  ``hf = h.float()``, ``hf * rsqrt(mean(hf^2) + eps)``, back to the model
  dtype, ``w * (.)`` -- with a bf16 weight, or an fp32 one (the output then
  stays fp32);
* ``torch.nn.functional.rms_norm`` / ``nn.RMSNorm`` (with or without eps):
  the weight multiply in fp32, then the cast;
* vLLM's native form: the residual added in fp32 (``ar.float() + r.float()``)
  and ``h`` a cast of that sum back to the model dtype;
* Gemma: ``(hf_normed * (1 + w.float())).type_as(h)``;
* fp32 models (no casts); the weight on either side of the multiply;
  ``x * x`` or ``pow(x, 2)`` (``torch.square``); ``mean(keepdim=True)`` or
  ``mean(-1)[..., None]``; ``x * rsqrt(v)`` or ``x / sqrt(v)``.

Epsilon is read from the graph: a literal, or a graph value (a 0-dim tensor:
``torch.compile(dynamic=True)`` passes a module's float attribute as an input).

Between the all-reduce and the residual add, layout-only ops that keep the rows
whole are looked through (:mod:`.layout`: a MoE block's ``reshape`` back to
``[batch, seq, hidden]``).  A norm without a weight (``x * rsqrt(mean(x^2) + eps)``
alone) matches with ``weight`` None: the pass hands the op a weight of ones.

A matcher follows the contract of :mod:`fusion_pass.patterns`: a
:class:`NormMatch`, a :class:`NormMiss` naming the node where the norm stopped
matching and why, or None when its form does not apply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..dtypes import FLOATS
from .fx_utils import aten, cast_target, dtype_of, is_call, other_operand, val
from .layout import stops_at, through
from .miss import Miss, most_specific

_ADD = (aten.add.Tensor, aten.add.Scalar)
Eps = Union[float, fx.Node]


@dataclass
class NormMatch:
    """How an all-reduce site's value flows into an RMSNorm."""

    form: str
    weight: Optional[fx.Node]
    """The [hidden] weight; None for a norm without one (the pass gives the op ones)."""
    eps: Eps
    """A float, or the node of a 0-dim floating tensor holding epsilon."""
    out_dtype: torch.dtype
    """The dtype of the norm output ``y``."""
    residual: Optional[fx.Node] = None
    gemma: bool = False
    round_normed: bool = False
    """The graph rounds the normalised row to the input dtype before the weight
    multiplies it (Hugging Face's ``weight * hidden.to(input_dtype)``)."""
    outputs: dict[fx.Node, str] = field(default_factory=dict)
    """Nodes whose uses take a fused output, by name: ``y``, ``h`` (and, with a
    quantization epilogue, ``q`` and ``scales``)."""
    nodes: set[fx.Node] = field(default_factory=set)
    """Every node the fused op replaces, outputs included."""
    private: set[fx.Node] = field(default_factory=set)
    """Nodes whose users must all be inside ``nodes`` (intermediates)."""
    quant: Optional[Any] = None
    """A :class:`fusion_pass.patterns.epilogue.QuantMatch` merged into the match."""
    layout: list[fx.Node] = field(default_factory=list)
    """Layout-only ops between the all-reduce and the norm (in order): the pass
    applies them to the all-reduce's input, so the op sees the norm's shape."""
    weight_dtype: Optional[torch.dtype] = None
    """For a norm without a weight: the dtype of the ones the pass inserts."""

    @property
    def y(self) -> Optional[fx.Node]:
        return next((n for n, name in self.outputs.items() if name == "y"), None)


class NormMiss(Miss):
    """Why the value did not match a norm form (:class:`.miss.Miss`)."""


Matched = Union[NormMatch, NormMiss]


def deepest(misses: list[Optional[NormMiss]]) -> NormMiss:
    """The most specific of ``misses`` (:func:`.miss.most_specific`)."""
    best = most_specific(misses)
    return best if best is not None else NormMiss("no RMSNorm after the all-reduce")


def _cast_user(node: fx.Node, dtype: torch.dtype) -> Optional[fx.Node]:
    for u in node.users:
        if cast_target(u) == dtype:
            return u
    return None


def _residual_adds(ar: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
    """Every ``ar + r`` (either order, same shape and dtype) among the users of ``ar``."""
    out = []
    for add in ar.users:
        if not is_call(add, aten.add.Tensor):
            continue
        r = other_operand(add, ar)
        if isinstance(r, fx.Node) and val(r) is not None and val(ar) is not None \
                and val(r).shape == val(ar).shape and val(r).dtype == val(ar).dtype:
            out.append((add, r))
    return out


def _roots(ar: fx.Node) -> list[tuple[str, fx.Node, Optional[fx.Node], Optional[fx.Node], set[fx.Node]]]:
    """Candidate (form, fp32 root, h, residual, private nodes) for the norm's input.

    A residual add that is not the only user of ``ar`` comes last: ``ar`` may feed a
    norm directly and also be the residual of a later add (vLLM's first layer), and
    only if nothing else matches is the add the norm's input (the pass then names
    the other users as the reason it cannot fuse)."""
    dt = dtype_of(ar)
    f32 = torch.float32
    out, late = [], []
    for add, r in _residual_adds(ar):
        root = add if dt == f32 else _cast_user(add, f32)
        if root is not None:
            cand = ("residual", root, add, r, {ar} | ({root} if root is not add else set()))
            (out if len(ar.users) == 1 else late).append(cand)
    if dt != f32 and len(ar.users) == 1:
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
    return out + late


def _square(root: fx.Node) -> Optional[fx.Node]:
    for u in root.users:
        if is_call(u, aten.pow.Tensor_Scalar) and u.args[0] is root and u.args[1] == 2:
            return u
        if is_call(u, aten.mul.Tensor) and u.args[0] is root and u.args[1] is root:
            return u
    return None


def unwrap_weight(w: object, hidden: Any) -> Optional[tuple[fx.Node, bool]]:
    """``(weight, gemma)`` from ``w``, ``w.float()`` or ``w.float() + 1``; None if no weight.

    Only what the op redoes exactly is unwrapped: a widening cast, and ``1 +`` in fp32.
    A ``1 + w`` summed in 16 bits is rounded there, so that sum is the weight; a
    narrowing cast of the weight stays in the graph the same way."""
    if not isinstance(w, fx.Node):
        return None
    gemma = False
    if is_call(w, *_ADD) and len(w.args) == 2 and 1.0 in w.args \
            and dtype_of(w) == torch.float32:
        w, gemma = next(a for a in w.args if a != 1.0), True
        if not isinstance(w, fx.Node):
            return None
    if cast_target(w) is not None and _widens(w.args[0], cast_target(w)):
        w = w.args[0]
    v = val(w)
    if v is None or v.dim() != 1 or not v.is_floating_point() \
            or not statically_known_true(v.shape[0] == hidden):
        return None
    return w, gemma


def eps_operand(e: object) -> Union[Eps, str]:
    """Epsilon from the other operand of ``variance + eps``: a float, a node of a
    0-dim floating tensor, or a string saying why it is neither."""
    if isinstance(e, bool):
        return f"eps {e!r} is not a number"
    if isinstance(e, (int, float)):
        return float(e)
    if isinstance(e, torch.SymFloat) or (isinstance(e, fx.Node)
                                         and isinstance(e.meta.get("val"), torch.SymFloat)):
        return "eps is a symbolic float (no tensor to hand to the fused op)"
    if not isinstance(e, fx.Node):
        return f"eps {e!r} is neither a number nor a graph value"
    v = val(e)
    if v is None or v.numel() != 1 or v.dim() != 0 or not v.is_floating_point():
        return f"eps {e.name} is not a 0-dim floating tensor ({None if v is None else tuple(v.shape)})"
    return e


def match_native(ar: fx.Node) -> Matched:
    """An RMSNorm in native ops fed by ``ar`` (optionally through layout-only ops and
    a residual add)."""
    if val(ar) is None or val(ar).dim() < 1:
        return NormMiss(f"{ar.name} has no tensor shape on the graph", ar)
    node, layout, stopped = through(ar)
    dt, hidden = dtype_of(node), val(node).shape[-1]
    misses = []
    for form, root, h, residual, private in _roots(node):
        m = _match_chain(root, dt, hidden)
        if isinstance(m, NormMiss):
            if m.at is root and h is not None and h is not root:
                # Stopped at once: what reads the sum itself says more (a graph output).
                m = _first(_stop(h), m)
            misses.append(m)
            continue
        y, weight, eps, gemma, round_normed, chain = m
        casts = {u for u in root.users if cast_target(u) == dt} if form == "residual_fp32" else set()
        nodes = chain | private | casts | {root} | set(layout) | ({h} if h is not None else set())
        outputs = {y: "y"}
        outputs.update({c: "h" for c in casts})
        if h is not None:
            outputs[h] = "h"
        # The fp32 root has the square, the normalise and (vLLM) the cast as users.
        priv = ((chain - {y}) | (private - {h}) | ({root} if root is not h else set())
                | (set(layout) - {h}) | ({ar} if layout else set()))
        return NormMatch(form=f"native_{form}", weight=weight, eps=eps, out_dtype=dtype_of(y),
                         residual=residual, gemma=gemma, round_normed=round_normed,
                         outputs=outputs, nodes=nodes, private=priv, layout=layout,
                         weight_dtype=dtype_of(y) if weight is None else None)
    summed = _summed_with_all_reduce(node)
    if summed is not None:
        return summed
    if stopped is not None:
        misses.append(NormMiss(f"no RMSNorm after the all-reduce: {stopped}", next(iter(node.users))))
    if not misses:  # what reads the sum plus the residual may say why (a graph output)
        misses.extend(m for m in (_stop(add) for add, _ in _residual_adds(node)) if m is not None)
    if not misses:
        users = ", ".join(u.name for u in node.users) or "none"
        misses.append(_first(_stop(node), NormMiss(
            f"no RMSNorm after the all-reduce: {node.name} ({dt}), alone or plus a residual, "
            f"is not read in float32 (users: {users})", node)))
    return deepest(misses)


def _first(*misses: Optional[NormMiss]) -> NormMiss:
    """The first miss that is not None."""
    return next(m for m in misses if m is not None)


def _summed_with_all_reduce(value: fx.Node) -> Optional[NormMiss]:
    """``value + all_reduce(b)`` on the way to the norm (routed + shared experts): the
    other sum is the residual only if nothing else is added before the norm."""
    from .collectives import AllReduceSite, find_site

    for u in value.users:
        other = other_operand(u, value) if is_call(u, aten.add.Tensor) else None
        if isinstance(other, fx.Node) and isinstance(find_site(other), AllReduceSite):
            return NormMiss(f"summed with another all-reduce ({other.name}) at {u.name} before "
                            "the residual add and the norm: two adds before the norm are not "
                            "one residual (merge_summed_all_reduces=True rewrites the two "
                            "all-reduces into one of the summed inputs)", u)
    return None


def _stop(value: fx.Node) -> Optional[NormMiss]:
    """What reads ``value`` (the reduced value or the norm's would-be input) instead of
    an RMSNorm, when it is one of the things that must not be fused as if absent: a
    LayerNorm's centering, a bias, a multiplier, a layout op, or else a graph output."""
    users = list(value.users)
    v = val(value)
    for u in users:
        if is_call(u, aten.var_mean.correction):
            return NormMiss(f"a LayerNorm, not an RMSNorm: {u.name} "
                            f"({getattr(u.target, '__name__', u.target)}) centres {value.name} "
                            "on its mean before the variance", u)
    for u in users:
        if is_call(u, aten.mean.dim) and any(is_call(s, aten.sub.Tensor) and s.args[0] is value
                                             and s.args[1] is u for s in users):
            return NormMiss(f"a LayerNorm, not an RMSNorm: {u.name} is the mean that "
                            f"{value.name} is centred on", u)
    for u in users:
        other = other_operand(u, value) if is_call(u, aten.add.Tensor, aten.sub.Tensor) else None
        ov = val(other) if isinstance(other, fx.Node) else None
        if ov is not None and v is not None and tuple(ov.shape) != tuple(v.shape):
            return NormMiss(f"a bias: {u.name} adds {other.name} {tuple(ov.shape)} to "
                            f"{value.name} after the all-reduce (the fused op adds only a "
                            "residual of the reduced shape)", u)
    for u in users:
        if is_call(u, aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar):
            other = other_operand(u, value)
            ov = val(other) if isinstance(other, fx.Node) else None
            if isinstance(other, (int, float)) or (ov is not None and ov.numel() == 1):
                shown = other.name if isinstance(other, fx.Node) else repr(other)
                return NormMiss(f"a multiplier: {u.name} scales {value.name} by {shown} "
                                f"after the all-reduce (the fused op has no multiplier: "
                                "fusing a norm after it would drop it)", u)
    for u in users:
        if len(users) == 1:
            why = stops_at(u, value)
            if why is not None:
                return NormMiss(f"no RMSNorm after the all-reduce: {why}", u)
    for u in users:  # last: a returned value may also feed one of the above
        if u.op == "output":
            return NormMiss(f"no RMSNorm after the all-reduce in this graph: {value.name} is a "
                            "graph output (a graph break after the all-reduce puts the norm in "
                            "the next graph)", u)
    return None


def _user(node: fx.Node, *targets: Any) -> Optional[fx.Node]:
    """The first user of ``node`` that calls one of ``targets``.  Other users do not
    stop the match: the pass refuses a match whose intermediates are used outside it,
    with a reason naming them (a training graph saving ``rsqrt`` for backward, say)."""
    return next((u for u in node.users if is_call(u, *targets)), None)


def _widens(node: fx.Node, to: torch.dtype) -> bool:
    frm = dtype_of(node)
    return frm is not None and frm.is_floating_point and to.itemsize > frm.itemsize


def _narrows(node: fx.Node, to: torch.dtype) -> bool:
    frm = dtype_of(node)
    return frm is not None and frm.is_floating_point and to.itemsize < frm.itemsize


def _match_chain(root: fx.Node, dt: torch.dtype, hidden: Any):
    """``root * rsqrt(mean(root^2, -1) + eps)`` (or ``root / sqrt(...)``), then the
    weight and casts: ``(y, weight, eps, gemma, round_normed, chain nodes)`` or a miss."""
    sq = _square(root)
    if sq is None:
        return _first(_stop(root), NormMiss(
            f"no RMSNorm after the all-reduce: no square of {root.name} (pow 2 or x * x; "
            f"users: {', '.join(u.name for u in root.users) or 'none'})", root))
    mean = _user(sq, aten.mean.dim)
    if mean is None:
        return NormMiss(f"{sq.name} (a square) is not averaged (users: "
                        f"{', '.join(u.name for u in sq.users)})", sq)
    ndim = val(root).dim()
    dims = [d % ndim for d in mean.args[1]] if len(mean.args) > 1 and mean.args[1] else None
    if dims != [ndim - 1]:
        return NormMiss(f"{mean.name} averages over dims {mean.args[1:2]}, not the hidden "
                        "dim alone (a partial-row variance is not an RMSNorm of the row)", mean)
    var = mean
    keepdim = bool(mean.args[2]) if len(mean.args) > 2 else bool(mean.kwargs.get("keepdim"))
    if not keepdim:
        var = _user(mean, aten.unsqueeze.default)
        if var is None or var.args[1] % (ndim) != ndim - 1:
            return NormMiss(f"{mean.name} drops the hidden dim and it is not restored by "
                            "unsqueeze(-1)", mean)
    add_eps = _user(var, *_ADD)
    if add_eps is None or len(add_eps.args) != 2:
        return NormMiss(f"{var.name} (the variance) is not followed by + eps", var)
    eps = eps_operand(other_operand(add_eps, var))
    if isinstance(eps, str):
        return NormMiss(eps, add_eps)
    inv = _user(add_eps, aten.rsqrt.default, aten.sqrt.default)
    if is_call(inv, aten.rsqrt.default):
        norm = next((u for u in inv.users if is_call(u, aten.mul.Tensor)
                     and other_operand(u, inv) is root), None)
    else:
        norm = next((u for u in inv.users if is_call(u, aten.div.Tensor)
                     and u.args[0] is root and u.args[1] is inv), None) if inv is not None else None
    if norm is None:
        return NormMiss(f"{add_eps.name} (variance + eps) does not normalise {root.name} "
                        "by rsqrt-multiply or sqrt-divide", add_eps)
    chain = {sq, mean, var, add_eps, inv, norm}
    # Tail: the weight multiply and at most one cast on each side of it.
    node, weight, gemma, rounded = norm, None, False, None
    for _ in range(3):
        nxt = next(iter(node.users)) if len(node.users) == 1 else None
        if nxt is None:
            break
        if cast_target(nxt) is not None:
            if weight is not None and _widens(node, cast_target(nxt)):
                # y was rounded and is widened for its reader (a quantization reads
                # y.float()): the fused y is the rounded one, as the graph's is.
                break
            if weight is None and _narrows(node, cast_target(nxt)):
                rounded = cast_target(nxt)  # the weight multiplies a rounded row
            node = nxt
        elif weight is None and is_call(nxt, aten.mul.Tensor):
            found = unwrap_weight(other_operand(nxt, node), hidden)
            if found is None:
                break
            weight, gemma = found
            node = nxt
        else:
            break
        chain.add(node)
    if weight is None:
        return _weightless(norm, dt, {sq, mean, var, add_eps, inv, norm}, eps)
    if dtype_of(node) not in FLOATS:
        return NormMiss(f"the norm output {node.name} is {dtype_of(node)}", node)
    if rounded is not None and rounded != dt:
        return NormMiss(f"the normalised {norm.name} is rounded to {rounded} before the "
                        f"weight, not to the input dtype {dt}", node)
    return node, weight, eps, gemma, rounded is not None, chain


def _weightless(norm: fx.Node, dt: torch.dtype, chain: set[fx.Node], eps: Eps):
    """A norm with no weight: ``y`` is the normalised row, or its rounding to the input
    dtype.  A tensor multiplying it that is not a [hidden] weight is a miss: the
    pass does not guess what it is."""
    y = norm
    nxt = next(iter(norm.users)) if len(norm.users) == 1 else None
    if nxt is not None and cast_target(nxt) == dt and _narrows(norm, dt):
        y = nxt
        nxt = next(iter(y.users)) if len(y.users) == 1 else None
    if is_call(nxt, aten.mul.Tensor) and isinstance(other_operand(nxt, y), fx.Node):
        other = other_operand(nxt, y)
        shape = tuple(val(other).shape) if val(other) is not None else "?"
        return NormMiss(f"no [hidden] weight multiplies the normalised {norm.name}: "
                        f"{nxt.name} multiplies it by {other.name} {shape}", nxt)
    if dtype_of(y) not in FLOATS:
        return NormMiss(f"the norm output {y.name} is {dtype_of(y)}", y)
    return y, None, eps, False, False, chain | {y}


NormMatcher = Callable[[fx.Node], Optional[Matched]]
"""A norm form's matcher: a match, a miss, or None when the form does not apply."""

_matchers: dict[str, NormMatcher] = {"native": match_native}


def register_norm_matcher(name: str, matcher: NormMatcher) -> None:
    _matchers[name] = matcher


def match_norm(ar: fx.Node) -> Matched:
    """The first registered norm form that ``ar`` flows into, or the deepest miss."""
    misses = []
    for matcher in _matchers.values():
        m = matcher(ar)
        if isinstance(m, NormMatch):
            return m
        if m is not None:
            misses.append(m)
    return deepest(misses)
