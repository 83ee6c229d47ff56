"""The fused ops and their Python entry points.

``torch.ops.fusion_pass.allreduce_rmsnorm`` returns ``(y, h)``;
``torch.ops.fusion_pass.allreduce_rmsnorm_quant`` returns ``(y, h, q, scales)``
with ``q`` the FP8 quantization of ``y`` (:data:`fusion_pass.spec.OUTPUTS`).
Both take the same arguments (:data:`ARGS`): the tensors, the c10d group, the
path, and the call's :class:`~fusion_pass.spec.NormSpec` as a string.

Both are functional (no mutated arguments) so that Inductor needs no
``auto_functionalized`` copies around them.  The path is a string argument
baked in by the pass; ``runtime`` (or ``auto``) asks the gate per call with the
concrete token count.

A scalar the spec says is a tensor (epsilon, the multiplier: graphs that carry
them as values, ``torch.compile(dynamic=True)`` or a buffer) is read on the
host when it is a CPU tensor, for free and without a device sync; a tensor on
the device goes to the kernels, which load it there.

An eager call costs host time on every layer of every step, so the op keeps,
per call signature (shapes, dtypes, devices, contiguity, spec, group name,
path: :func:`_signature`), the route its first call took (:class:`_Route`):
the checks passed, the backend and the gate's path, or the fallback and its
reason.  A later call with that signature checks only what the route rests on
and can change under it: the group's size (a group destroyed and made again
under the same name) and the backend's limits (new measured schedules); a new
backend selection forgets every route.

``site`` is the pass's record of the site this call replaced (JSON, the same
for the same graph); the op hands it to :func:`records.site_ran` the first time
it runs that site and never again, so that a graph loaded from a compile
cache, where the pass never ran, still says what it fused.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, NamedTuple, Optional, Sequence, Union

import torch
from torch._C import _len_torch_dispatch_stack

from . import backends, gate, records
from .backends.base import Backend, Call, Outputs, unfit_layout
from .dtypes import FLOATS
from .groups import c10d_world_size
from .log import once
from .quant import QuantSpec, quantize
from .spec import OUTPUTS, SCALARS, TENSOR, NormSpec

PATHS = ("auto",) + tuple(p.value for p in gate.FusionPath)
_UNFUSED = gate.FusionPath.UNFUSED  # an enum member read through its class costs 0.1-0.2 us per call

ARGS = (("x", "Tensor"), ("residual", "Tensor?"), ("weight", "Tensor"),
        *((name, "Tensor?") for name in SCALARS), ("scale", "Tensor?"), ("group_name", "str"),
        ("path", "str"), ("spec", "str"), ("site", "str"))
"""The fused ops' arguments, in order, with their schema types: both ops take these.
``eps`` and ``multiplier`` hold the scalars the spec says are tensors
(:data:`fusion_pass.spec.SCALARS`); ``scale`` is the static FP8 scale; ``site`` the
pass's record of the site (empty when called directly: :data:`_DEFAULTS`)."""
_DEFAULTS = {"site": "''"}

OPS = {"allreduce_rmsnorm": 2, "allreduce_rmsnorm_quant": 4}
"""Each fused op by name, and how many of :data:`OUTPUTS` it returns."""


