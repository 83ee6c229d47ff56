"""The dispatch gate: which path a fused all-reduce + RMSNorm call takes.

Pure Python on purpose: it runs at compile time inside the pass, at run time
inside the op (for the ``runtime`` path), and in notebooks, and it must be
testable exhaustively without torch.  Dtypes are named by string
(``"bfloat16"``, ``"float16"``, ``"float32"``); :func:`dtype_name` maps a torch
dtype to that name.

What a backend can run is stated once, by the backend, in a
:class:`BackendLimits` (a subclass where its kernels have rules of their own):
:meth:`BackendLimits.supports` says whether a kernel path takes a row at all,
:meth:`BackendLimits.accepts` whether it takes one exact call.  The gate builds
its answer from those and from the backend's token schedule (a measured one,
else one-stage up to 80 tokens and two-stage above, or a threshold the caller
forces), so that every kernel path it answers is one the backend accepts when
the op asks it again at run time.

Every token count maps to one path; a compile-time token range gets that path
when the whole range agrees and ``runtime`` (decided per call) when it does not.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Sequence, Union

PACK_BYTES = 16
"""Every kernel moves a row in 16-byte vectors: a row must be a whole number of them."""
BLOCK_ROW_BYTES = 1024 * PACK_BYTES
"""The widest row one block of 1024 threads holds at a 16-byte vector each: the
default one-stage limit (a one-stage kernel gives each row one block)."""
DEFAULT_TOKEN_THRESHOLD = 80

ELEMENT_SIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
"""The activation dtypes the fused op takes, by name, and their element sizes."""


def tokens_of(shape: Sequence[Any]) -> Any:
    """Tokens of an activation of ``shape``: every dimension but the last (hidden),
    none where hidden is 0.  Symbolic sizes (a graph's) give a symbolic count."""
    n = 1
    for d in shape[:-1]:
        n *= d
    return 0 if not len(shape) or (type(shape[-1]) is int and shape[-1] == 0) else n


class FusionPath(str, enum.Enum):
    """Which kernel runs a fused call: ``runtime`` is decided per call, ``unfused``
    runs the all-reduce and the norm as they were."""

    ONE_STAGE = "one_stage"
    TWO_STAGE = "two_stage"
    RUNTIME = "runtime"
    UNFUSED = "unfused"

    def __str__(self) -> str:
        return self.value


Path = FusionPath
"""The name :class:`FusionPath` had before it stopped shadowing :class:`pathlib.Path`."""


@dataclass(frozen=True)
class TokenRange:
    """What is known at compile time about the token count: ``start <= n <= end``.

    ``end=None`` means unbounded above.
    """

    start: int = 1
    end: Optional[int] = None

    def __post_init__(self) -> None:
        if self.start < 0 or (self.end is not None and self.end < self.start):
            raise ValueError(f"invalid token range [{self.start}, {self.end}]")

    def __str__(self) -> str:
        return f"[{self.start}, {'inf' if self.end is None else self.end}]"


Tokens = Union[int, TokenRange, None]

MULTIPLIER = "multiplier"
"""The feature of a call that scales the reduced value by a scalar before the residual
add (:meth:`fusion_pass.spec.NormSpec.features`, :attr:`BackendLimits.lacks`)."""

Steps = tuple[tuple[Optional[int], FusionPath], ...]
"""A token schedule: ``((up_to, path), ...)`` ascending, each step covering the
counts above the previous ``up_to`` and at most its own; the last ``up_to`` is None."""


def threshold_steps(threshold: int) -> Steps:
    """One-stage up to ``threshold`` tokens, two-stage above: AITER's rule."""
    return ((threshold, FusionPath.ONE_STAGE), (None, FusionPath.TWO_STAGE))


@dataclass(frozen=True)
class Schedule:
    """A measured token schedule for one (dtype, world size, hidden)."""

    dtype: str
    world_size: int
    hidden: int
    steps: Steps

    def __post_init__(self) -> None:
        ups = [u for u, _ in self.steps]
        if not ups or ups[-1] is not None or any(u is None for u in ups[:-1]) \
                or ups[:-1] != sorted(set(ups[:-1])):
            raise ValueError(f"schedule steps must ascend and end unbounded: {self.steps}")
        if any(p not in (FusionPath.ONE_STAGE, FusionPath.TWO_STAGE) for _, p in self.steps):
            raise ValueError(f"schedule steps name kernel paths only: {self.steps}")


@dataclass(frozen=True, eq=False)
class BackendLimits:
    """What a backend's kernels can run, stated by the backend itself.

    The gate decides from it at compile time and the op (and the backend)
    checks each call against it at run time, so both read the same rules.  A
    backend whose kernels have rules of their own subclasses it and overrides
    :meth:`row_reason` and :meth:`count_reason`; the fields here are what every
    backend states.

    ``max_bytes``: largest input (tokens * hidden * element size) the fused
    kernels take at all; above it the call must run unfused.
    ``one_stage_max_bytes``: per world size, the largest input for which the
    one-stage kernel is chosen (a preference between two paths that both run).
    ``one_stage_max_tokens``: a hard token limit of the one-stage kernel, or None.
    ``one_stage_row_bytes``: the widest row the one-stage kernel holds (default:
    one block of 1024 threads at a 16-byte vector each); None: no such limit.
    ``schedules``: measured token schedules; the nearest one (same dtype and
    world size, nearest row size) replaces the 80-token threshold.
    ``off``: kernel paths the backend never takes, with why (a release whose
    kernel has a known corruption bug, say).
    ``lacks``: what a call may ask beyond a plain fused norm that the backend's
    kernels cannot compute, with why (:meth:`fusion_pass.spec.NormSpec.features`:
    a scalar multiplier, say); a site that asks for one is left unfused.
    """

    name: str = "any"
    world_sizes: frozenset[int] = frozenset({2, 4, 8})
    dtypes: frozenset[str] = frozenset(ELEMENT_SIZE)
    max_bytes: Optional[int] = None
    one_stage_max_bytes: dict[int, Optional[int]] = field(default_factory=dict)
    one_stage_max_tokens: Optional[int] = None
    one_stage_row_bytes: Optional[int] = BLOCK_ROW_BYTES
    schedules: tuple[Schedule, ...] = ()
    off: tuple[tuple[FusionPath, str], ...] = ()
    lacks: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        # Hashed on every per-call decision (the gate's cache): once is enough.
        object.__setattr__(self, "_key", self._make_key())
        object.__setattr__(self, "_hash", hash(self._key))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]

    def __eq__(self, other: object) -> bool:
        return (type(other) is type(self)
                and other._key == self._key)  # type: ignore[attr-defined]

    def _make_key(self) -> tuple[Any, ...]:
        def norm(v: Any) -> Any:
            if isinstance(v, frozenset):
                return tuple(sorted(v))
            if isinstance(v, dict):
                return tuple(sorted(v.items()))
            return v

        return (type(self).__name__,) + tuple(norm(getattr(self, f.name)) for f in fields(self))

    def key(self) -> tuple[Any, ...]:
        """Stable description for cache keys (``uuid()``)."""
        return self._key  # type: ignore[attr-defined]

    def lacking(self, features: frozenset[str]) -> Optional[str]:
        """Why the backend cannot compute a call that asks for ``features``, or None."""
        return next((f"backend {self.name} {why}" for f, why in self.lacks if f in features),
                    None)

    def off_reason(self, path: FusionPath) -> Optional[str]:
        """Why the backend never takes ``path``, or None when it may."""
        return next((why for p, why in self.off if p is path), None)

    def steps_for(self, hidden: int, dtype: str, world_size: int) -> Optional[Steps]:
        """The measured schedule nearest to this row (same dtype and world size,
        nearest hidden size), or None when the backend has none for them."""
        same = [s for s in self.schedules if s.dtype == dtype and s.world_size == world_size]
        if not same:
            return None
        return min(same, key=lambda s: (abs(s.hidden - hidden), s.hidden)).steps

    # -- the rules: a backend with kernels of its own overrides these two -------

    def row_reason(self, hidden: int, dt: str, path: FusionPath) -> Optional[str]:
        """Why ``path``'s kernel cannot hold a row of ``hidden`` elements of ``dt``
        (a row of whole 16-byte vectors, on a world size and dtype the backend
        takes), or None."""
        if (path is FusionPath.ONE_STAGE and self.one_stage_row_bytes is not None
                and hidden * ELEMENT_SIZE[dt] > self.one_stage_row_bytes):
            return (f"hidden {hidden} does not fit one block ({pack_size(dt)}-element packs, "
                    f"<= {self.one_stage_row_bytes // PACK_BYTES} per row)")
        return None

    def count_reason(self, hidden: int, dt: str, world_size: int, lo: int, hi: Optional[int],
                     path: FusionPath) -> Optional[str]:
        """Why some token count in ``lo..hi`` (``hi`` None: unbounded) cannot take
        ``path`` beyond the byte and token limits above, or None."""
        return None

    # -- what the gate and the op ask ------------------------------------------

    def supports(self, hidden: int, dtype: Any, world_size: int, path: FusionPath) -> Optional[str]:
        """Why ``path`` cannot take this row at any token count, or None."""
        return _supports(self, hidden, dtype_name(dtype), world_size, FusionPath(path))

    def accepts(self, hidden: int, dtype: Any, world_size: int, tokens: int,
                path: FusionPath) -> Optional[str]:
        """Why ``path`` cannot run exactly ``tokens x hidden``, or None: the run-time
        check of every call, and true of every kernel path :func:`decide` answers."""
        return _accepts(self, hidden, dtype_name(dtype), world_size, tokens, FusionPath(path))


