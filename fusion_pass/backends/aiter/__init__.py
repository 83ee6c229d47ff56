"""ROCm backend: AITER's fused all-reduce + residual add + RMSNorm (+ FP8 quantization).

* :mod:`.limits`: the shapes AITER's kernels take, as the gate reads them;
* :mod:`.releases`: what each AITER release may be asked to do (its signature,
  kernel facts and known bugs, with the upstream change each comes from) and
  the gate limits that follow;
* :mod:`.installed`: the installed AITER's version, class and FP8 dtype;
* :mod:`.communicators`: which AITER communicator runs a group's calls (vLLM's,
  or one made here outside graph capture);
* :mod:`.epilogues`: when AITER's fused FP8 epilogue computes exactly the graph's
  quantization;
* :mod:`.backend`: :class:`AiterBackend`, the call itself.

See ``docs/rocm_aiter.md``.
"""

from __future__ import annotations

from typing import Optional

from .backend import AiterBackend
from .limits import AiterLimits
from .releases import Signature, allowed_bugs, capabilities, parse_version

__all__ = ["AiterBackend", "AiterLimits", "limits_for_version"]


def limits_for_version(version: Optional[str]) -> AiterLimits:
    """The gate limits of AITER ``version`` as released (no AITER needed), with the
    known bugs the environment accepts; an unreadable version declines every call."""
    text = version if version is not None else "unknown"
    return capabilities(text, Signature.released(parse_version(text)), None,
                        allowed_bugs()).limits
