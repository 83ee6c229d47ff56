"""A registry of pattern functions, tried in an order stated where each is registered.

Every registry of :mod:`fusion_pass.patterns` (site finders, norm matchers, quant
matchers, fused-elsewhere finders) is one of these: a function registers under
a name with a ``priority``, and the registry yields them in ascending priority,
then by name, whatever order the modules were imported in.  Registering a name
again replaces it.
"""

from __future__ import annotations

import contextlib
from typing import Generic, Iterator, TypeVar

F = TypeVar("F")


class Registry(Generic[F]):
    def __init__(self) -> None:
        self._entries: dict[str, tuple[int, F]] = {}
        self._order: list[F] = []

    def register(self, name: str, fn: F, priority: int) -> None:
        self._entries[name] = (priority, fn)
        self._rank()

    def _rank(self) -> None:
        ranked = sorted(self._entries.items(), key=lambda kv: (kv[1][0], kv[0]))
        self._order = [fn for _, (_, fn) in ranked]

    @contextlib.contextmanager
    def suspended(self, *names: str) -> Iterator[None]:
        """Inside the block, the registry without ``names`` (every one when none is
        named): for tests that compare what the other forms do."""
        kept = dict(self._entries)
        for name in names or list(self._entries):
            self._entries.pop(name, None)
        self._rank()
        try:
            yield
        finally:
            self._entries = kept
            self._rank()

    def __iter__(self) -> Iterator[F]:
        return iter(self._order)
