"""The dispatch gate: which path a fused all-reduce + RMSNorm call takes.

Pure Python on purpose: it runs at compile time inside the pass, at run time
inside the op (for the ``runtime`` path), and in notebooks, and it must be
testable exhaustively without torch.  Dtypes are named by string
(``"bfloat16"``, ``"float16"``, ``"float32"``); :func:`dtype_name` maps a torch
dtype to that name.

The rules (see ``shared/reference/aiter-facts.md``):

* pack rule: a thread owns one 16-byte pack, and one block must cover a row,
  so one-stage needs ``hidden % pack == 0 and hidden // pack <= 1024``;
* token rule: a schedule of token counts to paths.  AITER's is fixed (one-stage
  up to 80 tokens, two-stage above); a backend may carry measured schedules per
  (dtype, world size, hidden) instead (the Triton backend's come from
  ``benchmarks/bench_op.py``), and a caller may force a plain threshold;
* per-backend world sizes, dtypes, byte limits, the one-stage kernel's hard
  token cap, the two-stage kernel's row range and its exact-split rule.

Every token count maps to one path; a compile-time token range gets that path
when the whole range agrees and ``runtime`` (decided per call) when it does not.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import Any, Optional, Union

PACK_BYTES = 16
MAX_PACKS_PER_ROW = 1024
DEFAULT_TOKEN_THRESHOLD = 80

ELEMENT_SIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


class Path(str, enum.Enum):
    ONE_STAGE = "one_stage"
    TWO_STAGE = "two_stage"
    RUNTIME = "runtime"
    UNFUSED = "unfused"

    def __str__(self) -> str:
        return self.value


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

    @property
    def is_single(self) -> bool:
        return self.end == self.start

    def __str__(self) -> str:
        return f"[{self.start}, {'inf' if self.end is None else self.end}]"


Tokens = Union[int, TokenRange, None]

Steps = tuple[tuple[Optional[int], Path], ...]
"""A token schedule: ``((up_to, path), ...)`` ascending, each step covering the
counts above the previous ``up_to`` and at most its own; the last ``up_to`` is None."""


def threshold_steps(threshold: int) -> Steps:
    """One-stage up to ``threshold`` tokens, two-stage above: AITER's rule."""
    return ((threshold, Path.ONE_STAGE), (None, Path.TWO_STAGE))


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
        if any(p not in (Path.ONE_STAGE, Path.TWO_STAGE) for _, p in self.steps):
            raise ValueError(f"schedule steps name kernel paths only: {self.steps}")


@dataclass(frozen=True)
class BackendLimits:
    """What a backend's kernels can take.

    ``max_bytes``: largest input (tokens * hidden * element size) the fused
    kernels take at all; above it the call must run unfused.
    ``one_stage_max_bytes``: per world size, the largest input for which the
    one-stage kernel is chosen (a performance limit, as in vLLM's caller gate).
    ``one_stage_max_tokens``: a hard limit of the one-stage kernel (old AITER
    threw above 80 tokens), or None.
    ``hidden_sizes``: when set, the only hidden sizes that may fuse at all.
    ``two_stage_packs``: when set, the ``(min, max)`` 16-byte packs per row the
    two-stage kernel takes (AITER: 64..2048).
    ``two_stage_exact_split``: the two-stage kernel splits ``tokens * packs``
    evenly over the ranks and drops a remainder (AITER), so counts that do not
    divide must run another way.
    ``schedules``: measured token schedules; the nearest one (same dtype and
    world size, nearest row size) replaces the 80-token threshold.
    ``off``: kernel paths the backend never takes, with why (a release whose
    kernel has a known corruption bug, say).
    ``one_stage_max_elems``: a backend whose one-stage program holds a wider row
    than AITER's block of 1024 packs (the Triton kernels: 16384 elements) says
    so here; None keeps the pack rule.
    """

    name: str = "any"
    world_sizes: frozenset[int] = frozenset({2, 4, 8})
    dtypes: frozenset[str] = frozenset(ELEMENT_SIZE)
    max_bytes: Optional[int] = None
    one_stage_max_bytes: dict[int, Optional[int]] = field(default_factory=dict)
    one_stage_max_tokens: Optional[int] = None
    hidden_sizes: Optional[frozenset[int]] = None
    two_stage_packs: Optional[tuple[int, int]] = None
    two_stage_exact_split: bool = False
    schedules: tuple[Schedule, ...] = ()
    off: tuple[tuple[Path, str], ...] = ()
    one_stage_max_elems: Optional[int] = None

    def __post_init__(self) -> None:
        # Hashed on every per-call decision (the gate's cache): once is enough.
        object.__setattr__(self, "_hash", hash(self.key()))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]

    def key(self) -> tuple[Any, ...]:
        """Stable description for cache keys (``uuid()``)."""
        return (self.name, tuple(sorted(self.world_sizes)), tuple(sorted(self.dtypes)),
                self.max_bytes, tuple(sorted(self.one_stage_max_bytes.items())),
                self.one_stage_max_tokens,
                None if self.hidden_sizes is None else tuple(sorted(self.hidden_sizes)),
                self.two_stage_packs, self.two_stage_exact_split, self.schedules, self.off,
                self.one_stage_max_elems)

    def off_reason(self, path: Path) -> Optional[str]:
        """Why the backend never takes ``path``, or None when it may."""
        return next((why for p, why in self.off if p is path), None)

    def steps_for(self, hidden: int, dtype: str, world_size: int) -> Optional[Steps]:
        """The measured schedule nearest to this row (same dtype and world size,
        nearest hidden size), or None when the backend has none for them."""
        same = [s for s in self.schedules if s.dtype == dtype and s.world_size == world_size]
        if not same:
            return None
        return min(same, key=lambda s: (abs(s.hidden - hidden), s.hidden)).steps


