"""What the backend reads of its environment: programmatic dependent launch,
the wait bound (the process group's timeout or ``FUSION_PASS_TIMEOUT_S``) and
the SMs a launch may count on (:class:`SMBudget`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

import torch

from ...groups import Group

DEFAULT_TIMEOUT_S = 600.0
"""Wait bound when the group's own timeout cannot be read (NCCL's default)."""


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


def group_timeout_s(group: Union[Group, str]) -> float:
    """The process group's own timeout: its CUDA backend's options (torch 2.11-2.13:
    ``ProcessGroup._get_backend(device).options._timeout``), else c10d's default
    for NCCL, else :data:`DEFAULT_TIMEOUT_S`: a group that cannot be read
    (resolved by name, freed, no CUDA backend) is never an error here."""
    from torch.distributed import distributed_c10d

    try:
        pg = (distributed_c10d._resolve_process_group(group) if isinstance(group, str)
              else group.pg)
        return pg._get_backend(torch.device("cuda")).options._timeout.total_seconds()
    except Exception:  # no such group, or none with a CUDA backend's options
        fallback = getattr(distributed_c10d, "default_pg_nccl_timeout", None)
        return fallback.total_seconds() if fallback is not None else DEFAULT_TIMEOUT_S


_sm_count: dict[int, int] = {}


def sm_count(device: int) -> int:
    if device not in _sm_count:
        _sm_count[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _sm_count[device]


@dataclass(frozen=True)
class SMBudget:
    """The SMs the launch geometry sizes grids for.

    Programs that wait for one another must be resident together, or a
    spinning program keeps the one it waits for off the GPU.  With a GPU per
    rank that concerns the launches whose programs wait for each other (a
    split row's parts, the two-stage kernel's persistent programs): the
    geometry keeps those within :meth:`count` programs.  A one-stage program
    of a whole row waits only for programs on other GPUs, so such a launch may
    have any number of programs.

    ``sms``: None for the device's own count (:func:`sm_count`).
    ``every_launch``: every launch keeps within :meth:`count` programs
    (one-stage calls run in row pieces that fit:
    :func:`.geometry.resident_rows`).  Ranks that share one GPU need this
    (the simulated group of :mod:`fusion_pass.selftest.sim_group`): there every
    program waits for programs of the other ranks' launches on the same GPU.
    """

    sms: Optional[int] = None
    every_launch: bool = False

    def count(self, device: int) -> int:
        return sm_count(device) if self.sms is None else self.sms
