"""The fused ops and their Python entry points.

``torch.ops.fusion_pass.allreduce_rmsnorm`` returns ``(y, h)``;
``torch.ops.fusion_pass.allreduce_rmsnorm_quant`` returns ``(q, scales, h, y)``
with ``q`` the FP8 quantization of ``y`` (see :mod:`fusion_pass.quant`).

Both are functional (no mutated arguments) so that Inductor needs no
``auto_functionalized`` copies around them.  The path is a string argument
baked in by the pass; ``runtime`` (or ``auto``) asks the gate per call with the
concrete token count.

Epsilon is ``eps`` (a float the pass read from the graph) unless
``eps_tensor`` is given: a 0-dim tensor holding it, for graphs that carry
epsilon as a value (``torch.compile(dynamic=True)`` does not specialise Python
floats, so a norm's ``self.eps`` arrives as a graph input).  A CPU tensor is
read on the host, for free and without a device sync; a tensor on the device
goes to the kernels, which load it there.

An eager call costs host time on every layer of every step, so the op keeps,
per call signature (shapes, dtypes, devices, contiguity, options, group name,
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

from typing import NamedTuple, Optional, Union

import torch
from torch._C import _len_torch_dispatch_stack

from . import backends, gate, records
from .backends.base import Backend, Call, Outputs, unfit_layout
from .dtypes import FLOATS
from .groups import c10d_world_size
from .log import once
from .quant import QuantSpec, quantize

PATHS = ("auto",) + tuple(p.value for p in gate.Path)
_UNFUSED = gate.Path.UNFUSED  # an enum member read through its class costs 0.1-0.2 us per call


def _check(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
           path: str, eps_tensor: Optional[torch.Tensor], out_dtype: Optional[torch.dtype]) -> None:
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
    if eps_tensor is not None and (eps_tensor.numel() != 1 or not eps_tensor.is_floating_point()):
        raise ValueError(f"fusion_pass: eps_tensor must hold one float, not "
                         f"{tuple(eps_tensor.shape)} {eps_tensor.dtype}")
    if out_dtype is not None and out_dtype not in FLOATS:
        raise ValueError(f"fusion_pass: out_dtype must be one of {FLOATS}, not {out_dtype}")


def _gate(x: torch.Tensor, world_size: int, limits: gate.BackendLimits,
          group_size: Optional[int]) -> gate.Decision:
    return gate.decide(x.shape[-1], x.dtype, world_size, gate.tokens_of(x.shape), limits=limits,
                       group_size=group_size)


def _eps(eps: float, eps_tensor: Optional[torch.Tensor]) -> Union[float, torch.Tensor]:
    if eps_tensor is None:
        return eps
    return float(eps_tensor) if eps_tensor.device.type == "cpu" else eps_tensor


def _empty(call: Call) -> Outputs:
    """Outputs of a call with no tokens: nothing to reduce or launch on any backend."""
    x = call.x
    y = x.new_empty(x.shape, dtype=call.out_dtype)
    if call.quant is None:
        return Outputs(y, x.new_empty(x.shape))
    scales = call.quant.empty_scales(x)
    return Outputs(y, x.new_empty(x.shape), x.new_empty(x.shape, dtype=call.quant.dtype), scales)


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
    path: gate.Path
    limits: Optional[gate.BackendLimits]
    world: Optional[int]
    said: Optional[tuple[str, str]] = None


def _route(call: Call, path: str) -> _Route:
    """Where ``call`` runs (a call with tokens; :func:`run` returns empty ones)."""
    backend = backends.select(call.x.device.type)
    if backend.name == "reference" or path == "unfused":
        return _Route(backend, _UNFUSED, None, None)
    limits, world = backend.limits, c10d_world_size(call.group_name)
    if path in ("auto", "runtime"):
        group = call.quant.group if call.quant is not None and call.quant.group else None
        decision = _gate(call.x, world, limits, group)
        chosen, why = decision.path, None if decision.fused else decision.reason
    else:
        # A path baked at compile time, perhaps under other limits: the backend's rules
        # (the ones the gate decided with) say whether it runs this call.
        chosen = gate.Path(path)
        why = limits.accepts(call.hidden, call.x.dtype, world, call.tokens, chosen)
    if why is None:
        why = unfit_layout(call.x, call.residual, call.weight)
    if why is None:
        return _Route(backend, chosen, limits, world)
    return _Route(backend, _UNFUSED, limits, world, _fallback(backend, call, chosen, why))


def _fallback(backend: Backend, call: Call, path: gate.Path, why: str) -> tuple[str, str]:
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


def _signature(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
               path: str, eps_tensor: Optional[torch.Tensor], out_dtype: Optional[torch.dtype],
               gemma: bool, group_name: str) -> tuple:
    """What :func:`_check` and :func:`_route` read of a call,
    but the group's size and the backend's limits (:func:`_current` checks those):
    a call whose signature has been seen passed the checks and takes the same route."""
    return (x.shape, x.dtype, x.device, x.is_contiguous(), weight.shape, weight.dtype,
            weight.is_contiguous(),
            None if residual is None else residual.shape,
            None if residual is None else residual.dtype,
            None if residual is None else residual.is_contiguous(),
            None if eps_tensor is None else (eps_tensor.shape, eps_tensor.dtype,
                                             eps_tensor.device),
            out_dtype, gemma, path, group_name)


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
        if call.quant is not None and out.q is None:
            once(f"quant-separate:{backend.name}:{call.quant.mode}",
                 f"fusion_pass: the {backend.name} backend has no fused {call.quant.mode} "
                 "FP8 epilogue here: the norm is fused, the quantization runs separately")
            assert out.y is not None
            q, scales = quantize(out.y, call.quant, call.scale)
            out = Outputs(out.y if call.emit_y else None, out.h, q, scales)
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


_sites_run: set[str] = set()
"""The ``site`` arguments seen: each is reported once, on its first call."""


def _first_run(site: str) -> None:
    _sites_run.add(site)
    records.site_ran(site)


# Defined with torch.library.Library rather than torch.library.custom_op: the latter's
# Python autograd and dynamo-disable layers cost about 8 us per eager call (measured on
# the CPU), a quarter of the whole eager budget.  The ops are inference-only.
_lib = torch.library.Library("fusion_pass", "DEF")
_lib.define("allreduce_rmsnorm(Tensor x, Tensor? residual, Tensor weight, float eps, str group_name, "
            "str path, bool gemma=False, Tensor? eps_tensor=None, ScalarType? out_dtype=None, "
            "str site='', bool round_normed=False) -> (Tensor, Tensor)")
_lib.define("allreduce_rmsnorm_quant(Tensor x, Tensor? residual, Tensor weight, float eps, "
            "str group_name, str path, bool gemma, str quant, Tensor? scale, bool emit_y, "
            "Tensor? eps_tensor=None, ScalarType? out_dtype=None, str site='', "
            "bool round_normed=False) -> (Tensor, Tensor, Tensor, Tensor)")


def allreduce_rmsnorm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                      eps: float, group_name: str, path: str, gemma: bool = False,
                      eps_tensor: Optional[torch.Tensor] = None,
                      out_dtype: Optional[torch.dtype] = None, site: str = "",
                      round_normed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = all_reduce(x) (+ residual)``, ``y = rmsnorm(h) * w``; returns ``(y, h)``."""
    if site and site not in _sites_run:
        _first_run(site)
    key = _signature(x, residual, weight, path, eps_tensor, out_dtype, gemma, group_name)
    route = _routes.get(key)
    if route is None:
        _check(x, residual, weight, path, eps_tensor, out_dtype)
    out = run(Call(x, residual, weight, eps if eps_tensor is None else _eps(eps, eps_tensor),
                   group_name, _UNFUSED, gemma, out_dtype, round_normed=round_normed),
              path, key, route)
    assert out.y is not None
    return out.y, out.h


