"""What the pass matches: all-reduce sites, the RMSNorm forms they flow into, and
the quantization epilogues after the norm.

One contract for every registry (site finders, :func:`register_finder`; norm
matchers, :func:`register_norm_matcher`; quant matchers,
:func:`register_quant_matcher`; fused-elsewhere finders,
:func:`register_fused_elsewhere`).  A finder or matcher, given its anchor (a node;
a norm matcher, the reduced value as :class:`Reduced` after the layout ops and
scalar multiplier every norm form shares), returns one of:

* its match (:class:`AllReduceSite`, :class:`NormMatch`, :class:`QuantMatch`, or
  the :class:`FusedElsewhere` site another pass fused);
* a :class:`Miss` (:class:`SiteMiss`, :class:`NormMiss`, :class:`QuantMiss`): the
  form applies here but does not hold; it carries ``at``, the node the matcher
  stopped at, and ``reason``, what it saw there, in words a record can carry
  (as torch's ``pattern_matcher.FailedMatch`` carries its reason);
* None: not its form; nothing to say.

Each registry (:class:`.registry.Registry`) tries its forms in the priority
each was registered with, whatever the import order: all-reduce forms
``c10d_functional`` 0, ``vllm`` 10, ``vllm_cpu_shm`` 20; norm forms ``native`` 0
(:data:`.rms_norm.NATIVE`, a table of steps), ``vllm_ir`` 10,
``vllm_fused_quant`` 20, ``vllm_sandwich`` 30 (a miss naming vLLM's sandwich-norm op);
quantizations ``torch`` 0, ``vllm`` 10.  The first
match wins.  Without one, the most specific miss is the one that stopped at the
latest node in graph order (:func:`most_specific`): matchers walk from their
anchor towards its users, so the later stop is the longer partial match; among
equals, and misses that name no node, the first tried.  No registry ranks
misses any other way.
"""

from __future__ import annotations

import sys

from ..log import logger
from .collectives import (AllReduceSite, FusedElsewhere, SiteMiss, find_site, fused_elsewhere,
                          register_finder, register_fused_elsewhere)
from .miss import Miss, most_specific
from .epilogue import QuantMatch, QuantMiss, match_quant, register_quant_matcher
from .epilogue import merge as merge_quant
from .rms_norm import NormMatch, NormMiss, Reduced, match_norm, register_norm_matcher
from . import fp8_quant  # noqa: F401

__all__ = ["AllReduceSite", "FusedElsewhere", "Miss", "NormMatch", "NormMiss", "QuantMatch",
           "QuantMiss", "Reduced", "SiteMiss", "find_site", "fused_elsewhere",
           "load_vllm_forms", "match_norm", "match_quant", "merge_quant", "most_specific",
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
