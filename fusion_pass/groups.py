"""Process-group facts looked up by c10d group name."""

from __future__ import annotations

import weakref
from typing import Any

_c10d: Any = None


def _import_c10d() -> Any:
    """torch.distributed's c10d module, imported on first use (an import statement
    in the function would cost a third of its call)."""
    global _c10d
    from torch.distributed import distributed_c10d

    _c10d = distributed_c10d
    return _c10d


_sizes: dict[str, tuple[Any, int]] = {}
"""Per group name: a weak reference to the group last resolved under it, and its size."""


def c10d_world_size(group_name: str) -> int:
    """World size of the c10d group registered under ``group_name``.

    Names such as ``"0"`` come back after a process group is destroyed and
    another one, of another size, is created, so a size is reused only while
    the very group it was read from is still registered under that name
    (``destroy_process_group`` takes it out of c10d's name table); else the
    name is resolved again.  This runs on every eager call of the op: the check
    costs a third of resolving the name and reading the size (both C calls).
    """
    c10d = _c10d or _import_c10d()
    known = _sizes.get(group_name)
    if known is not None:
        pg = known[0]()
        if pg is not None and c10d._world.pg_names.get(pg) == group_name:
            return known[1]
    pg = c10d._resolve_process_group(group_name)
    size = pg.size()
    # Weak: a destroyed group's communicators must not be kept alive by this table.
    # A group registered with c10d but absent from its Python name table (never
    # seen in practice) fails the check above and is resolved on every call.
    _sizes[group_name] = (weakref.ref(pg), size)
    return size
