"""CUDA backend: fused all-reduce + residual + RMSNorm (+ FP8) in Triton on torch symmetric memory.

The package by job: the backend class (``backend.py``) makes a launch plan per
call shape (``plan.py``) from the launch geometry (``geometry.py``), what the
call's spec asks of the kernels (``call_args.py``: their constexprs, the plan's
key) and what it reads of its environment (``environment.py``: PDL, the wait
bound, the SM count); the kernels (``one_stage.py``, ``two_stage.py``) share the mailbox
protocol (``lamport.py``) and the norm and FP8 epilogue (``norm.py``) on
symmetric buffers (``buffers.py``), launched through ``launch.py``.  Which
rows the kernels take is stated in ``limits.py``, which the gate reads.

Importing this package needs torch alone; Triton is imported on the first
launch.  The names below are re-exported so that ``triton_symm.X`` keeps
working for every public name of the modules.
"""

from __future__ import annotations

from . import buffers  # noqa: F401
from .backend import TritonBackend  # noqa: F401
from .environment import (DEFAULT_TIMEOUT_S, SMBudget, group_timeout_s,  # noqa: F401
                          pdl_enabled, sm_count, timeout_override_s)
from .geometry import (ALIGN_ROWS, MAX_INPUT_BYTES, MAX_SPLIT, ONE_STAGE_MAX_WARPS,  # noqa: F401
                       OWN_MIN_BYTES, OWN_MIN_PARTS, OWN_SPLIT_PROGRAMS, PART_BYTES,
                       SPLIT_PROGRAMS, next_pow2, num_warps, one_stage_layout, one_stage_split,
                       one_stage_warps, owns_columns, part_elems, resident_rows,
                       rows_per_launch, slot_need)
from .limits import LIMITS, MAX_BLOCK  # noqa: F401
from .plan import PER_CALL, Plan  # noqa: F401
from .call_args import (GROUP_QUANTS, QUANT_MODE, constexprs, plan_key,  # noqa: F401
                        quant_constexprs, quant_decline)