def arguments(args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """A fused call's arguments by their names in :data:`ARGS` (a graph node's
    ``args`` and ``kwargs``, say); ``NormSpec.decode(arguments(...)["spec"])`` is
    what it computes."""
    named: dict[str, Any] = {"site": ""}
    named.update(zip((n for n, _ in ARGS), args))
    named.update(kwargs)
    return named


def _schema(name: str, outputs: int) -> str:
    args = ", ".join(f"{t} {n}" + (f"={_DEFAULTS[n]}" if n in _DEFAULTS else "")
                     for n, t in ARGS)
    returns = ", ".join(f"Tensor {o}" for o in OUTPUTS[:outputs])
    return f"{name}({args}) -> ({returns})"


def _check(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
           eps: Optional[torch.Tensor], multiplier: Optional[torch.Tensor],
           scale: Optional[torch.Tensor], path: str, spec: NormSpec, outputs: int) -> None:
    """Errors a caller must fix: they would be wrong on every backend."""
    if path not in PATHS:
        raise ValueError(f"fusion_pass: path must be one of {PATHS}, not {path!r}")
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"fusion_pass: weight of shape {tuple(weight.shape)} does not "
                         f"match input of shape {tuple(x.shape)} (needs [hidden])")
    if not weight.is_floating_point():
        raise ValueError(f"fusion_pass: the norm weight must be floating point, not {weight.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"fusion_pass: residual {tuple(residual.shape)} {residual.dtype} "
                         f"does not match input {tuple(x.shape)} {x.dtype}")
    for name, t in zip(SCALARS, (eps, multiplier)):
        if spec.takes(name) != (t is not None):
            raise ValueError(f"fusion_pass: the spec says {name} is "
                             f"{'a tensor' if spec.takes(name) else 'no tensor'}, and the "
                             f"{name} argument is {'None' if t is None else 'a tensor'}")
        if t is not None and (t.numel() != 1 or not t.is_floating_point()):
            raise ValueError(f"fusion_pass: {name} must hold one float, not "
                             f"{tuple(t.shape)} {t.dtype}")
    if (spec.quant is not None) != (outputs == len(OUTPUTS)):
        raise ValueError("fusion_pass: allreduce_rmsnorm_quant takes a quant spec, "
                         "allreduce_rmsnorm none")
    if spec.quant is not None:
        spec.quant.check(x.shape[-1], scale)
    elif scale is not None:
        raise ValueError("fusion_pass: a static scale goes with a static quantization only")


def _scalar(t: Optional[torch.Tensor], literal: object) -> Union[float, torch.Tensor, None]:
    """A scalar of the call: the spec's literal, or its tensor (read here if on the CPU)."""
    if t is None:
        return literal  # type: ignore[return-value]
    return float(t) if t.device.type == "cpu" else t


def _empty(call: Call) -> Outputs:
    """Outputs of a call with no tokens: nothing to reduce or launch on any backend."""
    x = call.x
    y = x.new_empty(x.shape, dtype=call.out_dtype) if call.spec.emit_y else None
    quant = call.spec.quant
    if quant is None:
        return Outputs(y, x.new_empty(x.shape))
    return Outputs(y, x.new_empty(x.shape), x.new_empty(x.shape, dtype=quant.dtype),
                   quant.empty_scales(x))


class _Route(NamedTuple):
    """How calls of one signature (:func:`_signature`) run, and what that rests on.

    ``backend`` is the selected backend; ``path`` the path it is asked for, or
    ``unfused``: the reference runs, and ``said`` (the once-key and message of
    the reason, when there is one) is said.  ``limits`` and ``world`` are the
    backend limits and group size the route was decided with (None: not asked):
    a route whose backend has other limits now, or whose group name now names a
    group of another size, is made again.
    """

    backend: Backend
    path: gate.FusionPath
    limits: Optional[gate.BackendLimits]
    world: Optional[int]
    said: Optional[tuple[str, str]] = None


def _route(call: Call, path: str) -> _Route:
    """Where ``call`` runs (a call with tokens; :func:`run` returns empty ones)."""
    backend = backends.select(call.x.device.type)
    if backend.name == "reference" or path == "unfused":
        return _Route(backend, _UNFUSED, None, None)
    limits, world = backend.limits, c10d_world_size(call.group_name)
    spec = call.spec
    if path in ("auto", "runtime"):
        group = spec.quant.group if spec.quant is not None and spec.quant.group else None
        decision = gate.decide(call.hidden, call.x.dtype, world, call.tokens, limits=limits,
                               group_size=group, features=spec.features())
        chosen, why = decision.path, None if decision.fused else decision.reason
    else:
        # A path baked at compile time, perhaps under other limits: the backend's rules
        # (the ones the gate decided with) say whether it runs this call.
        chosen = gate.FusionPath(path)
        why = (limits.lacking(spec.features())
               or limits.accepts(call.hidden, call.x.dtype, world, call.tokens, chosen))
    if why is None:
        why = unfit_layout(call.x, call.residual, call.weight)
    if why is None:
        return _Route(backend, chosen, limits, world)
    return _Route(backend, _UNFUSED, limits, world, _fallback(backend, call, chosen, why))


