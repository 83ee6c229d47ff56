"""What the pass matches: all-reduce sites, the RMSNorm forms they flow into, and
the quantization epilogues after the norm."""

from __future__ import annotations

import sys

from ..log import logger
from .collectives import (AllReduceSite, find_site, fused_elsewhere, register_finder,
                          register_fused_elsewhere)
from .epilogue import QuantMatch, QuantMiss, match_quant, register_quant_matcher
from .epilogue import merge as merge_quant
from .rms_norm import NormMatch, NormMiss, match_norm, register_norm_matcher
from . import fp8_quant  # noqa: F401

__all__ = ["AllReduceSite", "NormMatch", "NormMiss", "QuantMatch", "QuantMiss", "find_site",
           "fused_elsewhere", "load_vllm_forms", "match_norm", "match_quant", "merge_quant",
           "register_finder", "register_fused_elsewhere", "register_norm_matcher",
           "register_quant_matcher"]

_vllm_forms: bool | None = None


def load_vllm_forms() -> bool:
    """Register vLLM's forms if vLLM is already imported (a graph can hold its ops
    only then); never imports vLLM itself.  A failure is logged once with the
    exception: the pass then sees vLLM's graphs without its forms."""
    global _vllm_forms
    if "vllm" not in sys.modules:
        return False
    if _vllm_forms is None:
        try:
            from . import vllm_cpu, vllm_forms, vllm_in_tree, vllm_quant  # noqa: F401
            _vllm_forms = True
        except Exception as e:  # vLLM present but its modules or ops broken
            logger.warning("fusion_pass: vLLM is imported but its graph forms could not be "
                           "loaded; vLLM's all-reduce and norm ops will not be matched: %r", e)
            _vllm_forms = False
    return _vllm_forms
