"""FP8 quantization of the norm output ``y`` as torch code writes it (post-grad aten).

The spellings of vLLM's native ``QuantFP8``, torchao's ``_quantize_affine_float8``
and hand-written code, once decomposed:

* the quantized values: ``y`` (or ``y.float()``) divided by the scale, or times
  ``scale.reciprocal()`` (``1 / scale`` traces to that times 1), clamped to
  ``[-qmax, qmax]`` (``clamp_min`` + ``clamp_max`` or ``clamp``), cast to
  ``float8_e4m3fn`` / ``float8_e4m3fnuz``;
* a static scale: a one-element tensor the graph does not compute from ``y``;
* a dynamic scale: ``amax(|y|)`` over hidden (``amax(-1, keepdim=True)``,
  ``amax(-1).unsqueeze(-1)`` or ``max(-1, keepdim=True)[0]``), in fp32, divided
  by ``qmax`` and floored by ``clamp(min=f)`` after the division or by
  ``clamp(min=eps)`` on the amax before it;
* per group of ``g`` along hidden: the same on ``y.view(..., hidden // g, g)``,
  the codes viewed back to ``y``'s shape and the scales squeezed to
  ``[..., hidden // g]`` (whatever the graph does with them after that, such as
  a column-major copy, stays in the graph and reads the fused op's scales).

A dynamic quantization without a clamp is taken with the clamp at the scale's
divisor: ``|y| / (amax / qmax)`` exceeds ``qmax`` by at most an fp32 rounding,
which the FP8 cast rounds back to ``qmax``, so the codes are the same.

A quantization of ``y`` whose math :class:`QuantSpec` cannot express is a
:class:`QuantMiss` naming what differs; anything that is not a quantization of
``y`` is None.  The helpers :func:`amax_floor` and
:func:`quant_match` are shared with vLLM's quant ops (:mod:`.vllm_quant`).
"""

from __future__ import annotations

import operator
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..quant import FP8_DTYPES, QuantSpec, fp32, fp32_div
from .epilogue import QuantMatch, QuantMiss, first_match, register_quant_matcher
from .fx_utils import aten, cast_target, dtype_of, is_call, prims, val
from .rms_norm import NormMatch

FP8_NAMES = {dt: name for name, dt in FP8_DTYPES.items()}
_ANY_FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz)
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_SQUEEZES = _VIEWS + (aten.squeeze.dim, aten.squeeze.dims)
_CLAMPS = (aten.clamp_min.default, aten.clamp_max.default, aten.clamp.default)
# The ops between y and the FP8 cast of any spelling above (and of UE8M0 scales,
# so that those are found and said to be unsupported).
_QUANT_OPS = _SQUEEZES + _CLAMPS + (
    aten.mul.Tensor, aten.div.Tensor, aten.reciprocal.default, aten.abs.default,
    aten.amax.default, aten.max.dim, aten.max.default, aten.unsqueeze.default,
    aten.exp2.default, aten.log2.default, aten.ceil.default,
    prims.convert_element_type.default, aten._to_copy.default, operator.getitem)
_SEARCH_DEPTH = 12
F32 = torch.float32

Found = Optional[Union[QuantMatch, QuantMiss]]


def amax_floor(eps: float, qmax: float) -> float:
    """The scale floor of ``max(amax, eps) / qmax``: fp32 division rounds monotonically,
    so that equals ``max(amax / qmax, eps / qmax)`` with both quotients rounded."""
    return fp32_div(eps, qmax)


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def same_shape(node: fx.Node, shape: tuple[Any, ...]) -> bool:
    v = val(node)
    return v is not None and v.dim() == len(shape) and all(
        statically_known_true(a == b) for a, b in zip(v.shape, shape))


def quant_match(form: str, spec: QuantSpec, outputs: dict[fx.Node, str], nodes: set[fx.Node],
                spine: list[fx.Node],
                scale: Optional[fx.Node] = None) -> Union[QuantMatch, QuantMiss]:
    """The match of ``nodes`` whose ``outputs`` take the fused op's results.

    An intermediate that also feeds something outside stays in the graph (it reads
    ``y`` or a fused output once the rest is replaced), and so does what only it
    needs; if that takes a node of the ``spine`` (the cast to FP8 and the scaling
    before it), the fused op would not replace the quantization: a miss."""
    kept = set(nodes)
    changed = True
    while changed:
        changed = False
        for n in list(kept):
            if n not in outputs and any(u not in kept for u in n.users):
                kept.discard(n)
                changed = True
    lost = [n for n in spine if n not in kept]
    if lost:
        user = next(u for u in lost[0].users if u not in kept)
        return QuantMiss(f"{lost[0].name} of the {spec.mode} FP8 quantization is also used by "
                         f"{user.name}: the fused op cannot serve it")
    return QuantMatch(form=form, spec=spec, scale=scale, outputs=dict(outputs), nodes=kept,
                      private=kept - set(outputs))


