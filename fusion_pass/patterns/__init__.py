"""What the pass matches: all-reduce sites, and the RMSNorm forms they flow into."""

from __future__ import annotations

import sys

from .collectives import AllReduceSite, find_site, register_finder
from .rms_norm import NormMatch, match_norm, register_norm_matcher

__all__ = ["AllReduceSite", "NormMatch", "find_site", "match_norm", "register_finder",
           "register_norm_matcher", "load_vllm_forms"]


def load_vllm_forms() -> bool:
    """Register vLLM's forms if vLLM is already imported (a graph can hold its ops
    only then); never imports vLLM itself."""
    if "vllm" not in sys.modules:
        return False
    try:
        from . import vllm_cpu, vllm_forms  # noqa: F401
    except Exception:  # vLLM present but its ops unavailable (broken build)
        return False
    return True
