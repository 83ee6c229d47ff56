"""What an AITER release can be asked to do, and what it must not be asked.

Read from ROCm/aiter at every tag v0.1.7 .. v0.1.20.post1 and from the newest
PyPI wheel (``amd-aiter`` 0.1.7.post2.dev18); each fact names the upstream
change (pull request and commit) it comes from.  ``docs/rocm_aiter.md`` has
the table this module implements.

Two sources decide, and both must agree before a path is used:

* the installed ``CustomAllreduce`` itself (:class:`Signature`): which
  keywords ``fused_ar_rms`` takes and whether the per-group FP8 entry exists.
  A keyword the installed function lacks is never passed;
* the version, ``.postN`` included (:func:`parse_version`): what the kernels
  behind the same signature do (hidden sizes, token caps) and which known
  corruption bugs they still have.  Those never show in a signature.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Optional

import torch

from ...gate import Path
from ...log import once
from .limits import AiterLimits

Version = tuple[int, int, int, int]
"""``(major, minor, micro, post)``."""

ALLOW_ENV = "FUSION_PASS_AITER_ALLOW_KNOWN_BUGS"
"""Comma-separated upstream PR numbers of known bugs a user accepts (see KNOWN_BUGS)."""

FALLBACK_VERSION = "0.1.0"
"""setuptools_scm's ``fallback_version`` in AITER's pyproject: a build without git tags."""

_VERSION = re.compile(
    r"v?(?P<major>\d+)\.(?P<minor>\d+)(?:\.(?P<micro>\d+))?"
    r"(?:[.-]?(?P<pre>a|b|c|rc|alpha|beta|pre|preview)\.?\d*)?"
    r"(?:[.-]?post\.?(?P<post>\d+))?"
    r"(?:[.-]?(?P<dev>dev)\.?\d*)?"
    r"(?:[-_.][a-z][a-z0-9]*)?")  # a branch marker such as "-longctx"


def parse_version(text: str) -> Optional[Version]:
    """``"0.1.10.post2"`` -> ``(0, 1, 10, 2)``; None when ``text`` has no ``major.minor``.

    A dev or pre-release counts as the release it was built from, never as the
    one it precedes: setuptools_scm names a build N commits past tag T after
    T's successor (``0.1.7.post1`` + 18 commits is ``0.1.7.post2.dev18``,
    ``0.1.19`` + 5 is ``0.1.20.dev5``), so its last component is stepped back
    and no fix that landed after T is assumed to be in it.  A local part
    (``+rocm7.0``) and a branch marker (``-longctx``) are ignored.
    """
    m = _VERSION.fullmatch(text.strip().split("+", 1)[0].lower())
    if m is None:
        return None
    major, minor, micro = int(m["major"]), int(m["minor"]), int(m["micro"] or 0)
    post = int(m["post"] or 0)
    if m["pre"] is None and m["dev"] is None:
        return major, minor, micro, post
    if post:
        return major, minor, micro, post - 1
    return major, minor, micro - 1, 0


def format_version(v: Version) -> str:
    return f"{v[0]}.{v[1]}.{v[2]}" + (f".post{v[3]}" if v[3] else "")


# -- the facts, with the upstream change each comes from ---------------------------

RESIDUAL_INPUT = (0, 1, 7, 2)
"""``fused_ar_rms(inp, res_inp, ...)``: ROCm/aiter#1401 (2e6bf604); first in the PyPI wheel
0.1.7.post2.dev18 and tag v0.1.7.post2.  Before it the function took no residual."""
USE_1STAGE = (0, 1, 10, 2)
"""``use_1stage``: ROCm/aiter#1949 (f94d1c88), tag v0.1.10.post2.  Before it
``fused_ar_rms`` always ran the two-stage kernel: the path cannot be chosen."""
PER_TOKEN_QUANT = (0, 1, 10, 3)
"""``scale_out`` and ``post_per_token_quant``: ROCm/aiter#1990 (46bb1155)."""
RUNTIME_HIDDEN = (0, 1, 12, 0)
"""ROCm/aiter#2453 (8cfe5e28): one-stage takes any hidden by the pack rule, two-stage
64..2048 packs and throws "n too small/large" outside.  Before it one-stage ran only
hidden 512/1024/2048/4096 (other sizes were silently sent to two-stage) and two-stage only
rows of 1024..32768 bytes in whole KiB (other sizes printed an error and wrote nothing)."""
PER_GROUP_QUANT = (0, 1, 14, 0)
"""``fused_ar_rms_per_group_quant``: ROCm/aiter#2823 (4331ad7a)."""
GEMMA_NORM = (0, 1, 17, 0)
"""``gemma_norm``: ROCm/aiter#3792 (ace71b5f), #3981 (6dc68e58)."""
ONE_STAGE_GRID_STRIDE = (0, 1, 17, 0)
"""ROCm/aiter#3745 (2939ccfd): the one-stage launcher grid-strides; before it it threw
above 80 tokens (its 80 per-block signal slots)."""
EXPANDABLE_SEGMENTS_GUARD = (0, 1, 20, 0)
"""ROCm/aiter#4621 (84fdad89): with PyTorch's ``expandable_segments`` AITER backs its IPC
pool with plain hipMalloc and captures by copy-in; before it the IPC export of
expandable-segment memory fails (ROCm/aiter#4174)."""

