"""RMSNorm (with or without a residual add) written in native aten ops: the form as a table.

Recognises, from the reduced value of an all-reduce site (:class:`Reduced`: after
layout-only ops and a scalar multiplier, which every norm form shares), every
form the graphs we target contain once decomposed:

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

Each step is a row of :data:`NATIVE` (the engine: :mod:`.walk`); a new spelling
of a step is one more entry in its row.  Before the norm (:data:`PROLOGUE`):
layout-only ops that keep the rows whole are looked through (:mod:`.layout`: a
MoE block's ``reshape`` back to ``[batch, seq, hidden]``), and a scalar
multiplier of the reduced value (Granite's ``hidden * residual_multiplier``,
Gemma's ``embed * normalizer``) is taken along: a literal, or a 0-dim or
one-element floating tensor, whose product keeps the reduced value's dtype.

Epsilon is read from the graph: a literal, or a graph value (a 0-dim tensor:
``torch.compile(dynamic=True)`` passes a module's float attribute as an input).
A norm without a weight (``x * rsqrt(mean(x^2) + eps)`` alone) matches with
``weight`` None: the pass hands the op a weight of ones.

A matcher follows the contract of :mod:`fusion_pass.patterns`: a
:class:`NormMatch`, a :class:`NormMiss` naming the node where the norm stopped
matching and why, or None when its form does not apply.  Matchers are
registered with a priority (:func:`register_norm_matcher`) and read the
:class:`Reduced` value; :func:`match_norm` folds the prologue into their match.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..dtypes import FLOATS
from ..gate import dtype_name
from ..spec import TENSOR, NormSpec
from .fx_utils import aten, cast_target, dtype_of, is_call, other_operand, prims, val
from .layout import stops_at, through
from .miss import Miss, most_specific
from .registry import Registry
from .walk import CUR, NO, Cap, Op, Ref, Step, Walk, taken, walk

_ADD = (aten.add.Tensor, aten.add.Scalar)
_CASTS = (prims.convert_element_type.default, aten._to_copy.default)
F32 = torch.float32
Eps = Union[float, fx.Node]
Multiplier = Union[None, float, fx.Node]


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
    multiplier: Multiplier = None
    """The scalar the reduced value is multiplied by before the residual add: a
    literal, or the node of a one-element floating tensor."""

    @property
    def y(self) -> Optional[fx.Node]:
        return next((n for n, name in self.outputs.items() if name == "y"), None)

    def spec(self, dtype: torch.dtype, emit_y: bool = True) -> NormSpec:
        """What the fused op computes for this match, with activations of ``dtype``;
        ``emit_y``: whether ``y`` is used beside its quantization."""
        return NormSpec(
            eps=TENSOR if isinstance(self.eps, fx.Node) else self.eps,
            multiplier=TENSOR if isinstance(self.multiplier, fx.Node) else self.multiplier,
            gemma=self.gemma, round_normed=self.round_normed,
            out_dtype=dtype_name(self.out_dtype) if self.out_dtype != dtype else None,
            quant=self.quant.spec if self.quant is not None else None,
            emit_y=emit_y or self.quant is None)


class NormMiss(Miss):
    """Why the value did not match a norm form (:class:`.miss.Miss`)."""


Matched = Union[NormMatch, NormMiss]


@dataclass
class Reduced:
    """The reduced value as a norm form reads it: the all-reduce's value ``ar`` after
    the layout-only ops ``layout`` and a scalar ``multiplier``, if any."""

    ar: fx.Node
    value: fx.Node
    """What the norm form reads: the last of ``ar``, the layout ops and the multiply."""
    layout: list[fx.Node] = field(default_factory=list)
    multiplier: Multiplier = None
    nodes: list[fx.Node] = field(default_factory=list)
    """The layout ops and the multiply, in order."""
    stopped: Optional[str] = None
    """Why the layout walk stopped at a layout op it does not look through."""


def deepest(misses: list[Optional[NormMiss]]) -> NormMiss:
    """The most specific of ``misses`` (:func:`.miss.most_specific`)."""
    best = most_specific(misses)
    if best is None:
        return NormMiss("no RMSNorm after the all-reduce")
    return best if isinstance(best, NormMiss) else NormMiss(best.reason, best.at)


def _first(*misses: Optional[Miss]) -> Optional[Miss]:
    """The first miss that is not None."""
    return next((m for m in misses if m is not None), None)


def _users(node: fx.Node) -> str:
    return ", ".join(u.name for u in node.users) or "none"


# -- what a step reads ---------------------------------------------------------------------

def _widens(node: fx.Node, to: torch.dtype) -> bool:
    frm = dtype_of(node)
    return frm is not None and frm.is_floating_point and to.itemsize > frm.itemsize


def _narrows(node: fx.Node, to: torch.dtype) -> bool:
    frm = dtype_of(node)
    return frm is not None and frm.is_floating_point and to.itemsize < frm.itemsize


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


def _multiplier(c: object, w: Walk) -> Any:
    """A scalar the reduced value is multiplied by: a literal, or the node of a 0-dim or
    one-element floating tensor; a string says why another factor is not one."""
    if isinstance(c, bool):
        return NO
    if isinstance(c, (int, float)):
        return float(c)
    if not isinstance(c, fx.Node):
        return NO
    if isinstance(c.meta.get("val"), torch.SymFloat):
        return (f"{w.cur.name} is multiplied by {c.name}, a symbolic float (no tensor to "
                "hand to the fused op)")
    v = val(c)
    if v is None or v.numel() != 1 or not v.is_floating_point():
        shape = "?" if v is None else f"{tuple(v.shape)} {v.dtype}"
        return (f"{w.cur.name} is multiplied by {c.name} {shape}: not a scalar, and the fused "
                "op multiplies the reduced value by one number")
    return c


def _keeps_dtype(node: fx.Node, w: Walk) -> Any:
    """The multiply's product is the reduced value's shape and dtype (a one-element
    tensor of a wider dtype promotes it: that is another computation)."""
    a, b = val(w.cur), val(node)
    if a is None or b is None:
        return NO
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return (f"{node.name} multiplies {w.cur.name} {a.dtype} into {tuple(b.shape)} "
                f"{b.dtype}: the fused op keeps the reduced value's dtype and shape")
    return True


def _residual(r: object, w: Walk) -> Any:
    """A residual of the value's own shape and dtype."""
    if not isinstance(r, fx.Node) or val(r) is None or val(w.cur) is None:
        return NO
    same = val(r).shape == val(w.cur).shape and val(r).dtype == val(w.cur).dtype
    return r if same else NO