UNLIMITED = BackendLimits()


@dataclass(frozen=True)
class Decision:
    path: Path
    reason: str

    @property
    def fused(self) -> bool:
        return self.path is not Path.UNFUSED


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; strings pass through."""
    return str(dtype).removeprefix("torch.")


def pack_size(dtype: str) -> int:
    return PACK_BYTES // ELEMENT_SIZE[dtype]


def one_stage_fits(hidden: int, dtype: str, limits: Optional[BackendLimits] = None) -> bool:
    """The pack rule: one block of <= 1024 threads covers a row in 16-byte packs
    (or the backend's own widest one-stage row)."""
    pack = pack_size(dtype)
    widest = limits.one_stage_max_elems if limits is not None else None
    if widest is not None:
        return hidden % pack == 0 and hidden <= widest
    return hidden % pack == 0 and hidden // pack <= MAX_PACKS_PER_ROW


def _no_block(hidden: int, dt: str, limits: BackendLimits) -> str:
    if limits.one_stage_max_elems is not None:
        return (f"hidden {hidden} exceeds backend {limits.name}'s widest one-stage row "
                f"({limits.one_stage_max_elems} elements)")
    return (f"hidden {hidden} does not fit one block ({pack_size(dt)}-element packs, "
            f"<= {MAX_PACKS_PER_ROW} per row)")


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
    path: Path
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
) -> Decision:
    """Choose the path for an all-reduce + RMSNorm of ``tokens x hidden``.

    ``tokens`` is a concrete count, a :class:`TokenRange`, or None (unknown).
    ``threshold`` forces one-stage up to that many tokens; None takes the
    backend's measured schedule, else 80.  ``group_size``: a per-group
    quantization epilogue's group (the row must split into whole groups).
    Returns ``runtime`` only when the known range holds counts that take
    different paths, so that the choice has to be made per call.
    """
    lo, hi = _token_bounds(tokens)
    return _decide(hidden, dtype_name(dtype), world_size, lo, hi, limits, threshold, group_size)


@functools.lru_cache(maxsize=4096)
def _decide(hidden: int, dt: str, world_size: int, lo: int, hi: Optional[int],
            limits: BackendLimits, threshold: Optional[int],
            group_size: Optional[int]) -> Decision:
    why = _static_reason(hidden, dt, world_size, limits, group_size)
    if why is not None:
        return Decision(Path.UNFUSED, why)
    if hi == 0:
        return Decision(Path.UNFUSED, "0 tokens: empty outputs, nothing to launch")
    # An empty batch takes no path at all (the op returns empty outputs without a
    # launch), so it never makes a range straddle.
    lo = max(lo, 1)
    segs = [s for s in segments(hidden, dt, world_size, limits=limits, threshold=threshold)
            if s.lo <= (hi if hi is not None else s.lo) and (s.hi is None or s.hi >= lo)]
    span = _fmt(lo, hi)
    if len({s.path for s in segs}) == 1:
        seg = segs[0]
        split = _split_reason(hidden, dt, world_size, limits, lo, hi, seg.path)
        if split is None:
            return Decision(seg.path, f"tokens {span}: {seg.why}")
        if lo == hi:
            return Decision(Path.UNFUSED, f"tokens {span}: {split}")
        return Decision(Path.RUNTIME, f"tokens {span}: {seg.path} where tokens x packs divides "
                        f"by the world size, unfused elsewhere ({split}): decided per call")
    parts = [f"{_fmt(max(s.lo, lo), s.hi if hi is None or (s.hi is not None and s.hi < hi) else hi)}"
             f" {s.path}" for s in segs]
    return Decision(Path.RUNTIME, f"tokens {span} span " + ", ".join(parts)
                    + ": decided per call")


