"""A call larger than one launch takes (``MAX_INPUT_BYTES``) runs as launches of
consecutive row pieces: each piece a whole call of the protocol on its own slot,
its outputs written at its rows' offsets.  The kernels run in Triton's
interpreter against one simulated rank (``_SimRank``), with a launch limit
patched down to 16 rows so that 40 tokens make three pieces (16, 16, 8)."""

from __future__ import annotations

import json
from typing import Optional

import pytest
import torch

from fusion_pass import gate
from fusion_pass.testing.calls import make_call
from fusion_pass.backends import triton_symm
from fusion_pass.backends.triton_symm import buffers
from fusion_pass.quant import QuantSpec
from fusion_pass.selftest import kernel_checks
from test_triton_backend_cpu import _expected_h, _SimRank, interpret

ONE, TWO = gate.Path.ONE_STAGE, gate.Path.TWO_STAGE
MiB = 1 << 20


@pytest.mark.parametrize("path,hidden,elem,world,rows", [
    (TWO, 8192, 2, 2, 2048),           # 32 MiB exactly
    (TWO, 12288, 2, 2, 1360),          # 1365 rows fit, rounded down to 16
    (TWO, 16384, 4, 8, 512),
    (ONE, 16384, 2, 8, 256),           # the slot (world x rows) caps one-stage: 260 -> 256
    (ONE, 2880, 2, 2, 5824),
])
def test_rows_per_launch(path, hidden, elem, world, rows):
    got = triton_symm.rows_per_launch(path, hidden, elem, world)
    assert got == rows and got % 16 == 0
    assert got * hidden * elem <= triton_symm.MAX_INPUT_BYTES
    need = triton_symm.slot_need(path, got, hidden, torch.float32 if elem == 4 else torch.bfloat16,
                                 world)
    assert buffers.size_class(need, triton_symm.MAX_INPUT_BYTES) is not None


def test_large_calls_are_fused_not_declined():
    lim = triton_symm.LIMITS
    assert lim.max_bytes is None
    assert triton_symm.LIMITS.supports(16384, torch.bfloat16, 2, TWO) is None
    assert gate.decide(8192, torch.bfloat16, 2, 8192, limits=lim).fused


def _piece_case(path: gate.Path, quant: Optional[QuantSpec]) -> dict:
    """One 40-token call with the launch limit at 16 rows, interpreted (run in
    the subprocess :func:`interpreted` starts: the interpreter is chosen when
    Triton is imported)."""
    dtype, W, n, H, piece = torch.float16, 2, 40, 256, 16
    sim = _SimRank(W, 1, dtype)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, H, generator=g).to(dtype) for _ in range(W)]
    res = torch.randn(n, H, generator=g).to(dtype)  # the same on every rank
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
    h_exp = _expected_h(xs, res)
    for k, a in enumerate(range(0, n, piece)):  # three launches, three slots
        sim.prefill(path, k, [x[a:a + piece] for x in xs], h_exp[a:a + piece])

    scale = torch.tensor([0.013]) if quant is not None and quant.mode == "static" else None
    out, be = sim.run(make_call(xs[sim.rank], res, w, 1e-6, "sim", path, quant=quant,
                                scale=scale),
                      MAX_INPUT_BYTES=piece * H * 2)
    firsts = [first for first, _ in next(iter(be._plans.values())).pieces]
    hd = h_exp.double()
    y_ref = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    tol = 2 * torch.finfo(dtype).eps * y_ref.abs() + 1e-5
    case = dict(path=path.value, quant=quant.mode if quant else None, firsts=firsts,
                slot_after=int(sim.buf.state[0]) & 3, h_ok=torch.equal(out.h, h_exp),
                y_ok=bool(((out.y.double() - y_ref).abs() <= tol).all()))
    if quant is not None:
        q_exp, s_exp, v = kernel_checks.fp8_device_math(out.y, quant, scale)
        case.update(s_ok=torch.equal(out.scales, s_exp),
                    q_ok=bool(kernel_checks.same_codes_but_interpreter(out.q, q_exp, v).all()))
    return case


QUANTS = (None, QuantSpec("static"), QuantSpec("per_token", reciprocal=True),
          QuantSpec("per_group", group=64))
"""A static scale too: its scales output is empty, and no piece may advance it."""


@pytest.fixture(scope="module")
def interpreted() -> list[dict]:
    return interpret(__file__)


def test_pieces_write_every_row(interpreted):
    assert {(c["path"], c["quant"]) for c in interpreted} == {
        (p.value, q.mode if q else None) for p in (ONE, TWO) for q in QUANTS}
    for c in interpreted:
        assert c["firsts"] == [0, 16, 32], c
        assert c["slot_after"] == 0, ("three launches go round the three slots once", c)
        assert c["h_ok"] and c["y_ok"], c
        if c["quant"]:
            assert c["s_ok"] and c["q_ok"], c


if __name__ == "__main__":
    print(json.dumps([_piece_case(p, q) for p in (ONE, TWO) for q in QUANTS]))
