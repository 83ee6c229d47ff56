"""Backends of the fused op, behind a small registry.

A backend computes :class:`Outputs` for a :class:`Call` on the path the gate
chose, or returns the reason it declines an input it cannot take; the op then
runs the reference backend and says why once.  Selection: the user's choice (``FUSION_PASS_BACKEND`` or
:func:`set_backend`), else AITER on ROCm when importable, Triton on CUDA/ROCm,
the reference everywhere else.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Callable, NamedTuple, Optional, Protocol, Union

import torch

from ..gate import BackendLimits, Path
from ..log import logger, once
from ..quant import QuantSpec


class Call:
    """One call of the fused op, as the op hands it to a backend.

    ``eps`` is a float, or a 0-dim tensor on the input's device when the graph
    computes epsilon there (a CPU tensor is read into the float by the op).
    ``out_dtype`` is the dtype of ``y``; ``h`` is always in ``x.dtype``.  With
    ``quant`` set, ``y`` is quantized by that spec (``scale``: the static scale)
    and kept only when ``emit_y``.  ``round_normed``: the normalised row is
    rounded to ``x.dtype`` before the weight multiplies it, as Hugging Face's
    ``weight * hidden.to(input_dtype)`` and vLLM's CUDA RMSNorm kernels do
    (``y = round(w * round(h * rstd))``); else ``y = round(h * rstd * w)``.
    """

    __slots__ = ("x", "residual", "weight", "eps", "group_name", "path", "gemma", "out_dtype",
                 "quant", "scale", "emit_y", "round_normed")

    def __init__(self, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                 eps: Union[float, torch.Tensor], group_name: str, path: Path,
                 gemma: bool = False, out_dtype: Optional[torch.dtype] = None,
                 quant: Optional[QuantSpec] = None, scale: Optional[torch.Tensor] = None,
                 emit_y: bool = True, round_normed: bool = False) -> None:
        self.x, self.residual, self.weight, self.eps = x, residual, weight, eps
        self.group_name, self.path, self.gemma = group_name, path, gemma
        self.out_dtype = x.dtype if out_dtype is None else out_dtype
        self.quant, self.scale, self.emit_y = quant, scale, emit_y
        self.round_normed = round_normed

    @property
    def hidden(self) -> int:
        return self.x.shape[-1]

    @property
    def tokens(self) -> int:
        return self.x.numel() // self.x.shape[-1] if self.x.shape[-1] else 0

    def without_quant(self) -> "Call":
        """The same call with the quantization epilogue left to the caller."""
        return Call(self.x, self.residual, self.weight, self.eps, self.group_name, self.path,
                    self.gemma, self.out_dtype, round_normed=self.round_normed)


class Outputs(NamedTuple):
    """What a backend computed: ``y`` (None when quantized and not emitted), ``h``,
    and for a quantizing call ``q`` and ``scales`` (None when the backend fused
    the norm but left the quantization to the op)."""

    y: Optional[torch.Tensor]
    h: torch.Tensor
    q: Optional[torch.Tensor] = None
    scales: Optional[torch.Tensor] = None


class Backend(Protocol):
    name: str
    limits: BackendLimits

    def run(self, call: Call) -> Union[Outputs, str]:
        """The fused result, or the reason this call is declined (the op then runs
        the reference and logs the reason once)."""
        ...


_factories: dict[str, Callable[[], Backend]] = {}
_instances: dict[str, Backend] = {}
_override: Optional[str] = None


def register(name: str, factory: Callable[[], Backend]) -> None:
    _factories[name] = factory


def names() -> list[str]:
    return sorted(_factories)


def get(name: str) -> Backend:
    if name not in _instances:
        if name not in _factories:
            raise ValueError(f"unknown fusion_pass backend {name!r}; known: {names()}")
        _instances[name] = _factories[name]()
    return _instances[name]


def set_backend(name: Optional[str]) -> None:
    """Force a backend for this process (None: choose by device again)."""
    if name is not None and name not in _factories:
        raise ValueError(f"unknown fusion_pass backend {name!r}; known: {names()}")
    global _override
    _override = name
    _selected.clear()
    for forget in _listeners:
        forget()


_listeners: list[Callable[[], None]] = []


def on_selection_change(forget: Callable[[], None]) -> None:
    """Call ``forget`` whenever :func:`set_backend` changes the selection: for
    whoever keeps what it selected (the op keeps a route per call signature)."""
    _listeners.append(forget)


@functools.lru_cache(maxsize=None)
def import_error(module: str) -> Optional[BaseException]:
    """Why ``module`` cannot be imported (None: it can), logged once: a broken
    install at WARNING with the exception, a package that is simply absent at INFO."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:  # the package is there but something it needs is not
            logger.warning("fusion_pass: importing %s failed: %r", module, e)
        else:
            logger.info("fusion_pass: %s is not installed", module)
        return e
    except Exception as e:  # a broken build raises anything (OSError, RuntimeError, ...)
        logger.warning("fusion_pass: importing %s failed: %r", module, e)
        return e
    return None


def default_name(device_type: str) -> str:
    """The backend a device type gets when the user chose none."""
    if device_type != "cuda":
        return "reference"
    if torch.version.hip is not None and "aiter" in _factories and import_error("aiter") is None:
        return "aiter"
    if "triton" in _factories and import_error("triton") is None:
        return "triton"
    once(f"reference-on-{device_type}",
         f"fusion_pass: no fused backend can be imported on this {'ROCm' if torch.version.hip else 'CUDA'} "
         f"device (triton: {import_error('triton')!r}); the fused op runs the unfused reference")
    return "reference"


def selected_name(device_type: str) -> str:
    """The backend for ``device_type``: :func:`set_backend`'s, else
    ``FUSION_PASS_BACKEND``'s (read once per process), else the device's default."""
    name = _selected.get(device_type)
    if name is None:
        name = _override or os.environ.get("FUSION_PASS_BACKEND") or default_name(device_type)
        _selected[device_type] = name
    return name


_selected: dict[str, str] = {}
"""Per device type: looked up on every op call, so the environment is read once."""


def select(device_type: str) -> Backend:
    return get(selected_name(device_type))


def _register_builtins() -> None:
    from . import reference

    register("reference", reference.ReferenceBackend)
    # Heavy backends import lazily: their modules load only when chosen.
    register("triton", lambda: __import__(
        "fusion_pass.backends.triton_symm", fromlist=["TritonBackend"]).TritonBackend())
    register("aiter", lambda: __import__(
        "fusion_pass.backends.aiter", fromlist=["AiterBackend"]).AiterBackend())


_register_builtins()