def _fp32_residual(rf: object, w: Walk) -> Any:
    """vLLM's native form: the residual cast to fp32 from the model dtype."""
    if isinstance(rf, fx.Node) and cast_target(rf) == F32 and dtype_of(rf.args[0]) == w["dt"]:
        return rf.args[0]
    return NO


def _is_cast_to(dtype: torch.dtype) -> Callable[[fx.Node, Walk], bool]:
    return lambda n, w: cast_target(n) == dtype


def _alone(n: fx.Node, w: Walk) -> bool:
    """vLLM's fp32 residual add is taken only where the value feeds nothing else."""
    return cast_target(n) == F32 and w["dt"] != F32 and len(w.cur.users) == 1


def _mark(name: str) -> Callable[[fx.Node, Walk], bool]:
    """A ``where`` that captures the value the op reads (the walk's current node)."""
    def where(n: fx.Node, w: Walk) -> bool:
        w.caps.setdefault(name, w.cur)
        return True
    return where


def _fp32_sum(n: fx.Node, w: Walk) -> Any:
    """vLLM's fp32 sum, the only user of the cast before it."""
    if len(w.cur.users) != 1:
        return NO
    w.caps["fp32_sum"] = True
    return True


def _mean(keepdim: bool) -> Callable[[fx.Node, Walk], Any]:
    """A ``where`` for ``mean``: over the hidden dim alone, keeping it or not."""
    def where(n: fx.Node, w: Walk) -> Any:
        ndim = val(w.cur).dim()
        dims = [d % ndim for d in n.args[1]] if len(n.args) > 1 and n.args[1] else None
        if dims != [ndim - 1]:
            return (f"{n.name} averages over dims {n.args[1:2]}, not the hidden dim alone "
                    "(a partial-row variance is not an RMSNorm of the row)")
        kept = bool(n.args[2]) if len(n.args) > 2 else bool(n.kwargs.get("keepdim"))
        return kept == keepdim or NO
    return where