def _fallback(backend: Backend, call: Call, path: gate.FusionPath, why: str) -> tuple[str, str]:
    # Keyed without the token count, so that a long run says it once per shape class.
    return (f"fallback:{backend.name}:{call.hidden}:{call.x.dtype}:{path}:{why[:40]}",
            f"fusion_pass: {backend.name} backend falls back to the reference for "
            f"{tuple(call.x.shape)} {call.x.dtype}: {why}")


def _current(route: _Route, group_name: str) -> bool:
    """Whether what ``route`` was decided on still holds."""
    if route.world is not None and c10d_world_size(group_name) != route.world:
        return False
    lim = route.limits
    return lim is None or lim is route.backend.limits or lim == route.backend.limits


_routes: dict[tuple, _Route] = {}
"""Per call signature (:func:`_signature`): made on its first call, forgotten when
the backend selection changes (:func:`backends.set_backend`)."""
_MAX_ROUTES = 4096
backends.on_selection_change(_routes.clear)


def _facts(t: Optional[torch.Tensor]) -> Optional[tuple]:
    return None if t is None else (t.shape, t.dtype, t.device, t.is_contiguous())


def _signature(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
               eps: Optional[torch.Tensor], multiplier: Optional[torch.Tensor],
               scale: Optional[torch.Tensor], group_name: str, path: str, spec: str) -> tuple:
    """What :func:`_check` and :func:`_route` read of a call,
    but the group's size and the backend's limits (:func:`_current` checks those):
    a call whose signature has been seen passed the checks and takes the same route."""
    return (_facts(x), _facts(residual), _facts(weight), _facts(eps), _facts(multiplier),
            _facts(scale), group_name, path, spec)


def run(call: Call, path: str, key: Optional[tuple] = None,
        route: Optional[_Route] = None) -> Outputs:
    """Run ``call`` on the selected backend, or on the reference with the reason said once.

    ``key``: the call's :func:`_signature`, when the caller has checked the call;
    the route is then kept for the next call with that signature.  ``route``:
    the one kept for ``key`` (the caller looked it up), None when there is none."""
    if route is None or not _current(route, call.group_name):
        if call.tokens == 0:
            return _empty(call)
        route = _route(call, path)
        if key is not None:
            if len(_routes) >= _MAX_ROUTES:
                _routes.clear()
            _routes[key] = route
    if route.path is _UNFUSED:
        if route.said is not None:
            once(*route.said)
        return _reference(call)
    backend = route.backend
    call.path = route.path
    out = backend.run(call)
    if isinstance(out, Outputs):
        quant = call.spec.quant
        if quant is not None and out.q is None:
            once(f"quant-separate:{backend.name}:{quant.mode}",
                 f"fusion_pass: the {backend.name} backend has no fused {quant.mode} "
                 "FP8 epilogue here: the norm is fused, the quantization runs separately")
            assert out.y is not None
            q, scales = quantize(out.y, quant, call.scale)
            out = Outputs(out.y if call.spec.emit_y else None, out.h, q, scales)
        return out
    # Declined by the backend: per call, as a decline may not last (buffer growth in capture).
    once(*_fallback(backend, call, route.path, out))
    return _reference(call)


def _reference(call: Call) -> Outputs:
    call.path = _UNFUSED
    out = backends.get("reference").run(call)
    assert isinstance(out, Outputs)
    # y, h and q row-major whatever the inputs' layouts are, as the fake kernels say;
    # the scales come in the layout their spec asks for (column-major for DeepGEMM).
    y, h, q, scales = out
    return Outputs(y.contiguous() if y is not None else None, h.contiguous(),
                   q.contiguous() if q is not None else None, scales)


