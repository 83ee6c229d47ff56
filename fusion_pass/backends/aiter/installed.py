"""The installed AITER: its version, its ``CustomAllreduce`` class, its FP8 dtype.

Nothing here guesses: each is read from the installation, and an AITER that
cannot be imported raises with the import error attached.
"""

from __future__ import annotations

import sys
from importlib import metadata
from typing import Optional

import torch

DIST_NAME = "amd-aiter"
MODULE = "aiter.dist.device_communicators.custom_all_reduce"


def version() -> Optional[str]:
    """The installed AITER's version string, or None when nothing says it."""
    try:
        return metadata.version(DIST_NAME)
    except metadata.PackageNotFoundError:
        pass
    # A source checkout on sys.path has no dist metadata, only the file
    # setuptools_scm wrote at build time.
    try:
        from aiter._version import __version__  # type: ignore[import-not-found]
    except ImportError:
        return None
    return str(__version__)


def custom_allreduce_class() -> type:
    """AITER's ``CustomAllreduce``; a RuntimeError carrying the import error when it
    cannot be imported (AITER missing, or a broken build)."""
    try:
        module = __import__(MODULE, fromlist=["CustomAllreduce"])
    except ImportError as e:
        raise RuntimeError(f"fusion_pass: the aiter backend needs AITER's {MODULE} (pip package "
                           f"{DIST_NAME!r}, or a source build of ROCm/aiter): {e!r}") from e
    return module.CustomAllreduce


def fp8_dtype(cls: type) -> Optional[torch.dtype]:
    """The FP8 dtype ``cls``'s quantizing kernels write: the ``fp8`` its module takes from
    ``aiter.utility.dtypes`` for the GPU it runs on.  None when the module has none
    (AITER before its FP8 epilogues) or AITER does not know the GPU (its uint8 fallback)."""
    fp8 = getattr(sys.modules.get(cls.__module__), "fp8", None)
    if not isinstance(fp8, torch.dtype) or not fp8.is_floating_point or fp8.itemsize != 1:
        return None
    return fp8