def _static_reason(hidden: int, dt: str, world_size: int, limits: BackendLimits,
                   group_size: Optional[int]) -> Optional[str]:
    """Why no token count of this row can fuse, or None."""
    if dt not in ELEMENT_SIZE:
        return f"dtype {dt} is not one of bf16/fp16/fp32"
    if dt not in limits.dtypes:
        return f"backend {limits.name} does not take {dt}"
    if world_size < 2:
        return f"world size {world_size}: nothing to reduce"
    if world_size not in limits.world_sizes:
        return (f"backend {limits.name} supports world sizes {sorted(limits.world_sizes)}, "
                f"not {world_size}")
    if hidden <= 0:
        return f"hidden size {hidden} is not positive"
    if limits.hidden_sizes is not None and hidden not in limits.hidden_sizes:
        return f"backend {limits.name} fuses only hidden sizes {sorted(limits.hidden_sizes)}"
    if (hidden * ELEMENT_SIZE[dt]) % PACK_BYTES:
        return f"row of {hidden} x {dt} is not a whole number of 16-byte packs"
    if group_size is not None and (group_size <= 0 or hidden % group_size):
        return f"hidden {hidden} is not a whole number of {group_size}-element quant groups"
    one_off, two_off = limits.off_reason(Path.ONE_STAGE), limits.off_reason(Path.TWO_STAGE)
    if one_off is not None and two_off is not None:
        return f"backend {limits.name} takes no kernel path: {one_off}" + (
            f"; {two_off}" if two_off != one_off else "")
    one = one_off or (None if one_stage_fits(hidden, dt, limits) else _no_block(hidden, dt, limits))
    two = two_off or (None if _two_stage_takes(hidden, dt, limits) else
                      f"hidden {hidden} is outside backend {limits.name}'s two-stage row range "
                      f"{limits.two_stage_packs} packs")
    if one is not None and two is not None:
        return f"no kernel path: {one}; {two}"
    return None


def _two_stage_takes(hidden: int, dt: str, limits: BackendLimits) -> bool:
    if limits.two_stage_packs is None:
        return True
    lo_p, hi_p = limits.two_stage_packs
    return lo_p <= hidden // pack_size(dt) <= hi_p


def _split_reason(hidden: int, dt: str, world_size: int, limits: BackendLimits,
                  lo: int, hi: Optional[int], path: Path) -> Optional[str]:
    """Why some count in ``lo..hi`` cannot take the two-stage split, or None."""
    if path is not Path.TWO_STAGE or not limits.two_stage_exact_split:
        return None
    packs = hidden // pack_size(dt)
    if packs % world_size == 0:
        return None
    counts = range(lo, (hi if hi is not None else lo + world_size) + 1)
    if all(n * packs % world_size == 0 for n in counts):
        return None
    return (f"tokens x packs ({packs} per row) not divisible by world size {world_size}: "
            f"backend {limits.name}'s two-stage would drop the remainder")


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
    one_off, two_off = limits.off_reason(Path.ONE_STAGE), limits.off_reason(Path.TWO_STAGE)
    fits = one_stage_fits(hidden, dt, limits) and one_off is None
    two_ok = _two_stage_takes(hidden, dt, limits) and two_off is None
    hard_cap = limits.one_stage_max_tokens
    byte_cap = limits.one_stage_max_bytes.get(world_size)
    pref_cap = None if byte_cap is None else (byte_cap - 1) // row_bytes
    max_tokens = None if limits.max_bytes is None else limits.max_bytes // row_bytes

    def path_at(n: int) -> tuple[Path, str]:
        if max_tokens is not None and n > max_tokens:
            return Path.UNFUSED, (f"above the backend's {limits.max_bytes} byte limit "
                                  f"({max_tokens} tokens)")
        pref = next(p for up, p in steps if up is None or n <= up)
        hard_ok = fits and (hard_cap is None or n <= hard_cap)
        if pref is Path.ONE_STAGE and hard_ok and (pref_cap is None or n <= pref_cap):
            return Path.ONE_STAGE, f"one-stage by {source}, hidden {hidden} fits one block"
        if two_ok:
            if one_off is not None:
                why = f"one-stage is off: {one_off}"
            elif not fits:
                why = _no_block(hidden, dt, limits)
            elif pref is Path.TWO_STAGE:
                why = f"two-stage by {source}"
            elif not hard_ok:
                why = f"the backend's one-stage kernel takes at most {hard_cap} tokens"
            else:
                why = f"one-stage is chosen below {byte_cap} bytes at world size {world_size}"
            return Path.TWO_STAGE, why
        no_two = (f"two-stage is off: {two_off}" if two_off is not None else
                  f"hidden {hidden} is outside backend {limits.name}'s two-stage row range "
                  f"{limits.two_stage_packs}")
        if hard_ok:
            return Path.ONE_STAGE, f"one-stage, the only path: {no_two}"
        return Path.UNFUSED, (f"above the one-stage kernel's {hard_cap} tokens, and {no_two}")

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