UNLIMITED = BackendLimits()


@dataclass(frozen=True)
class Decision:
    path: FusionPath
    reason: str

    @property
    def fused(self) -> bool:
        return self.path is not FusionPath.UNFUSED


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; strings pass through."""
    return str(dtype).removeprefix("torch.")


def pack_size(dtype: str) -> int:
    return PACK_BYTES // ELEMENT_SIZE[dtype]


def whole_packs(hidden: int, dt: str) -> bool:
    """Whether a row of ``hidden`` x ``dt`` is a whole, positive number of 16-byte packs."""
    return hidden > 0 and (hidden * ELEMENT_SIZE[dt]) % PACK_BYTES == 0


def one_stage_fits(hidden: int, dtype: str, limits: Optional[BackendLimits] = None) -> bool:
    """Whether the backend's one-stage kernel holds a row of ``hidden`` x ``dtype``
    (the kernel rules alone by default)."""
    lim = limits if limits is not None else UNLIMITED
    return whole_packs(hidden, dtype) and lim.row_reason(hidden, dtype, FusionPath.ONE_STAGE) is None


def dtype_reason(dtype: Any, limits: BackendLimits) -> Optional[str]:
    """Why no fused path of a backend with these limits takes activations of ``dtype``, or None."""
    dt = dtype_name(dtype)
    if dt not in ELEMENT_SIZE:
        return f"dtype {dt} is not one of bf16/fp16/fp32"
    if dt not in limits.dtypes:
        return f"backend {limits.name} does not take {dt}"
    return None


_LABEL = {FusionPath.ONE_STAGE: "one-stage", FusionPath.TWO_STAGE: "two-stage"}


def _row_static(hidden: int, dt: str, world_size: int, limits: BackendLimits) -> Optional[str]:
    """Why no path of any backend of these limits can take the row, or None."""
    why = dtype_reason(dt, limits)
    if why is not None:
        return why
    if world_size < 2:
        return f"world size {world_size}: nothing to reduce"
    if world_size not in limits.world_sizes:
        return (f"backend {limits.name} supports world sizes {sorted(limits.world_sizes)}, "
                f"not world size {world_size}")
    if hidden <= 0:
        return f"hidden size {hidden} is not positive"
    if not whole_packs(hidden, dt):
        return f"row of {hidden} x {dt} is not a whole number of 16-byte packs"
    return None


def _kernel_row(limits: BackendLimits, hidden: int, dt: str, world_size: int,
                path: FusionPath) -> Optional[str]:
    """Why ``path`` is no kernel path or the row no row of these limits, or None."""
    if path not in _LABEL:
        return f"path {path.value} is not a kernel path"
    return _row_static(hidden, dt, world_size, limits)


@functools.lru_cache(maxsize=4096)
def _supports(limits: BackendLimits, hidden: int, dt: str, world_size: int,
              path: FusionPath) -> Optional[str]:
    why = _kernel_row(limits, hidden, dt, world_size, path)
    if why is not None:
        return why
    off = limits.off_reason(path)
    if off is not None:
        return f"{_LABEL[path]} is off: {off}"
    return limits.row_reason(hidden, dt, path)


@functools.lru_cache(maxsize=4096)
def _accepts(limits: BackendLimits, hidden: int, dt: str, world_size: int, tokens: int,
             path: FusionPath) -> Optional[str]:
    # The generic rules first, then the counts, then the backend's own row rules.
    why = _kernel_row(limits, hidden, dt, world_size, path)
    if why is not None:
        return why
    if tokens < 1:
        return "0 tokens: empty outputs, nothing to launch"
    row_bytes = hidden * ELEMENT_SIZE[dt]
    if limits.max_bytes is not None and tokens * row_bytes > limits.max_bytes:
        return _over_bytes(limits, row_bytes)
    why = _supports(limits, hidden, dt, world_size, path)
    if why is not None:
        return why
    cap = limits.one_stage_max_tokens
    if path is FusionPath.ONE_STAGE and cap is not None and tokens > cap:
        return _over_cap(cap)
    return limits.count_reason(hidden, dt, world_size, tokens, tokens, path)


def _over_bytes(limits: BackendLimits, row_bytes: int) -> str:
    assert limits.max_bytes is not None
    return (f"above the backend's {limits.max_bytes} byte limit "
            f"({limits.max_bytes // row_bytes} tokens)")


def _over_cap(cap: int) -> str:
    return f"the backend's one-stage kernel takes at most {cap} tokens"


def _token_bounds(tokens: Tokens) -> tuple[int, Optional[int]]:
    if tokens is None:
        return 1, None
    if isinstance(tokens, TokenRange):
        return tokens.start, tokens.end
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise TypeError(f"tokens must be an int, a TokenRange or None, not {tokens!r}")
    return tokens, tokens


@dataclass(frozen=True)
class Segment:
    """Token counts ``lo..hi`` (``hi`` None: unbounded) and the path they take."""

    lo: int
    hi: Optional[int]
    path: FusionPath
    why: str


def decide(
    hidden: int,
    dtype: Any,
    world_size: int,
    tokens: Tokens = None,
    *,
    limits: BackendLimits = UNLIMITED,
    threshold: Optional[int] = None,
    group_size: Optional[int] = None,
    features: frozenset[str] = frozenset(),
) -> Decision:
    """Choose the path for an all-reduce + RMSNorm of ``tokens x hidden``.

    ``tokens`` is a concrete count, a :class:`TokenRange`, or None (unknown).
    ``threshold`` forces one-stage up to that many tokens; None takes the
    backend's measured schedule, else 80.  ``group_size``: a per-group
    quantization epilogue's group (the row must split into whole groups).
    ``features``: what the call asks beyond a plain fused norm
    (:meth:`BackendLimits.lacking`).  Returns ``runtime`` only when the known
    range holds counts that take different paths, so that the choice has to be
    made per call.
    """
    lo, hi = _token_bounds(tokens)
    lacking = limits.lacking(features)
    if lacking is not None:
        return Decision(FusionPath.UNFUSED, lacking)
    return _decide(hidden, dtype_name(dtype), world_size, lo, hi, limits, threshold, group_size)


@functools.lru_cache(maxsize=4096)
def _decide(hidden: int, dt: str, world_size: int, lo: int, hi: Optional[int],
            limits: BackendLimits, threshold: Optional[int],
            group_size: Optional[int]) -> Decision:
    why = _static_reason(hidden, dt, world_size, limits, group_size)
    if why is not None:
        return Decision(FusionPath.UNFUSED, why)
    if hi == 0:
        return Decision(FusionPath.UNFUSED, "0 tokens: empty outputs, nothing to launch")
    # An empty batch takes no path at all (the op returns empty outputs without a
    # launch), so it never makes a range straddle.
    lo = max(lo, 1)
    segs = [s for s in segments(hidden, dt, world_size, limits=limits, threshold=threshold)
            if s.lo <= (hi if hi is not None else s.lo) and (s.hi is None or s.hi >= lo)]
    span = _fmt(lo, hi)
    if len({s.path for s in segs}) == 1:
        seg = segs[0]
        split = (None if seg.path is FusionPath.UNFUSED else
                 limits.count_reason(hidden, dt, world_size, lo, hi, seg.path))
        if split is None:
            return Decision(seg.path, f"tokens {span}: {seg.why}")
        if lo == hi:
            return Decision(FusionPath.UNFUSED, f"tokens {span}: {split}")
        return Decision(FusionPath.RUNTIME, f"tokens {span}: {seg.path} for the counts the backend "
                        f"takes, unfused for the others ({split}): decided per call")
    parts = [f"{_fmt(max(s.lo, lo), s.hi if hi is None or (s.hi is not None and s.hi < hi) else hi)}"
             f" {s.path}" for s in segs]
    return Decision(FusionPath.RUNTIME, f"tokens {span} span " + ", ".join(parts)
                    + ": decided per call")


def _static_reason(hidden: int, dt: str, world_size: int, limits: BackendLimits,
                   group_size: Optional[int]) -> Optional[str]:
    """Why no token count of this row can fuse, or None."""
    why = _row_static(hidden, dt, world_size, limits)
    if why is not None:
        return why
    if group_size is not None and (group_size <= 0 or hidden % group_size):
        return f"hidden {hidden} is not a whole number of {group_size}-element quant groups"
    one_off, two_off = limits.off_reason(FusionPath.ONE_STAGE), limits.off_reason(FusionPath.TWO_STAGE)
    if one_off is not None and two_off is not None:
        return f"backend {limits.name} takes no kernel path: {one_off}" + (
            f"; {two_off}" if two_off != one_off else "")
    one = limits.supports(hidden, dt, world_size, FusionPath.ONE_STAGE)
    two = limits.supports(hidden, dt, world_size, FusionPath.TWO_STAGE)
    if one is not None and two is not None:
        return f"no kernel path: {one}" + (f"; {two}" if two != one else "")
    return None


def segments(hidden: int, dtype: Any, world_size: int, *, limits: BackendLimits = UNLIMITED,
             threshold: Optional[int] = None) -> list[Segment]:
    """Every token count from 1 up, cut into runs that take one path each.

    Assumes the row can fuse at all (:func:`decide` checks that first).
    """
    dt = dtype_name(dtype)
    row_bytes = hidden * ELEMENT_SIZE[dt]
    if threshold is not None:
        steps, source = threshold_steps(threshold), f"threshold {threshold}"
    else:
        measured = limits.steps_for(hidden, dt, world_size)
        steps, source = ((measured, f"backend {limits.name}'s measured schedule")
                         if measured is not None else
                         (threshold_steps(DEFAULT_TOKEN_THRESHOLD),
                          f"threshold {DEFAULT_TOKEN_THRESHOLD}"))
    no_one = limits.supports(hidden, dt, world_size, FusionPath.ONE_STAGE)
    no_two = limits.supports(hidden, dt, world_size, FusionPath.TWO_STAGE)
    hard_cap = limits.one_stage_max_tokens
    byte_cap = limits.one_stage_max_bytes.get(world_size)
    pref_cap = None if byte_cap is None else (byte_cap - 1) // row_bytes
    max_tokens = None if limits.max_bytes is None else limits.max_bytes // row_bytes

    def path_at(n: int) -> tuple[FusionPath, str]:
        if max_tokens is not None and n > max_tokens:
            return FusionPath.UNFUSED, _over_bytes(limits, row_bytes)
        pref = next(p for up, p in steps if up is None or n <= up)
        hard_ok = no_one is None and (hard_cap is None or n <= hard_cap)
        if pref is FusionPath.ONE_STAGE and hard_ok and (pref_cap is None or n <= pref_cap):
            return FusionPath.ONE_STAGE, f"one-stage by {source}, hidden {hidden} fits one block"
        if no_two is None:
            if no_one is not None:
                why = no_one
            elif pref is FusionPath.TWO_STAGE:
                why = f"two-stage by {source}"
            elif not hard_ok:
                assert hard_cap is not None
                why = _over_cap(hard_cap)
            else:
                why = f"one-stage is chosen below {byte_cap} bytes at world size {world_size}"
            return FusionPath.TWO_STAGE, why
        if hard_ok:
            return FusionPath.ONE_STAGE, f"one-stage, the only path: {no_two}"
        return FusionPath.UNFUSED, (f"above the one-stage kernel's {hard_cap} tokens, and {no_two}")

    cuts = sorted({up for up, _ in steps if up is not None}
                  | {c for c in (hard_cap, pref_cap, max_tokens) if c is not None and c >= 1})
    out: list[Segment] = []
    lo = 1
    for hi in cuts + [None]:
        if hi is not None and hi < lo:
            continue
        path, why = path_at(lo)
        if out and out[-1].path is path and out[-1].why == why:
            out[-1] = Segment(out[-1].lo, hi, path, why)
        else:
            out.append(Segment(lo, hi, path, why))
        if hi is None:
            break
        lo = hi + 1
    return out


def breakpoints(hidden: int, dtype: Any, world_size: int, *,
                limits: BackendLimits = UNLIMITED, threshold: Optional[int] = None) -> list[int]:
    """The token counts after which the path changes: where a compiler that
    splits by token ranges (vLLM's compile ranges) should cut."""
    segs = segments(hidden, dtype, world_size, limits=limits, threshold=threshold)
    return [a.hi for a, b in zip(segs, segs[1:]) if a.path is not b.path and a.hi is not None]


def _fmt(lo: int, hi: Optional[int]) -> str:
    if lo == hi:
        return str(lo)
    return f"[{lo}, {'inf' if hi is None else hi}]"