def _eps(e: object, w: Walk) -> Any:
    return eps_operand(e)


def _unsqueezed_last(d: object, w: Walk) -> Any:
    ndim = val(w["root"]).dim()
    return d if isinstance(d, int) and d % ndim == ndim - 1 else NO


def _tail_cast(n: fx.Node, w: Walk) -> Any:
    to = cast_target(n)
    if to is None:
        return NO
    if "weight" in w.caps and _widens(w.cur, to):
        # y was rounded and is widened for its reader (a quantization reads
        # y.float()): the fused y is the rounded one, as the graph's is.
        return NO
    if "weight" not in w.caps and _narrows(w.cur, to):
        w.caps["rounded"] = to  # the weight multiplies a rounded row
    return True


def _weight(wt: object, w: Walk) -> Any:
    if "weight" in w.caps:
        return NO
    found = unwrap_weight(wt, w["hidden"])
    if found is None:
        return NO
    w.caps["gemma"] = found[1]
    return found[0]


# -- the table -----------------------------------------------------------------------------

MULTIPLIER = Step("multiplier", optional=True, spellings=(
    (Op((aten.mul.Tensor, aten.mul.Scalar), (CUR, Cap("multiplier", _multiplier)),
        commutative=True, where=_keeps_dtype),),
))
"""A scalar multiplier of the reduced value (before the norm form: :data:`PROLOGUE`)."""


def _no_square(w: Walk) -> Optional[Miss]:
    root = w.cur
    base = NormMiss(f"no RMSNorm after the all-reduce: no square of {root.name} (pow 2 or "
                    f"x * x; users: {_users(root)})", root)
    h = _h(w)
    return _first(_stop(root), _stop(h) if h is not None and h is not root else None, base)


def _not_averaged(w: Walk) -> Miss:
    sq = w.cur
    mean = next((u for u in sq.users if is_call(u, aten.mean.dim)), None)
    if mean is not None:
        return NormMiss(f"{mean.name} drops the hidden dim and it is not restored by "
                        "unsqueeze(-1)", mean)
    return NormMiss(f"{sq.name} (a square) is not averaged (users: {_users(sq)})", sq)


NATIVE: tuple[Step, ...] = (
    Step("residual add", optional=True, spellings=(
        (Op((aten.add.Tensor,), (CUR, Cap("residual", _residual)), commutative=True,
            name="sum"),),
        # vLLM's native form: the add in fp32, on casts of both operands.
        (Op(_CASTS, (CUR,), where=_alone, kwargs=frozenset({"dtype"})),
         Op((aten.add.Tensor,), (CUR, Cap("residual", _fp32_residual)), commutative=True,
            where=_fp32_sum, name="sum")),
    )),
    Step("cast to float32", skip_when=lambda w: dtype_of(w.cur) == F32, spellings=(
        (Op(_CASTS, (CUR,), where=_is_cast_to(F32), kwargs=frozenset({"dtype"})),),
    )),
    Step("square", miss=_no_square, spellings=(
        (Op((aten.pow.Tensor_Scalar,), (CUR, 2), where=_mark("root"), name="square"),),
        (Op((aten.mul.Tensor,), (CUR, CUR), where=_mark("root"), name="square"),),
    )),
    Step("mean", miss=_not_averaged, spellings=(
        (Op((aten.mean.dim,), (CUR,), where=_mean(keepdim=True), kwargs=frozenset({"keepdim"})),),
        (Op((aten.mean.dim,), (CUR,), where=_mean(keepdim=False), kwargs=frozenset({"keepdim"})),
         Op((aten.unsqueeze.default,), (CUR, Cap("unsqueeze", _unsqueezed_last)))),
    )),
    Step("+ eps", miss=lambda w: NormMiss(f"{w.cur.name} (the variance) is not followed by "
                                          "+ eps", w.cur), spellings=(
        (Op(_ADD, (CUR, Cap("eps", _eps)), commutative=True),),
    )),
    Step("normalise", miss=lambda w: NormMiss(
        f"{w.cur.name} (variance + eps) does not normalise {w['root'].name} by "
        "rsqrt-multiply or sqrt-divide", w.cur), spellings=(
        (Op((aten.rsqrt.default,), (CUR,)),
         Op((aten.mul.Tensor,), (Ref("root"), CUR), commutative=True, name="norm")),
        (Op((aten.sqrt.default,), (CUR,)),
         Op((aten.div.Tensor,), (Ref("root"), CUR), name="norm")),
    )),
    # The weight multiply and at most one cast on each side of it (each the only user).
    Step("weight", repeat=3, only_user=True, spellings=(
        (Op(_CASTS, (CUR,), where=_tail_cast, kwargs=frozenset({"dtype"})),),
        (Op((aten.mul.Tensor,), (CUR, Cap("weight", _weight)), commutative=True),),
    )),
)
"""A native RMSNorm from the reduced value: the residual add, the cast to fp32, the
square, its mean over hidden, ``+ eps``, the normalise, the weight and casts."""


