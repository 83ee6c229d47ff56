"""What the pass matches: all-reduce sites, the RMSNorm forms they flow into, and
the quantization epilogues after the norm.

One contract for every registry (site finders, :func:`register_finder`; norm
matchers, :func:`register_norm_matcher`; quant matchers,
:func:`register_quant_matcher`; fused-elsewhere finders,
:func:`register_fused_elsewhere`).  A finder or matcher, given its anchor node,
returns one of:

* its match (:class:`AllReduceSite`, :class:`NormMatch`, :class:`QuantMatch`, or
  the :class:`~fusion_pass.records.SiteRecord` of a site fused elsewhere);
* a :class:`Miss` (:class:`SiteMiss`, :class:`NormMiss`, :class:`QuantMiss`): the
  form applies here but does not hold; it carries ``at``, the node the matcher
  stopped at, and ``reason``, what it saw there, in words a record can carry
  (as torch's ``pattern_matcher.FailedMatch`` carries its reason);
* None: not its form; nothing to say.

The first match in registration order wins.  Without one, the most specific miss
is the one that stopped at the latest node in graph order (:func:`most_specific`):
matchers walk from their anchor towards its users, so the later stop is the
longer partial match; among equals, and misses that name no node, the first
registered.  No registry ranks misses any other way.
"""

from __future__ import annotations

import sys

from ..log import logger
from .collectives import (AllReduceSite, SiteMiss, find_site, fused_elsewhere, register_finder,
                          register_fused_elsewhere)
from .miss import Miss, most_specific
from .epilogue import QuantMatch, QuantMiss, match_quant, register_quant_matcher
from .epilogue import merge as merge_quant
from .rms_norm import NormMatch, NormMiss, match_norm, register_norm_matcher
from . import fp8_quant  # noqa: F401

__all__ = ["AllReduceSite", "Miss", "NormMatch", "NormMiss", "SiteMiss", "most_specific", "QuantMatch", "QuantMiss", "find_site",
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
            from . import (vllm_cpu, vllm_forms, vllm_in_tree, vllm_quant,  # noqa: F401
                           vllm_sandwich)
            _vllm_forms = True
        except Exception as e:  # vLLM present but its modules or ops broken
            logger.warning("fusion_pass: vLLM is imported but its graph forms could not be "
                           "loaded; vLLM's all-reduce and norm ops will not be matched: %r", e)
            _vllm_forms = False
    return _vllm_forms
