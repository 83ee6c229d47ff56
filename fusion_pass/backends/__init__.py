"""The registry of the fused op's backends, and which one a device gets.

What a backend is (:class:`~.base.Call`, :class:`~.base.Outputs`,
:class:`~.base.Backend`) is in :mod:`.base`; the backends import it from there
and this registry imports them, the heavy ones lazily.  Selection: the user's choice (``FUSION_PASS_BACKEND`` or
:func:`set_backend`), else AITER on ROCm when importable, Triton on CUDA/ROCm,
the reference everywhere else.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Callable, Optional

import torch

from ..log import logger, once
from .base import Backend, Call, Outputs

__all__ = ["Backend", "Call", "Outputs", "forget", "get", "names", "register", "select",
           "set_backend"]


_factories: dict[str, Callable[[], Backend]] = {}
_instances: dict[str, Backend] = {}
_override: Optional[str] = None


def register(name: str, factory: Callable[[], Backend]) -> None:
    _factories[name] = factory


def forget(name: str) -> None:
    """Drop the instance made of ``name`` (one registered again is made anew)."""
    _instances.pop(name, None)


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