def _fp8_casts(y: fx.Node) -> list[fx.Node]:
    """Casts to an FP8 dtype reached from ``y`` through quantization ops, nearest first."""
    seen = {y}
    found = []
    frontier = deque([(y, 0)])
    while frontier:
        node, depth = frontier.popleft()
        for u in node.users:
            if u in seen or u.op != "call_function":
                continue
            seen.add(u)
            if cast_target(u) in _ANY_FP8:
                found.append(u)
            elif depth + 1 < _SEARCH_DEPTH and u.target in _QUANT_OPS:
                frontier.append((u, depth + 1))
    return found


def _clamp_bounds(node: Any) -> tuple[Any, Any, Any, list[fx.Node]]:
    """``node`` as ``clamp(inner, lo, hi)`` in any spelling: ``(inner, lo, hi, clamp nodes)``;
    a missing bound is None."""
    lo = hi = None
    nodes: list[fx.Node] = []
    while isinstance(node, fx.Node):
        if is_call(node, aten.clamp_min.default) and lo is None:
            lo = node.args[1]
        elif is_call(node, aten.clamp_max.default) and hi is None:
            hi = node.args[1]
        elif is_call(node, aten.clamp.default) and lo is None and hi is None:
            args = list(node.args[1:]) + [None, None]
            lo, hi = node.kwargs.get("min", args[0]), node.kwargs.get("max", args[1])
        else:
            break
        nodes.append(node)
        node = node.args[0]
    return node, lo, hi, nodes


def _strip_f32(node: Any, nodes: set[fx.Node]) -> Any:
    if isinstance(node, fx.Node) and cast_target(node) == F32:
        nodes.add(node)
        return node.args[0]
    return node


@dataclass
class _Source:
    """How the quantized (or measured) values are read from ``y``."""

    group: int
    """Elements per group of the view ``[..., hidden // group, group]``; 0: rows of ``y``."""
    top: fx.Node
    nodes: set[fx.Node] = field(default_factory=set)


def _group_of(view: fx.Node, hidden: Any) -> Optional[int]:
    v = val(view)
    if v is None or v.dim() < 2 or not isinstance(v.shape[-1], int) or v.shape[-1] == hidden:
        return None
    return v.shape[-1] if statically_known_true(v.shape[-1] * v.shape[-2] == hidden) else None


def _source(node: Any, y: fx.Node) -> Optional[_Source]:
    """``node`` is ``y``, ``y`` in fp32, or ``y`` viewed as groups (cast before or after)."""
    if not isinstance(node, fx.Node):
        return None
    nodes: set[fx.Node] = set()
    n = node if node is y else _strip_f32(node, nodes)
    group = 0
    if n is not y and is_call(n, *_VIEWS):
        group = _group_of(n, val(y).shape[-1]) or 0
        if not group:
            return None
        nodes.add(n)
        n = n.args[0] if n.args[0] is y else _strip_f32(n.args[0], nodes)
    return _Source(group, node, nodes) if n is y else None


def _depends_on(node: Any, y: fx.Node) -> bool:
    """Whether ``y`` is among the near ancestors of ``node`` (a scale computed from ``y``)."""
    frontier, seen = deque([(node, 0)]), set()
    while frontier:
        n, depth = frontier.popleft()
        if n is y:
            return True
        if not isinstance(n, fx.Node) or n in seen or depth >= _SEARCH_DEPTH:
            continue
        seen.add(n)
        frontier.extend((i, depth + 1) for i in n.all_input_nodes)
    return False


def _inverse(node: Any) -> Optional[tuple[fx.Node, set[fx.Node]]]:
    """``node`` as ``1 / s`` (``reciprocal(s)``, possibly times 1): ``(s, nodes)``."""
    nodes: set[fx.Node] = set()
    if is_call(node, aten.mul.Tensor) and len(node.args) == 2:
        rest = [a for a in node.args if not (is_number(a) and a == 1)]
        if len(rest) == 1:
            nodes.add(node)
            node = rest[0]
    if is_call(node, aten.reciprocal.default):
        return node.args[0], nodes | {node}
    return None


