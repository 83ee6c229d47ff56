"""Every vLLM name fusion_pass relies on, the vLLM versions it supports, and how to check them.

The matchers (``fusion_pass/patterns/vllm_*.py``) recognise vLLM's ops by name and the
integration (``fusion_pass/vllm_integration``) calls vLLM's classes, functions and config
fields by name.  Those names are written here once, each with the vLLM module that defines or
registers it and the releases that have it (:data:`NAMES`), so that one test
(``tests/unit/test_vllm_names.py``) checks them all against the installed vLLM and fails with the
name that moved, not with a traceback deep inside a compile.  When a new vLLM release moves
nothing, supporting it is the one-line change of :data:`SUPPORTED`.

This module imports nothing from vLLM when imported: patterns and the integration both read it.
:func:`problem` imports the vLLM module a name lives in, on demand.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import re
from dataclasses import dataclass
from typing import Optional

Version = tuple[int, int]

SUPPORTED: tuple[Version, Version] = ((0, 26), (0, 35))
"""``(oldest, first_unsupported)`` vLLM releases, as ``(major, minor)``."""


def parse_version(text: str) -> Optional[Version]:
    """``(major, minor)`` of a version string such as ``0.32.0+cpu``; None if unreadable."""
    m = re.match(r"(\d+)\.(\d+)", text)
    return None if m is None else (int(m[1]), int(m[2]))


def supported_text() -> str:
    (a, b), (c, d) = SUPPORTED
    return f"{a}.{b} through {c}.{d - 1}"


# -- op names, as their schemas name them (``namespace::name``) --------------------------------

ALL_REDUCE = "vllm::all_reduce"
RMS_NORM = "vllm_ir::rms_norm"
FUSED_ADD_RMS_NORM = "vllm_ir::fused_add_rms_norm"
SHM_ALLREDUCE = "_C::shm_allreduce"
"""vLLM's CPU build (AVX-512): the in-place shared-memory all-reduce."""

# vLLM's in-tree all-reduce + RMSNorm fusions (``pass_config.fuse_allreduce_rms``).
FLASHINFER_AR_NORM = "vllm::flashinfer_trtllm_fused_allreduce_norm"
AITER_AR_NORM = "vllm::rocm_aiter_fused_allreduce_rmsnorm"
AITER_AR_NORM_GROUP_QUANT = "vllm::rocm_aiter_fused_allreduce_rmsnorm_quant_per_group"
AITER_AR_NORM_GROUP_QUANT_BF16 = \
    "vllm::rocm_aiter_fused_allreduce_rmsnorm_quant_per_group_with_bf16_norm"

# FP8 quant ops after a norm.
STATIC_FP8_QUANT = "_C::static_scaled_fp8_quant"
DYNAMIC_FP8_QUANT = "_C::dynamic_scaled_fp8_quant"
PER_TOKEN_FP8_QUANT = "_C::dynamic_per_token_scaled_fp8_quant"
PER_GROUP_FP8_QUANT = "_C::per_token_group_fp8_quant"
AITER_GROUP_FP8_QUANT = "vllm::rocm_aiter_group_fp8_quant"
AITER_PER_TOKEN_QUANT = "vllm::rocm_aiter_per_token_quant"

# Fused RMSNorm + FP8 quant ops that vLLM's norm+quant fusion (``pass_config.fuse_norm_quant``)
# leaves in the graph before a custom pass runs.
RMS_NORM_STATIC_FP8 = "_C::rms_norm_static_fp8_quant"
ADD_RMS_NORM_STATIC_FP8 = "_C::fused_add_rms_norm_static_fp8_quant"
RMS_NORM_PER_TOKEN = "_C::rms_norm_dynamic_per_token_quant"
RMS_NORM_PER_BLOCK = "_C::rms_norm_per_block_quant"
AITER_RMS_NORM_GROUP_FP8 = "vllm::rocm_aiter_rmsnorm_fp8_group_quant"
AITER_ADD_RMS_NORM_GROUP_FP8 = "vllm::rocm_aiter_rmsnorm_with_add_fp8_group_quant"
AITER_RMS_NORM_PER_TOKEN = "vllm::rocm_aiter_rmsnorm_fused_dynamic_quant"
AITER_ADD_RMS_NORM_PER_TOKEN = "vllm::rocm_aiter_rmsnorm_fused_add_dynamic_quant"
AITER_RMS_NORM_STATIC_FP8 = "vllm::rocm_aiter_fused_rms_fp8_per_tensor_static_quant"
"""vLLM 0.33+: AITER's Triton RMSNorm + static per-tensor FP8 (ROCm)."""
AITER_ADD_RMS_NORM_STATIC_FP8 = "vllm::rocm_aiter_fused_add_rms_fp8_per_tensor_static_quant"
"""vLLM 0.33+: the same with the residual add first; returns ``(q, residual_out)``."""