@torch.library.register_fake("fusion_pass::allreduce_rmsnorm")
def _(x, residual, weight, eps, group_name, path, gemma=False, eps_tensor=None, out_dtype=None,
      site="", round_normed=False):
    _check(x, residual, weight, path, eps_tensor, out_dtype)
    # Row-major whatever x's layout: what every backend (and the reference) returns.
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape)


def allreduce_rmsnorm_quant(x: torch.Tensor, residual: Optional[torch.Tensor],
                            weight: torch.Tensor, eps: float, group_name: str, path: str,
                            gemma: bool, quant: str, scale: Optional[torch.Tensor],
                            emit_y: bool, eps_tensor: Optional[torch.Tensor] = None,
                            out_dtype: Optional[torch.dtype] = None, site: str = "",
                            round_normed: bool = False,
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """All-reduce + RMSNorm + FP8 quantization of ``y``: returns ``(q, scales, h, y)``;
    ``y`` is empty unless ``emit_y``, ``scales`` empty for a static scale."""
    if site and site not in _sites_run:
        _first_run(site)
    spec = QuantSpec.decode(quant)
    key = _signature(x, residual, weight, path, eps_tensor, out_dtype, gemma, group_name) + (
        quant, emit_y, None if scale is None else (scale.shape, scale.dtype, scale.device))
    route = _routes.get(key)
    if route is None:
        _check(x, residual, weight, path, eps_tensor, out_dtype)
        spec.check(x.shape[-1], scale)
    out = run(Call(x, residual, weight, _eps(eps, eps_tensor), group_name, _UNFUSED,
                   gemma, out_dtype, spec, scale, emit_y, round_normed), path, key, route)
    assert out.q is not None and out.scales is not None
    y = out.y if emit_y and out.y is not None else x.new_empty(0, dtype=out_dtype or x.dtype)
    return out.q, out.scales, out.h, y


@torch.library.register_fake("fusion_pass::allreduce_rmsnorm_quant")
def _(x, residual, weight, eps, group_name, path, gemma, quant, scale, emit_y, eps_tensor=None,
      out_dtype=None, site="", round_normed=False):
    spec = QuantSpec.decode(quant)
    _check(x, residual, weight, path, eps_tensor, out_dtype)
    spec.check(x.shape[-1], scale)
    y = (x.new_empty(x.shape, dtype=out_dtype) if emit_y
         else x.new_empty(0, dtype=out_dtype or x.dtype))
    return (x.new_empty(x.shape, dtype=spec.dtype),
            spec.empty_scales(x),
            x.new_empty(x.shape), y)


_lib.impl("allreduce_rmsnorm", allreduce_rmsnorm, "CompositeExplicitAutograd")
_lib.impl("allreduce_rmsnorm_quant", allreduce_rmsnorm_quant, "CompositeExplicitAutograd")


def _split_eps(eps: Union[float, torch.Tensor]) -> tuple[float, Optional[torch.Tensor]]:
    """The op's ``eps`` and ``eps_tensor`` arguments for the wrappers' ``eps``."""
    if type(eps) is float:  # first: isinstance(eps, torch.Tensor) takes torch's metaclass hook
        return eps, None
    return (0.0, eps) if isinstance(eps, torch.Tensor) else (float(eps), None)


def _eager(x: torch.Tensor) -> bool:
    """Whether a call may skip the dispatcher: plain tensors, nothing tracing or
    intercepting (torch.compile, make_fx, fake or functional modes, subclasses).
    The dispatcher costs 13-22 us per call on an H200 host, a third of
    an eager call; everything else in the op is the same either way."""
    return (type(x) is torch.Tensor and not torch.compiler.is_compiling()
            and _len_torch_dispatch_stack() == 0)  # no mode: _get_current_dispatch_mode() is None


def fused_allreduce_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: Union[float, torch.Tensor],
                            group_name: str, residual: Optional[torch.Tensor] = None,
                            path: str = "auto", gemma: bool = False,
                            out_dtype: Optional[torch.dtype] = None, round_normed: bool = False,
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """All-reduce ``x`` over the c10d group ``group_name``, add ``residual``, RMSNorm.

    Returns ``(y, h)``: the normalised output (in ``out_dtype``, default
    ``x.dtype``) and the pre-norm sum (in ``x.dtype``).  ``eps`` is a float or
    a 0-dim tensor.  ``path`` is ``auto`` (the gate decides per call) or one of
    ``one_stage``, ``two_stage``, ``unfused``.  ``round_normed``: round the
    normalised row to ``x.dtype`` before the weight multiplies it, as Hugging
    Face's ``weight * hidden.to(input_dtype)`` does (the pass sets it from the graph).
    """
    eps_f, eps_t = _split_eps(eps)
    op = allreduce_rmsnorm if _eager(x) else torch.ops.fusion_pass.allreduce_rmsnorm
    return op(x, residual, weight, eps_f, group_name, str(path), gemma, eps_t, out_dtype, "",
              round_normed)


def fused_allreduce_rmsnorm_quant(x: torch.Tensor, weight: torch.Tensor,
                                  eps: Union[float, torch.Tensor], group_name: str,
                                  quant: QuantSpec, scale: Optional[torch.Tensor] = None,
                                  residual: Optional[torch.Tensor] = None, path: str = "auto",
                                  gemma: bool = False, emit_y: bool = False,
                                  out_dtype: Optional[torch.dtype] = None,
                                  round_normed: bool = False,
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`fused_allreduce_rmsnorm` followed by FP8 quantization of ``y`` by ``quant``.

    Returns ``(q, scales, h, y)``; ``y`` is empty unless ``emit_y``.
    """
    eps_f, eps_t = _split_eps(eps)
    op = allreduce_rmsnorm_quant if _eager(x) else torch.ops.fusion_pass.allreduce_rmsnorm_quant
    return op(x, residual, weight, eps_f, group_name, str(path), gemma, quant.encode(), scale,
              emit_y, eps_t, out_dtype, "", round_normed)