# -- the native matcher --------------------------------------------------------------------

def _h(w: Walk) -> Optional[fx.Node]:
    """The pre-norm value ``h`` of a walk in the model dtype (one node; vLLM's fp32
    form: the first cast of its fp32 sum back, if any)."""
    if w["fp32_sum"]:
        return next((u for u in w["sum"].users if cast_target(u) == w["dt"]), None)
    return w["sum"] if w["sum"] is not None else w["value"]


def _native(red: Reduced) -> Matched:
    node = red.value
    dt, hidden = dtype_of(node), val(node).shape[-1]
    found = walk(NATIVE, Walk(node, {"value": node, "dt": dt, "hidden": hidden}))
    if isinstance(found, Walk):
        return _native_match(found)
    misses: list[Optional[Miss]] = [found]
    summed = _summed_with_all_reduce(node)
    if summed is not None:
        return summed
    if red.stopped is not None:
        misses.append(NormMiss(f"no RMSNorm after the all-reduce: {red.stopped}",
                               next(iter(node.users))))
    if not any(misses):  # what reads the sum plus the residual may say why (a graph output)
        misses.extend(_stop(add) for add in node.users
                      if is_call(add, aten.add.Tensor) and _residual(other_operand(add, node),
                                                                     Walk(node)) is not NO)
    if not any(misses):
        misses.append(_first(_stop(node), NormMiss(
            f"no RMSNorm after the all-reduce: {node.name} ({dt}), alone or plus a residual, "
            f"is not read in float32 (users: {_users(node)})", node)))
    return deepest(misses)


def _native_match(w: Walk) -> Matched:
    dt, root, norm = w["dt"], w["root"], w["norm"]
    chain = w.nodes[:w.nodes.index(norm) + 1]
    weight, y, rounded = w["weight"], w.cur, w["rounded"]
    if weight is None:
        weightless = _weightless(norm, dt)
        if isinstance(weightless, NormMiss):
            return weightless
        y, chain = weightless, chain + ([weightless] if weightless is not norm else [])
    elif dtype_of(y) not in FLOATS:
        return NormMiss(f"the norm output {y.name} is {dtype_of(y)}", y)
    elif rounded is not None and rounded != dt:
        return NormMiss(f"the normalised {norm.name} is rounded to {rounded} before the "
                        f"weight, not to the input dtype {dt}", y)
    else:
        chain = w.nodes
    if w["fp32_sum"]:
        hs = [u for u in root.users if cast_target(u) == dt]
    else:
        hs = [_h(w)]
    nodes = set(chain) | set(hs) | {w["value"]}
    outputs = {y: "y", **{h: "h" for h in hs}}
    form = "residual_fp32" if w["fp32_sum"] else "residual" if w["sum"] is not None else "plain"
    return NormMatch(form=f"native_{form}", weight=weight, eps=w["eps"], out_dtype=dtype_of(y),
                     residual=w["residual"], gemma=bool(w["gemma"]),
                     round_normed=weight is not None and rounded is not None,
                     outputs=outputs, nodes=nodes, private=nodes - set(outputs),
                     weight_dtype=dtype_of(y) if weight is None else None)


