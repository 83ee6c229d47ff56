"""The AITER backend on the CPU, against every AITER release line users have.

AITER's ``CustomAllreduce`` is replaced by the hand-written stand-ins of
``tests/helpers/aiter_standins.py``: one per release line, with that line's real
signatures (a keyword it lacks raises TypeError), its kernels' arithmetic, and a
record of every call that line would throw on, silently miscompute, or corrupt
by a known bug.  The tests check what the backend asks of each line (declines
with their messages, the exact call arguments), that it never asks anything the
line cannot do, and its results against float64 math of their own.  They say
nothing about AITER's kernels on a GPU (``tests/rocm/test_aiter_rocm.py``).
"""

from __future__ import annotations

import inspect
import itertools
import logging
import weakref
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import aiter_standins as standins
import pytest
import torch
import torch.distributed as dist

from fusion_pass import backends, fused_allreduce_rmsnorm, log
from fusion_pass.op import fused_allreduce_rmsnorm_quant
from fusion_pass.backends import Call, Outputs
from fusion_pass.testing.calls import make_call
from fusion_pass.backends.aiter import AiterBackend, installed, limits_for_version
from fusion_pass.backends.aiter import communicators as comms
from fusion_pass.backends.aiter.epilogues import fused_epilogue
from fusion_pass.backends.aiter.releases import ALLOW_ENV, parse_version
from fusion_pass.gate import Path, decide
from fusion_pass.quant import QuantSpec, quantize

WORLD = 2
EPS = 1e-6
LINES = {c.VERSION: c for c in standins.LINES}
VLLM_FLOOR = 1.0 / (448.0 * 512.0)  # vLLM's QuantFP8 scale floor


# -- fixtures and helpers --------------------------------------------------------------

@pytest.fixture(scope="module")
def group_name():
    """A two-rank c10d group in this one process (fake backend: no peers, no I/O; its
    all-reduce returns the input, so the reference computes ``h = x + r``)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


class Env(SimpleNamespace):
    capturing: bool
    new_groups: list
    alloc_conf: str


@pytest.fixture
def env(monkeypatch, group_name) -> Env:
    """ROCm as far as our code can tell; graph capture and allocator settings under the
    test's control; gloo group creation recorded; no known bug accepted; nothing said yet."""
    e = Env(capturing=False, new_groups=[], alloc_conf="")
    monkeypatch.setattr(log, "_said", set())
    monkeypatch.setattr(torch.version, "hip", "6.3.42131", raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: e.capturing)
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: e.alloc_conf,
                        raising=False)
    monkeypatch.delenv(ALLOW_ENV, raising=False)

    def new_group(*args, **kwargs):
        e.new_groups.append((args, kwargs))
        return SimpleNamespace(gloo_for=args[0])

    monkeypatch.setattr(dist, "new_group", new_group)
    return e


@pytest.fixture
def install(env, monkeypatch):
    """``install(version, accepted=())``: that release line installed, the known bugs in
    ``accepted`` opted into through the environment; returns ``(backend, line class)``."""

    def _install(version: str, accepted: tuple[int, ...] = ()) -> tuple[AiterBackend, type]:
        line = LINES[version]
        # A fresh class per install: its own record of what was made, and the bugs accepted.
        cls = standins.release(line.__mro__[1], version, line.KEY, frozenset(accepted))
        monkeypatch.setattr(installed, "custom_allreduce_class", lambda: cls)
        monkeypatch.setattr(installed, "version", lambda: version)
        if accepted:
            monkeypatch.setenv(ALLOW_ENV, ",".join(map(str, accepted)))
        else:
            monkeypatch.delenv(ALLOW_ENV, raising=False)
        return AiterBackend(), cls

    return _install


def make(tokens: int, hidden: int = 2880, dtype=torch.bfloat16, residual: bool = True):
    g = torch.Generator().manual_seed(tokens * 7 + hidden)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    r = torch.randn(tokens, hidden, generator=g).to(dtype) if residual else None
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    return x, r, w


def call(group: str, x, r, w, path: Path, **kw) -> Call:
    return make_call(x, r, w, EPS, group, path, **kw)


def oracle(x, r, w, gemma: bool = False, ranks: int = WORLD):
    """float64: ``h = ranks * x + r`` (every rank holds ``x``), ``y = h / rms(h) * w``."""
    h = ranks * x.double() + (0 if r is None else r.double())
    wf = w.double() + 1 if gemma else w.double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * wf, h


def assert_close_to(t: torch.Tensor, want: torch.Tensor) -> None:
    """Within the rounding of the 2-byte dtypes (a few ulps of bf16)."""
    torch.testing.assert_close(t.double(), want, rtol=2e-2, atol=2e-2)


def only(cls: type):
    assert len(cls.created) == 1, cls.created
    return cls.created[0]


# -- versions --------------------------------------------------------------------------

