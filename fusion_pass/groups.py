"""Process-group facts looked up by c10d group name."""

from __future__ import annotations


def c10d_world_size(group_name: str) -> int:
    """World size of the c10d group registered under ``group_name``.

    Not cached: names such as ``"0"`` come back after a process group is
    destroyed and another one, of another size, is created.
    """
    from torch.distributed import distributed_c10d

    return distributed_c10d._resolve_process_group(group_name).size()
