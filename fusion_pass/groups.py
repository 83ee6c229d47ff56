"""Process groups as the fused ops' state knows them: one :class:`Group` per live c10d group.

c10d reuses group names: ``"0"`` names the default group, and after
``destroy_process_group`` the next group made may get a name a destroyed one
had, with another size, other peers, or the same ranks in new communicators
(vLLM's ``cleanup_dist_env_and_memory()`` before the next engine, a notebook's
second ``LLM``).  So whatever is kept for a group (the Triton backend's
symmetric buffers, plans and wait bound) is kept for a :class:`Group`, never
for a name: :func:`group` gives the one that is registered under a name now,
and a group that is gone ends (:meth:`Group.end`), telling whoever watches it
to let go of what it kept for it.

The check runs on every eager call of the op (:func:`c10d_world_size`, from
the op's route check): a weak reference and c10d's name table, a third of the
cost of resolving the name and reading the size (both C calls).  A new group
under an old name is noticed there, on the first call after it was made, and
the old :class:`Group` ends then, before anything of it can be used again.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

_c10d: Any = None


def _import_c10d() -> Any:
    """torch.distributed's c10d module, imported on first use (an import statement
    in the function would cost a third of its call)."""
    global _c10d
    from torch.distributed import distributed_c10d

    _c10d = distributed_c10d
    return _c10d


class Group:
    """One process group under its name, for as long as it is the one registered
    under that name: the key of everything kept for it.

    ``name`` and ``size`` are the group's; ``pg`` the c10d ``ProcessGroup`` (held
    weakly: a destroyed group's communicators must not be kept alive by this),
    or None for a group that is no c10d group (a simulated one).  A group ends
    once (:meth:`end`): when its name is found to name another group, or the
    group is gone, or its owner ends it; then every watcher is told."""

    __slots__ = ("name", "size", "_pg", "_watchers", "ended", "__weakref__")

    def __init__(self, name: str, size: int, pg: Any = None) -> None:
        self.name, self.size = name, size
        self._pg = None if pg is None else weakref.ref(pg)
        self._watchers: list[Any] = []
        self.ended = False

    @property
    def pg(self) -> Any:
        """The c10d ``ProcessGroup``, or None (no c10d group, or it was freed)."""
        return None if self._pg is None else self._pg()

    @property
    def freed(self) -> bool:
        """Whether nothing can use the group any more: its ``ProcessGroup`` was
        freed (for a group that is no c10d group: it ended)."""
        return self.ended if self._pg is None else self._pg() is None

    def watch(self, fn: Callable[["Group"], None]) -> None:
        """Call ``fn(self)`` when the group ends (at once if it has).  A bound
        method is held weakly: watching does not keep its object alive."""
        if self.ended:
            fn(self)
            return
        ref: Any = weakref.WeakMethod(fn) if hasattr(fn, "__self__") else (lambda: fn)
        self._watchers.append(ref)

    def end(self) -> None:
        """The group is no longer the one its name names: tell every watcher, once."""
        if self.ended:
            return
        self.ended = True
        watchers, self._watchers = self._watchers, []
        for ref in watchers:
            fn = ref()
            if fn is not None:
                fn(self)

    def __repr__(self) -> str:
        state = "ended" if self.ended else "live"
        return f"Group({self.name!r}, size={self.size}, {state})"


_live: dict[str, tuple[Any, int, Group]] = {}
"""Per group name: the :class:`Group` last found registered under it, with its
``ProcessGroup``'s weak reference and its size (a tuple: read faster than the
group's attributes, on every eager call)."""


def group(group_name: str) -> Group:
    """The :class:`Group` registered under ``group_name`` now.

    The one found last is kept while the very ``ProcessGroup`` it was made for is
    still registered under the name (``destroy_process_group`` takes it out of
    c10d's name table); else it ends and the name is resolved again (raising as
    c10d does for a name that names no group)."""
    c10d = _c10d or _import_c10d()
    known = _live.get(group_name)
    if known is not None:
        pg = known[0]()
        if pg is not None and c10d._world.pg_names.get(pg) == group_name:
            return known[2]
    return _resolve(group_name, known)


def c10d_world_size(group_name: str) -> int:
    """World size of the c10d group registered under ``group_name``: :func:`group`'s
    check, inlined (this runs on every eager call of the op: a call of
    :func:`group` would add a fifth to it)."""
    c10d = _c10d or _import_c10d()
    known = _live.get(group_name)
    if known is not None:
        pg = known[0]()
        if pg is not None and c10d._world.pg_names.get(pg) == group_name:
            return known[1]
    return _resolve(group_name, known).size


def _resolve(group_name: str, known: Optional[tuple[Any, int, Group]]) -> Group:
    """The name resolved anew; the group known under it before ends unless it is
    the same ``ProcessGroup`` (registered with c10d but absent from its Python
    name table: never seen in practice, and resolved on every call)."""
    c10d = _c10d or _import_c10d()
    before = None if known is None else known[2]
    try:
        pg = c10d._resolve_process_group(group_name)
    except BaseException:
        if before is not None:
            _live.pop(group_name, None)
            before.end()
        raise
    if before is not None:
        if before.pg is pg:
            return before
        before.end()
    made = Group(group_name, pg.size(), pg)
    _live[group_name] = (made._pg, made.size, made)
    return made


def known(group_name: str) -> Optional[Group]:
    """The :class:`Group` last found under ``group_name`` (unchecked), or None."""
    found = _live.get(group_name)
    return None if found is None else found[2]