@pytest.mark.parametrize("text, key", [
    ("0.1.10.post1", (0, 1, 10, 1)),
    ("0.1.10.post2", (0, 1, 10, 2)),              # .postN is kept: post1 and post2 differ
    ("v0.1.13", (0, 1, 13, 0)),
    ("0.1.20.post1+rocm7.0", (0, 1, 20, 1)),      # a local part is ignored
    ("0.1.7.post2.dev18", (0, 1, 7, 1)),          # the PyPI wheel: 0.1.7.post1 + 18 commits
    ("0.1.20.dev5+g1a2b3c4", (0, 1, 19, 0)),      # 0.1.19 + 5 commits: no later fix assumed
    ("0.1.17rc0", (0, 1, 16, 0)),
    ("0.1.17-rc0", (0, 1, 16, 0)),
    ("0.1.13.dev0", (0, 1, 12, 0)),
    ("0.1.17-longctx", (0, 1, 17, 0)),            # a branch marker
    ("0.2", (0, 2, 0, 0)),
    ("not-a-version", None),
    ("", None),
])
def test_parse_version(text: str, key) -> None:
    assert parse_version(text) == key


# -- what each release line is asked -----------------------------------------------------

#   version -> (one-stage taken, two-stage taken, words of the decline message)
DEFAULTS = {
    "0.1.7.post1": (False, False, ["0.1.7.post1", "no residual input", ">= 0.1.19.post1"]),
    "0.1.7.post2.dev18": (False, False, ["0.1.7.post2.dev18", "no use_1stage", ">= 0.1.19.post1"]),
    "0.1.10.post1": (False, False, ["0.1.10.post1", "no use_1stage", ">= 0.1.19.post1"]),
    "0.1.10.post2": (False, False, ["0.1.10.post2", "#2890", ">= 0.1.14", "#4346"]),
    "0.1.11": (False, False, ["0.1.11", "#2890", "#4346", ">= 0.1.19.post1"]),
    "0.1.13": (False, False, ["0.1.13", "#2890", "#4346"]),
    "0.1.14": (False, True, ["0.1.14", "#4346", "end barrier", ">= 0.1.19.post1", ALLOW_ENV]),
    "0.1.16.post6": (False, True, ["0.1.16.post6", "#4346", ">= 0.1.19.post1"]),
    "0.1.19": (False, True, ["0.1.19", "#4346", ">= 0.1.19.post1"]),
    "0.1.19.post1": (True, True, []),
    "0.1.20.post1": (True, True, []),
}


@pytest.mark.parametrize("version", list(LINES))
def test_release_line_paths(install, version: str, caplog) -> None:
    one, two, words = DEFAULTS[version]
    with caplog.at_level(logging.WARNING, logger="fusion_pass"):
        be, _ = install(version)
    assert (be.caps.takes(Path.ONE_STAGE), be.caps.takes(Path.TWO_STAGE)) == (one, two)
    for word in words:
        assert word in be.caps.declined_reasons
    if words:  # said once, at construction
        assert any(be.caps.declined_reasons in r.getMessage() for r in caplog.records)
    if not (one or two):
        assert dict(be.limits.off) == be.caps.declined
        d = decide(4096, torch.bfloat16, 2, 8, limits=be.limits)
        assert d.path is Path.UNFUSED and "takes no kernel path" in d.reason


@pytest.mark.parametrize("version, accepted, one, two", [
    ("0.1.10.post2", (4346,), True, False),
    ("0.1.10.post2", (2890,), False, True),
    ("0.1.11", (2890, 4346), True, True),
    ("0.1.16.post6", (4346,), True, True),
    ("0.1.19", (4346,), True, True),
    ("0.1.10.post1", (2890, 4346), False, False),   # no use_1stage: never, opted in or not
    ("0.1.7.post1", (2890, 4346), False, False),
])
def test_known_bugs_only_when_opted_in_loudly(install, version, accepted, one, two,
                                              caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="fusion_pass"):
        be, _ = install(version, accepted)
    assert (be.caps.takes(Path.ONE_STAGE), be.caps.takes(Path.TWO_STAGE)) == (one, two)
    said = " ".join(r.getMessage() for r in caplog.records)
    for bug in be.caps.accepted_bugs:
        assert f"{ALLOW_ENV}={bug.pr}" in said and "results can be wrong" in said


@pytest.mark.parametrize("version, accepted, hidden_sizes, one_cap, off", [
    ("0.1.10.post2", (4346,), frozenset({512, 1024, 2048, 4096}), 80, {Path.TWO_STAGE}),
    ("0.1.10.post2", (2890,), frozenset(range(512, 16385, 512)), 80, {Path.ONE_STAGE}),
    ("0.1.11", (2890, 4346), frozenset({512, 1024, 2048, 4096}), 80, set()),
    ("0.1.13", (2890, 4346), None, 80, set()),
    ("0.1.14", (), None, 80, {Path.ONE_STAGE}),
    ("0.1.16.post6", (4346,), None, 80, set()),
    ("0.1.19", (4346,), None, None, set()),
    ("0.1.19.post1", (), None, None, set()),
    ("0.1.20.post1", (), None, None, set()),
])
def test_limits_per_release_line(install, version, accepted, hidden_sizes, one_cap,
                                 off) -> None:
    be, _ = install(version, accepted)
    lim = be.limits
    assert (lim.hidden_sizes, lim.one_stage_max_tokens, lim.two_stage_packs) == \
        (hidden_sizes, one_cap, (64, 2048))
    assert {p for p, _ in lim.off} == off
    for path in off:  # the gate says why a path is off, in the words of the release table
        assert lim.off_reason(path) == be.caps.declined[path]
    assert lim.two_stage_exact_split
    assert lim.world_sizes == frozenset({2, 4, 8})
    assert lim.dtypes == frozenset({"bfloat16", "float16"})
    assert lim.max_bytes == 64 * 1024 * 1024
    assert lim.one_stage_max_bytes == {2: None, 4: 256 * 1024, 8: 128 * 1024}
    # Without AITER installed (``fusion-pass gate --backend aiter-X``) the same limits.
    assert limits_for_version(version) == lim