OLD_ONE_STAGE_HIDDEN = frozenset({512, 1024, 2048, 4096})
OLD_TWO_STAGE_HIDDEN = frozenset(range(512, 16384 + 1, 512))
"""Rows of 1024..32768 bytes in whole KiB, for the 2-byte dtypes this backend takes."""
TWO_STAGE_PACKS = (64, 2048)
ONE_STAGE_MAX_TOKENS = 80

# AITER's default custom all-reduce cutoff and vLLM's effective maximum (half of its
# 128 MiB IPC buffer: the two-stage kernel needs a 2x temp region).
MAX_BYTES = 64 * 1024 * 1024
# vLLM 0.32's caller gate (AiterCustomAllreduce.use_1stage_fused_ar_rms).
ONE_STAGE_MAX_BYTES: dict[int, Optional[int]] = {2: None, 4: 256 * 1024, 8: 128 * 1024}
# The C++ launchers handle 2, 4 and 8 ranks (Python also admits 6, which the fused
# launchers reject).
WORLD_SIZES = frozenset({2, 4, 8})


@dataclass(frozen=True)
class KnownBug:
    pr: int
    path: Path
    fixed_in: Version
    commit: str
    what: str

    def reason(self, version: str) -> str:
        fix = format_version(self.fixed_in)
        return (f"AITER {version}'s {self.path.value.replace('_', '-')} kernel {self.what} "
                f"(fixed by ROCm/aiter#{self.pr}, {self.commit}, in {fix}); upgrade to AITER "
                f">= {fix}, or set {ALLOW_ENV}={self.pr} to run it anyway")


KNOWN_BUGS = (
    KnownBug(2890, Path.TWO_STAGE, (0, 1, 14, 0), "c71075ce",
             "publishes its reduce-scatter with relaxed memory ordering: results are "
             "corrupted above ~1.2 MB per rank"),
    KnownBug(4346, Path.ONE_STAGE, (0, 1, 19, 1), "0e475758",
             "lacks its end barrier: back-to-back calls race across requests"),
)
SAFE_FROM = max(b.fixed_in for b in KNOWN_BUGS)
"""The first release whose two paths have no known corruption bug."""


@dataclass(frozen=True)
class Signature:
    """What the installed ``CustomAllreduce`` lets a caller ask for."""

    residual: bool
    use_1stage: bool
    gemma: bool
    per_token_quant: bool
    per_group_quant: bool

    @staticmethod
    def of(cls: type) -> "Signature":
        """Read from the class itself."""
        params = inspect.signature(cls.fused_ar_rms).parameters
        group = getattr(cls, "fused_ar_rms_per_group_quant", None)
        group_params = inspect.signature(group).parameters if group is not None else {}
        return Signature(
            residual="res_inp" in params,
            use_1stage="use_1stage" in params,
            gemma="gemma_norm" in params,
            per_token_quant={"scale_out", "post_per_token_quant"} <= params.keys(),
            per_group_quant={"group_size", "use_1stage", "registered"} <= group_params.keys())

    @staticmethod
    def released(v: Optional[Version]) -> "Signature":
        """What release ``v`` shipped (for limits without AITER installed)."""
        def has(since: Version) -> bool:
            return v is not None and v >= since

        return Signature(residual=has(RESIDUAL_INPUT), use_1stage=has(USE_1STAGE),
                         gemma=has(GEMMA_NORM), per_token_quant=has(PER_TOKEN_QUANT),
                         per_group_quant=has(PER_GROUP_QUANT))


