"""CUDA backend: fused all-reduce + residual + RMSNorm (+ FP8) in Triton on torch symmetric memory.

``TritonBackend.run`` launches the one-stage kernel (``one_stage.py``) or the
two-stage kernel (``two_stage.py``) for the path the gate chose, on Lamport
mailboxes in a symmetric buffer (``buffers.py``, ``lamport.py``); both finish
rows with the same norm and FP8 epilogue (``norm.py``).  No host
synchronisation and no allocation of symmetric memory per call: the outputs are
fresh tensors from the caching allocator, the slot counter lives on the device,
so calls capture into CUDA graphs and replay correctly.

Per call shape a :class:`Plan` is made once (world size, buffer, grid,
constexprs, timeout, the compiled kernel's C launcher: ``launch.py``); a call
then costs a dictionary lookup, the output allocations and one C launch.

Importing this package needs torch alone; Triton is imported on the first
launch.  Which rows the kernels take is stated once in :mod:`.limits`, which
the gate reads; whatever a call cannot take makes ``run`` return the reason,
and the op falls back to the reference with one log line.
An FP8 epilogue the kernels cannot compute (a group size that is not a power of
two, e4m3fnuz with qmax above 240) leaves ``q`` to the op, which quantizes the
fused ``y``.

Waiting for a peer is bounded: a kernel that waits longer than the timeout
fails with a device assertion ("timed out waiting for a peer rank"), after
which the process's CUDA context is unusable, as after an NCCL timeout.  The
timeout is the c10d group's own (``ProcessGroupNCCL``: 10 minutes by default,
``init_process_group(timeout=...)`` sets it) unless ``FUSION_PASS_TIMEOUT_S``
(read when the backend is made) says otherwise.  A long timeout survives a peer
that is late for a while (compiling, checkpointing, a slow data loader), as
NCCL would; a short one turns a dead or diverged peer into an error sooner.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch

from ...dtypes import FLOATS
from ...gate import ELEMENT_SIZE, BackendLimits, Path, dtype_name
from ...groups import c10d_world_size
from ...quant import QuantSpec
from ..base import Call, Outputs
from . import buffers
from .limits import LIMITS, MAX_BLOCK  # noqa: F401  (the backend's limits, re-exported)
from .quant_args import GROUP_QUANTS, QUANT_MODE, quant_constexprs, quant_decline

MAX_INPUT_BYTES = 32 << 20
"""Largest input one launch takes (2048 x 8192 bf16); a larger call runs as
launches of consecutive row pieces of at most this size, one after another on
the stream (each piece is a whole call of the protocol, so nothing else
changes).  Sets the largest symmetric slot (``buffers.max_slot_bytes``)."""

DEFAULT_TIMEOUT_S = 600.0
"""Wait bound when the group's own timeout cannot be read (NCCL's default)."""

PART_BYTES = 2048
"""Bytes of a one-stage row part: a row leaves from ``row bytes / PART_BYTES``
SMs (at most :data:`MAX_SPLIT`), so that a wide row's push is not limited by
what one SM has in flight (timings: docs/triton_backend.md)."""

MAX_SPLIT = buffers.MAX_PARTS

OWN_MIN_BYTES = 12 << 10
"""Parts own their columns when each would otherwise read at least this many
bytes of other parts' columns (``row x (1 - 1 / split)``), and the row has at
least :data:`OWN_MIN_PARTS` parts: the exchange of sums of squares costs a local
round trip, reading the whole row costs more the wider it is (timings:
docs/triton_backend.md)."""

OWN_MIN_PARTS = 3
"""Fewest parts of a row that own their columns (:data:`OWN_MIN_BYTES`)."""

SPLIT_PROGRAMS = 32
"""Rows are split only while the grid stays this small (and the parts of a row
never number more than :data:`MAX_SPLIT`), or :data:`OWN_SPLIT_PROGRAMS`."""

OWN_SPLIT_PROGRAMS = 64
"""A larger grid for rows whose parts then own their columns: more parts per
token push a wide row from more SMs, and each part still reads its own
columns alone (timings: docs/triton_backend.md)."""

def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def slot_need(path: Path, tokens: int, hidden: int, dtype: torch.dtype, world_size: int) -> int:
    row = hidden * ELEMENT_SIZE[dtype_name(dtype)]
    if path is Path.ONE_STAGE:
        return buffers.one_stage_need(tokens, row, world_size)
    return buffers.two_stage_need(tokens, row, world_size)


def rows_per_launch(path: Path, hidden: int, elem_size: int, world_size: int) -> int:
    """Most rows one launch takes: :data:`MAX_INPUT_BYTES` of input whose slot
    fits the largest buffer, a multiple of 16 rows so that every piece's FP8
    codes and scales start 16-byte aligned, as the compiled kernel assumes."""
    row = hidden * elem_size
    rows = MAX_INPUT_BYTES // row
    if path is Path.ONE_STAGE:
        rows = min(rows, buffers.max_slot_bytes(MAX_INPUT_BYTES) // (world_size * row))
    return max(16, rows // 16 * 16)


def num_warps(hidden: int, elem_size: int) -> int:
    """One 16-byte vector per thread per row (4 to 32 warps): a single row's
    exchange is latency-bound, so more threads in flight per program pay."""
    return min(32, max(4, next_pow2(hidden) * elem_size // (16 * 32)))


ONE_STAGE_MAX_WARPS = 16
"""Warps of a one-stage program whose block exceeds 8192 elements (32 warps
spill there), and of every one-stage program without an FP8 epilogue in a grid
larger than the SM count (more programs of 16 warps share an SM than of 32);
otherwise a row takes its 32 warps (timings: docs/triton_backend.md)."""


def one_stage_warps(warps: int, block: int, grid: int, sms: int, quant: int) -> int:
    """Warps of a one-stage launch of ``grid`` programs over ``block`` columns:
    ``warps`` (:func:`num_warps` of the block), capped at
    :data:`ONE_STAGE_MAX_WARPS` as its note says."""
    if block > 8192 or (grid > sms and not quant):
        return min(warps, ONE_STAGE_MAX_WARPS)
    return warps


def one_stage_split(tokens: int, hidden: int, elem_size: int, sms: int,
                    programs: Optional[int] = None) -> int:
    """Programs per token of the one-stage kernel: one per :data:`PART_BYTES`
    of the row, at most :data:`MAX_SPLIT`, while the grid has at most
    ``programs`` (:data:`SPLIT_PROGRAMS`) programs and fits the SMs (a program
    of a split row waits for its sibling parts on the peers, so they must be
    resident)."""
    per_token = min(programs or SPLIT_PROGRAMS, sms) // max(tokens, 1)
    return max(1, min(MAX_SPLIT, hidden * elem_size // PART_BYTES, per_token))


def one_stage_layout(tokens: int, hidden: int, elem_size: int, sms: int, quant: int,
                     group: int) -> tuple[int, int, bool]:
    """``(split, part columns, parts own their columns)`` of a one-stage launch:
    the grid of :data:`OWN_SPLIT_PROGRAMS` where its parts own their columns,
    else that of :data:`SPLIT_PROGRAMS`."""
    for programs in (OWN_SPLIT_PROGRAMS, SPLIT_PROGRAMS):
        split = one_stage_split(tokens, hidden, elem_size, sms, programs)
        part = part_elems(hidden, split, elem_size)
        own = (owns_columns(hidden, elem_size, split, part, quant, group)
               and tokens <= buffers.PART_ROWS)
        if own:
            break
    return split, part, own


def owns_columns(hidden: int, elem_size: int, split: int, part: int, quant: int,
                 group: int) -> bool:
    """Whether the parts of a split row finish their own columns: where it pays
    (:data:`OWN_MIN_BYTES`, :data:`OWN_MIN_PARTS`), and not with a per-token FP8
    scale (its amax needs the whole row) nor with groups that straddle parts."""
    pays = split >= OWN_MIN_PARTS and hidden * elem_size * (split - 1) >= OWN_MIN_BYTES * split
    return (split > 1 and pays and quant != QUANT_MODE["per_token"]
            and (quant not in GROUP_QUANTS or part % group == 0))


def part_elems(hidden: int, split: int, elem_size: int) -> int:
    """Columns of one part: whole 16-byte vectors, the last part may be shorter."""
    vec = 16 // elem_size
    return -(-hidden // (split * vec)) * vec


def pdl_enabled(device: int) -> bool:
    """Whether to launch with programmatic dependent launch: Hopper or newer
    (``griddepcontrol``), not turned off by ``FUSION_PASS_PDL=0``, and never in
    Triton's interpreter (``device`` -1), which has no such instruction."""
    if device < 0 or os.environ.get("FUSION_PASS_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def timeout_override_s() -> Optional[float]:
    value = os.environ.get("FUSION_PASS_TIMEOUT_S")
    return float(value) if value else None


def group_timeout_s(group_name: str) -> float:
    """The c10d group's own timeout: its CUDA backend's options (torch 2.11-2.13:
    ``ProcessGroup._get_backend(device).options._timeout``)."""
    from torch.distributed import distributed_c10d

    pg = distributed_c10d._resolve_process_group(group_name)
    try:
        return pg._get_backend(torch.device("cuda")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        fallback = getattr(distributed_c10d, "default_pg_nccl_timeout", None)
        return fallback.total_seconds() if fallback is not None else DEFAULT_TIMEOUT_S


_sm_count: dict[int, int] = {}


def sm_count(device: int) -> int:
    if device not in _sm_count:
        _sm_count[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _sm_count[device]


_PER_CALL = ("x_ptr", "res_ptr", "w_ptr", "eps", "y_ptr", "h_ptr", "q_ptr", "s_ptr", "scale_ptr")


class Plan:
    """Everything about a call that its shape, dtypes, options and group fix:
    made once, then each call allocates its outputs and launches.

    ``pieces`` holds ``(first row, launcher)`` per launch: one for every call
    up to :data:`MAX_INPUT_BYTES`, consecutive row pieces above it."""

    __slots__ = ("pieces", "launcher", "device", "out_dtype", "emit_y", "quant", "fp8", "fnuz",
                 "dummy_y", "s_row", "generation")

    def __init__(self, pieces: tuple[tuple[int, Any], ...], device: int, out_dtype: torch.dtype,
                 emit_y: bool, quant: Optional[QuantSpec], s_row: int, x: torch.Tensor) -> None:
        self.pieces, self.device, self.out_dtype = pieces, device, out_dtype
        self.launcher = pieces[0][1] if len(pieces) == 1 else None
        self.emit_y, self.quant, self.s_row = emit_y, quant, s_row
        self.fp8 = quant.dtype if quant is not None else None
        self.fnuz = quant is not None and quant.fp8_dtype == "float8_e4m3fnuz"
        # The kernel reads y's dtype from its pointer; with y not emitted it gets
        # this never-written stand-in.
        self.dummy_y = None if emit_y else x.new_empty(1, dtype=out_dtype)
        self.generation = buffers.generation

    def __call__(self, call: Call) -> Union[Outputs, str]:
        x, res, w, eps = call.x, call.residual, call.weight, call.eps
        if res is None:
            res = x
        if not (x.is_contiguous() and res.is_contiguous() and w.is_contiguous()):
            return "non-contiguous input"
        xp, rp, wp = x.data_ptr(), res.data_ptr(), w.data_ptr()
        aligned = ((xp | rp | wp) & 15) == 0
        launcher = self.launcher
        fast = aligned and launcher is not None and launcher.ready
        h = torch.empty_like(x)
        y = torch.empty_like(x, dtype=self.out_dtype) if self.emit_y else self.dummy_y
        if self.quant is None:
            if fast:
                launcher.launch_addresses(self.device, (
                    xp, rp, wp, eps if type(eps) is float else eps.data_ptr(),
                    y.data_ptr(), h.data_ptr(), 0, 0, 0))
            else:
                self._launch(x, (x, res, w, eps, y, h, h, h, h), aligned)
            return Outputs(y, h)
        scale = call.scale if call.scale is not None else h
        if scale.get_device() != self.device:
            return "the static scale is not on the input's device"
        q = torch.empty_like(x, dtype=self.fp8)
        scales = self.quant.empty_scales(x)
        qk = q.view(torch.uint8) if self.fnuz else q
        if fast:
            launcher.launch_addresses(self.device, (
                xp, rp, wp, eps if type(eps) is float else eps.data_ptr(), y.data_ptr(),
                h.data_ptr(), q.data_ptr(), scales.data_ptr(), scale.data_ptr()))
        else:
            self._launch(x, (x, res, w, eps, y, h, qk, scales, scale), aligned)
        return Outputs(y if self.emit_y else None, h, q, scales)

    def _launch(self, x: torch.Tensor, args: tuple, aligned: bool) -> None:
        """Launch every piece with its rows' tensors: ``args`` (in ``_PER_CALL``
        order) with the per-row ones (x, residual, y, h, q, scales) advanced to
        the piece's first row; the others (weight, epsilon, static scale, the
        stand-ins of absent outputs) as they are."""
        hidden, quant = x.shape[-1], self.quant is not None
        per_row = (hidden, hidden, 0, 0, hidden if self.emit_y else 0, hidden,
                   hidden if quant else 0, self.s_row if quant else 0, 0)
        for first, launcher in self.pieces:
            piece = args if first == 0 else tuple(
                _advanced(a, first * k) if k else a for a, k in zip(args, per_row))
            launcher(self.device, piece, aligned)


def _advanced(t: torch.Tensor, elems: int) -> torch.Tensor:
    """A view of ``t`` starting ``elems`` elements later (a kernel takes a
    pointer: only the start address and the dtype matter)."""
    return t.as_strided((1,), (1,), t.storage_offset() + elems)


class TritonBackend:
    name = "triton"

    def __init__(self, limits: BackendLimits = LIMITS) -> None:
        """``limits``: the committed ones, or others (a benchmark's own measured
        schedules) for this instance alone."""
        self.limits = limits
        self.timeout_s_override = timeout_override_s()
        self._plans: dict[tuple, Union[Plan, str]] = {}
        self._timeouts: dict[str, int] = {}

    def timeout_ns(self, group_name: str) -> int:
        """How long a kernel waits for a peer of ``group_name`` before it fails."""
        if group_name not in self._timeouts:
            s = self.timeout_s_override
            if s is None:
                s = group_timeout_s(group_name)
            self._timeouts[group_name] = int(min(s * 1e9, 2 ** 62))
        return self._timeouts[group_name]

    def run(self, call: Call) -> Union[Outputs, str]:
        """The fused kernel's outputs, or why this call is declined."""
        device = call.x.get_device()
        if device < 0 or device != torch._C._cuda_getDevice():
            return "input is not on the current CUDA device"
        return self.run_on(call, device)

    def run_on(self, call: Call, device: int) -> Union[Outputs, str]:
        """:meth:`run` once the device is known (the CPU tests drive the
        interpreter through this with device -1)."""
        x, eps = call.x, call.eps
        if isinstance(eps, torch.Tensor) and eps.get_device() != device:
            if eps.get_device() >= 0:
                return "epsilon is a tensor on another device"
            call.eps = eps = float(eps)  # the op reads CPU epsilon itself; direct callers may not
        key = (call.path, x.shape, x.dtype, device, call.residual is None, call.weight.dtype,
               call.out_dtype, call.gemma, eps.dtype if isinstance(eps, torch.Tensor) else None,
               call.quant, call.emit_y, call.round_normed, call.group_name)
        plan = self._plans.get(key)
        if plan is None or (type(plan) is Plan and plan.generation != buffers.generation):
            plan, lasting = self._plan(call, device)
            if lasting:
                self._plans[key] = plan
        if type(plan) is str:
            return plan
        return plan(call)

    def _plan(self, call: Call, device: int) -> tuple[Union[Plan, str], bool]:
        """A plan for calls like ``call``, or the reason none can be made (and
        whether that holds for every such call: growth during capture does not)."""
        x, spec = call.x, call.quant
        hidden, tokens, dtype = x.shape[-1], call.tokens, x.dtype
        path = Path(call.path)
        world = c10d_world_size(call.group_name)
        why = self.limits.accepts(hidden, dtype, world, tokens, path)
        if why is None and call.weight.dtype not in FLOATS:
            why = f"norm weight dtype {call.weight.dtype} is not one of {FLOATS}"
        if why is None and call.out_dtype not in FLOATS:
            why = f"output dtype {call.out_dtype} is not one of {FLOATS}"
        if why is not None:
            return why, True
        if spec is not None and quant_decline(spec, hidden) is not None:
            spec = None  # the op quantizes the fused y
        s_row, s_group = spec.scale_strides(x.shape) if spec is not None else (0, 0)
        elem = x.element_size()
        per_launch = min(tokens, rows_per_launch(path, hidden, elem, world))
        buf = buffers.get(call.group_name, 8 * elem, x.device,
                          slot_need(path, per_launch, hidden, dtype, world), MAX_INPUT_BYTES)
        if buf is None:
            return "the symmetric buffer would have to grow during graph capture", False
        if isinstance(buf, str):
            return buf, True
        values: dict[str, Any] = dict(
            local_ptr=buf.tensor, peer_ptrs=buf.peer_ptrs, state_ptr=buf.state, rank=buf.rank,
            timeout_ns=self.timeout_ns(call.group_name), slot_elems=buf.slot_elems,
            s_row=s_row, s_group=s_group,
            HIDDEN=hidden, BLOCK=next_pow2(hidden), WORLD=world,
            HAS_RES=call.residual is not None, GEMMA=bool(call.gemma),
            NEG0=buffers.negative_zero_bits(8 * elem), SLOTS=buffers.SLOTS,
            EPS_PTR=isinstance(call.eps, torch.Tensor),
            EMIT_Y=spec is None or call.emit_y, PDL=pdl_enabled(device),
            ROUND_N=bool(call.round_normed), **quant_constexprs(spec))
        launchers: dict[int, Any] = {}
        pieces = []
        for first in range(0, tokens, per_launch):
            rows = min(per_launch, tokens - first)
            if rows not in launchers:
                launchers[rows] = self._launcher(path, rows, device, elem, dict(values))
            pieces.append((first, launchers[rows]))
        return Plan(tuple(pieces), device, call.out_dtype, values["EMIT_Y"], spec, s_row, x), True

    @staticmethod
    def _launcher(path: Path, rows: int, device: int, elem: int, values: dict[str, Any]) -> Any:
        """The launcher of one launch of ``rows`` rows, ``values`` completed with
        what depends on the row count (the grid and its constexprs)."""
        from .launch import Launcher

        hidden = values["HIDDEN"]
        values["n"] = rows
        warps = num_warps(hidden, elem)
        if path is Path.ONE_STAGE:
            from .one_stage import one_stage_kernel as kernel

            split, part, own = one_stage_layout(rows, hidden, elem, sm_count(device),
                                                values["QUANT"], values["GROUP"])
            # What the call leaves to clear shares an int32 with the slot (lamport.load_state).
            assert buffers.state_word(buffers.SLOTS - 1, rows * hidden) < 2 ** 31
            values.update(SPLIT=split, PART=part, OWN=own)
            if own:
                values["BLOCK"] = next_pow2(part)
                warps = num_warps(part, elem)
            grid = rows * split
            warps = one_stage_warps(warps, values["BLOCK"], grid, sm_count(device),
                                    values["QUANT"])
        else:
            from .two_stage import two_stage_kernel as kernel

            values.update(chunk=buffers.ceil_div(rows, values["WORLD"]))
            grid = min(rows, sm_count(device))
        return Launcher(kernel, grid, _PER_CALL, values,
                        dict(num_warps=warps, sanitize_overflow=False, launch_pdl=values["PDL"]))