def _fused(outputs: int, x: torch.Tensor, residual: Optional[torch.Tensor],
           weight: torch.Tensor, eps: Optional[torch.Tensor],
           multiplier: Optional[torch.Tensor], scale: Optional[torch.Tensor], group_name: str,
           path: str, spec: Union[str, NormSpec], site: str = "") -> tuple[torch.Tensor, ...]:
    """Both ops: the first ``outputs`` of :data:`OUTPUTS` (``y`` empty when not emitted)."""
    if site and site not in records.ran:  # each site is reported once, on its first call
        records.site_ran(site)
    text = spec if type(spec) is str else spec.encode()
    key = _signature(x, residual, weight, eps, multiplier, scale, group_name, path, text)
    route = _routes.get(key)
    norm = spec if type(spec) is NormSpec else NormSpec.decode(text)
    if route is None:
        _check(x, residual, weight, eps, multiplier, scale, path, norm, outputs)
    out = run(Call(x, residual, weight, norm, group_name, _UNFUSED, _scalar(eps, norm.eps),
                   _scalar(multiplier, norm.multiplier), scale), path, key, route)
    if outputs == 2:
        assert out.y is not None
        return out.y, out.h
    assert out.q is not None and out.scales is not None
    y = out.y if norm.emit_y and out.y is not None else x.new_empty(0, dtype=norm.y_dtype(x.dtype))
    return y, out.h, out.q, out.scales


def _fake(outputs: int, x, residual, weight, eps, multiplier, scale, group_name, path, spec,
          site=""):
    norm = NormSpec.decode(spec)
    _check(x, residual, weight, eps, multiplier, scale, path, norm, outputs)
    # Row-major whatever x's layout: what every backend (and the reference) returns.
    y = x.new_empty(x.shape if norm.emit_y else (0,), dtype=norm.y_dtype(x.dtype))
    if outputs == 2:
        return y, x.new_empty(x.shape)
    quant = norm.quant
    return y, x.new_empty(x.shape), x.new_empty(x.shape, dtype=quant.dtype), quant.empty_scales(x)


# Defined with torch.library.Library rather than torch.library.custom_op: the latter's
# Python autograd and dynamo-disable layers cost about 8 us per eager call (measured on
# the CPU), a quarter of the whole eager budget.  The ops are inference-only.
_lib = torch.library.Library("fusion_pass", "DEF")
for _name, _n in OPS.items():
    _lib.define(_schema(_name, _n))
    _lib.impl(_name, functools.partial(_fused, _n), "CompositeExplicitAutograd")
    torch.library.register_fake(f"fusion_pass::{_name}", functools.partial(_fake, _n), lib=_lib)

allreduce_rmsnorm = functools.partial(_fused, OPS["allreduce_rmsnorm"])
allreduce_rmsnorm_quant = functools.partial(_fused, OPS["allreduce_rmsnorm_quant"])
"""The ops' implementations, called without the dispatcher (arguments: :data:`ARGS`)."""


# -- the Python entry points ------------------------------------------------------------


def _split(value: object) -> tuple[Optional[Union[float, str]], Optional[torch.Tensor]]:
    """A scalar argument of the entry points: its entry in the spec, and its tensor."""
    if value is None:
        return None, None
    if type(value) is float:  # first: isinstance(value, torch.Tensor) takes torch's metaclass hook
        return value, None
    if isinstance(value, torch.Tensor):
        return TENSOR, value
    return float(value), None  # type: ignore[arg-type]


@functools.lru_cache(maxsize=1024)
def _spec(eps: Union[float, str], multiplier: Optional[Union[float, str]], gemma: bool,
          round_normed: bool, out_dtype: Optional[torch.dtype], quant: Optional[QuantSpec],
          emit_y: bool) -> NormSpec:
    if out_dtype is not None and out_dtype not in FLOATS:
        raise ValueError(f"fusion_pass: out_dtype must be one of {FLOATS}, not {out_dtype}")
    return NormSpec(eps=eps, multiplier=multiplier, gemma=bool(gemma),
                    round_normed=bool(round_normed),
                    out_dtype=None if out_dtype is None else gate.dtype_name(out_dtype),
                    quant=quant, emit_y=bool(emit_y))