@dataclass(frozen=True)
class Capabilities:
    """What this backend may ask of one AITER, decided once."""

    version: str
    key: Optional[Version]
    signature: Signature
    fp8: Optional[torch.dtype]
    """The FP8 dtype AITER's quantizing kernels write (gfx942: e4m3fnuz; gfx950: e4m3fn)."""
    declined: dict[Path, str] = field(default_factory=dict)
    """Kernel paths this AITER is never sent, and why."""
    accepted_bugs: tuple[KnownBug, ...] = ()
    """Known bugs of this AITER on paths the user opted into."""

    def takes(self, path: Path) -> bool:
        return path not in self.declined

    @property
    def declined_reasons(self) -> str:
        return "; ".join(dict.fromkeys(self.declined.values()))

    @property
    def expandable_segments_guarded(self) -> bool:
        return self.key is not None and self.key >= EXPANDABLE_SEGMENTS_GUARD

    @property
    def limits(self) -> AiterLimits:
        """The gate's view: exactly the shapes the enabled paths can take."""
        one, two = self.takes(Path.ONE_STAGE), self.takes(Path.TWO_STAGE)
        name = f"aiter-{self.version}"
        if not (one or two):
            return AiterLimits(name=name, off=tuple(self.declined.items()))
        assert self.key is not None
        old = self.key < RUNTIME_HIDDEN
        if not (one and two):
            name += f" ({(Path.ONE_STAGE if one else Path.TWO_STAGE).value} only)"
        return AiterLimits(
            name=name,
            world_sizes=WORLD_SIZES,
            # fp32 is accepted by the C++ but neither vLLM nor our ROCm tests run it.
            dtypes=frozenset({"bfloat16", "float16"}),
            max_bytes=MAX_BYTES,
            one_stage_max_bytes=dict(ONE_STAGE_MAX_BYTES),
            one_stage_max_tokens=(None if self.key >= ONE_STAGE_GRID_STRIDE
                                  else ONE_STAGE_MAX_TOKENS),
            # One hidden list serves both paths, so where they differ (before
            # 0.1.12) the one-stage list, the narrower one, is used when it runs.
            hidden_sizes=(None if not old else OLD_ONE_STAGE_HIDDEN if one
                          else OLD_TWO_STAGE_HIDDEN),
            two_stage_packs=TWO_STAGE_PACKS,
            two_stage_exact_split=True,
            off=tuple(self.declined.items()),
        )


def allowed_bugs() -> frozenset[int]:
    """The known bugs the user accepts in ``FUSION_PASS_AITER_ALLOW_KNOWN_BUGS``."""
    raw = os.environ.get(ALLOW_ENV, "")
    known = {b.pr for b in KNOWN_BUGS}
    out = set()
    for tok in filter(None, (t.strip().lstrip("#") for t in raw.split(","))):
        if tok.isdigit() and int(tok) in known:
            out.add(int(tok))
        else:
            once(f"aiter-allow:{tok}", f"fusion_pass: {ALLOW_ENV} names {tok!r}, which is not a "
                 f"known AITER bug ({sorted(known)}); ignored")
    return frozenset(out)


def capabilities(version: str, signature: Signature, fp8: Optional[torch.dtype],
                 allowed: frozenset[int]) -> Capabilities:
    """What may be asked of an AITER of ``version`` whose class has ``signature``."""
    key = parse_version(version)
    whole = _whole_reason(version, key, signature)
    if whole is not None:
        return Capabilities(version, key, signature, fp8,
                            declined={p: whole for p in (Path.ONE_STAGE, Path.TWO_STAGE)})
    assert key is not None
    declined: dict[Path, str] = {}
    accepted: list[KnownBug] = []
    for bug in KNOWN_BUGS:
        if key >= bug.fixed_in:
            continue
        if bug.pr in allowed:
            accepted.append(bug)
        else:
            declined[bug.path] = bug.reason(version)
    return Capabilities(version, key, signature, fp8, declined, tuple(accepted))


def _whole_reason(version: str, key: Optional[Version], sig: Signature) -> Optional[str]:
    """Why no path of this AITER can be called at all, or None."""
    upgrade = f"upgrade to AITER >= {format_version(SAFE_FROM)}"
    if key is None or version.strip() == FALLBACK_VERSION:
        fallback = (f" ({FALLBACK_VERSION} is what a build without git tags reports)"
                    if key is not None else "")
        return (f"AITER's version {version!r} does not say which release it is{fallback}, so its "
                f"known corruption bugs cannot be ruled out; install a release "
                f">= {format_version(SAFE_FROM)}")
    if not sig.residual:
        return (f"AITER {version}'s fused_ar_rms takes no residual input (res_inp came with "
                f"ROCm/aiter#1401 in {format_version(RESIDUAL_INPUT)}); {upgrade}")
    if not sig.use_1stage:
        return (f"AITER {version}'s fused_ar_rms has no use_1stage, so the kernel path cannot be "
                f"chosen (ROCm/aiter#1949, in {format_version(USE_1STAGE)}), and the two-stage "
                f"kernel it always runs has known corruption bugs; {upgrade}")
    return None


def say_once(caps: Capabilities) -> None:
    """Log, once per process, what this AITER declines and which known bugs the user accepted."""
    for bug in caps.accepted_bugs:
        once(f"aiter-accepted:{caps.version}:{bug.pr}",
             f"fusion_pass: {ALLOW_ENV}={bug.pr}: the aiter backend runs AITER {caps.version}'s "
             f"{bug.path.value.replace('_', '-')} kernel, which {bug.what} (ROCm/aiter#{bug.pr}); "
             f"results can be wrong", logging.WARNING)
    if caps.declined:
        once(f"aiter-declined:{caps.declined_reasons}",
             f"fusion_pass: the aiter backend declines: {caps.declined_reasons}")
