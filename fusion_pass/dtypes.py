"""The activation dtypes the fused op takes, as torch dtypes (the gate names them by string)."""

from __future__ import annotations

import torch

from .gate import ELEMENT_SIZE

FLOATS: tuple[torch.dtype, ...] = tuple(getattr(torch, name) for name in ELEMENT_SIZE)