@dataclass
class _Dynamic:
    divisor: float
    floor: float
    nodes: set[fx.Node]


def _dynamic_scale(scale: fx.Node, y: fx.Node, src: _Source) -> Union[_Dynamic, QuantMiss]:
    """``scale`` as ``max(amax(|src|) / qmax, floor)`` over the last dim of ``src``'s view."""
    nodes: set[fx.Node] = set()
    s, lo, hi, clamps = _clamp_bounds(scale)
    nodes.update(clamps)
    if hi is not None or (lo is not None and not is_number(lo)):
        return QuantMiss(f"the dynamic scale {scale.name} has an upper bound or a tensor "
                         "floor (scale_ub): not expressible by QuantSpec")
    if is_call(s, aten.exp2.default):
        # QuantFP8's native UE8M0 floors the rounded scale (the floor need not be a
        # power of two); QuantSpec's UE8M0 is the CUDA kernel's: floor, then round.
        return QuantMiss(f"the dynamic scale {scale.name} is rounded to a power of two "
                         "(UE8M0 scales) in torch ops: taken in the form of vLLM's "
                         "_C.per_token_group_fp8_quant only, whose floor precedes the rounding")
    if not (is_call(s, aten.div.Tensor) and is_number(s.args[1]) and s.args[1] > 0):
        return QuantMiss(f"the dynamic scale {scale.name} is not amax / qmax (optionally "
                         "floored): not expressible by QuantSpec")
    divisor = float(s.args[1])
    nodes.add(s)
    a = _strip_f32(s.args[0], nodes)
    a, lo_amax, hi_amax, clamps = _clamp_bounds(a)
    nodes.update(clamps)
    if hi_amax is not None or (lo_amax is not None and not is_number(lo_amax)):
        return QuantMiss(f"the amax behind {scale.name} has an upper bound or a tensor floor: "
                         "not expressible by QuantSpec")
    while is_call(a, aten.unsqueeze.default) or cast_target(a) == F32:
        nodes.add(a)
        a = a.args[0]
    if is_call(a, aten.amax.default):
        measured = a.args[0]
        dims = a.args[1] if len(a.args) > 1 else a.kwargs.get("dim", [])
        nodes.add(a)
    elif is_call(a, operator.getitem) and a.args[1] == 0 and is_call(a.args[0], aten.max.dim):
        measured, dims = a.args[0].args[0], [a.args[0].args[1]]
        nodes.update((a, a.args[0]))
    elif is_call(a, aten.max.default):
        dims = []
        measured = a.args[0]
    else:
        return QuantMiss(f"the dynamic scale {scale.name} does not come from amax(|y|)")
    ndim = val(src.top).dim()
    if not dims or sorted(d % ndim for d in dims) == list(range(ndim)):
        return QuantMiss("a dynamic per-tensor scale (amax over every token): QuantSpec has "
                         "per-token and per-group dynamic scales")
    if [d % ndim for d in dims] != [ndim - 1]:
        return QuantMiss(f"the amax behind {scale.name} reduces dims {list(dims)}, not the "
                         "hidden dim (or the group) alone")
    measured_src = _source(measured.args[0], y) if is_call(measured, aten.abs.default) else None
    if measured_src is None or measured_src.group != src.group:
        return QuantMiss(f"the dynamic scale {scale.name} measures other values than it scales")
    nodes |= {measured} | measured_src.nodes
    if dtype_of(scale) != F32 or not same_shape(scale, (*val(src.top).shape[:-1], 1)):
        return QuantMiss(f"the dynamic scale {scale.name} is not one fp32 value per "
                         f"{'group' if src.group else 'token'}")
    floors = [0.0]
    if lo is not None:
        floors.append(fp32(lo))
    if lo_amax is not None:
        floors.append(amax_floor(lo_amax, divisor))
    return _Dynamic(divisor, max(floors), nodes)


def _grouped_out(node: fx.Node, shape: tuple[Any, ...]) -> Optional[fx.Node]:
    """The view (or squeeze) of ``node`` to ``shape`` among its users."""
    return next((u for u in node.users if is_call(u, *_SQUEEZES) and same_shape(u, shape)), None)