def test_limits_without_aiter_for_unreadable_versions() -> None:
    for v in (None, "junk", "0.1.0"):
        lim = limits_for_version(v)
        assert {p for p, _ in lim.off} == {Path.ONE_STAGE, Path.TWO_STAGE}
        assert "does not say which release" in lim.off_reason(Path.ONE_STAGE)
        assert decide(4096, torch.bfloat16, 2, 8, limits=lim).path is Path.UNFUSED
    assert "0.1.0 is what a build without git tags reports" in \
        limits_for_version("0.1.0").off_reason(Path.TWO_STAGE)


# -- never anything a release cannot do --------------------------------------------------

OPT_INS = ((), (2890,), (4346,), (2890, 4346))
HIDDENS = (256, 504, 512, 520, 1024, 2560, 2880, 4096, 7168, 8192, 8200, 12288, 16384, 16392,
           16896)
TOKENS = (0, 1, 3, 7, 80, 81, 96, 4097)


@pytest.mark.parametrize("version", [v for v in LINES if LINES[v].KEY >= (0, 1, 10, 2)])
def test_gate_never_sends_what_a_release_cannot_take(install, version) -> None:
    """Every shape the gate fuses under a line's limits is one that line takes (as the
    stand-in's independent transcription of the kernels says), at world sizes 2, 4, 8."""
    for accepted in OPT_INS:
        _, cls = install(version, accepted)
        lim = limits_for_version(version)
        for hidden, tokens, ws in itertools.product(HIDDENS, TOKENS, (2, 4, 8)):
            d = decide(hidden, torch.bfloat16, ws, tokens, limits=lim)
            if d.fused:
                problems, _ = cls.problems(d.path is Path.ONE_STAGE, hidden, tokens, ws)
                assert problems == [], (accepted, hidden, tokens, ws, d)


#   each shape is at the edge of some release's rule
SHAPES = (
    (4096, 8),      # a template size of the old one-stage kernel: every path everywhere
    (2560, 8),      # in the old two-stage sizes, not in the old one-stage ones
    (2880, 81),     # GPT-OSS above 80 tokens: the old one-stage launcher throws
    (256, 3),       # 32 packs: the two-stage kernel throws "n too small"
    (520, 3),       # 65 packs x 3 tokens over 2 ranks: the two-stage split drops a remainder
    (520, 4),
    (16384, 2),     # 2048 packs: two-stage only
    (16896, 2),     # 2112 packs: neither
    (4096, 0),      # no tokens: before 0.1.18 a zero grid
)


@pytest.mark.parametrize("version", list(LINES))
def test_backend_never_breaks_a_release(install, group_name, version) -> None:
    """Either path, baked or not, on shapes at every rule's edge: the backend declines or
    makes a call that binds and that the release can run; what it returns matches float64."""
    for accepted in OPT_INS[::3]:
        be, cls = install(version, accepted)
        for (hidden, tokens), path in itertools.product(SHAPES, (Path.ONE_STAGE, Path.TWO_STAGE)):
            x, r, w = make(tokens, hidden)
            out = be.run(call(group_name, x, r, w, path))
            if isinstance(out, str):
                assert out
                continue
            y_want, h_want = oracle(x, r, w)
            assert_close_to(out.h, h_want)
            assert_close_to(out.y, y_want)
        assert standins.all_violations(cls) == []


# -- the exact call ----------------------------------------------------------------------

@pytest.mark.parametrize("version, accepted, path, hidden, extra", [
    # v0.1.11: use_1stage and the per-token keywords, nothing else; hidden 4096 is a
    # template size of its one-stage kernel.
    ("0.1.11", (2890, 4346), Path.ONE_STAGE, 4096, {}),
    ("0.1.11", (2890, 4346), Path.TWO_STAGE, 2048, {}),
    ("0.1.16.post6", (), Path.TWO_STAGE, 2880, {"out_hidden_dim": 0}),
    ("0.1.19", (), Path.TWO_STAGE, 2880, {"out_hidden_dim": 0, "gemma_norm": False,
                                          "emit_bf16": False}),
    ("0.1.20.post1", (), Path.ONE_STAGE, 2880, {"out_hidden_dim": 0, "gemma_norm": False,
                                                "emit_bf16": False}),
])
def test_exact_call(install, group_name, version, accepted, path, hidden, extra) -> None:
    be, cls = install(version, accepted)
    x, r, w = make(8, hidden)
    out = be.run(call(group_name, x, r, w, path))
    assert isinstance(out, Outputs)
    (got,) = only(cls).fused()
    want = dict(res_out=out.h, out=out.y, scale_out=None, w=w, eps=EPS, registered=False,
                use_1stage=path is Path.ONE_STAGE, post_per_token_quant=False, **extra)
    assert got.pop("fn") == "fused_ar_rms"
    args = got.pop("args")
    assert args[0] is x and args[1] is r
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] is want[k] or got[k] == want[k], k
    # Fresh outputs, handed to AITER and returned as they are.
    for t in (out.y, out.h):
        assert t.shape == x.shape and t.dtype == x.dtype
        assert t.data_ptr() not in (x.data_ptr(), r.data_ptr(), w.data_ptr())
    assert out.y.data_ptr() != out.h.data_ptr()