# vLLM 0.34's Muse sandwich norm (ROCm gfx950): RMSNorm -> residual add -> RMSNorm in one
# AITER kernel.  AITER registers it as a custom op in some releases; in others the Triton
# kernel is launched directly and the graph holds a Triton-kernel call of this kernel name.
SANDWICH_NORM = "aiter::fused_rmsnorm_add_rmsnorm"
SANDWICH_NORM_KERNEL = "_fused_rmsnorm_add_rmsnorm_kernel"
SANDWICH_NORM_PASS = "MuseSandwichNormFusionPass"

# -- other names ------------------------------------------------------------------------------

PLUGIN_GROUP = "vllm.general_plugins"
BREAKABLE_CUDAGRAPH_ENV = "VLLM_USE_BREAKABLE_CUDAGRAPH"
"""Before 0.34 vLLM records breakable CUDA graphs here (0.34 reads it first, then its config)."""


@dataclass(frozen=True)
class Name:
    """One name fusion_pass relies on and where vLLM keeps it.

    ``kind``: ``op`` (an op's schema name: ``where`` registers or calls it; ``args`` are the
    argument names the matchers read), ``attr`` (``where``'s attribute path, e.g. a class's
    method), ``field`` (a config dataclass's field: ``Class.field``) or ``text`` (a string in
    ``where``'s source, e.g. the plugin entry-point group).
    """

    name: str
    kind: str
    where: str
    use: str
    since: Version = SUPPORTED[0]
    until: Optional[Version] = None
    """The first release without it (None: every release from ``since``)."""
    args: tuple[str, ...] = ()
    required: bool = False
    """The integration cannot run without it: checked at run time too (:func:`missing_required`)."""

    def in_release(self, version: Version) -> bool:
        return self.since <= version and (self.until is None or version < self.until)


_PASS = "vllm.compilation.passes.inductor_pass"
_AITER = "vllm._aiter_ops"
_OPS = "vllm._custom_ops"
_AR_FUSION = "vllm.compilation.passes.fusion.allreduce_rms_fusion"
_RMS_QUANT = "vllm.compilation.passes.fusion.rms_quant_fusion"

