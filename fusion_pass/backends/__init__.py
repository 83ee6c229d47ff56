"""Backends of the fused op, behind a small registry.

A backend computes ``(y, h)`` for a path chosen by the gate, or returns None to
decline an input it cannot take; the op then runs the reference backend and
says why once.  Selection: the user's choice (``FUSION_PASS_BACKEND`` or
:func:`set_backend`), else AITER on ROCm when importable, Triton on CUDA/ROCm,
the reference everywhere else.
"""

from __future__ import annotations

import os
from typing import Callable, Optional, Protocol

import torch

from ..gate import BackendLimits, Path


class Backend(Protocol):
    name: str
    limits: BackendLimits

    def run(self, x: torch.Tensor, residual: Optional[torch.Tensor],
            weight: torch.Tensor, eps: float, group_name: str, path: Path,
            gemma: bool) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """Fused result, or None when this input is declined."""
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


def _aiter_importable() -> bool:
    try:
        import aiter  # noqa: F401
    except Exception:
        return False
    return True


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def default_name(device_type: str) -> str:
    """The backend a device type gets when the user chose none."""
    if device_type == "cuda":
        if torch.version.hip is not None and "aiter" in _factories and _aiter_importable():
            return "aiter"
        if "triton" in _factories and _triton_importable():
            return "triton"
    return "reference"


def selected_name(device_type: str) -> str:
    return _override or os.environ.get("FUSION_PASS_BACKEND") or default_name(device_type)


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