def test_exact_call_of_a_release_without_quant_keywords(install, group_name) -> None:
    be, cls = install("0.1.10.post2", (4346,))
    x, r, w = make(8, 1024)
    out = be.run(call(group_name, x, r, w, Path.ONE_STAGE))
    (got,) = only(cls).fused()
    assert {k: v for k, v in got.items() if k not in ("args", "fn")} == dict(
        res_out=out.h, out=out.y, w=w, eps=EPS, registered=False, use_1stage=True)


def test_gemma_where_the_release_has_it(install, group_name) -> None:
    be, cls = install("0.1.20.post1")
    x, r, w = make(4)
    out = be.run(call(group_name, x, r, w, Path.ONE_STAGE, gemma=True))
    assert only(cls).fused()[0]["gemma_norm"] is True
    y_want, _ = oracle(x, r, w, gemma=True)
    assert_close_to(out.y, y_want)
    be, cls = install("0.1.16.post6", (4346,))
    why = be.run(call(group_name, x, r, w, Path.ONE_STAGE, gemma=True))
    assert "0.1.16.post6" in why and "gemma_norm" in why and "0.1.17" in why
    assert cls.created == []


def test_no_residual_adds_zeros(install, group_name) -> None:
    be, cls = install("0.1.20.post1")
    x, _, w = make(4, residual=False)
    out = be.run(call(group_name, x, None, w, Path.TWO_STAGE))
    res_in = only(cls).fused()[0]["args"][1]
    assert res_in.shape == x.shape and res_in.dtype == x.dtype and not res_in.any()
    _, h_want = oracle(x, None, w)
    assert_close_to(out.h, h_want)


#   case: (version, accepted, tokens, hidden, path, words of the reason)
DECLINES = {
    "baked_one_stage_over_cap": ("0.1.16.post6", (4346,), 81, 2880, Path.ONE_STAGE,
                                 "at most 80 tokens"),
    "two_stage_packs": ("0.1.20.post1", (), 8, 256, Path.TWO_STAGE, "row range (64, 2048)"),
    "remainder": ("0.1.20.post1", (), 3, 520, Path.TWO_STAGE, "not divisible by world size 2"),
    "old_hidden": ("0.1.11", (2890, 4346), 8, 2880, Path.ONE_STAGE, "only hidden sizes"),
    "zero_tokens": ("0.1.20.post1", (), 0, 2880, Path.ONE_STAGE, "0 tokens"),
    "too_big": ("0.1.20.post1", (), 4 * 1024 * 1024 + 1, 8, Path.TWO_STAGE, "byte limit"),
    "unfused": ("0.1.20.post1", (), 8, 2880, Path.UNFUSED, "not a kernel path"),
    "weight_dtype": ("0.1.20.post1", (), 8, 2880, Path.ONE_STAGE, "norm weight"),
    "eps_tensor": ("0.1.20.post1", (), 8, 2880, Path.ONE_STAGE, "host float"),
    "out_dtype": ("0.1.20.post1", (), 8, 2880, Path.ONE_STAGE, "y in bfloat16 only"),
    "aiter_declines": ("0.1.20.post1", (), 8, 2880, Path.ONE_STAGE, "should_custom_ar"),
    "disabled": ("0.1.20.post1", (), 8, 2880, Path.ONE_STAGE, "disabled its all-reduce"),
}


@pytest.mark.parametrize("case", list(DECLINES))
def test_declines(install, group_name, case) -> None:
    version, accepted, tokens, hidden, path, words = DECLINES[case]
    be, cls = install(version, accepted)
    if case == "too_big":  # 4 Mi + 1 rows of 16 bytes: just over 64 MiB
        x = torch.empty(tokens, hidden, dtype=torch.bfloat16)
        r, w = torch.empty_like(x), torch.ones(hidden, dtype=torch.bfloat16)
    else:
        x, r, w = make(tokens, hidden)
    c = call(group_name, x, r, w.float() if case == "weight_dtype" else w, path,
             out_dtype=torch.float32 if case == "out_dtype" else None)
    if case == "eps_tensor":
        c.eps = torch.tensor(EPS)
    if case in ("aiter_declines", "disabled"):
        be.prepare(group_name, x.device)
        setattr(only(cls), "accept" if case == "aiter_declines" else "disabled",
                case == "disabled")
    why = be.run(c)
    assert isinstance(why, str) and words in why, why
    assert all(not ca.fused() for ca in cls.created)
    assert standins.all_violations(cls) == []


# -- graph capture and communicators ------------------------------------------------------

def test_first_call_under_capture_declines_and_allocates_nothing(install, env, group_name) -> None:
    be, cls = install("0.1.20.post1")
    x, r, w = make(4)
    env.capturing = True
    why = be.run(call(group_name, x, r, w, Path.ONE_STAGE))
    assert "first AITER call" in why and "graph capture" in why
    assert cls.created == [] and env.new_groups == []
    env.capturing = False
    assert isinstance(be.run(call(group_name, x, r, w, Path.ONE_STAGE)), Outputs)
    env.capturing = True  # made now: later captured calls use it
    assert isinstance(be.run(call(group_name, x, r, w, Path.ONE_STAGE)), Outputs)
    assert len(cls.created) == 1 and standins.all_violations(cls) == []


