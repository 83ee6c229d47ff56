"""What a process can see of its machine and GPUs, and which groups get no symmetric memory.

Torch's symmetric memory maps every rank's buffer into every other rank's
address space, so it holds only for ranks on one host, each on a GPU of its
own, every two of whose GPUs can map each other's memory (peer access: NVLink,
or PCIe with P2P).  :func:`group_decline` states those rules, once; the Triton
backend exchanges every rank's :class:`RankFacts` before a group's first
buffer and applies them, so that every rank of a group takes the same branch.
``fusion-pass doctor`` reports :func:`gpus` and :func:`p2p_matrix` of this
machine.

Importing this module needs the standard library alone; torch is imported by
the functions that read the GPUs.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any, Optional, Sequence

BOOT_ID = "/proc/sys/kernel/random/boot_id"
"""The kernel's identity of this boot: the same for every process of the
machine, whatever its container calls the host."""


@dataclass(frozen=True)
class RankFacts:
    """What one rank can see: its host, its GPU and the GPUs that GPU can map."""

    host: str
    """The hostname and the kernel's boot id (where readable): differs between machines."""
    gpu: str
    """The CUDA device's UUID ("" without one)."""
    device: int
    """The local device index (-1 without one)."""
    can_map: tuple[str, ...]
    """The UUIDs of the visible GPUs this rank's GPU can access as peers, its own included."""


@dataclass(frozen=True)
class GpuFacts:
    """One visible CUDA GPU."""

    index: int
    name: str
    uuid: str
    capability: tuple[int, int]
    sms: int
    total_bytes: int


def host_identity() -> str:
    """The hostname, and the kernel's boot id where it can be read: two
    containers of one machine share the boot id, two machines never do."""
    name = socket.gethostname()
    try:
        with open(BOOT_ID) as f:
            boot = f.read().strip()
    except OSError:
        return name
    return f"{name}/{boot}" if boot else name


def _cuda() -> Any:
    """torch.cuda where a CUDA GPU is visible, else None."""
    try:
        import torch
    except ImportError:
        return None
    try:
        return torch.cuda if torch.cuda.is_available() and torch.cuda.device_count() else None
    except Exception:  # a broken driver: no GPU to speak of
        return None


def _uuid(cuda: Any, index: int) -> str:
    return str(cuda.get_device_properties(index).uuid)


def gpus() -> list[GpuFacts]:
    """Every visible CUDA GPU ([] without CUDA)."""
    cuda = _cuda()
    if cuda is None:
        return []
    out = []
    for i in range(cuda.device_count()):
        p = cuda.get_device_properties(i)
        out.append(GpuFacts(index=i, name=p.name, uuid=str(p.uuid),
                            capability=(p.major, p.minor), sms=p.multi_processor_count,
                            total_bytes=p.total_memory))
    return out


def p2p_matrix() -> list[list[bool]]:
    """``[i][j]``: visible GPU ``i`` can map GPU ``j``'s memory (the diagonal is True)."""
    cuda = _cuda()
    if cuda is None:
        return []
    n = cuda.device_count()
    return [[i == j or bool(cuda.can_device_access_peer(i, j))
             for j in range(n)] for i in range(n)]


def local_facts(device: int) -> RankFacts:
    """This rank's facts with its GPU ``device`` (-1: none)."""
    host = host_identity()
    cuda = _cuda()
    if cuda is None or device < 0:
        return RankFacts(host=host, gpu="", device=-1, can_map=())
    mapped = tuple(_uuid(cuda, j) for j in range(cuda.device_count())
                   if j == device or cuda.can_device_access_peer(device, j))
    return RankFacts(host=host, gpu=_uuid(cuda, device), device=device, can_map=mapped)


def group_decline(facts: Sequence[RankFacts]) -> Optional[str]:
    """Why a group whose ranks see ``facts`` (in rank order) gets no symmetric
    memory, or None.  The rules, in the order they are checked:

    - every rank on one host (a group over several machines has no memory all
      of its GPUs can map; such groups want NCCL);
    - every rank with a GPU;
    - no two ranks on one GPU (torch's rendezvous raises for that: "allocations
      from overlapping devices");
    - every two ranks' GPUs can map each other's memory; a GPU that is not
      visible to a rank counts as one it cannot map (the rank cannot check it,
      and torch's peer mapping needs it visible).

    Every rank applies them to the same list, so every rank gets the same answer."""
    hosts: dict[str, int] = {}
    for rank, f in enumerate(facts):
        hosts.setdefault(f.host, rank)
    if len(hosts) > 1:
        (a, first), (b, other) = list(hosts.items())[:2]
        return (f"the group spans {len(hosts)} hosts (rank {first} on {a}, rank {other} on "
                f"{b}): symmetric memory maps the GPUs of one host")
    for rank, f in enumerate(facts):
        if not f.gpu:
            return f"rank {rank} has no CUDA GPU: symmetric memory needs one per rank"
    first_on: dict[str, int] = {}
    for rank, f in enumerate(facts):
        if f.gpu in first_on:
            return (f"ranks {first_on[f.gpu]} and {rank} share one GPU: symmetric memory "
                    "needs a GPU of its own for each rank")
        first_on[f.gpu] = rank
    for i, a in enumerate(facts):
        for j, b in enumerate(facts):
            if i != j and b.gpu not in a.can_map:
                return (f"rank {i}'s GPU {a.gpu} cannot map rank {j}'s GPU {b.gpu} (no peer "
                        f"access between them, or it is not visible to rank {i}): symmetric "
                        "memory needs every two GPUs of the group to map each other")
    return None
