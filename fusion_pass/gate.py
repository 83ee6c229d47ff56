"""The dispatch gate: which path a fused all-reduce + RMSNorm call takes.

Pure Python on purpose: it runs at compile time inside the pass, at run time
inside the op (for the ``runtime`` path), and in notebooks, and it must be
testable exhaustively without torch.  Dtypes are named by string
(``"bfloat16"``, ``"float16"``, ``"float32"``); :func:`dtype_name` maps a torch
dtype to that name.

The rules are AITER's (see ``shared/reference/aiter-facts.md``):

* pack rule: a thread owns one 16-byte pack, and one block must cover a row,
  so one-stage needs ``hidden % pack == 0 and hidden // pack <= 1024``;
* token rule: one-stage up to ``threshold`` tokens (80), two-stage above;
* per-backend world sizes and byte limits.
"""

from __future__ import annotations

import enum
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
    """

    name: str = "any"
    world_sizes: frozenset[int] = frozenset({2, 4, 8})
    dtypes: frozenset[str] = frozenset(ELEMENT_SIZE)
    max_bytes: Optional[int] = None
    one_stage_max_bytes: dict[int, Optional[int]] = field(default_factory=dict)
    one_stage_max_tokens: Optional[int] = None
    hidden_sizes: Optional[frozenset[int]] = None

    def __hash__(self) -> int:
        return hash((self.name, self.world_sizes, self.dtypes, self.max_bytes,
                     tuple(sorted(self.one_stage_max_bytes.items())),
                     self.one_stage_max_tokens, self.hidden_sizes))

    def key(self) -> tuple[Any, ...]:
        """Stable description for cache keys (``uuid()``)."""
        return (self.name, sorted(self.world_sizes), sorted(self.dtypes),
                self.max_bytes, sorted(self.one_stage_max_bytes.items()),
                self.one_stage_max_tokens,
                None if self.hidden_sizes is None else sorted(self.hidden_sizes))


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


def one_stage_fits(hidden: int, dtype: str) -> bool:
    """The pack rule: one block of <= 1024 threads covers a row in 16-byte packs."""
    pack = pack_size(dtype)
    return hidden % pack == 0 and hidden // pack <= MAX_PACKS_PER_ROW


def _token_bounds(tokens: Tokens) -> tuple[int, Optional[int]]:
    if tokens is None:
        return 1, None
    if isinstance(tokens, TokenRange):
        return tokens.start, tokens.end
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise TypeError(f"tokens must be an int, a TokenRange or None, not {tokens!r}")
    return tokens, tokens


def decide(
    hidden: int,
    dtype: Any,
    world_size: int,
    tokens: Tokens = None,
    *,
    limits: BackendLimits = UNLIMITED,
    threshold: int = DEFAULT_TOKEN_THRESHOLD,
) -> Decision:
    """Choose the path for an all-reduce + RMSNorm of ``tokens x hidden``.

    ``tokens`` is a concrete count, a :class:`TokenRange`, or None (unknown).
    Returns ``runtime`` only when the known range straddles a boundary, so that
    the choice has to be made per call.
    """
    dt = dtype_name(dtype)
    if dt not in ELEMENT_SIZE:
        return Decision(Path.UNFUSED, f"dtype {dt} is not one of bf16/fp16/fp32")
    if dt not in limits.dtypes:
        return Decision(Path.UNFUSED, f"backend {limits.name} does not take {dt}")
    if world_size < 2:
        return Decision(Path.UNFUSED, f"world size {world_size}: nothing to reduce")
    if world_size not in limits.world_sizes:
        return Decision(Path.UNFUSED, f"backend {limits.name} supports world sizes "
                        f"{sorted(limits.world_sizes)}, not {world_size}")
    if hidden <= 0:
        return Decision(Path.UNFUSED, f"hidden size {hidden} is not positive")
    if limits.hidden_sizes is not None and hidden not in limits.hidden_sizes:
        return Decision(Path.UNFUSED, f"backend {limits.name} fuses only hidden sizes "
                        f"{sorted(limits.hidden_sizes)}")
    if (hidden * ELEMENT_SIZE[dt]) % PACK_BYTES:
        return Decision(Path.UNFUSED, f"row of {hidden} x {dt} is not a whole number "
                        "of 16-byte packs")

    lo, hi = _token_bounds(tokens)
    row_bytes = hidden * ELEMENT_SIZE[dt]
    if limits.max_bytes is not None:
        max_tokens = limits.max_bytes // row_bytes
        if lo > max_tokens:
            return Decision(Path.UNFUSED, f"{lo} tokens exceed the backend's "
                            f"{limits.max_bytes} byte limit ({max_tokens} tokens)")
    else:
        max_tokens = None

    # Largest token count for which one-stage is allowed and chosen.
    one_stage_max: Optional[int] = threshold
    why_two = f"more than {threshold} tokens"
    if not one_stage_fits(hidden, dt):
        one_stage_max, why_two = 0, (f"hidden {hidden} does not fit one block "
                                     f"({pack_size(dt)}-element packs, <= 1024 per row)")
    else:
        if limits.one_stage_max_tokens is not None and limits.one_stage_max_tokens < one_stage_max:
            one_stage_max = limits.one_stage_max_tokens
            why_two = f"the backend's one-stage kernel takes at most {one_stage_max} tokens"
        cap = limits.one_stage_max_bytes.get(world_size)
        if cap is not None and (cap - 1) // row_bytes < one_stage_max:
            one_stage_max = (cap - 1) // row_bytes
            why_two = f"one-stage is chosen below {cap} bytes at world size {world_size}"

    overflow = max_tokens is not None and (hi is None or hi > max_tokens)
    if one_stage_max == 0 and not overflow:  # no token count takes one-stage
        return Decision(Path.TWO_STAGE, f"tokens {_fmt(lo, hi)}: {why_two}")
    if hi is not None and hi <= one_stage_max and not overflow:
        return Decision(Path.ONE_STAGE, f"tokens {_fmt(lo, hi)} <= {one_stage_max}, "
                        f"hidden {hidden} fits one block")
    if lo > one_stage_max and not overflow:
        return Decision(Path.TWO_STAGE, f"tokens {_fmt(lo, hi)}: {why_two}")
    parts = []
    if lo <= one_stage_max < (hi if hi is not None else one_stage_max + 1):
        parts.append(f"straddles the one-stage limit {one_stage_max}")
    if overflow:
        parts.append(f"may exceed the backend's size limit ({max_tokens} tokens)")
    return Decision(Path.RUNTIME, f"tokens {_fmt(lo, hi)} " + " and ".join(parts)
                    + ": decided per call")


def _fmt(lo: int, hi: Optional[int]) -> str:
    if lo == hi:
        return str(lo)
    return f"[{lo}, {'inf' if hi is None else hi}]"