def _weightless(norm: fx.Node, dt: torch.dtype) -> Union[fx.Node, NormMiss]:
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
    return y


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
    LayerNorm's centering, a bias, a multiplier the op cannot take, a layout op, or
    else a graph output."""
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
                return NormMiss(f"a multiplier: {u.name} scales {value.name} by {shown} where "
                                "the fused op has none (it multiplies the reduced value, "
                                "before the residual add and in its dtype, or nothing)", u)
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


# -- the registry --------------------------------------------------------------------------

NormMatcher = Callable[[Reduced], Optional[Matched]]
"""A norm form's matcher: from the reduced value, a match, a miss, or None when the
form does not apply."""

_matchers: Registry[NormMatcher] = Registry()
_matchers.register("native", _native, priority=0)


def register_norm_matcher(name: str, matcher: NormMatcher, priority: int) -> None:
    """Add a norm form; forms are tried in ascending ``priority`` (then by name)."""
    _matchers.register(name, matcher, priority)


def prologues(ar: fx.Node) -> tuple[list[Reduced], list[Optional[Miss]]]:
    """The ways the norm may read ``ar``'s value (:class:`Reduced`, the one to try
    first first), and why a multiply that follows it is no multiplier the op takes."""
    node, layout, stopped = through(ar)
    plain = Reduced(ar, node, layout, None, list(layout), stopped)
    scaled, misses = [], []
    for got in taken(MULTIPLIER, Walk(node)):
        if isinstance(got, Walk):
            scaled.append(Reduced(ar, got.cur, layout, got["multiplier"],
                                  list(layout) + got.nodes))
        else:
            misses.append(got)
    alone = len(node.users) == 1
    return (scaled + [plain] if alone else [plain] + scaled), misses


def fold(red: Reduced, m: NormMatch) -> NormMatch:
    """``m``, a form's match from ``red.value``, as a match from the all-reduce: the
    layout ops and the multiply replaced with it, private unless they are outputs."""
    before = set(red.nodes) | {red.ar}
    m.layout, m.multiplier = red.layout, red.multiplier
    m.nodes |= before
    m.private |= before - set(m.outputs)
    return m


def _rounds_apart(red: Reduced, m: NormMatch) -> Optional[str]:
    """Why ``m`` cannot take ``red``'s multiplier: the op rounds ``round(sum) * c + r``
    once, as Inductor's kernel of the graph's multiply and add does (native forms); an
    op that adds the residual in its own kernel reads the multiply's rounded output, a
    second rounding the fused op would drop."""
    if red.multiplier is None or m.residual is None or m.form.startswith("native"):
        return None
    return (f"{m.form} adds the residual to the multiplied value in its own kernel (the "
            "product rounded first); the fused op rounds product and sum once")


def match_norm(ar: fx.Node) -> Matched:
    """The first registered norm form that ``ar`` flows into, or the deepest miss."""
    if val(ar) is None or val(ar).dim() < 1:
        return NormMiss(f"{ar.name} has no tensor shape on the graph", ar)
    starts, misses = prologues(ar)
    for red in starts:
        for matcher in _matchers:
            m = matcher(red)
            if isinstance(m, NormMatch):
                why = _rounds_apart(red, m)
                if why is None:
                    return fold(red, m)
                # Placed at the norm's op, the furthest node of this form, so that this
                # reason, not a shallower form's, is the one recorded.
                order = {n: i for i, n in enumerate(ar.graph.nodes)}
                m = NormMiss(why, max(m.nodes, key=lambda n: order.get(n, -1)))
            if m is not None:
                misses.append(m)
    return deepest(misses)