NAMES: tuple[Name, ...] = (
    # The plugin, the pass and the config helpers.
    Name(PLUGIN_GROUP, "text", "vllm.plugins", "the plugin's entry-point group"),
    Name("InductorPass", "attr", _PASS, "the pass's base class", required=True),
    Name("get_pass_context", "attr", _PASS, "the compile range inside VLLM_COMPILE",
         required=True),
    Name("pass_context", "attr", _PASS, "a pass context with a compile range (tests)"),
    Name("Range", "attr", "vllm.config.utils", "a compile range (inclusive start, end)"),
    Name("VllmInductorPass", "attr", "vllm.compilation.passes.vllm_inductor_pass",
         "the dump index of the pass manager's graph dumps"),
    Name("PostGradPassManager", "attr", "vllm.compilation.passes.pass_manager",
         "runs vLLM's passes, then the custom post pass (tests)"),
    Name("VllmConfig._set_compile_ranges", "attr", "vllm.config",
         "the plugin's hook on the final config", required=True),
    Name("CompilationConfig.compile_ranges_endpoints", "field", "vllm.config",
         "where the token schedule cuts compile ranges", required=True),
    Name("CompilationConfig.inductor_compile_config", "field", "vllm.config",
         "carries post_grad_custom_post_pass", required=True),
    Name("CompilationConfig.inductor_passes", "field", "vllm.config",
         "names the pass in plain JSON"),
    Name("CompilationConfig.debug_dump_path", "field", "vllm.config",
         "the helper's debug_dump_path"),
    Name("CompilationConfig.mode", "field", "vllm.config",
         "NONE: vLLM compiles nothing, so no post-grad pass runs"),
    Name("CompilationConfig.backend", "field", "vllm.config",
         "'eager': Dynamo without Inductor, so no post-grad pass runs"),
    Name("CompilationConfig.use_breakable_cudagraph", "field", "vllm.config",
         "why vLLM runs a model without compiling it", since=(0, 34)),
    Name(BREAKABLE_CUDAGRAPH_ENV, "text", "vllm.envs",
         "why vLLM runs a model without compiling it (before 0.34)"),
    Name("CompilationMode.NONE", "attr", "vllm.config.compilation", "no compilation"),
    Name("PassConfig.fuse_allreduce_rms", "field", "vllm.config",
         "vLLM's in-tree all-reduce fusion, switched off by the helpers", required=True),
    Name("PassConfig.enable_sp", "field", "vllm.config",
         "sequence parallelism takes all-reduces before this pass", until=(0, 32)),
    Name("PassConfig.fuse_gemm_comms", "field", "vllm.config",
         "async TP, which forces sequence parallelism on", until=(0, 32)),
    Name("PassConfig.sp_min_token_num", "field", "vllm.config",
         "from which token count sequence parallelism takes the all-reduces", until=(0, 32)),
    Name("current_platform", "attr", "vllm.platforms", "the device the backend is chosen for"),
    Name("VLLM_LOGGING_LEVEL", "text", "vllm.envs", "the plugin logs at vLLM's level"),
    Name("_groups", "attr", "vllm.distributed.parallel_state",
         "vLLM's group names (tp:0) -> their c10d groups"),
    Name("model_parallel_is_initialized", "attr", "vllm.distributed.parallel_state",
         "whether TP is set up in this process"),
    Name("get_tensor_model_parallel_world_size", "attr", "vllm.distributed.parallel_state",
         "the TP size"),
    Name("get_tp_group", "attr", "vllm.distributed.parallel_state",
         "the TP group whose all-reduces the in-tree fusion takes (its c10d group name)"),
    Name("prepare_debug", "attr", "vllm.compilation.depyf_compat",
         "depyf with the hook torch 2.14 needs", since=(0, 34)),
    # The graph forms the matchers read.
    Name(ALL_REDUCE, "op", "vllm.distributed.parallel_state", "the all-reduce (CUDA, ROCm)",
         args=("tensor", "group_name")),
    Name(RMS_NORM, "op", "vllm.ir.ops.layernorm", "RMSNorm"),
    Name(FUSED_ADD_RMS_NORM, "op", "vllm.ir.ops.layernorm", "residual add + RMSNorm"),
    Name(SHM_ALLREDUCE, "op", "vllm.distributed.device_communicators.cpu_communicator",
         "the CPU build's all-reduce"),
    Name(FLASHINFER_AR_NORM, "op", _AR_FUSION, "vLLM's in-tree fusion (CUDA)"),
    Name(AITER_AR_NORM, "op", _AITER, "vLLM's in-tree fusion (ROCm)"),
    Name(AITER_AR_NORM_GROUP_QUANT, "op", _AITER, "vLLM's in-tree fusion + per-group FP8"),
    Name(AITER_AR_NORM_GROUP_QUANT_BF16, "op", _AITER,
         "vLLM's in-tree fusion + per-group FP8, bf16 norm kept"),
    Name(STATIC_FP8_QUANT, "op", _OPS, "static FP8 after the norm"),
    Name(DYNAMIC_FP8_QUANT, "op", _OPS, "dynamic per-tensor FP8 (recorded, not taken)"),
    Name(PER_TOKEN_FP8_QUANT, "op", _OPS, "per-token FP8 after the norm"),
    Name(PER_GROUP_FP8_QUANT, "op", "vllm.model_executor.layers.quantization.utils.fp8_utils",
         "per-group FP8 after the norm"),
    Name(AITER_GROUP_FP8_QUANT, "op", _AITER, "AITER's per-group FP8 (recorded)",
         args=("x", "group_size")),
    Name(AITER_PER_TOKEN_QUANT, "op", _AITER, "AITER's per-token FP8 (recorded)"),
    Name(RMS_NORM_STATIC_FP8, "op", _RMS_QUANT, "vLLM's fused norm + static FP8"),
    Name(ADD_RMS_NORM_STATIC_FP8, "op", _RMS_QUANT, "vLLM's fused add + norm + static FP8"),
    Name(RMS_NORM_PER_TOKEN, "op", _OPS, "vLLM's fused norm + per-token FP8"),
    Name(RMS_NORM_PER_BLOCK, "op", _OPS, "vLLM's fused norm + per-group FP8"),
    Name(AITER_RMS_NORM_GROUP_FP8, "op", _AITER, "AITER's fused norm + per-group FP8",
         args=("x", "weight", "variance_epsilon", "group_size")),
    Name(AITER_ADD_RMS_NORM_GROUP_FP8, "op", _AITER, "AITER's fused add + norm + per-group FP8",
         args=("x", "residual", "weight", "variance_epsilon", "group_size")),
    Name(AITER_RMS_NORM_PER_TOKEN, "op", _AITER, "AITER's fused norm + per-token FP8",
         args=("x", "weight", "epsilon")),
    Name(AITER_ADD_RMS_NORM_PER_TOKEN, "op", _AITER, "AITER's fused add + norm + per-token FP8",
         args=("x", "residual", "weight", "epsilon")),
    Name(AITER_RMS_NORM_STATIC_FP8, "op", _AITER, "AITER's fused norm + static FP8",
         since=(0, 33), args=("x", "weight", "epsilon", "scale", "quant_dtype")),
    Name(AITER_ADD_RMS_NORM_STATIC_FP8, "op", _AITER, "AITER's fused add + norm + static FP8",
         since=(0, 33), args=("x", "residual", "weight", "epsilon", "scale", "quant_dtype")),
    Name(SANDWICH_NORM_PASS, "attr", "vllm.compilation.passes.fusion."
         "muse_glimmer_sandwich_norm_fusion", "takes the norm after an all-reduce (gfx950)",
         since=(0, 34)),
    Name("fused_rmsnorm_add_rmsnorm", "text", "vllm.compilation.passes.fusion."
         "muse_glimmer_sandwich_norm_fusion", "AITER's sandwich-norm function it calls",
         since=(0, 34)),
)