def test_prepare_and_graph_capture_make_the_communicator_outside_capture(
        install, env, group_name) -> None:
    be, cls = install("0.1.20.post1")
    x, r, w = make(4)
    assert be.prepare(group_name, x.device) is None
    assert len(cls.created) == 1
    be, cls = install("0.1.20.post1")
    with be.graph_capture(group_name, x.device):  # made on entry, before capture begins
        env.capturing = True
        assert isinstance(be.run(call(group_name, x, r, w, Path.ONE_STAGE)), Outputs)
    env.capturing = False
    ca = only(cls)
    assert ca.fused()[0]["registered"] is True and ca.flushes == 1
    assert standins.all_violations(cls) == []


def test_registered_only_inside_aiter_capture(install, env, group_name) -> None:
    be, cls = install("0.1.20.post1")
    x, r, w = make(4)
    be.run(call(group_name, x, r, w, Path.ONE_STAGE))           # eager: makes it
    env.capturing = True
    be.run(call(group_name, x, r, w, Path.ONE_STAGE))           # captured, no AITER context
    with be.graph_capture(group_name, x.device):
        be.run(call(group_name, x, r, w, Path.ONE_STAGE))
    env.capturing = False
    with be.graph_capture(group_name, x.device):
        be.run(call(group_name, x, r, w, Path.ONE_STAGE))       # warm-up inside the context
    ca = only(cls)
    assert [c["registered"] for c in ca.fused()] == [False, False, True, False]
    assert ca.flushes == 2 and standins.all_violations(cls) == []


@pytest.mark.parametrize("version, registered", [("0.1.20.post1", True), ("0.1.19.post1", False)])
def test_expandable_segments(install, env, group_name, version, registered) -> None:
    """Before 0.1.20 AITER cannot IPC-export expandable-segment memory (ROCm/aiter#4174):
    no communicator of ours, and captures by copy-in.  From 0.1.20 AITER handles it
    itself (its ``enable_register_for_capturing``, which we follow: tested below)."""
    be, cls = install(version)
    x, r, w = make(4)
    env.alloc_conf = "max_split_size_mb:64,expandable_segments:True"
    why = be.prepare(group_name, x.device)
    if not registered:
        assert "expandable_segments" in why and version in why and "0.1.20" in why
        assert cls.created == []
        env.alloc_conf = ""
        assert be.prepare(group_name, x.device) is None
        env.alloc_conf = "expandable_segments:True"
    run_captured(be, env, group_name, x, r, w)
    assert only(cls).fused()[0]["registered"] is registered


def test_not_registered_when_aiter_forbids_it(install, env, group_name) -> None:
    be, cls = install("0.1.20.post1")
    x, r, w = make(4)
    be.prepare(group_name, x.device)
    only(cls).enable_register_for_capturing = False  # what AITER forces on gfx1250
    run_captured(be, env, group_name, x, r, w)
    assert only(cls).fused()[0]["registered"] is False


def run_captured(be, env, group_name, x, r, w) -> None:
    """One one-stage call inside the backend's capture context, as if captured."""
    with be.graph_capture(group_name, x.device):
        env.capturing = True
        be.run(call(group_name, x, r, w, Path.ONE_STAGE))
    env.capturing = False


def test_one_communicator_per_group_on_gloo(install, env, group_name) -> None:
    be, cls = install("0.1.20.post1")
    x, r, w = make(4)
    for path in (Path.ONE_STAGE, Path.TWO_STAGE, Path.ONE_STAGE):
        be.run(call(group_name, x, r, w, path))
    ca = only(cls)
    assert len(ca.fused()) == 3
    assert env.new_groups == [(([0, 1],), dict(backend="gloo", use_local_synchronization=True))]
    assert ca.init_args[0].gloo_for == [0, 1] and ca.init_args[1] == x.device
    assert ca.init_kwargs == dict(max_size=comms.OWN_BUFFER_BYTES,
                                  enable_register_for_capturing=True)


@pytest.mark.parametrize("version", [v for v in LINES])
def test_communicator_creation_binds_on_every_line(version) -> None:
    """The one constructor call we make binds to every line's ``__init__``."""
    inspect.signature(LINES[version]).bind(object(), torch.device("cpu"),
                                           max_size=comms.OWN_BUFFER_BYTES)


# -- FP8 epilogues --------------------------------------------------------------------------

FN = dict(mode="per_token", fp8_dtype="float8_e4m3fn", qmax=448.0)


def quant_call(group, x, r, w, spec: QuantSpec, path=Path.ONE_STAGE, out_dtype=torch.float32,
               emit_y=False, gemma=False) -> Call:
    return call(group, x, r, w, path, gemma=gemma, out_dtype=out_dtype, quant=spec,
                emit_y=emit_y)


def check_fp8(q: torch.Tensor, scales: torch.Tensor, y64: torch.Tensor, group: int,
              qmax: float) -> None:
    """Against float64: scales = amax / qmax per group, q * scale = y within FP8 rounding,
    and each group's largest element lands on +-qmax."""
    rows = y64.unflatten(-1, (-1, group))
    amax = rows.abs().amax(-1)
    torch.testing.assert_close(scales.double().reshape(amax.shape), amax / qmax,
                               rtol=1e-5, atol=0)
    deq = q.double().unflatten(-1, (-1, group)) * scales.double().reshape(amax.shape)[..., None]
    torch.testing.assert_close(deq, rows, rtol=2 ** -3, atol=amax.max().item() * 2 ** -9)
    assert (q.double().abs().unflatten(-1, (-1, group)).amax(-1) == qmax).all()


