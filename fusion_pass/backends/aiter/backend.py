"""The ``aiter`` backend: one call of AITER's fused all-reduce + residual add + RMSNorm
(+ FP8 quantization) per fused op, or the reason it declines.

What it may call is decided once, from the installed AITER
(:mod:`.releases`, :mod:`.limits`); every call is checked against those limits
before AITER sees it, because a graph may carry a path baked under other limits.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Optional, Union

import torch

from ...gate import Path, dtype_name
from ...groups import c10d_world_size
from ...log import once
from ..base import Call, Outputs
from . import installed
from .communicators import Communicators
from .epilogues import Epilogue, fused_epilogue
from .releases import (GEMMA_NORM, Signature, allowed_bugs, capabilities, format_version,
                       say_once)


class AiterBackend:
    """Dispatches the fused op to AITER's ``CustomAllreduce``."""

    name = "aiter"

    def __init__(self, version: Optional[str] = None) -> None:
        """``version`` overrides the installed AITER's own (tests; a build whose
        version string is wrong)."""
        if torch.version.hip is None:
            raise RuntimeError("fusion_pass: the aiter backend needs a ROCm build of torch "
                               f"(this one is {torch.__version__}); choose another backend "
                               "with FUSION_PASS_BACKEND or fusion_pass.set_backend()")
        cls = installed.custom_allreduce_class()
        self.version = version if version is not None else installed.version() or "unknown"
        self.caps = capabilities(self.version, Signature.of(cls), installed.fp8_dtype(cls),
                                 allowed_bugs())
        self.limits = self.caps.limits
        self._comms = Communicators(cls, self.caps)
        say_once(self.caps)

    # -- communicators ------------------------------------------------------

    def prepare(self, group_name: str, device: torch.device) -> Optional[str]:
        """Make ``group_name``'s AITER communicator now, outside graph capture (a setup
        hook for callers that capture before any eager call); why not, or None."""
        return self._comms.prepare(group_name, device)

    @contextlib.contextmanager
    def graph_capture(self, group_name: str, device: torch.device) -> Iterator[None]:
        """Wrap a graph capture with this so that the fused calls in it read their
        inputs in place; entering it also makes the communicator, outside capture."""
        with self._comms.graph_capture(group_name, device):
            yield

    # -- the call -----------------------------------------------------------

    def run(self, call: Call) -> Union[Outputs, str]:
        why = self._unfit(call)
        if why:
            return why
        epilogue: Optional[Epilogue] = None
        if call.spec.quant is not None:
            epilogue, why_not = fused_epilogue(self.caps, call)
            if epilogue is None:
                if call.out_dtype != call.x.dtype:
                    return f"{why_not}, and AITER writes y in {dtype_name(call.x.dtype)} only"
                once(f"aiter-quant:{why_not}", f"fusion_pass: {why_not}; the norm runs on AITER, "
                     "the quantization after it", logging.INFO)
        ca = self._comms.get(call.group_name, call.x.device)
        if isinstance(ca, str):
            return ca
        if not ca.should_custom_ar(call.x):
            return ("AITER's should_custom_ar declines the input (disabled, outside its size "
                    "window, or not contiguous)")
        return self._call(ca, call, epilogue)

    def _unfit(self, call: Call) -> str:
        """Why AITER must not see this call, checked before anything is allocated."""
        path = Path(call.path)  # the op resolves ``runtime`` before calling a backend
        v = self.version
        tokens, hidden = call.tokens, call.hidden
        # The same rules the gate decided with (a graph may carry a path baked under others).
        why = self.limits.accepts(hidden, call.x.dtype, c10d_world_size(call.group_name),
                                  tokens, path)
        if why is not None:
            return f"AITER {v}'s {path.value} kernel cannot take {tokens} x {hidden}: {why}"
        if call.weight.dtype != call.x.dtype:
            return (f"AITER reads the norm weight as {dtype_name(call.x.dtype)}, not "
                    f"{dtype_name(call.weight.dtype)}")
        if isinstance(call.eps, torch.Tensor):
            return "AITER takes epsilon as a host float; reading this device tensor would sync"
        lacking = self.limits.lacking(call.spec.features())
        if lacking is not None:  # the op asks the same rule first: a graph baked elsewhere
            return lacking
        if call.spec.quant is None and call.out_dtype != call.x.dtype:
            return f"AITER writes y in {dtype_name(call.x.dtype)} only"
        if call.spec.gemma and not self.caps.signature.gemma:
            return (f"AITER {v}'s fused_ar_rms has no gemma_norm (ROCm/aiter#3792, in "
                    f"{format_version(GEMMA_NORM)}) for Gemma's (1 + w) norm")
        return ""

    def _call(self, ca: Any, call: Call, epilogue: Optional[Epilogue]) -> Outputs:
        x = call.x
        # The kernel always adds a residual; adding zeros is exact.
        res_in = call.residual if call.residual is not None else torch.zeros_like(x)
        common: dict[str, Any] = dict(w=call.weight, eps=call.eps,
                                      registered=self._comms.registered(ca),
                                      use_1stage=call.path is Path.ONE_STAGE)
        if epilogue is Epilogue.PER_GROUP:
            assert call.spec.quant is not None
            # It allocates its own outputs (fresh tensors, not its IPC buffers).
            q, h, scales = ca.fused_ar_rms_per_group_quant(
                x, res_in, group_size=call.spec.quant.group, **common)
            return Outputs(None, h, q, scales)
        if self.caps.signature.gemma:
            common["gemma_norm"] = call.spec.gemma
        # Fresh outputs that the caller owns: AITER writes into whatever it is
        # given, so nothing returned can alias its IPC buffers on any version.
        h = torch.empty_like(x)
        if epilogue is Epilogue.PER_TOKEN:
            assert call.spec.quant is not None and self.caps.fp8 is not None
            q = torch.empty_like(x, dtype=self.caps.fp8)
            scales = x.new_empty(call.spec.quant.scales_shape(x.shape), dtype=torch.float32)
            ca.fused_ar_rms(x, res_in, res_out=h, out=q, scale_out=scales,
                            post_per_token_quant=True, **common)
            return Outputs(None, h, q, scales)
        y = torch.empty_like(x)
        ca.fused_ar_rms(x, res_in, res_out=h, out=y, **common)
        return Outputs(y, h)
