"""Which AITER ``CustomAllreduce`` runs a group's calls, and when one may be made.

* Inside vLLM: the one vLLM already owns for that group
  (``CudaCommunicator.aiter_ar_comm``, an ``AiterCustomAllreduce`` wrapping
  AITER's class).  A second one would duplicate its IPC buffers (memory vLLM's
  profiler does not count) and would never see vLLM's graph-capture context.
* Outside vLLM: one per process group, owned here, created outside any graph
  capture: ``CustomAllreduce.__init__`` allocates its IPC buffers and exchanges
  their handles with the peers, which must not happen while a graph is being
  captured.  It is made by the first eager call, by :meth:`Communicators.prepare`
  or by entering :meth:`Communicators.graph_capture`; a group whose first call
  comes under capture is declined, and made by its next eager call.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator, Optional, Union

import torch

from .releases import EXPANDABLE_SEGMENTS_GUARD, MAX_BYTES, Capabilities, format_version

# The IPC input buffer of the communicators made here: the size vLLM gives its own,
# so that inputs up to MAX_BYTES fit the two-stage kernel's 2x temp region.
OWN_BUFFER_BYTES = 2 * MAX_BYTES
# Where PyTorch reads allocator settings when it has no getter for them, first set wins.
_ALLOC_CONF_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def vllm_communicator(group_name: str) -> tuple[bool, Any]:
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


def expandable_segments() -> bool:
    """Whether PyTorch's caching allocator is set to hand out expandable segments,
    whose memory hipIpcGetMemHandle cannot export (ROCm/aiter#4174)."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    conf = getter() if getter is not None else next(
        (os.environ[k] for k in _ALLOC_CONF_ENV if os.environ.get(k)), "")
    for item in conf.split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments":
            return value.strip().lower() in ("1", "true")
    return False


class Communicators:
    """The AITER communicator of each process group this backend has served."""

    def __init__(self, cls: type, caps: Capabilities) -> None:
        self._cls = cls
        self._caps = caps
        self._own: dict[str, Any] = {}

    def get(self, group_name: str, device: torch.device) -> Union[Any, str]:
        """The ``CustomAllreduce`` for ``group_name``, or why there is none now."""
        inside_vllm, vllm_comm = vllm_communicator(group_name)
        if inside_vllm:
            if vllm_comm is None or vllm_comm.disabled:
                return (f"vLLM has no enabled AITER all-reduce for group {group_name} (set "
                        "VLLM_ROCM_USE_AITER=1 and VLLM_ROCM_USE_AITER_CUSTOM_AR=1)")
            return vllm_comm.aiter_ca
        ca = self._own.get(group_name)
        if ca is None:
            why = self._cannot_create(group_name)
            if why:
                return why
            ca = self._own[group_name] = self._create(group_name, device)
        if ca.disabled:
            return (f"AITER disabled its all-reduce for group {group_name} (multi-node, "
                    "unsupported world size or no custom all-reduce build)")
        return ca

    def prepare(self, group_name: str, device: torch.device) -> Optional[str]:
        """Make the group's communicator now, outside graph capture; why not, or None."""
        got = self.get(group_name, device)
        return got if isinstance(got, str) else None

    @contextlib.contextmanager
    def graph_capture(self, group_name: str, device: torch.device) -> Iterator[None]:
        """Enter before a CUDA/HIP graph capture so that the fused calls in it read
        their inputs in place (``registered=True``).

        AITER learns the captured input addresses during capture and exchanges
        them with the peers when its ``capture()`` context exits.  Without this
        context (inside vLLM, vLLM's ``graph_capture`` does the same for its
        communicator) captured calls copy their input into AITER's pre-registered
        buffer instead, which is graph-safe but one copy slower.
        """
        ca = self.get(group_name, device)
        with contextlib.nullcontext() if isinstance(ca, str) else ca.capture():
            yield

    def registered(self, ca: Any) -> bool:
        """Whether this call may read its input in place: only under capture inside
        AITER's capture context (which registers the captured addresses when it
        exits), where AITER allows it, and where the input's memory can be exported."""
        return bool(torch.cuda.is_current_stream_capturing()
                    and getattr(ca, "_IS_CAPTURING", False)
                    and getattr(ca, "enable_register_for_capturing", True)
                    and (self._caps.expandable_segments_guarded or not expandable_segments()))

    def _cannot_create(self, group_name: str) -> str:
        if torch.cuda.is_current_stream_capturing():
            return (f"the first AITER call of group {group_name} is under graph capture, where "
                    "AITER would allocate and exchange its IPC buffers; run one eager call (or "
                    "AiterBackend.prepare) before capturing")
        if not self._caps.expandable_segments_guarded and expandable_segments():
            return (f"PyTorch's expandable_segments is on, and AITER {self._caps.version} cannot "
                    "export such memory to its peers (ROCm/aiter#4174, handled by #4621 in "
                    f"{format_version(EXPANDABLE_SEGMENTS_GUARD)}); upgrade AITER or turn "
                    "expandable_segments off")
        return ""

    def _create(self, group_name: str, device: torch.device) -> Any:
        import torch.distributed as dist

        group = dist.distributed_c10d._resolve_process_group(group_name)
        # AITER refuses NCCL/RCCL groups (it exchanges its IPC metadata on the
        # host); a gloo group over the same ranks is made by those ranks alone,
        # so other tensor-parallel groups need not join.
        cpu_group = dist.new_group(dist.get_process_group_ranks(group), backend="gloo",
                                   use_local_synchronization=True)
        return self._cls(cpu_group, device, max_size=OWN_BUFFER_BYTES)