@pytest.mark.parametrize("version", ["0.1.19.post1", "0.1.20.post1"])
def test_per_token_epilogue_taken_when_the_math_is_the_same(install, group_name, version) -> None:
    be, cls = install(version)
    x, r, w = make(8)
    spec = QuantSpec(**FN)
    out = be.run(quant_call(group_name, x, r, w, spec))
    assert isinstance(out, Outputs) and out.y is None
    (got,) = only(cls).fused()
    assert got["fn"] == "fused_ar_rms" and got["post_per_token_quant"] is True
    assert got["use_1stage"] is True and got["gemma_norm"] is False
    assert got["out"] is out.q and got["scale_out"] is out.scales and got["res_out"] is out.h
    assert out.q.dtype == torch.float8_e4m3fn and out.scales.shape == (8, 1)
    assert out.scales.dtype == torch.float32
    y64, h64 = oracle(x, r, w)
    assert_close_to(out.h, h64)
    check_fp8(out.q, out.scales, y64, x.shape[-1], 448.0)
    assert standins.all_violations(cls) == []


def test_per_group_epilogue_taken_when_the_math_is_the_same(install, group_name) -> None:
    be, cls = install("0.1.20.post1")
    x, r, w = make(8, 4096)
    spec = QuantSpec(mode="per_group", fp8_dtype="float8_e4m3fn", qmax=448.0, group=128)
    out = be.run(quant_call(group_name, x, r, w, spec))
    (got,) = only(cls).fused()
    assert got.pop("fn") == "fused_ar_rms_per_group_quant"
    args = got.pop("args")
    assert args[0] is x and args[1] is r
    assert got == dict(w=w, eps=EPS, group_size=128, registered=False, use_1stage=True,
                       emit_bf16=False, transpose_scale=False)
    assert out.y is None and out.q.dtype == torch.float8_e4m3fn
    assert out.scales.shape == (8, 4096 // 128)
    y64, h64 = oracle(x, r, w)
    assert_close_to(out.h, h64)
    check_fp8(out.q, out.scales, y64, 128, 448.0)
    assert standins.all_violations(cls) == []


def test_e4m3fnuz_aiter(install, group_name, monkeypatch) -> None:
    """gfx942: AITER writes e4m3fnuz scaled to 240; vLLM's graphs scale fnuz to 224."""
    monkeypatch.setattr(standins, "fp8", torch.float8_e4m3fnuz)
    be, cls = install("0.1.20.post1")
    x, r, w = make(8)
    ok = QuantSpec(mode="per_token", fp8_dtype="float8_e4m3fnuz", qmax=240.0)
    out = be.run(quant_call(group_name, x, r, w, ok))
    assert out.q.dtype == torch.float8_e4m3fnuz
    check_fp8(out.q, out.scales, oracle(x, r, w)[0], x.shape[-1], 240.0)
    vllm = QuantSpec(mode="per_token", fp8_dtype="float8_e4m3fnuz", qmax=224.0)
    assert "224" in be.run(quant_call(group_name, x, r, w, vllm))
    assert standins.all_violations(cls) == []


#   (spec overrides, call overrides, version, accepted, words of why)
MISMATCHES = {
    "scale_floor": (dict(scale_floor=VLLM_FLOOR), {}, "0.1.20.post1", (), "floor"),
    "reciprocal": (dict(reciprocal=True), {}, "0.1.20.post1", (), "reciprocal"),
    "qmax": (dict(qmax=224.0), {}, "0.1.20.post1", (), "224"),
    "fp8_dtype": (dict(fp8_dtype="float8_e4m3fnuz", qmax=240.0), {}, "0.1.20.post1", (),
                  "float8_e4m3fnuz"),
    "rounded_y": ({}, dict(out_dtype=torch.bfloat16), "0.1.20.post1", (), "rounded to bfloat16"),
    "emit_y": ({}, dict(emit_y=True), "0.1.20.post1", (), "copy of y"),
    "two_stage": ({}, dict(path=Path.TWO_STAGE), "0.1.20.post1", (), "one-stage"),
    "static": (dict(mode="static"), {}, "0.1.20.post1", (), "static"),
    "no_per_token": ({}, {}, "0.1.10.post2", (4346,), "post_per_token_quant"),
    "group_gemma": (dict(mode="per_group", group=128), dict(gemma=True), "0.1.20.post1", (),
                    "gemma_norm"),
    "group_size": (dict(mode="per_group", group=384), {}, "0.1.20.post1", (), "power of two"),
    "no_per_group": (dict(mode="per_group", group=128), {}, "0.1.13", (2890, 4346),
                     "fused_ar_rms_per_group_quant"),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_epilogue_not_taken_when_the_math_differs(install, group_name, case) -> None:
    spec_kw, call_kw, version, accepted, word = MISMATCHES[case]
    be, cls = install(version, accepted)
    hidden = 1536 if case == "group_size" else 4096
    x, r, w = make(8, hidden)
    spec = QuantSpec(**{**FN, **spec_kw})
    c = quant_call(group_name, x, r, w, spec, **call_kw)
    if spec.mode == "static":
        c.scale = torch.tensor(0.01)
    epilogue, why = fused_epilogue(be.caps, c)
    assert epilogue is None and word in why
    out = be.run(c)
    if c.out_dtype == x.dtype:  # the norm is fused, the quantization left to the op
        assert isinstance(out, Outputs) and out.q is None and out.scales is None
        assert only(cls).fused()[0].get("post_per_token_quant", False) is False
        assert_close_to(out.y, oracle(x, r, w, gemma=c.spec.gemma)[0])
    else:  # AITER writes y in bfloat16 only: nothing fused
        assert isinstance(out, str) and word in out and "bfloat16 only" in out
        assert all(not ca.fused() for ca in cls.created)
    assert standins.all_violations(cls) == []


def near_midpoints(fp8: torch.dtype, qmax: float, amax: float = 1.1) -> torch.Tensor:
    """A row of 1024 whose groups of 128 each hold ``amax`` and values that, scaled by
    ``amax / qmax``, sit on and next to the midpoints between FP8 values: where dividing
    by the scale and multiplying by its reciprocal round to different FP8 values."""
    grid = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    grid = grid[torch.isfinite(grid) & (grid > 0)].unique()
    mids = (grid[:-1] + grid[1:]) / 2 * (torch.tensor(amax) / qmax)
    near = torch.cat([torch.nextafter(mids, mids * 2), mids, torch.nextafter(mids, mids * 0)])
    near = near[near < amax]
    groups = [torch.cat([torch.tensor([amax]), near.roll(-127 * i)[:127]]) for i in range(8)]
    return torch.cat(groups)


def test_aiter_formula_is_quantize_for_the_specs_taken(monkeypatch) -> None:
    """The premise of the matching rule: AITER's epilogue (the stand-in's transcription)
    and ``quant.quantize`` give the same bits for every spec the backend takes, except
    an all-zero row (0/0 in the spec's formula, zeros with scale 1 in AITER's); and
    differ for what it refuses."""
    g = torch.Generator().manual_seed(3)
    for fp8, qmax in ((torch.float8_e4m3fn, 448.0), (torch.float8_e4m3fnuz, 240.0)):
        y = torch.randn(64, 1024, generator=g) * torch.logspace(-6, 2, 64)[:, None]
        y[5] = 0
        y[6] = near_midpoints(fp8, qmax)
        nonzero = torch.ones(64, dtype=torch.bool)
        nonzero[5] = False
        monkeypatch.setattr(standins, "fp8", fp8)
        name = str(fp8).removeprefix("torch.")
        for mode, group in (("per_token", 1024), ("per_group", 128)):
            spec = QuantSpec(mode=mode, fp8_dtype=name, qmax=qmax, group=group if mode ==
                             "per_group" else 0)
            q_aiter, s_aiter = standins._Release._fp8_epilogue(y, group)
            q_spec, s_spec = quantize(y, spec)
            assert torch.equal(q_aiter[nonzero].view(torch.uint8),
                               q_spec[nonzero].view(torch.uint8))
            assert torch.equal(s_aiter[nonzero].reshape(-1), s_spec[nonzero].reshape(-1))
            assert (q_aiter[5].float() == 0).all() and (s_aiter[5] == 1).all()
            for refused in (dict(scale_floor=VLLM_FLOOR), dict(reciprocal=True),
                            dict(qmax=qmax - 16)):
                q_other, _ = quantize(y, replace(spec, **refused))
                assert not torch.equal(q_aiter[nonzero].view(torch.uint8),
                                       q_other[nonzero].view(torch.uint8)), refused
            rounded, _ = quantize(y.to(torch.bfloat16), spec)
            assert not torch.equal(q_aiter[nonzero].view(torch.uint8),
                                   rounded[nonzero].view(torch.uint8))


# -- through the op, on every release line ---------------------------------------------------

@pytest.fixture
def selected(monkeypatch):
    monkeypatch.setattr(backends, "_instances", {})
    backends.set_backend("aiter")
    yield
    backends.set_backend(None)


@pytest.mark.parametrize("version", list(LINES))
@pytest.mark.parametrize("path", ["auto", "one_stage", "two_stage"])
def test_first_forward_on_every_line(install, group_name, selected, version, path) -> None:
    """The op on each release line: no TypeError or anything else, and the result of
    whichever ran (AITER on this rank and its equal peer, or the reference over the fake
    group, whose all-reduce returns the input) matches float64."""
    _, cls = install(version)
    for tokens in (0, 8, 81):
        x, r, w = make(tokens, 4096)
        y, h = fused_allreduce_rmsnorm(x, w, EPS, group_name, residual=r, path=path)
        assert y.shape == h.shape == x.shape
        ran_aiter = any(c["args"][0] is x for ca in cls.created for c in ca.fused())
        y_want, h_want = oracle(x, r, w, ranks=WORLD if ran_aiter else 1)
        assert_close_to(h, h_want)
        assert_close_to(y, y_want)
    assert standins.all_violations(cls) == []


def test_quant_through_the_op(install, group_name, selected) -> None:
    _, cls = install("0.1.20.post1")
    x, r, w = make(8)
    taken = QuantSpec(**FN)
    y, h, q, scales = fused_allreduce_rmsnorm_quant(x, w, EPS, group_name, taken, residual=r,
                                                    path="one_stage", out_dtype=torch.float32)
    assert y.numel() == 0 and only(cls).fused()[0]["post_per_token_quant"] is True
    y64, h64 = oracle(x, r, w)
    check_fp8(q, scales, y64, x.shape[-1], 448.0)
    # vLLM's form (bf16 y, floored scale): the norm on AITER, the quantization after it.
    vllm = QuantSpec(mode="per_token", qmax=448.0, scale_floor=VLLM_FLOOR, reciprocal=True)
    y, h, q, scales = fused_allreduce_rmsnorm_quant(x, w, EPS, group_name, vllm, residual=r,
                                                    path="one_stage", emit_y=True)
    assert only(cls).fused()[1]["post_per_token_quant"] is False
    assert_close_to(y, y64)
    check_fp8(q, scales, y.double(), x.shape[-1], 448.0)


# -- inside vLLM --------------------------------------------------------------------------

class _Coordinator:
    """The parts of vLLM's GroupCoordinator the backend reads."""

    def __init__(self, group_name: str, aiter_ar_comm: Any) -> None:
        self.unique_name = "tp:0"
        self.device_group = SimpleNamespace(group_name=group_name)
        self.device_communicator = SimpleNamespace(aiter_ar_comm=aiter_ar_comm)


@pytest.fixture
def vllm_groups(monkeypatch):
    ps = pytest.importorskip("vllm.distributed.parallel_state",
                             reason="vLLM is not installed: no vLLM communicator to find")
    monkeypatch.setattr(ps, "_groups", {})
    keep: list[_Coordinator] = []

    def register(group_name: str, aiter_ar_comm: Any) -> None:
        coord = _Coordinator(group_name, aiter_ar_comm)
        keep.append(coord)
        ps._groups[coord.unique_name] = weakref.ref(coord)

    return register


def test_reuses_vllms_aiter_communicator(install, env, group_name, vllm_groups) -> None:
    from vllm.distributed.device_communicators.aiter_custom_all_reduce import AiterCustomAllreduce

    be, cls = install("0.1.20.post1")
    impl = cls(None, torch.device("cpu"))
    cls.created.clear()
    wrapper = AiterCustomAllreduce.__new__(AiterCustomAllreduce)  # vLLM's class, AITER replaced
    wrapper._impl = impl
    vllm_groups(group_name, wrapper)
    env.capturing = True  # vLLM made it: a first call under capture is fine
    x, r, w = make(8)
    out = be.run(call(group_name, x, r, w, Path.ONE_STAGE))
    assert cls.created == [] and env.new_groups == []
    (got,) = impl.fused()
    assert got["use_1stage"] is True and got["out"] is out.y and got["registered"] is False


def test_declines_in_vllm_without_aiter_allreduce(install, group_name, vllm_groups) -> None:
    be, cls = install("0.1.20.post1")
    vllm_groups(group_name, None)
    x, r, w = make(8)
    assert "VLLM_ROCM_USE_AITER_CUSTOM_AR" in be.run(call(group_name, x, r, w, Path.ONE_STAGE))
    assert cls.created == []


# -- construction ---------------------------------------------------------------------------

def test_refuses_non_rocm_torch(monkeypatch) -> None:
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    with pytest.raises(RuntimeError, match="ROCm build of torch"):
        AiterBackend("0.1.20.post1")


def test_import_failure_is_not_hidden(env, monkeypatch) -> None:
    import builtins

    real_import = builtins.__import__

    def broken(name, *args, **kwargs):
        if name == "aiter" or name.startswith("aiter."):
            raise OSError("libmodule_custom_all_reduce.so: undefined symbol")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", broken)
    with pytest.raises(OSError, match="undefined symbol"):  # a broken build, as it is
        AiterBackend()
    monkeypatch.setattr(builtins, "__import__", real_import)
    with pytest.raises(RuntimeError, match="amd-aiter") as info:  # not installed
        AiterBackend()
    assert isinstance(info.value.__cause__, ImportError)


def test_standins_carry_the_installed_aiters_signatures(install, group_name) -> None:
    """Where AITER is importable (ROCm): the stand-in of the installed release line has
    no parameter the real class lacks, and every call the backend makes binds to it."""
    try:
        from aiter.dist.device_communicators.custom_all_reduce import CustomAllreduce as real
    except Exception as exc:  # AITER's import loads HIP extensions
        pytest.skip(f"AITER is not importable here ({type(exc).__name__}: {exc}); the "
                    "stand-ins are checked against the real signatures only where it is")
    key = parse_version(installed.version() or "")
    assert key is not None, installed.version()
    line = [c for c in standins.LINES if c.KEY <= key][-1]
    for name in ("__init__", "should_custom_ar", "fused_ar_rms", "fused_ar_rms_per_group_quant"):
        if hasattr(line, name):
            real_params = inspect.signature(getattr(real, name)).parameters
            for p in inspect.signature(getattr(line, name)).parameters.values():
                assert p.name in real_params and real_params[p.name].kind == p.kind, (name, p)
    be, cls = install(line.VERSION, (2890, 4346))
    x, r, w = make(8, 4096)
    for path in (Path.ONE_STAGE, Path.TWO_STAGE):
        be.run(call(group_name, x, r, w, path))
    be.run(quant_call(group_name, x, r, w, QuantSpec(**FN)))
    be.run(quant_call(group_name, x, r, w, QuantSpec(mode="per_group", group=128)))
    for ca in cls.created:
        for name, args, kwargs in ca.calls:
            inspect.signature(getattr(real, name)).bind(object(), *args, **kwargs)
