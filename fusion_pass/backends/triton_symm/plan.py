"""A launch plan: everything about a call that its shape, dtypes, options and
group fix, made once per call shape by the backend (``backend.py``); a call
then costs a dictionary lookup, the output allocations and one C launch
(``launch.py``)."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from ...quant import QuantSpec
from ..base import Call, Outputs
from .call_args import scalar_arg

PER_CALL = ("x_ptr", "res_ptr", "w_ptr", "eps", "mult", "y_ptr", "h_ptr", "q_ptr", "s_ptr",
            "scale_ptr")
"""The kernels' leading parameters, given anew by every call (the rest are the plan's)."""


class Plan:
    """Everything about a call that its shape, dtypes, options and group fix:
    made once, then each call allocates its outputs and launches.

    ``pieces`` holds ``(first row, launcher)`` per launch: one for every call
    up to :data:`.geometry.MAX_INPUT_BYTES`, consecutive row pieces above it."""

    __slots__ = ("pieces", "launcher", "device", "out_dtype", "emit_y", "quant", "fp8", "fnuz",
                 "dummy_y", "s_row", "generation")

    def __init__(self, pieces: tuple[tuple[int, Any], ...], device: int, out_dtype: torch.dtype,
                 emit_y: bool, quant: Optional[QuantSpec], s_row: int, x: torch.Tensor,
                 generation: int = 0) -> None:
        """``generation``: the buffer provider's when the plan was made (a plan of
        an older one looks its buffer up again)."""
        self.pieces, self.device, self.out_dtype = pieces, device, out_dtype
        self.launcher = pieces[0][1] if len(pieces) == 1 else None
        self.emit_y, self.quant, self.s_row = emit_y, quant, s_row
        self.fp8 = quant.dtype if quant is not None else None
        self.fnuz = quant is not None and quant.fp8_dtype == "float8_e4m3fnuz"
        # The kernel reads y's dtype from its pointer; with y not emitted it gets
        # this never-written stand-in.
        self.dummy_y = None if emit_y else x.new_empty(1, dtype=out_dtype)
        self.generation = generation

    def __call__(self, call: Call) -> Union[Outputs, str]:
        x, res, w, eps, m = call.x, call.residual, call.weight, call.eps, scalar_arg(call.multiplier)
        if res is None:
            res = x
        if not (x.is_contiguous() and res.is_contiguous() and w.is_contiguous()):
            return "non-contiguous input"
        xp, rp, wp = x.data_ptr(), res.data_ptr(), w.data_ptr()
        aligned = ((xp | rp | wp) & 15) == 0
        launcher = self.launcher
        fast = aligned and launcher is not None and launcher.ready
        h = torch.empty_like(x)
        y = torch.empty_like(x, dtype=self.out_dtype) if self.emit_y else self.dummy_y
        if self.quant is None:
            if fast:
                launcher.launch_addresses(self.device, (
                    xp, rp, wp, eps if type(eps) is float else eps.data_ptr(),
                    m if type(m) is float else m.data_ptr(), y.data_ptr(), h.data_ptr(), 0, 0, 0))
            else:
                self._launch(x, (x, res, w, eps, m, y, h, h, h, h), aligned)
            return Outputs(y, h)
        scale = call.scale if call.scale is not None else h
        if scale.get_device() != self.device:
            return "the static scale is not on the input's device"
        q = torch.empty_like(x, dtype=self.fp8)
        scales = self.quant.empty_scales(x)
        qk = q.view(torch.uint8) if self.fnuz else q
        if fast:
            launcher.launch_addresses(self.device, (
                xp, rp, wp, eps if type(eps) is float else eps.data_ptr(),
                m if type(m) is float else m.data_ptr(), y.data_ptr(), h.data_ptr(),
                q.data_ptr(), scales.data_ptr(), scale.data_ptr()))
        else:
            self._launch(x, (x, res, w, eps, m, y, h, qk, scales, scale), aligned)
        return Outputs(y if self.emit_y else None, h, q, scales)

    def _launch(self, x: torch.Tensor, args: tuple, aligned: bool) -> None:
        """Launch every piece with its rows' tensors: ``args`` (in ``PER_CALL``
        order) with the per-row ones (x, residual, y, h, q, dynamic scales)
        advanced to the piece's first row; the others (weight, epsilon,
        multiplier, static scale, the empty scales of a static one, the
        stand-ins of absent outputs) as they are."""
        hidden, quant = x.shape[-1], self.quant is not None
        per_token = quant and self.quant.mode != "static"
        per_row = (hidden, hidden, 0, 0, 0, hidden if self.emit_y else 0, hidden,
                   hidden if quant else 0, self.s_row if per_token else 0, 0)
        for first, launcher in self.pieces:
            piece = args if first == 0 else tuple(
                _advanced(a, first * k) if k else a for a, k in zip(args, per_row))
            launcher(self.device, piece, aligned)


def _advanced(t: torch.Tensor, elems: int) -> torch.Tensor:
    """A view of ``t`` starting ``elems`` elements later (a kernel takes a
    pointer: only the start address and the dtype matter)."""
    return t.as_strided((1,), (1,), t.storage_offset() + elems)
