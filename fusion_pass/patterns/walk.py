"""The engine that walks a form written as a table of steps, from a node toward its users.

A form is a tuple of :class:`Step` rows.  A step is one thing the value does
next (is squared, averaged, plus epsilon...); its :class:`Op` spellings are the
ways a graph writes it, each a short sequence of ops, each op a user of the value
the walk stands at (or of the op before it in the spelling).  An op names what
its arguments must be: the current value (:data:`CUR`), a node captured earlier
(:class:`Ref`), a constant, or a value read into the walk's captures by a
function (:class:`Cap`).  A new spelling of a step is one more :class:`Op`
sequence in its row; a new step, one more row.

:func:`walk` tries the spellings of each step in table order and backtracks
through the alternatives.  An optional step is taken before it is skipped when
its op is the current value's only user, and skipped first otherwise (a value
that also feeds something else more likely feeds the norm directly; the pass
names the other users if it does not).  When no alternative completes the form,
the walk returns the most specific miss (:func:`.miss.most_specific`): the
reason of the step that got furthest (a spelling's own, among equals, before
its step's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Union

from torch import fx

from .fx_utils import is_call
from .miss import Miss, most_specific


class _Cur:
    def __repr__(self) -> str:
        return "CUR"


CUR = _Cur()
"""An argument that is the value the walk stands at."""


@dataclass(frozen=True)
class Ref:
    """An argument that is the node captured earlier under ``name``."""

    name: str


@dataclass(frozen=True)
class Cap:
    """An argument read into the captures under ``name`` by ``read(arg, walk)``: the
    value to keep, :data:`NO` (not this spelling), or a string (a miss: the form is
    written here, but the pass cannot take it, and that is why)."""

    name: str
    read: Callable[[Any, "Walk"], Any]


class _No:
    def __repr__(self) -> str:
        return "NO"


NO = _No()
"""What a :class:`Cap` reader or a ``where`` predicate returns for "not this spelling"."""

Pattern = Any
"""An argument pattern: :data:`CUR`, a :class:`Ref`, a :class:`Cap`, or a constant."""


@dataclass(frozen=True)
class Op:
    """One op of a spelling: a call of one of ``targets`` whose positional arguments
    match ``args`` (either order of two with ``commutative``), then ``where(node,
    walk)`` (True; :data:`NO` or False: not this spelling; a string: a miss).
    ``name``: the node is captured under it."""

    targets: tuple[Any, ...]
    args: tuple[Pattern, ...]
    commutative: bool = False
    where: Optional[Callable[[fx.Node, "Walk"], Any]] = None
    name: Optional[str] = None
    kwargs: frozenset[str] = frozenset()
    """The keyword arguments the op may carry (what they say, ``where`` reads)."""


Spelling = tuple[Op, ...]


@dataclass(frozen=True)
class Step:
    """One row of a form.

    ``optional``: the form holds without it.  ``repeat``: taken up to that many times
    (the first spelling that holds each time, no backtracking).  ``only_user``: its
    op must be the current value's only user.  ``role``: the value after the step
    is captured under it.  ``miss(walk)``: the miss when no spelling holds (a
    required step), None for a generic one."""

    name: str
    spellings: tuple[Spelling, ...]
    optional: bool = False
    repeat: int = 1
    only_user: bool = False
    role: Optional[str] = None
    miss: Optional[Callable[["Walk"], Optional[Miss]]] = None
    skip_when: Optional[Callable[["Walk"], bool]] = None
    """The step is not taken (nor needed) when this holds (a cast to fp32 of an fp32 value)."""


@dataclass
class Walk:
    """Where a walk stands: the current value, what it captured, the nodes it passed."""

    cur: fx.Node
    caps: dict[str, Any] = field(default_factory=dict)
    nodes: list[fx.Node] = field(default_factory=list)

    def fork(self) -> "Walk":
        return Walk(self.cur, dict(self.caps), list(self.nodes))

    def __getitem__(self, name: str) -> Any:
        return self.caps.get(name)


def _plain_ok(pattern: Pattern, arg: Any, w: Walk) -> bool:
    if pattern is CUR:
        return arg is w.cur
    if isinstance(pattern, Ref):
        return arg is w.caps.get(pattern.name)
    if isinstance(arg, fx.Node) or isinstance(pattern, fx.Node):
        return False
    return type(arg) is not bool and arg == pattern


def _op_holds(op: Op, node: fx.Node, w: Walk) -> Union[Walk, str, None]:
    """The walk after ``node`` as ``op`` (a fork), a miss string, or None."""
    if not is_call(node, *op.targets) or not set(node.kwargs) <= op.kwargs:
        return None
    orders = [tuple(node.args)]
    if op.commutative and len(node.args) == 2:
        orders.append(tuple(reversed(node.args)))
    miss = None
    for args in orders:
        if len(args) < len(op.args):
            continue
        pairs = list(zip(op.args, args))
        if not all(_plain_ok(p, a, w) for p, a in pairs if not isinstance(p, Cap)):
            continue
        f = w.fork()
        for p, a in pairs:
            if isinstance(p, Cap):
                got = p.read(a, f)
                if got is NO or isinstance(got, str):
                    miss = got if isinstance(got, str) else miss
                    break
                f.caps[p.name] = got
        else:
            ok = True if op.where is None else op.where(node, f)
            if isinstance(ok, str):
                miss = ok
            elif ok is not NO and ok is not False:
                if op.name is not None:
                    f.caps[op.name] = node
                f.nodes.append(node)
                f.cur = node
                return f
    return miss


def _spelled(spelling: Spelling, w: Walk, only_user: bool) -> Iterator[Union[Walk, Miss]]:
    """Every way ``spelling`` holds from ``w.cur`` (or the miss where it stops being it)."""
    if not spelling:
        yield w
        return
    op, rest = spelling[0], spelling[1:]
    users = list(w.cur.users)
    if only_user and len(users) != 1:
        return
    for u in users:
        got = _op_holds(op, u, w)
        if isinstance(got, str):
            yield Miss(got, u)
        elif got is not None:
            yield from _spelled(rest, got, False)


def taken(step: Step, w: Walk) -> list[Union[Walk, Miss]]:
    """Every way ``step`` is taken once from ``w`` (forks), and the misses of the
    spellings that stopped partway."""
    out: list[Union[Walk, Miss]] = []
    for spelling in step.spellings:
        for got in _spelled(spelling, w, step.only_user):
            if isinstance(got, Walk) and step.role is not None:
                got.caps[step.role] = got.cur
            out.append(got)
    return out


def walk(form: tuple[Step, ...], w: Walk) -> Union[Walk, Miss, None]:
    """``form`` from ``w``: the walk at its end, or the most specific miss (None: no
    step had anything to say)."""
    return _walk(form, 0, w)


def _walk(form: tuple[Step, ...], i: int, w: Walk) -> Union[Walk, Miss, None]:
    if i == len(form):
        return w
    step = form[i]
    if step.skip_when is not None and step.skip_when(w):
        return _walk(form, i + 1, w)
    if step.repeat > 1:
        for _ in range(step.repeat):
            took = next((t for t in taken(step, w) if isinstance(t, Walk)), None)
            if took is None:
                break
            w = took
        return _walk(form, i + 1, w)
    found = taken(step, w)
    walks = [t for t in found if isinstance(t, Walk)]
    misses: list[Optional[Miss]] = [t for t in found if not isinstance(t, Walk)]
    if step.optional:
        alone = len(w.cur.users) == 1
        tries = walks + [w] if alone else [w] + walks
    else:
        tries = walks
        if not walks and step.miss is not None:
            misses.append(step.miss(w))
    for t in tries:
        got = _walk(form, i + 1, t)
        if isinstance(got, Walk):
            return got
        misses.append(got)
    return most_specific(misses)