def _quantization(y: fx.Node, cast: fx.Node) -> Found:
    """The quantization of ``y`` ending in ``cast``; None if ``cast`` quantizes something else."""
    inner, lo, hi, clamps = _clamp_bounds(cast.args[0])
    # A clamp in bf16 decomposes to fp32 between casts: see through them, then refuse.
    casts = []
    while cast_target(inner) is not None:
        casts.append(inner)
        inner, lo2, hi2, more = _clamp_bounds(inner.args[0])
        if more and lo is None and hi is None:
            lo, hi, clamps = lo2, hi2, more
    inv_nodes: set[fx.Node] = set()
    if is_call(inner, aten.div.Tensor) and len(inner.args) == 2:
        src, factor, reciprocal = _source(inner.args[0], y), inner.args[1], False
    elif is_call(inner, aten.mul.Tensor) and len(inner.args) == 2:
        a, b = inner.args
        src_a = _source(a, y)
        src, factor = (src_a, b) if src_a is not None else (_source(b, y), a)
        reciprocal = True
    else:
        return None
    if src is None or not isinstance(factor, fx.Node):
        return None
    dtype = cast_target(cast)
    if dtype not in FP8_NAMES:
        return QuantMiss(f"quantizes to {dtype}; the fused op writes {', '.join(FP8_DTYPES)}")
    scale = factor
    if reciprocal:
        inverse = _inverse(factor)
        if inverse is None:
            return QuantMiss(f"multiplies by {factor.name}, which is not 1 / scale (a precomputed "
                             "inverse scale, torchao's convention): QuantSpec takes the scale")
        scale, inv_nodes = inverse
    if (lo is None) != (hi is None) or (lo is not None and not (
            is_number(lo) and is_number(hi) and hi > 0 and lo == -hi)):
        return QuantMiss(f"the clamp before {cast.name} is not [-qmax, qmax] ({lo}, {hi})")
    if dtype_of(inner) != F32 or any(cast_target(c) != F32 for c in casts):
        return QuantMiss(f"{inner.name} scales in {dtype_of(inner)} (or rounds before the "
                         "FP8 cast), not in fp32")
    nodes = {cast, inner} | set(clamps) | set(casts) | inv_nodes | src.nodes
    outputs: dict[fx.Node, str] = {}
    y_shape = tuple(val(y).shape)
    if _depends_on(scale, y):
        dyn = _dynamic_scale(scale, y, src)
        if isinstance(dyn, QuantMiss):
            return dyn
        if hi is not None and hi != dyn.divisor:
            return QuantMiss(f"the clamp bound {hi} differs from the scale's divisor {dyn.divisor}")
        nodes |= dyn.nodes | {scale}
        mode, qmax, floor, static_scale = ("per_group" if src.group else "per_token",
                                           dyn.divisor, dyn.floor, None)
        scales_out = scale if not src.group else _grouped_out(scale, (*y_shape[:-1],
                                                                      y_shape[-1] // src.group))
        if scales_out is not None:
            nodes.add(scales_out)
            outputs[scales_out] = "scales"
    else:
        if hi is None:
            return QuantMiss("a static scale without a clamp: values past the FP8 range become "
                             "NaN where the fused op saturates")
        static_scale = scale.args[0] if cast_target(scale) == F32 else scale
        v = val(static_scale)
        if v is None or v.numel() != 1 or not v.is_floating_point():
            return QuantMiss(f"the static scale {static_scale.name} is not one floating value "
                             f"({None if v is None else tuple(v.shape)}): QuantSpec takes a "
                             "per-tensor scale")
        mode, qmax, floor = "static", float(hi), 0.0
    q_out = cast if not src.group else _grouped_out(cast, y_shape)
    if q_out is None or not same_shape(q_out, y_shape):
        return QuantMiss(f"the codes {cast.name} are used in another shape than y's")
    nodes.add(q_out)
    outputs[q_out] = "q"
    spec = QuantSpec(mode=mode, fp8_dtype=FP8_NAMES[dtype], qmax=float(qmax), group=src.group,
                     scale_floor=floor, reciprocal=reciprocal)
    return quant_match(f"torch_{mode}", spec, outputs, nodes, [cast, inner], static_scale)


def match_torch_quant(norm: NormMatch, y: fx.Node) -> Found:
    """The first quantization of ``y`` that fuses, else the first that does not, else None."""
    if val(y) is None or val(y).dim() < 1:
        return None
    return first_match(_quantization(y, cast) for cast in _fp8_casts(y))


register_quant_matcher("torch", match_torch_quant, priority=0)
