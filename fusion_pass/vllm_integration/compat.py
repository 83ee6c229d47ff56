"""What differs between the vLLM versions the integration supports, each named once.

Supported: vLLM 0.26 through 0.34 (:data:`SUPPORTED`, set in :mod:`fusion_pass.vllm_names`,
which also lists every vLLM name the integration and the matchers rely on, with the releases
that have it; ``tests/unit/test_vllm_names.py`` checks them against the installed vLLM).  Across
that range the pieces the integration touches keep their names and places: ``InductorPass``,
``get_pass_context`` / ``pass_context`` in ``vllm.compilation.passes.inductor_pass``,
``Range`` (inclusive ``start``/``end``) in ``vllm.config.utils``,
``VllmConfig._set_compile_ranges``, ``CompilationConfig.compile_ranges_endpoints``
and ``inductor_passes``, ``pass_config.fuse_allreduce_rms``, the
``torch.ops.vllm.all_reduce(x, group_name)`` collective, the ``vllm_ir`` norm ops
and vLLM's in-tree fused op names.  What changes:

* vLLM 0.26-0.31 have a sequence-parallelism pass (``pass_config.enable_sp``,
  forced on by ``fuse_gemm_comms``), on by default at -O2 for dense models on
  Hopper/Blackwell with a large enough hidden size.  It runs before custom passes
  and, from ``pass_config.sp_min_token_num`` tokens up, turns each all-reduce into
  reduce-scatter + all-gather, so this pass sees no all-reduce there.  vLLM 0.32
  has no such pass.
* vLLM 0.32+ run some architectures without compiling them (breakable CUDA graphs set
  ``compilation_config.mode`` to NONE; 0.34 runs Qwen3.5, Qwen3.5-MoE and MistralLarge4
  from ``vllm/models/*/nvidia`` that way on CUDA): no post-grad pass runs for them
  (:func:`compile_off_reason`).
* vLLM 0.33+ pin torch 2.14, whose Inductor passes ``set_sys_modules`` to a function
  depyf 0.20.0 replaces with a hook that rejects it; vLLM 0.34 patches the hook in
  ``vllm.compilation.depyf_compat`` (:func:`depyf_prepare_debug`).
* vLLM 0.33+ fuse RMSNorm + static FP8 on ROCm into AITER ops, and 0.34's sandwich-norm
  pass takes the norm after an all-reduce on gfx950, both before custom passes: the
  matchers know their ops (:mod:`fusion_pass.patterns.vllm_quant`,
  :mod:`fusion_pass.patterns.vllm_in_tree`).

API (stable; every function is cheap after its first call):

* ``SUPPORTED``: ``(oldest, first_unsupported)`` as ``(major, minor)`` tuples.
* ``ANY_VERSION_ENV``: environment variable; set to 1 to try a vLLM outside the range.
* ``vllm_version() -> str | None``: the installed vLLM's version string, None if none.
* ``unsupported_reason() -> str | None``: one line saying why the integration stays
  off with this vLLM (version outside the range, or a required name missing), None if usable.
* ``InductorPass``: vLLM's pass base class, or a stand-in where this vLLM lacks it.
* ``compile_range() -> tuple[int, int] | None``: ``(start, end)`` of the range the
  current VLLM_COMPILE pass context compiles; None outside one (the CPU build).
* ``dump_prefix() -> int | None``: the pass manager's dump index for graph dumps.
* ``pass_config_fields() -> frozenset[str]``: this vLLM's ``PassConfig`` field names.
* ``in_tree_settings(enabled) -> dict``: ``pass_config`` entries that switch vLLM's
  own all-reduce + RMSNorm fusion on or off.
* ``sequence_parallel_settings(enabled) -> dict``: ``pass_config`` entries that switch
  sequence parallelism (and the async TP built on it) on or off; ``{}`` where this
  vLLM has none and ``enabled`` is False; ValueError where it has none and True.
* ``sequence_parallel_from(vllm_config) -> int | None``: the token count from which
  vLLM's sequence-parallelism pass takes the all-reduces of a final config, None
  when it takes none.
* ``compile_off_reason(vllm_config) -> str | None``: why vLLM compiles nothing for a
  final config (so no post-grad pass runs), None when it compiles.
* ``depyf_prepare_debug() -> callable | None``: vLLM's depyf entry point with its
  compatibility patches, None where this vLLM has none.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Optional

from .. import vllm_names

SUPPORTED = vllm_names.SUPPORTED
ANY_VERSION_ENV = "FUSION_PASS_ANY_VLLM"
_SP_FIELDS = ("enable_sp", "fuse_gemm_comms")


def vllm_version() -> Optional[str]:
    try:
        import vllm
    except Exception:  # not installed, or broken on import
        return None
    return str(getattr(vllm, "__version__", "unknown"))


@functools.cache
def unsupported_reason() -> Optional[str]:
    version = vllm_version()
    if version is None:
        return "vLLM is not importable"
    release = vllm_names.parse_version(version)
    if release is None:
        return f"vLLM's version {version!r} is not one fusion_pass can read"
    if not SUPPORTED[0] <= release < SUPPORTED[1] and os.environ.get(ANY_VERSION_ENV) != "1":
        return (f"vLLM {version} is outside the versions fusion_pass supports "
                f"({vllm_names.supported_text()}; set {ANY_VERSION_ENV}=1 to try it anyway)")
    missing = vllm_names.missing_required()
    if missing:
        return f"vLLM {version} lacks {', '.join(missing)}, which fusion_pass needs"
    return None


def _inductor_pass_base() -> type:
    if unsupported_reason() is None:
        from vllm.compilation.passes.inductor_pass import InductorPass as base
        return base

    class InductorPassStandIn:
        """Stands in for vLLM's InductorPass where this vLLM is not supported."""

        @staticmethod
        def hash_source(*srcs: Any) -> str:
            return repr(srcs)

    return InductorPassStandIn


