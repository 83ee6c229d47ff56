"""ROCm backend: AITER's fused all-reduce + residual add + RMSNorm kernel.

Which AITER communicator runs the call:

* inside vLLM, the one vLLM already owns for that group
  (``CudaCommunicator.aiter_ar_comm``, an ``AiterCustomAllreduce`` wrapping
  AITER's ``CustomAllreduce``): a second one would duplicate its IPC buffers
  (hundreds of MiB per GPU that vLLM's memory profiling does not know about)
  and would never see vLLM's graph-capture context;
* outside vLLM, one AITER ``CustomAllreduce`` per process group, created on
  first use and owned by this backend.

What AITER can take is decided once, from the installed version
(:func:`limits_for_version`), and handed to the gate as ``limits``.  The call
itself is ``CustomAllreduce.fused_ar_rms`` (see ``docs/rocm_aiter.md``).
AITER is imported only when a communicator is first needed.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import sys
from typing import Any, Iterator, Optional, Union

import torch

from ..gate import BackendLimits, Path
from ..log import once
from . import Call, Outputs

DIST_NAME = "amd-aiter"

# AITER's default custom all-reduce cutoff and vLLM's effective maximum (half of
# its 128 MiB IPC buffer, because the two-stage kernel needs a 2x temp region).
MAX_BYTES = 64 * 1024 * 1024
# IPC input buffer of the communicators this backend creates: the same size
# vLLM gives its own, so that MAX_BYTES fits the two-stage temp region.
OWN_BUFFER_BYTES = 2 * MAX_BYTES

# Before 0.1.12 the hidden size was a template parameter of the fused kernel:
# other sizes compiled to a kernel that silently did nothing.
OLD_HIDDEN_SIZES = frozenset({512, 1024, 2048, 4096})
# One block per token and 80 signal slots: until 0.1.17 the one-stage launcher
# threw above 80 tokens; from 0.1.17 it grid-strides and 80 is only a threshold.
OLD_ONE_STAGE_MAX_TOKENS = 80

# vLLM's caller gate (AiterCustomAllreduce.use_1stage_fused_ar_rms): one-stage
# always at world size 2, below 256 KiB up to 4 ranks, below 128 KiB up to 8.
ONE_STAGE_MAX_BYTES: dict[int, Optional[int]] = {2: None, 4: 256 * 1024, 8: 128 * 1024}

_VERSION_RE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?(.*)$")


def version_key(version: str) -> Optional[tuple[int, int, int, int]]:
    """``"0.1.16.post3"`` -> ``(0, 1, 16, 0)``; a pre-release sorts before its release.

    setuptools_scm names an untagged build after the NEXT release
    (``0.1.17.dev5+g…`` is 0.1.16 plus five commits), so ``dev``/``rc``/``a``/``b``
    versions get ``-1`` and are treated as the release before.  None when the
    string has no ``major.minor`` at its start.
    """
    m = _VERSION_RE.match(version)
    if m is None:
        return None
    rest = m.group(4).split("+", 1)[0].lower()
    pre = re.match(r"^[.-]?(dev|rc|a|b|alpha|beta|pre|preview|c)\d*", rest) is not None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0), -1 if pre else 0


def limits_for_version(version: Optional[str]) -> BackendLimits:
    """What AITER ``version`` can fuse; an unknown or unparsable version gets the
    oldest (most restrictive) row, never a guess that could silently miscompute."""
    key = version_key(version) if version is not None else None
    hidden_sizes: Optional[frozenset[int]] = None
    one_stage_max_tokens: Optional[int] = None
    if key is None or key < (0, 1, 17, 0):
        one_stage_max_tokens = OLD_ONE_STAGE_MAX_TOKENS
    if key is None or key < (0, 1, 12, 0):
        hidden_sizes = OLD_HIDDEN_SIZES
    return BackendLimits(
        name=f"aiter-{version}",
        world_sizes=frozenset({2, 4, 8}),
        # fp32 is accepted by the C++ but neither vLLM nor our ROCm tests run it.
        dtypes=frozenset({"bfloat16", "float16"}),
        max_bytes=MAX_BYTES,
        one_stage_max_bytes=dict(ONE_STAGE_MAX_BYTES),
        one_stage_max_tokens=one_stage_max_tokens,
        hidden_sizes=hidden_sizes,
    )


def installed_version() -> Optional[str]:
    """The installed AITER's version, or None when AITER is not installed."""
    from importlib import metadata

    try:
        return metadata.version(DIST_NAME)
    except metadata.PackageNotFoundError:
        pass
    # A source checkout on sys.path has no dist metadata, only the file
    # setuptools_scm wrote at build time.
    try:
        from aiter._version import __version__  # type: ignore[import-not-found]
    except ImportError:
        return None
    return str(__version__)