def spec_of(eps: object, multiplier: object = None, gemma: bool = False,
            round_normed: bool = False, out_dtype: Optional[torch.dtype] = None,
            quant: Optional[QuantSpec] = None, emit_y: bool = True,
            ) -> tuple[NormSpec, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The entry points' options as the ops take them: ``(spec, eps tensor, multiplier
    tensor)``, a scalar given as a tensor being :data:`~fusion_pass.spec.TENSOR` in the spec."""
    e, e_t = _split(eps)
    m, m_t = _split(multiplier)
    return _spec(e, m, gemma, round_normed, out_dtype, quant, emit_y), e_t, m_t


def _eager(x: torch.Tensor) -> bool:
    """Whether a call may skip the dispatcher: plain tensors, nothing tracing or
    intercepting (torch.compile, make_fx, fake or functional modes, subclasses).
    The dispatcher costs 13-22 us per call on an H200 host, a third of
    an eager call; everything else in the op is the same either way."""
    return (type(x) is torch.Tensor and not torch.compiler.is_compiling()
            and _len_torch_dispatch_stack() == 0)  # no mode: _get_current_dispatch_mode() is None


def _call(outputs: int, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
          eps: object, multiplier: object, scale: Optional[torch.Tensor], group_name: str,
          path: str, gemma: bool, out_dtype: Optional[torch.dtype], round_normed: bool,
          quant: Optional[QuantSpec], emit_y: bool) -> tuple[torch.Tensor, ...]:
    spec, e_t, m_t = spec_of(eps, multiplier, gemma, round_normed, out_dtype, quant, emit_y)
    if _eager(x):
        return _fused(outputs, x, residual, weight, e_t, m_t, scale, group_name, str(path), spec)
    op = getattr(torch.ops.fusion_pass, next(n for n, k in OPS.items() if k == outputs))
    return op(x, residual, weight, e_t, m_t, scale, group_name, str(path), spec.encode())


def fused_allreduce_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: Union[float, torch.Tensor],
                            group_name: str, residual: Optional[torch.Tensor] = None,
                            path: str = "auto", gemma: bool = False,
                            out_dtype: Optional[torch.dtype] = None, round_normed: bool = False,
                            multiplier: Union[float, torch.Tensor, None] = None,
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """All-reduce ``x`` over the c10d group ``group_name``, multiply by ``multiplier``,
    add ``residual``, RMSNorm.

    Returns ``(y, h)``: the normalised output (in ``out_dtype``, default
    ``x.dtype``) and the pre-norm value (in ``x.dtype``).  ``eps`` and
    ``multiplier`` are floats or one-element tensors.  ``path`` is ``auto`` (the
    gate decides per call) or one of ``one_stage``, ``two_stage``, ``unfused``.
    ``round_normed``: round the normalised row to ``x.dtype`` before the weight
    multiplies it, as Hugging Face's ``weight * hidden.to(input_dtype)`` does (the
    pass sets it from the graph).  :class:`~fusion_pass.spec.NormSpec` says what
    each option computes.
    """
    return _call(2, x, residual, weight, eps, multiplier, None, group_name, path, gemma,
                 out_dtype, round_normed, None, True)  # type: ignore[return-value]


def fused_allreduce_rmsnorm_quant(x: torch.Tensor, weight: torch.Tensor,
                                  eps: Union[float, torch.Tensor], group_name: str,
                                  quant: QuantSpec, scale: Optional[torch.Tensor] = None,
                                  residual: Optional[torch.Tensor] = None, path: str = "auto",
                                  gemma: bool = False, emit_y: bool = False,
                                  out_dtype: Optional[torch.dtype] = None,
                                  round_normed: bool = False,
                                  multiplier: Union[float, torch.Tensor, None] = None,
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`fused_allreduce_rmsnorm` followed by FP8 quantization of ``y`` by ``quant``.

    Returns ``(y, h, q, scales)``; ``y`` is empty unless ``emit_y``, ``scales``
    empty for a static scale.
    """
    return _call(4, x, residual, weight, eps, multiplier, scale, group_name, path, gemma,
                 out_dtype, round_normed, quant, emit_y)  # type: ignore[return-value]