InductorPass = _inductor_pass_base()


def compile_range() -> Optional[tuple[int, int]]:
    if unsupported_reason() is not None:
        return None
    from vllm.compilation.passes.inductor_pass import get_pass_context

    try:
        rng = get_pass_context().compile_range
    # No pass context (DYNAMO_TRACE_ONCE, the CPU build): vLLM asserts, or under
    # ``python -O`` hands back None.
    except (AssertionError, AttributeError):
        return None
    return rng.start, rng.end


def dump_prefix() -> Optional[int]:
    if unsupported_reason() is not None:
        return None
    from vllm.compilation.passes.vllm_inductor_pass import VllmInductorPass

    return getattr(VllmInductorPass, "dump_prefix", None)


@functools.cache
def pass_config_fields() -> frozenset[str]:
    try:
        from vllm.config import PassConfig
    except Exception:
        return frozenset()
    return frozenset(getattr(PassConfig, "__dataclass_fields__", {}))


def in_tree_settings(enabled: bool) -> dict[str, bool]:
    return {"fuse_allreduce_rms": enabled}


def sequence_parallel_settings(enabled: bool) -> dict[str, bool]:
    fields = [f for f in _SP_FIELDS if f in pass_config_fields()]
    if enabled and not fields:
        raise ValueError(f"vLLM {vllm_version()} has no sequence-parallelism pass to enable")
    # Async TP (fuse_gemm_comms) forces enable_sp on: off means both off; on, only SP.
    return {f: False for f in fields} if not enabled else {"enable_sp": True}


def sequence_parallel_from(vllm_config: Any) -> Optional[int]:
    pc = getattr(getattr(vllm_config, "compilation_config", None), "pass_config", None)
    if pc is None or not getattr(pc, "enable_sp", False):
        return None
    start = getattr(pc, "sp_min_token_num", None)
    return None if start is None else int(start)


def compile_off_reason(vllm_config: Any) -> Optional[str]:
    """Why vLLM compiles nothing for this final config, so that no post-grad pass runs;
    None when it compiles (VLLM_COMPILE, or the CPU build's plain torch.compile).

    vLLM sets ``compilation_config.mode`` to NONE for ``enforce_eager``, -O0,
    ``TORCH_COMPILE_DISABLE=1``, and where it runs the model with breakable CUDA graphs
    (0.34 does so by default for the architectures it runs from ``vllm/models/*/nvidia``
    on CUDA: "eager + breakable CUDA-graph modelling code"); the ``eager`` backend traces
    with Dynamo but never runs Inductor.
    """
    cc = getattr(vllm_config, "compilation_config", None)
    if cc is None:
        return None
    mode = getattr(cc, "mode", None)
    backend = getattr(cc, "backend", None)
    if mode is not None and int(mode) == 0:  # CompilationMode.NONE
        return f"{_model_text(vllm_config)} without torch.compile ({_why_mode_none(vllm_config)})"
    if backend == "eager":
        return (f"{_model_text(vllm_config)} with the 'eager' compilation backend (Dynamo "
                "without Inductor)")
    return None


def _model_text(vllm_config: Any) -> str:
    archs = list(getattr(getattr(vllm_config, "model_config", None), "architectures", None) or [])
    return f"vLLM runs {', '.join(archs) if archs else 'this model'}"


def _why_mode_none(vllm_config: Any) -> str:
    cc = vllm_config.compilation_config
    breakable = getattr(cc, "use_breakable_cudagraph", None)
    if breakable is None:  # before 0.34 vLLM records it in the environment only
        breakable = os.environ.get(vllm_names.BREAKABLE_CUDAGRAPH_ENV) == "1"
    if breakable:
        return (f"eager code captured in breakable CUDA graphs; "
                f"{vllm_names.BREAKABLE_CUDAGRAPH_ENV}=0 makes vLLM compile it where it can")
    if getattr(getattr(vllm_config, "model_config", None), "enforce_eager", False):
        return "enforce_eager"
    return "compilation mode NONE"


def depyf_prepare_debug() -> Optional[Any]:
    """vLLM's ``depyf_compat.prepare_debug`` (0.34+: depyf's hooks patched for the
    installed torch), None where this vLLM has none."""
    if unsupported_reason() is not None:
        return None
    try:
        from vllm.compilation import depyf_compat
    except ImportError:
        return None
    return getattr(depyf_compat, "prepare_debug", None)