def in_release(version: Version) -> list[Name]:
    """The names a vLLM release of ``version`` should have."""
    return [n for n in NAMES if n.in_release(version)]


# -- checking them against the installed vLLM ---------------------------------------------------

@functools.cache
def _source(module: str) -> Optional[str]:
    """The source text of a vLLM module, without importing it (None where it has none)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    with open(spec.origin, encoding="utf-8") as f:
        return f.read()


def _registered_args(module_source: str, op: str) -> Optional[list[str]]:
    """Argument names of ``op`` where the module registers it from Python: the function given
    as ``op_func`` to ``direct_register_custom_op(op_name=op, ...)``, or a function named ``op``
    (vLLM's IR ops are decorated functions).  None where neither is in the source."""
    tree = ast.parse(module_source)
    defs = {d.name: d for d in tree.body if isinstance(d, ast.FunctionDef)}
    func = None
    for call in ast.walk(tree):
        if not isinstance(call, ast.Call):
            continue
        kw = {k.arg: k.value for k in call.keywords}
        name = kw.get("op_name")
        if isinstance(name, ast.Constant) and name.value == op and isinstance(kw.get("op_func"),
                                                                              ast.Name):
            func = defs.get(kw["op_func"].id)
            break
    func = func or defs.get(op)
    if func is None:
        return None
    return [a.arg for a in func.args.posonlyargs + func.args.args + func.args.kwonlyargs]


def _resolve(module: str, path: str) -> tuple[bool, str]:
    try:
        obj = importlib.import_module(module)
    except Exception as e:  # a moved or broken module
        return False, f"module {module} does not import ({type(e).__name__}: {e})"
    for part in path.split("."):
        if not hasattr(obj, part):
            return False, f"{module} has no {path}"
        obj = getattr(obj, part)
    return True, ""


def problem(n: Name) -> Optional[str]:
    """What is wrong with ``n`` in the installed vLLM, in one line; None if it is there."""
    where = f"{n.kind} {n.name!r} (in {n.where}: {n.use})"
    if n.kind == "attr":
        ok, why = _resolve(n.where, n.name)
        return None if ok else f"{where}: {why}"
    if n.kind == "field":
        cls_name, field_name = n.name.rsplit(".", 1)
        ok, why = _resolve(n.where, cls_name)
        if not ok:
            return f"{where}: {why}"
        cls = getattr(importlib.import_module(n.where), cls_name)
        fields = getattr(cls, "__dataclass_fields__", {})
        return None if field_name in fields else f"{where}: {cls_name} has no field {field_name}"
    src = _source(n.where)
    if src is None:
        return f"{where}: module {n.where} is not in this vLLM"
    short = n.name.split("::")[-1]
    if not re.search(rf"(?<![\w]){re.escape(short)}(?![\w])", src):
        return f"{where}: {n.where} no longer names {short!r}"
    if n.kind == "op" and n.args:
        found = _registered_args(src, short)
        if found is not None and not set(n.args) <= set(found):
            return (f"{where}: its arguments are now {found}; the matchers read "
                    f"{sorted(set(n.args) - set(found))}")
    return None


def missing_required() -> list[str]:
    """The required names (:attr:`Name.required`) the installed vLLM lacks."""
    return [n.name for n in NAMES if n.required and problem(n) is not None]
