"""The backend class: the fused op's calls to plans and launches.

``TritonBackend.run`` launches the one-stage kernel (``one_stage.py``) or the
two-stage kernel (``two_stage.py``) for the path the gate chose, on Lamport
mailboxes in a symmetric buffer (``buffers.py``, ``lamport.py``); both finish
rows with the same norm and FP8 epilogue (``norm.py``).  No host
synchronisation and no allocation of symmetric memory per call: the outputs are
fresh tensors from the caching allocator, the slot counter lives on the device,
so calls capture into CUDA graphs and replay correctly.

Per call shape a :class:`~.plan.Plan` is made once (world size, buffer, grid
from ``geometry.py``, constexprs, timeout, the compiled kernel's C launcher).

Which rows the kernels take is stated once in :mod:`.limits`, which the gate
reads; whatever a call cannot take makes ``run`` return the reason, and the op
falls back to the reference with one log line.  An FP8 epilogue the kernels
cannot compute (a group size that is not a power of two, e4m3fnuz with qmax
above 240) leaves ``q`` to the op, which quantizes the fused ``y``.

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

from typing import Any, Callable, Optional, Union

import torch

from ... import groups
from ...dtypes import FLOATS
from ...gate import BackendLimits, FusionPath
from ...groups import Group
from ...spec import SCALARS
from ..base import Call, Outputs
from . import buffers, geometry
from .environment import SMBudget, group_timeout_s, pdl_enabled, timeout_override_s
from .limits import LIMITS
from .call_args import constexprs, plan_key, quant_decline
from .plan import PER_CALL, Plan


GROWTH_IN_CAPTURE = "the symmetric buffer would have to grow during graph capture"
"""Why a call is declined while a CUDA graph is captured (for that call alone:
outside capture the buffer grows)."""


class TritonBackend:
    """The Triton backend: :meth:`run` a call, or say why not.

    Three seams, each defaulting to the real thing: ``provider`` gives the
    symmetric buffers (the :mod:`.buffers` module: its ``get(group,
    elem_bits, device, need, max_input_bytes)`` returns a
    :class:`~.buffers.SymmBuffer`, the reason one was refused, or None to
    decline the call; its ``generation`` changes whenever ``get`` may answer
    with another buffer, and plans made before look theirs up again);
    ``group`` maps a group name to the :class:`~fusion_pass.groups.Group`
    registered under it now (:func:`fusion_pass.groups.group`; or
    ``world_size``, a name's size, for groups that never end);
    ``sm_budget`` is what the launch geometry counts on of the device
    (:class:`~.environment.SMBudget`).  :mod:`fusion_pass.selftest.sim_group`
    sets them to run N ranks on one GPU.

    What is kept per group (plans, declines, the wait bound) is kept for its
    :class:`~fusion_pass.groups.Group`, and let go when the group ends.  A plan
    is found by its key, which holds the group's name, with no check of the
    name of its own: the op checks it on every call (``groups.c10d_world_size``
    in its route check) before it calls :meth:`run`, and a group found gone
    there ends at once, its plans with it.  A direct caller that makes a group
    again under a name calls :func:`fusion_pass.groups.group` first.
    """

    name = "triton"

    def __init__(self, limits: BackendLimits = LIMITS, *, provider: Any = None,
                 world_size: Optional[Callable[[str], int]] = None,
                 group: Optional[Callable[[str], Group]] = None,
                 sm_budget: SMBudget = SMBudget(), timeout_s: Optional[float] = None) -> None:
        """``limits``: the committed ones, or others (a benchmark's own measured
        schedules) for this instance alone.  ``timeout_s``: the wait bound,
        else ``FUSION_PASS_TIMEOUT_S``, else the group's own timeout."""
        self.limits = limits
        self.provider = buffers if provider is None else provider
        if group is not None:
            self.group_of = group
        elif world_size is not None:
            self.group_of = _Standing(world_size)
        else:
            self.group_of = groups.group
        self.sm_budget = sm_budget
        self.timeout_s_override = timeout_s if timeout_s is not None else timeout_override_s()
        self._plans: dict[tuple, Union[Plan, str]] = {}
        """Per plan key (:func:`~.call_args.plan_key`): the plan, or why such calls
        are declined."""
        self._owner: dict[tuple, Group] = {}
        """Per plan key: the group its plan was made for."""
        self._kept: dict[Group, set[tuple]] = {}
        """Per group watched: the plan keys made for it."""
        self._timeouts: dict[Group, int] = {}

    def world_size(self, group_name: str) -> int:
        """The size of the group registered under ``group_name``."""
        return self.group_of(group_name).size

    def _watch(self, group: Group) -> None:
        if group not in self._kept:
            self._kept[group] = set()
            group.watch(self._group_ended)

    def _group_ended(self, group: Group) -> None:
        """Let go of everything kept for ``group`` (its plans hold its buffers)."""
        for key in self._kept.pop(group, ()):
            if self._owner.get(key) is group:
                del self._owner[key]
                self._plans.pop(key, None)
        self._timeouts.pop(group, None)

    def held(self, group: Group) -> list[Union[Plan, str]]:
        """The plans and declines kept for ``group``."""
        return [self._plans[k] for k, g in self._owner.items() if g is group and k in self._plans]

    def timeout_ns(self, group: Union[Group, str]) -> int:
        """How long a kernel waits for a peer of ``group`` (or of the group
        registered under a name) before it fails."""
        if type(group) is str:
            group = self.group_of(group)
        ns = self._timeouts.get(group)
        if ns is None:
            s = self.timeout_s_override
            if s is None:
                s = group_timeout_s(group)
            ns = self._timeouts[group] = int(min(s * 1e9, 2 ** 62))
            self._watch(group)
        return ns

    def run(self, call: Call) -> Union[Outputs, str]:
        """The fused kernel's outputs, or why this call is declined."""
        device = call.x.get_device()
        if device < 0 or device != torch._C._cuda_getDevice():
            return "input is not on the current CUDA device"
        return self.run_on(call, device)

    def run_on(self, call: Call, device: int) -> Union[Outputs, str]:
        """:meth:`run` once the device is known (the CPU tests drive the
        interpreter through this with device -1)."""
        plan = self.prepare(call, device)
        if type(plan) is str:
            return plan
        return plan(call)

    def prepare(self, call: Call, device: int) -> Union[Plan, str]:
        """The plan :meth:`run_on` would launch ``call`` with (made on first use
        and kept while its buffer lasts), or why the call is declined."""
        for name in SCALARS:
            v = getattr(call, name)
            if isinstance(v, torch.Tensor) and v.get_device() != device:
                if v.get_device() >= 0:
                    return f"{name} is a tensor on another device"
                setattr(call, name, float(v))  # the op reads CPU scalars itself; direct callers may not
        key = plan_key(call, device)
        plan = self._plans.get(key)
        if plan is None or (type(plan) is Plan and plan.generation != self.provider.generation):
            plan, lasting = self._plan(call, device)
            if lasting:
                self._keep(key, call.group_name, plan)
        return plan

    def _keep(self, key: tuple, group_name: str, plan: Union[Plan, str]) -> None:
        """Keep ``plan`` for calls of ``key``, for as long as the group it was made
        for is the one registered under ``group_name``."""
        try:
            group = self.group_of(group_name)
        except Exception:  # no group under the name: nothing lasts
            return
        if group.ended:
            return
        self._watch(group)
        self._kept[group].add(key)
        self._owner[key] = group
        self._plans[key] = plan

    def _plan(self, call: Call, device: int) -> tuple[Union[Plan, str], bool]:
        """A plan for calls like ``call``, or the reason none can be made (and
        whether that holds for every such call: growth during capture does not)."""
        x, spec = call.x, call.spec.quant
        hidden, tokens, dtype = x.shape[-1], call.tokens, x.dtype
        path = FusionPath(call.path)
        try:
            group = self.group_of(call.group_name)
        except Exception as e:  # a name that names no group now: the op's reference says so
            return f"no process group is registered under {call.group_name!r} ({e!r})", False
        world = group.size
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
        per_launch = min(tokens, geometry.rows_per_launch(path, hidden, elem, world))
        if self.sm_budget.every_launch and path is FusionPath.ONE_STAGE:
            per_launch = min(per_launch, geometry.resident_rows(self.sm_budget.count(device)))
        need = geometry.slot_need(path, per_launch, hidden, dtype, world)
        buf = self.provider.get(group, 8 * elem, x.device, need, geometry.MAX_INPUT_BYTES)
        if buf is None:
            return GROWTH_IN_CAPTURE, False
        if isinstance(buf, str):
            return buf, True
        values: dict[str, Any] = dict(
            local_ptr=buf.tensor, peer_ptrs=buf.peer_ptrs, state_ptr=buf.state, rank=buf.rank,
            timeout_ns=self.timeout_ns(group), slot_elems=buf.slot_elems,
            s_row=s_row, s_group=s_group,
            HIDDEN=hidden, BLOCK=geometry.next_pow2(hidden), WORLD=world,
            NEG0=buffers.negative_zero_bits(8 * elem), SLOTS=buffers.SLOTS,
            PDL=pdl_enabled(device), **constexprs(call, spec))
        launchers: dict[int, Any] = {}
        pieces = []
        for first in range(0, tokens, per_launch):
            rows = min(per_launch, tokens - first)
            if rows not in launchers:
                launchers[rows] = self._launcher(path, rows, device, elem, dict(values))
            pieces.append((first, launchers[rows]))
        return Plan(tuple(pieces), device, call.out_dtype, values["EMIT_Y"], spec, s_row, x,
                    self.provider.generation), True

    def _launcher(self, path: FusionPath, rows: int, device: int, elem: int,
                  values: dict[str, Any]) -> Any:
        """The launcher of one launch of ``rows`` rows, ``values`` completed with
        what depends on the row count (the grid and its constexprs)."""
        from .launch import Launcher

        hidden = values["HIDDEN"]
        sms = self.sm_budget.count(device)
        values["n"] = rows
        warps = geometry.num_warps(hidden, elem)
        if path is FusionPath.ONE_STAGE:
            from .one_stage import one_stage_kernel as kernel

            split, part, own = geometry.one_stage_layout(rows, hidden, elem, sms,
                                                         values["QUANT"], values["GROUP"])
            # What the call leaves to clear shares an int32 with the slot (lamport.load_state).
            assert buffers.state_word(buffers.SLOTS - 1, rows * hidden) < 2 ** 31
            values.update(SPLIT=split, PART=part, OWN=own)
            if own:
                values["BLOCK"] = geometry.next_pow2(part)
                warps = geometry.num_warps(part, elem)
            grid = rows * split
            warps = geometry.one_stage_warps(warps, values["BLOCK"], grid, sms,
                                             values["QUANT"])
        else:
            from .two_stage import two_stage_kernel as kernel

            values.update(chunk=buffers.ceil_div(rows, values["WORLD"]))
            grid = min(rows, sms)
        return Launcher(kernel, grid, PER_CALL, values,
                        dict(num_warps=warps, sanitize_overflow=False, launch_pdl=values["PDL"]))


class _Standing:
    """``group`` for a backend given ``world_size``: one :class:`Group` per name and
    size in the process (every such backend sees the same one), which never ends."""

    made: dict[tuple[str, int], Group] = {}

    def __init__(self, world_size: Callable[[str], int]) -> None:
        self.size_of = world_size

    def __call__(self, group_name: str) -> Group:
        size = self.size_of(group_name)
        made = self.made.get((group_name, size))
        if made is None:
            made = self.made[(group_name, size)] = Group(group_name, size)
        return made