def _aiter_custom_allreduce_class() -> type:
    from aiter.dist.device_communicators.custom_all_reduce import CustomAllreduce

    return CustomAllreduce


@functools.lru_cache(maxsize=None)
def _takes_gemma_norm(cls: type) -> bool:
    return "gemma_norm" in inspect.signature(cls.fused_ar_rms).parameters


def _vllm_communicator(group_name: str) -> tuple[bool, Any]:
    """``(inside_vllm, vLLM's AiterCustomAllreduce or None)`` for the c10d group.

    Inside vLLM means: vLLM's parallel state is loaded and one of its group
    coordinators reduces over ``group_name``.  vLLM is never imported here.
    """
    ps = sys.modules.get("vllm.distributed.parallel_state")
    if ps is None:
        return False, None
    for ref in list(getattr(ps, "_groups", {}).values()):
        coord = ref()
        group = getattr(coord, "device_group", None)
        if group is None or group.group_name != group_name:
            continue
        comm = getattr(getattr(coord, "device_communicator", None), "aiter_ar_comm", None)
        return True, comm
    return False, None


class AiterBackend:
    """Dispatches the fused op to AITER's ``CustomAllreduce.fused_ar_rms``."""

    name = "aiter"

    def __init__(self, version: Optional[str] = None) -> None:
        if torch.version.hip is None:
            raise RuntimeError("fusion_pass: the aiter backend needs a ROCm build of torch "
                               f"(this one is {torch.__version__}); choose another backend "
                               "with FUSION_PASS_BACKEND or fusion_pass.set_backend()")
        if version is None:
            version = installed_version()
            if version is None:
                raise RuntimeError(f"fusion_pass: the aiter backend needs AITER (pip package "
                                   f"{DIST_NAME!r}, or a source build of ROCm/aiter)")
        if version_key(version) is None:
            once(f"aiter-version:{version}", f"fusion_pass: cannot parse AITER version "
                 f"{version!r}; using the limits of AITER < 0.1.12")
        self.version = version
        self.limits = limits_for_version(version)
        self._own: dict[str, Any] = {}

    # -- communicators ------------------------------------------------------

    def communicator(self, group_name: str, device: torch.device) -> Optional[Any]:
        """AITER's ``CustomAllreduce`` for ``group_name``, or None (declined, logged once)."""
        inside_vllm, vllm_comm = _vllm_communicator(group_name)
        if inside_vllm:
            if vllm_comm is None or vllm_comm.disabled:
                once(f"aiter-novllm:{group_name}",
                     f"fusion_pass: vLLM has no enabled AITER all-reduce for group {group_name} "
                     "(set VLLM_ROCM_USE_AITER=1 and VLLM_ROCM_USE_AITER_CUSTOM_AR=1); "
                     "running unfused")
                return None
            return vllm_comm.aiter_ca
        if group_name not in self._own:
            self._own[group_name] = self._create(group_name, device)
        ca = self._own[group_name]
        if ca.disabled:
            once(f"aiter-disabled:{group_name}",
                 f"fusion_pass: AITER disabled its all-reduce for group {group_name} "
                 "(multi-node, unsupported world size or no custom all-reduce build); "
                 "running unfused")
            return None
        return ca

    def _create(self, group_name: str, device: torch.device) -> Any:
        import torch.distributed as dist

        group = dist.distributed_c10d._resolve_process_group(group_name)
        # AITER refuses NCCL/RCCL groups (it exchanges IPC handles over the
        # group with CPU tensors); a gloo group over the same ranks is made by
        # those ranks alone, so other tensor-parallel groups need not join.
        cpu_group = dist.new_group(dist.get_process_group_ranks(group), backend="gloo",
                                   use_local_synchronization=True)
        return _aiter_custom_allreduce_class()(cpu_group, device, max_size=OWN_BUFFER_BYTES)

    @contextlib.contextmanager
    def graph_capture(self, group_name: str, device: torch.device) -> Iterator[None]:
        """Wrap a CUDA/HIP graph capture with this so that the fused calls in it
        read their inputs in place (``registered=True``).

        AITER learns the captured input addresses during capture and exchanges
        them with the peers when its ``capture()`` context exits.  Without this
        context (and inside vLLM, vLLM's ``graph_capture`` does the same for its
        communicator) captured calls copy their input into AITER's
        pre-registered buffer instead, which is graph-safe but one copy slower.
        """
        ca = self.communicator(group_name, device)
        with ca.capture() if ca is not None else contextlib.nullcontext():
            yield

    # -- the call -----------------------------------------------------------

    def run(self, call: Call) -> Union[Outputs, str]:
        out = self._run(call.x, call.residual, call.weight, call.eps, call.group_name,
                        call.path, call.gemma)
        return "declined" if out is None else Outputs(*out)

    def _run(self, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
             eps: float, group_name: str, path: Path,
             gemma: bool) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        path = Path(path)  # the op resolves ``runtime`` before calling a backend
        if path not in (Path.ONE_STAGE, Path.TWO_STAGE):
            return None
        hidden = x.shape[-1]
        if self.limits.hidden_sizes is not None and hidden not in self.limits.hidden_sizes:
            # A path baked under other limits must not reach a kernel that
            # silently does nothing for this hidden size.
            return None
        cap = self.limits.one_stage_max_tokens
        if path is Path.ONE_STAGE and cap is not None and x.numel() // hidden > cap:
            path = Path.TWO_STAGE  # this AITER's one-stage launcher throws above cap
        if weight.dtype != x.dtype:
            # The kernel reads the weight as the input's element type.
            once(f"aiter-wdtype:{weight.dtype}:{x.dtype}",
                 f"fusion_pass: AITER needs the norm weight in {x.dtype}, not {weight.dtype}")
            return None
        ca = self.communicator(group_name, x.device)
        if ca is None or not ca.should_custom_ar(x):
            return None
        takes_gemma = _takes_gemma_norm(type(ca))
        if gemma and not takes_gemma:
            once("aiter-gemma", f"fusion_pass: AITER {self.version} has no Gemma-style "
                 "(1 + w) norm; Gemma norms run unfused")
            return None

        # Registered (in-place) input only when AITER will exchange the captured
        # addresses at the end of its capture context; otherwise the copy-in
        # path through its pre-registered buffer, which is graph-safe too.
        registered = bool(torch.cuda.is_current_stream_capturing()
                          and getattr(ca, "_IS_CAPTURING", False)
                          and getattr(ca, "enable_register_for_capturing", True))
        # Fresh outputs that the caller owns: AITER writes into whatever it is
        # given, so nothing returned can alias its IPC buffers on any version.
        out = torch.empty_like(x)
        res_out = torch.empty_like(x)
        # The kernel always adds a residual; adding zeros is exact.
        res_in = residual if residual is not None else torch.zeros_like(x)
        kwargs: dict[str, Any] = dict(res_out=res_out, out=out, w=weight, eps=eps,
                                      registered=registered,
                                      use_1stage=path is Path.ONE_STAGE)
        if takes_gemma:
            kwargs["gemma_norm"] = gemma
        ca.fused_ar_rms(x, res_in, **kwargs)
        return out, res_out
