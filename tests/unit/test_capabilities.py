"""The gate answers a kernel path exactly when the backend's run-time check accepts the call.

One grid of shapes (hidden sizes past every rule's edge, among them rows wider
than a Triton program), dtypes, world sizes and token counts, for every backend:
the reference, Triton (its own check, reached through ``run_on`` with the
symmetric buffer stubbed out) and AITER at every release line that can choose
its path (the stand-ins of ``tests/helpers/aiter_standins.py``; its check is the
backend's own, before anything is allocated).  Then what the op does with a
path baked for a row the backend cannot take: it runs the reference and says why.
"""

from __future__ import annotations

import itertools
from typing import Callable, Optional

import pytest
import torch

from fusion_pass import backends, gate, op
from fusion_pass.backends import Call
from fusion_pass.backends.reference import ReferenceBackend
from fusion_pass.testing.calls import make_call
from fusion_pass.gate import Path, TokenRange

import test_aiter_backend_cpu as aiter_tests
from test_aiter_backend_cpu import env, group_name, install  # noqa: F401  (fixtures)

HIDDENS = (128, 256, 520, 2880, 4096, 4104, 8192, 8200, 12288, 16384, 16392, 18432, 20480,
           24576, 32768)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
WORLDS = (2, 4, 8)
TOKENS = (1, 3, 8, 80, 81, 128, 1024, 4096)
RANGES = (TokenRange(1, 80), TokenRange(81, 4096), TokenRange(1, 8), TokenRange(3, 3))
KERNEL_PATHS = (Path.ONE_STAGE, Path.TWO_STAGE)
REFUSED = "stub: the symmetric buffer"

Check = Callable[[int, torch.dtype, int, int, Path], Optional[str]]
"""``(hidden, dtype, world size, tokens, path)`` -> why the backend refuses the call, or None."""


def meta_call(hidden: int, dtype: torch.dtype, tokens: int, path: Path) -> Call:
    # Meta tensors: the checks read shapes and dtypes only, so the grid allocates nothing.
    x = torch.empty(tokens, hidden, dtype=dtype, device="meta")
    return make_call(x, torch.empty_like(x), torch.empty(hidden, dtype=dtype, device="meta"),
                     1e-6, "g", path)


def agrees(limits: gate.BackendLimits, check: Check, dtypes=DTYPES) -> int:
    """Assert the agreement over the grid; the number of fused decisions checked."""
    fused = 0
    for hidden, dtype, world in itertools.product(HIDDENS, dtypes, WORLDS):
        for n in TOKENS:
            d = gate.decide(hidden, dtype, world, n, limits=limits)
            ok = {p: check(hidden, dtype, world, n, p) for p in KERNEL_PATHS}
            if d.fused:
                fused += 1
                assert ok[d.path] is None, (hidden, dtype, world, n, d, ok[d.path])
            elif "drop the remainder" not in d.reason:
                # The one unfused answer a kernel could still run: AITER's two-stage split
                # refuses a count its schedule gives to two-stage (one-stage is not chosen).
                assert all(why is not None for why in ok.values()), (hidden, dtype, world, n, d)
        # A path baked for a token range is one the backend takes at every count in it.
        for rng in RANGES:
            d = gate.decide(hidden, dtype, world, rng, limits=limits)
            if d.path in KERNEL_PATHS:
                for n in (c for c in TOKENS + (rng.start, rng.end)
                          if c is not None and rng.start <= c <= rng.end):
                    assert check(hidden, dtype, world, n, d.path) is None, (hidden, rng, n, d)
    return fused


def test_reference() -> None:
    be = ReferenceBackend()

    def check(hidden, dtype, world, n, path):
        return be.limits.accepts(hidden, dtype, world, n, path)

    assert agrees(be.limits, check) > 0


def test_triton() -> None:
    from fusion_pass.backends import triton_symm

    class Refusing:
        generation = 0

        @staticmethod
        def get(*args):
            return REFUSED

    world = {"size": 2}
    be = triton_symm.TritonBackend(provider=Refusing, world_size=lambda name: world["size"])

    def check(hidden, dtype, ws, n, path):
        world["size"] = ws
        be._plans.clear()
        out = be.run_on(meta_call(hidden, dtype, n, path), -1)
        assert isinstance(out, str)
        return None if out == REFUSED else out  # past every shape rule: it asked for a buffer

    assert agrees(be.limits, check) > 0
    # Rows wider than one program: no kernel path, and the reason says so.
    for hidden in (16392, 18432, 20480, 24576, 32768):
        d = gate.decide(hidden, torch.bfloat16, 2, 8, limits=be.limits)
        assert d.path is Path.UNFUSED and "16384-element row a program holds" in d.reason, d


@pytest.mark.parametrize("version", [v for v, c in aiter_tests.LINES.items()
                                     if c.KEY >= (0, 1, 10, 2)])
def test_aiter(install, monkeypatch, version) -> None:  # noqa: F811
    from fusion_pass.backends.aiter import backend as aiter_backend

    be, cls = install(version)
    world = {"size": 2}
    monkeypatch.setattr(aiter_backend, "c10d_world_size", lambda name: world["size"])

    def check(hidden, dtype, ws, n, path):
        world["size"] = ws
        why = be._unfit(meta_call(hidden, dtype, n, path))
        if not why:  # and the stand-in's transcription of the kernels agrees
            problems, _ = cls.problems(path is Path.ONE_STAGE, hidden, n, ws)
            assert problems == [], (version, hidden, n, ws, path, problems)
        return why or None

    agrees(be.limits, check, dtypes=(torch.bfloat16, torch.float16))


def test_the_op_runs_the_reference_for_a_path_the_backend_cannot_take(monkeypatch) -> None:
    """A graph baked under other limits (or by hand): the op asks the backend's rules."""
    monkeypatch.setattr(op, "c10d_world_size", lambda name: 2)
    backends.set_backend("triton")
    try:
        x = torch.empty(8, 20480, dtype=torch.bfloat16)
        call = make_call(x, None, torch.empty(20480, dtype=torch.bfloat16), 1e-6, "g")
        route = op._route(call, "two_stage")
        assert route.path is Path.UNFUSED and route.said is not None
        assert "16384-element row a program holds" in route.said[1]
        ok = op._route(make_call(x[:, :16384].contiguous(), None,
                                 torch.empty(16384, dtype=x.dtype), 1e-6, "g"), "two_stage")
        assert ok.path is Path.TWO_STAGE
    finally:
        backends.set_backend(None)
