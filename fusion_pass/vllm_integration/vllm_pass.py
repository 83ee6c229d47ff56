"""The fusion pass as vLLM sees it: an ``InductorPass`` that knows vLLM's compile ranges.

One object serves both of vLLM's compile modes:

* VLLM_COMPILE (CUDA, ROCm): vLLM's ``PostGradPassManager`` calls the pass
  inside a pass context; :meth:`compile_range` reads the range being compiled
  from it, so the gate bakes one-stage or two-stage per range, and
  :meth:`is_applicable_for_range` skips ranges the backend cannot take at all;
* DYNAMO_TRACE_ONCE (the CPU build): Inductor calls the pass directly, with no
  pass context; the token range then comes from the graph's own shapes.

Where vLLM compiles nothing (compilation mode NONE: ``enforce_eager``, or a model it runs
with breakable CUDA graphs, as vLLM 0.34 does for its ``vllm/models/*/nvidia`` models on
CUDA), no post-grad pass runs: :meth:`prepare` says so once and the pass stays off.

:meth:`prepare` runs once on the final vLLM config (the plugin's config hook
calls it): it decides whether the fusion applies at all (tensor parallelism,
dtype) and which compile-range endpoints vLLM must add.  Its outcome travels
with the pickled pass to the engine and worker processes.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any, Iterable, Optional

from .. import backends, gate
from ..allreduce_rmsnorm_pass import AllReduceRMSNormFusionPass
from ..log import logger, once
from . import compat
from .compat import InductorPass

PASS_NAME = "AllReduceRMSNormFusionPass"
SAID_ENV = "FUSION_PASS_VLLM_SAID"


def _say(level: int, msg: str) -> None:
    """Log ``msg`` once across this process and the processes it starts later.

    vLLM builds its config again in the engine-core process; the environment,
    which spawned children inherit, remembers what the parent already said.
    """
    key = hashlib.sha256(msg.encode()).hexdigest()[:12]
    said = [k for k in os.environ.get(SAID_ENV, "").split(",") if k]
    if key in said:
        return
    os.environ[SAID_ENV] = ",".join(said + [key])
    logger.log(level, msg)


def supported() -> bool:
    """True if this vLLM is one the integration supports; otherwise says once why
    not (one line) and the caller changes nothing."""
    reason = compat.unsupported_reason()
    if reason is not None:
        _say(logging.WARNING, f"fusion_pass: {reason}: the all-reduce + RMSNorm fusion "
             "stays off and the model runs unchanged.")
    return reason is None


def _platform_device_type() -> str:
    from vllm.platforms import current_platform

    return "cuda" if current_platform.is_cuda_alike() else current_platform.device_type


class VllmAllReduceRMSNormPass(InductorPass, AllReduceRMSNormFusionPass):
    """All-reduce -> (residual add) -> RMSNorm fusion for vLLM's compilation config.

    ``threshold``: forces one-stage up to that many tokens; None (default) takes
    the backend's token schedule (AITER: 80; Triton: its measured crossovers).
    vLLM gets a compile-range endpoint wherever the schedule changes path, so
    each range compiles with one baked path.  ``dtypes``: model dtypes to fuse
    (names such as ``"bfloat16"``); None means every dtype the backend takes.
    ``merge_summed_all_reduces``: as for :class:`AllReduceRMSNormFusionPass` (off by
    default); it is part of :meth:`uuid`, so vLLM's compile cache keeps the two apart.
    """

    def __init__(self, threshold: Optional[int] = None,
                 dtypes: Optional[Iterable[str]] = None,
                 merge_summed_all_reduces: bool = False) -> None:
        AllReduceRMSNormFusionPass.__init__(self, threshold=threshold,
                                            merge_summed_all_reduces=merge_summed_all_reduces)
        self.dtypes: Optional[tuple[str, ...]] = (
            None if dtypes is None else tuple(sorted(gate.dtype_name(d) for d in dtypes)))
        unknown = set(self.dtypes or ()) - set(gate.ELEMENT_SIZE)
        if unknown:
            raise ValueError(f"fusion_pass: unknown dtype(s) {sorted(unknown)}; "
                             f"known: {sorted(gate.ELEMENT_SIZE)}")
        self.inactive_reason: Optional[str] = None if supported() else compat.unsupported_reason()
        """Why the fusion does not apply (this vLLM, or the model: :meth:`prepare`)."""
        self.model: Optional[tuple[int, str]] = None
        """(hidden size, dtype name) of the model, set by :meth:`prepare`."""

    # -- configuration -------------------------------------------------------

    def prepare(self, vllm_config: Any) -> list[int]:
        """Decide, once, whether the fusion applies to this vLLM config.

        Returns the compile-range endpoints vLLM should add (empty when the
        fusion does not apply).  Says once what it decided.
        """
        if not supported():
            self.inactive_reason = compat.unsupported_reason()
            return []
        tp = vllm_config.parallel_config.tensor_parallel_size
        model_config = vllm_config.model_config
        backend = backends.selected_name(_platform_device_type())
        limits = backends.get(backend).limits
        dtype = gate.dtype_name(model_config.dtype) if model_config is not None else None
        hidden = model_config.get_hidden_size() if model_config is not None else None
        self.model = (hidden, dtype) if hidden is not None and dtype is not None else None
        self.inactive_reason = self._why_inactive(tp, dtype, limits, vllm_config)
        if self.inactive_reason is not None:
            _say(logging.WARNING, f"fusion_pass: all-reduce + RMSNorm fusion is enabled but "
                 f"does not apply: {self.inactive_reason}. The model runs unchanged.")
            return []
        endpoints = self._endpoints(limits, tp)
        max_tokens = self._max_tokens(limits)
        if max_tokens is not None:
            endpoints.append(max_tokens)
        schedule = ", ".join(f"{gate._fmt(s.lo, s.hi)} {s.path}" for s in self._segments(limits, tp)) \
            if self.model is not None else f"threshold {self.threshold or gate.DEFAULT_TOKEN_THRESHOLD}"
        merging = "; summed all-reduces merged" if self.merge_summed_all_reduces else ""
        _say(logging.INFO, f"fusion_pass: all-reduce + RMSNorm fusion enabled (TP={tp}, "
             f"{dtype}, hidden {hidden}, backend {backend}; tokens {schedule}{merging})")
        sp_from = compat.sequence_parallel_from(vllm_config)
        if sp_from is not None:
            _say(logging.INFO, f"fusion_pass: vLLM's sequence parallelism (pass_config.enable_sp) "
                 f"takes the all-reduces from {sp_from} tokens up, before this pass sees them; "
                 "compilation_config(sequence_parallel=False) leaves them all to the fusion")
        return sorted(set(endpoints))

    def _segments(self, limits: gate.BackendLimits, tp: int) -> list[gate.Segment]:
        assert self.model is not None
        hidden, dtype = self.model
        return gate.segments(hidden, dtype, tp, limits=limits, threshold=self.threshold)

    def _endpoints(self, limits: gate.BackendLimits, tp: int) -> list[int]:
        """Where vLLM must cut its compile ranges so that each range has one path."""
        if self.model is None:
            return [self.threshold or gate.DEFAULT_TOKEN_THRESHOLD]
        hidden, dtype = self.model
        return gate.breakpoints(hidden, dtype, tp, limits=limits, threshold=self.threshold)

    def _why_inactive(self, tp: int, dtype: Optional[str], limits: gate.BackendLimits,
                      vllm_config: Any) -> Optional[str]:
        if tp < 2:
            return f"tensor_parallel_size={tp}, so there is no all-reduce to fuse"
        off = compat.compile_off_reason(vllm_config)
        if off is not None:
            return f"{off}, and the fusion is a compile-time (Inductor post-grad) pass"
        if dtype is None:
            return None
        if gate.dtype_reason(dtype, limits) is not None:
            return f"model dtype {dtype} is not supported (backend {limits.name} takes " \
                   f"{', '.join(sorted(set(gate.ELEMENT_SIZE) & set(limits.dtypes)))})"
        if self.dtypes is not None and dtype not in self.dtypes:
            return f"model dtype {dtype} is not one the fusion was enabled for " \
                   f"({', '.join(self.dtypes)})"
        return None

    def _max_tokens(self, limits: gate.BackendLimits) -> Optional[int]:
        """Largest token count the backend's kernels take for this model, if bounded."""
        if self.model is None or limits.max_bytes is None:
            return None
        hidden, dtype = self.model
        return limits.max_bytes // (hidden * gate.ELEMENT_SIZE[dtype])

    # -- vLLM's InductorPass interface ---------------------------------------

    def uuid(self) -> str:
        h = hashlib.sha256(AllReduceRMSNormFusionPass.uuid(self).encode())
        h.update(InductorPass.hash_source(self, VllmAllReduceRMSNormPass).encode())
        h.update(repr((self.dtypes, self.inactive_reason, self.model)).encode())
        return h.hexdigest()

    def is_applicable_for_range(self, compile_range: Any) -> bool:
        if self.inactive_reason is not None:
            return False
        backend = backends.selected_name(_platform_device_type())
        max_tokens = self._max_tokens(backends.get(backend).limits)
        return max_tokens is None or compile_range.start <= max_tokens

    def compile_range(self) -> Optional[gate.TokenRange]:
        """vLLM's range for this compile where a pass context exists (VLLM_COMPILE);
        otherwise None, and the pass reads the graph's shapes."""
        rng = compat.compile_range()
        return self.token_range if rng is None else gate.TokenRange(*rng)

    def __call__(self, graph: Any) -> None:
        if self.inactive_reason is not None:
            logger.debug("fusion_pass: skipped: %s", self.inactive_reason)
            return
        if not self._tp_active():
            return
        _dump(graph, "before")
        AllReduceRMSNormFusionPass.__call__(self, graph)
        _dump(graph, "after")

    def _tp_active(self) -> bool:
        """Without :meth:`prepare` (the plugin disabled), check TP here, and say it once."""
        if self.model is not None:
            return True
        from vllm.distributed import parallel_state

        if parallel_state.model_parallel_is_initialized() and \
                parallel_state.get_tensor_model_parallel_world_size() < 2:
            once("inactive:tp1", "fusion_pass: all-reduce + RMSNorm fusion is enabled but "
                 "does not apply: tensor_parallel_size=1, so there is no all-reduce to fuse. "
                 "The model runs unchanged.")
            return False
        return True


def _dump(graph: Any, stage: str) -> None:
    """Hand the graph to depyf's dump hook, as vLLM's own passes do (a no-op
    unless depyf is active in this process)."""
    from torch._dynamo.utils import lazy_format_graph_code

    i = compat.dump_prefix()
    lazy_format_graph_code(f"post_grad{'' if i is None else f'.{i}'}.{PASS_NAME}.{stage}",
                           graph.owning_module)
