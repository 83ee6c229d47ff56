"""CUDA backend: fused all-reduce + residual + RMSNorm in Triton on torch symmetric memory.

``TritonBackend.run`` launches the one-stage kernel (``one_stage.py``) or the
two-stage kernel (``two_stage.py``) for the path the gate chose, on Lamport
mailboxes in a symmetric buffer (``buffers.py``, ``lamport.py``).  No host
synchronisation and no allocation of symmetric memory per call: the outputs are
fresh tensors from the caching allocator, the slot counter lives on the device,
so calls capture into CUDA graphs and replay correctly.

Importing this package needs torch alone; Triton is imported on the first
launch.  Whatever the kernels cannot take makes ``run`` return None, and the op
falls back to the reference with one log line: see :func:`decline_reason`.

Settings (environment, read when the backend is made):

* ``FUSION_PASS_TIMEOUT_S`` (default 5): how long a kernel waits for a peer
  before it fails with a device assertion ("timed out waiting for a peer
  rank").  After that the CUDA context of the process is unusable, as after an
  NCCL timeout: the job must restart.
"""

from __future__ import annotations

import os
from typing import Optional, Union

import torch

from ...gate import ELEMENT_SIZE, BackendLimits, Path, dtype_name
from ... import schedules
from ...groups import c10d_world_size
from .. import Call, Outputs
from . import buffers

MAX_INPUT_BYTES = 32 << 20
"""Largest input the kernels take (2048 x 8192 bf16); larger inputs run
unfused.  Sets the largest symmetric slot (``buffers.max_slot_bytes``)."""

MAX_BLOCK = 16384
"""Largest row, in elements, one program holds in registers."""

DEFAULT_TIMEOUT_S = 5.0

LIMITS = BackendLimits(
    name="triton",
    world_sizes=frozenset({2, 4, 8}),
    dtypes=frozenset(ELEMENT_SIZE),
    max_bytes=MAX_INPUT_BYTES,
    schedules=schedules.load("triton"),
)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def decline_reason(hidden: int, dtype: torch.dtype, world_size: int, tokens: int,
                   path: Path) -> Optional[str]:
    """Why the kernels cannot take this call (shape and type alone), or None."""
    dt = dtype_name(dtype)
    if dt not in LIMITS.dtypes:
        return f"dtype {dt} is not one of {sorted(LIMITS.dtypes)}"
    if world_size not in LIMITS.world_sizes:
        return f"world size {world_size} is not one of {sorted(LIMITS.world_sizes)}"
    if path not in (Path.ONE_STAGE, Path.TWO_STAGE):
        return f"path {path} is not a kernel path"
    if hidden <= 0 or (hidden * ELEMENT_SIZE[dt]) % 16:
        return f"row of {hidden} x {dt} is not a whole number of 16-byte vectors"
    if next_pow2(hidden) > MAX_BLOCK:
        return f"hidden {hidden} exceeds the {MAX_BLOCK}-element row a program holds"
    if tokens * hidden * ELEMENT_SIZE[dt] > MAX_INPUT_BYTES:
        return f"{tokens} x {hidden} x {dt} exceeds {MAX_INPUT_BYTES} bytes"
    return None


def slot_need(path: Path, tokens: int, hidden: int, dtype: torch.dtype, world_size: int) -> int:
    row = hidden * ELEMENT_SIZE[dtype_name(dtype)]
    if path is Path.ONE_STAGE:
        return buffers.one_stage_need(tokens, row, world_size)
    return buffers.two_stage_need(tokens, row, world_size)


def num_warps(hidden: int, elem_size: int) -> int:
    """One 16-byte vector per thread per row (4 to 32 warps): a single row's
    exchange is latency-bound, so more threads in flight per program pay."""
    return min(32, max(4, next_pow2(hidden) * elem_size // (16 * 32)))


def timeout_ns() -> int:
    return int(float(os.environ.get("FUSION_PASS_TIMEOUT_S", DEFAULT_TIMEOUT_S)) * 1e9)


_sm_count: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _sm_count:
        _sm_count[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _sm_count[idx]


class TritonBackend:
    name = "triton"
    limits: BackendLimits = LIMITS

    def __init__(self) -> None:
        self.timeout_ns = timeout_ns()

    def run(self, call: Call) -> Union[Outputs, str]:
        """The fused kernel's outputs, or why this call is declined."""
        x, residual, weight = call.x, call.residual, call.weight
        if x.device.type != "cuda" or x.device.index != torch.cuda.current_device():
            return "input is not on the current CUDA device"
        if isinstance(call.eps, torch.Tensor):
            return "epsilon as a device tensor is not supported yet"
        if weight.dtype != x.dtype or call.out_dtype != x.dtype:
            return "norm weight or output dtype differs from the input's"
        if call.quant is not None:
            return "no FP8 epilogue yet"
        hidden = x.shape[-1]
        tokens = call.tokens
        world = c10d_world_size(call.group_name)
        path = Path(call.path)
        why = decline_reason(hidden, x.dtype, world, tokens, path)
        if why is not None:
            return why
        y, h = torch.empty_like(x), torch.empty_like(x)
        elem_bits = 8 * x.element_size()
        buf = buffers.get(call.group_name, elem_bits, x.device,
                          slot_need(path, tokens, hidden, x.dtype, world), MAX_INPUT_BYTES)
        if buf is None:
            return "the symmetric buffer would have to grow during graph capture"
        common = dict(HIDDEN=hidden, BLOCK=next_pow2(hidden), WORLD=world,
                      HAS_RES=residual is not None, GEMMA=bool(call.gemma),
                      NEG0=buffers.negative_zero_bits(elem_bits), SLOTS=buffers.SLOTS,
                      num_warps=num_warps(hidden, x.element_size()), sanitize_overflow=False)
        res = residual if residual is not None else x
        eps = float(call.eps)
        if path is Path.ONE_STAGE:
            from .one_stage import one_stage_kernel

            one_stage_kernel[(tokens,)](
                x, res, weight, y, h, buf.tensor, buf.peer_ptrs, buf.state,
                buf.rank, tokens, eps, self.timeout_ns, buf.slot_elems, **common)
        else:
            from .two_stage import two_stage_kernel

            chunk = buffers.ceil_div(tokens, world)
            two_stage_kernel[(min(tokens, sm_count(x.device)),)](
                x, res, weight, y, h, buf.tensor, buf.peer_ptrs, buf.state,
                buf.rank, tokens, chunk, eps, self.timeout_ns, buf.slot_elems, **common)
        return Outputs(y, h)
