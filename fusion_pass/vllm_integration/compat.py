"""What differs between the vLLM versions the integration supports, each named once.

Supported: vLLM 0.26 through 0.32 (:data:`SUPPORTED`).  Across that range the
pieces the integration touches keep their names and places: ``InductorPass``,
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

API (stable; every function is cheap after its first call):

* ``SUPPORTED``: ``(oldest, first_unsupported)`` as ``(major, minor)`` tuples.
* ``ANY_VERSION_ENV``: environment variable; set to 1 to try a vLLM outside the range.
* ``vllm_version() -> str | None``: the installed vLLM's version string, None if none.
* ``unsupported_reason() -> str | None``: one line saying why the integration stays
  off with this vLLM (version outside the range, or a piece missing), None if usable.
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
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any, Optional

SUPPORTED = ((0, 26), (0, 33))
ANY_VERSION_ENV = "FUSION_PASS_ANY_VLLM"
_SP_FIELDS = ("enable_sp", "fuse_gemm_comms")


def vllm_version() -> Optional[str]:
    try:
        import vllm
    except Exception:  # not installed, or broken on import
        return None
    return str(getattr(vllm, "__version__", "unknown"))


def _range_text() -> str:
    (a, b), (c, d) = SUPPORTED
    return f"{a}.{b} through {c}.{d - 1}"


@functools.cache
def unsupported_reason() -> Optional[str]:
    version = vllm_version()
    if version is None:
        return "vLLM is not importable"
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        return f"vLLM's version {version!r} is not one fusion_pass can read"
    if not SUPPORTED[0] <= (int(m[1]), int(m[2])) < SUPPORTED[1] and \
            os.environ.get(ANY_VERSION_ENV) != "1":
        return (f"vLLM {version} is outside the versions fusion_pass supports "
                f"({_range_text()}; set {ANY_VERSION_ENV}=1 to try it anyway)")
    missing = [name for name, ok in _pieces().items() if not ok]
    if missing:
        return f"vLLM {version} lacks {', '.join(missing)}, which fusion_pass needs"
    return None


def _pieces() -> dict[str, bool]:
    """The vLLM pieces the integration calls, each True where this vLLM has it."""
    found: dict[str, bool] = {}
    try:
        from vllm.compilation.passes import inductor_pass as ip
        found["vllm.compilation.passes.inductor_pass.InductorPass"] = hasattr(ip, "InductorPass")
        found["get_pass_context"] = hasattr(ip, "get_pass_context")
    except Exception:
        found["vllm.compilation.passes.inductor_pass"] = False
    try:
        from vllm.config import CompilationConfig, VllmConfig
        found["VllmConfig._set_compile_ranges"] = hasattr(VllmConfig, "_set_compile_ranges")
        fields = getattr(CompilationConfig, "__dataclass_fields__", {})
        found["CompilationConfig.compile_ranges_endpoints"] = \
            "compile_ranges_endpoints" in fields
    except Exception:
        found["vllm.config"] = False
    return found


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
