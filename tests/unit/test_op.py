"""The custom op on two gloo ranks: numerics against float64, paths, errors, compile."""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import pytest
import torch

from fusion_pass.testing.spawn import run_ranks

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}


@contextlib.contextmanager
def said() -> Iterator[list[str]]:
    """The messages the package logs inside the block."""
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: messages.append(rec.getMessage())
    log = logging.getLogger("fusion_pass")
    log.addHandler(handler)
    try:
        yield messages
    finally:
        log.removeHandler(handler)


def declining_backend(name: str, why: str) -> type:
    """A fused backend (no limits) that declines every call with ``why`` and
    counts the calls in its ``calls``."""
    import fusion_pass

    class Declining:
        limits = fusion_pass.gate.UNLIMITED
        calls = 0

        def run(self, call):
            Declining.calls += 1
            return why

    Declining.name = name
    return Declining


def make_inputs(rank: int, tokens: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    """Each rank's x, and the shared residual and weight, reproducible on any rank."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    g = torch.Generator().manual_seed(seed * 1000 + 999)
    residual = torch.randn(tokens, hidden, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    return x, residual, weight


def float64_reference(world_size: int, tokens: int, hidden: int, dtype: torch.dtype, eps: float,
                      residual: bool, gemma: bool, seed: int = 0):
    xs = [make_inputs(r, tokens, hidden, dtype, seed) for r in range(world_size)]
    h = sum(x.double() for x, _, _ in xs)
    if residual:
        h = h + xs[0][1].double()
    w = xs[0][2].double() + (1 if gemma else 0)
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w
    return y, h


def _op_cases(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    import fusion_pass
    from fusion_pass import backends

    group = dist.group.WORLD.group_name
    out: dict = {}
    for dtype in DTYPES:
        for tokens, hidden in [(1, 64), (7, 2880), (81, 128), (3, 4096)]:
            for residual in (False, True):
                for path in ("auto", "one_stage", "two_stage", "unfused"):
                    x, r, w = make_inputs(rank, tokens, hidden, dtype)
                    y, h = fusion_pass.fused_allreduce_rmsnorm(
                        x, w, 1e-6, group, residual=r if residual else None, path=path)
                    out[(str(dtype), tokens, hidden, residual, path)] = (y, h)
    x, r, w = make_inputs(rank, 5, 64, torch.bfloat16)
    out["gemma"] = fusion_pass.fused_allreduce_rmsnorm(x, w, 1e-5, group, residual=r, gemma=True)
    out["3d"] = fusion_pass.fused_allreduce_rmsnorm(x.view(1, 5, 64), w, 1e-6, group, residual=r.view(1, 5, 64))
    out["2d"] = fusion_pass.fused_allreduce_rmsnorm(x, w, 1e-6, group, residual=r)

    # Bad input: clear errors before any collective, identical on every rank.
    errors = {}
    for name, call in {
        "path": lambda: fusion_pass.fused_allreduce_rmsnorm(x, w, 1e-6, group, path="fast"),
        "weight": lambda: fusion_pass.fused_allreduce_rmsnorm(x, w[:10], 1e-6, group),
        "residual": lambda: fusion_pass.fused_allreduce_rmsnorm(x, w, 1e-6, group, residual=r[:2]),
    }.items():
        try:
            call()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    out["errors"] = errors

    # A backend that declines every input: the op falls back and says so once.
    Declining = declining_backend("declining", "declines everything (test)")

    # Which path a fused backend is asked for, per requested path and token count.
    class Recording:
        name = "recording"
        limits = fusion_pass.gate.UNLIMITED
        asked: list = []

        def run(self, call):
            Recording.asked.append((call.hidden, call.tokens, call.path.value))
            return "records only (test)"

    backends.register("recording", Recording)
    backends.set_backend("recording")
    try:
        for requested, tokens, hidden in [("one_stage", 100, 64), ("two_stage", 8, 64),
                                          ("runtime", 8, 64), ("runtime", 100, 64),
                                          ("auto", 80, 64), ("auto", 81, 64),
                                          ("runtime", 8, 8200), ("unfused", 8, 64),
                                          ("auto", 0, 64), ("one_stage", 0, 64)]:
            a, b, c = make_inputs(rank, tokens, hidden, torch.bfloat16)
            fusion_pass.fused_allreduce_rmsnorm(a, c, 1e-6, group, residual=b, path=requested)
    finally:
        backends.set_backend(None)
    out["asked"] = Recording.asked

    backends.register("declining", Declining)
    backends.set_backend("declining")
    try:
        with said() as records:
            declined = [fusion_pass.fused_allreduce_rmsnorm(x, w, 1e-6, group, residual=r)
                        for _ in range(3)]
    finally:
        backends.set_backend(None)
    out["declined"] = (declined, Declining.calls, records)

    out.update(_new_interface_cases(rank, group))

    # Under torch.compile: fullgraph, dynamic token dim, the op stays one call.
    def f(a, b):
        return fusion_pass.fused_allreduce_rmsnorm(a, w, 1e-6, group, residual=b)

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    comp = []
    # A functional op must neither return nor modify its inputs; torch checks the
    # first compiled call but only warns unless told to raise.
    with torch._functorch.config.patch(error_on_custom_op_aliasing=True):
        for tokens in (3, 17, 100):
            a, b, _ = make_inputs(rank, tokens, 64, torch.bfloat16, seed=tokens)
            a0, b0 = a.clone(), b.clone()
            got = compiled(a, b)
            unchanged = torch.equal(a, a0) and torch.equal(b, b0)
            comp.append((got, f(a, b), unchanged))
    out["compiled"] = comp

    # Column-major x and residual: the outputs are row-major, as the fake kernels say,
    # so compiled code that reads them by the fakes' strides reads them right.
    from fusion_pass.quant import QuantSpec

    def g(a, b):
        y, h = fusion_pass.fused_allreduce_rmsnorm(a, w, 1e-6, group, residual=b)
        _, _, q, scales = fusion_pass.fused_allreduce_rmsnorm_quant(
            a, w, 1e-6, group, QuantSpec("per_token"), residual=b)
        return y * 2, h + 1, q.float() * scales

    a, b, _ = make_inputs(rank, 5, 64, torch.bfloat16, seed=11)
    at, bt = a.t().contiguous().t(), b.t().contiguous().t()
    eager = fusion_pass.fused_allreduce_rmsnorm(at, w, 1e-6, group, residual=bt)
    out["column_major"] = (torch.compile(g, fullgraph=True)(at, bt), g(a, b),
                           [t.is_contiguous() for t in eager])
    return out


def _new_interface_cases(rank: int, group: str) -> dict:
    """eps as a tensor, y in another dtype, fp32 weights, empty batches, FP8 epilogues."""
    import fusion_pass
    from fusion_pass import backends
    from fusion_pass.backends import Outputs, reference
    from fusion_pass.quant import QuantSpec

    out: dict = {}
    x, r, w = make_inputs(rank, 6, 256, torch.bfloat16, seed=3)
    out["eps_float"] = fusion_pass.fused_allreduce_rmsnorm(x, w, 1e-5, group, residual=r)
    out["eps_tensor"] = fusion_pass.fused_allreduce_rmsnorm(
        x, w, torch.tensor(1e-5, dtype=torch.float64), group, residual=r)
    out["fp32_weight_fp32_y"] = fusion_pass.fused_allreduce_rmsnorm(
        x, w.float(), 1e-5, group, residual=r, out_dtype=torch.float32)

    # No tokens: empty outputs, and no collective (a rank-skewed collective would hang).
    launched = []
    real = reference.all_reduce
    reference.all_reduce = lambda *a: launched.append(a) or real(*a)
    try:
        empty = fusion_pass.fused_allreduce_rmsnorm(x[:0], w, 1e-5, group, residual=r[:0])
        qempty = fusion_pass.op.fused_allreduce_rmsnorm_quant(
            x[:0], w, 1e-5, group, QuantSpec("per_group", group=128), residual=r[:0])
    finally:
        reference.all_reduce = real
    out["empty"] = ([tuple(t.shape) for t in empty] + [tuple(t.shape) for t in qempty],
                    len(launched))

    specs = {
        "static": (QuantSpec("static", reciprocal=True), torch.tensor([0.02])),
        "per_token": (QuantSpec("per_token", scale_floor=1 / (448 * 512), reciprocal=True), None),
        "per_group": (QuantSpec("per_group", group=128, scale_floor=1e-10 / 448), None),
    }
    for name, (spec, scale) in specs.items():
        for residual in (False, True):
            for gemma in (False, True):
                out[("quant", name, residual, gemma)] = fusion_pass.op.fused_allreduce_rmsnorm_quant(
                    x, w, 1e-6, group, spec, scale, residual=r if residual else None,
                    gemma=gemma, emit_y=True)

    # A backend that fuses the norm but leaves the quantization to the op.
    class NormOnly:
        name = "norm-only"
        limits = fusion_pass.gate.UNLIMITED

        def run(self, call):
            y, h = reference.add_rms_norm(reference.all_reduce(call.x, call.group_name),
                                          call.residual, call.weight, call.spec, call.eps)
            return Outputs(y, h)

    backends.register("norm-only", NormOnly)
    backends.set_backend("norm-only")
    try:
        with said() as messages:
            spec, _ = specs["per_token"]
            out["quant_separate"] = [fusion_pass.op.fused_allreduce_rmsnorm_quant(
                x, w, 1e-6, group, spec, residual=r) for _ in range(2)]
    finally:
        backends.set_backend(None)
    out["quant_separate_said"] = [m for m in messages if "quantization runs separately" in m]
    return out


def fp8_oracle(y: torch.Tensor, mode: str, scale, group: int = 128,
               floor: float = 0.0, reciprocal: bool = False):
    """FP8 e4m3fn codes and scales of ``y``, written from the formula (not fusion_pass.quant):
    dynamic scale = max(amax / 448, floor); q = round(clamp(y / s or y * (1/s)))."""
    yf = y.float()
    if mode == "static":
        s = scale.float().reshape(1, 1)
        rows = yf
    elif mode == "per_token":
        s = torch.maximum(yf.abs().amax(-1, keepdim=True) / 448.0, torch.tensor(floor))
        rows = yf
    else:
        rows = yf.reshape(yf.shape[0], -1, group)
        s = torch.maximum(rows.abs().amax(-1, keepdim=True) / 448.0, torch.tensor(floor))
    v = rows * (1.0 / s) if reciprocal else rows / s
    q = torch.clamp(v, -448.0, 448.0).to(torch.float8_e4m3fn).reshape(y.shape)
    return q, s


@pytest.fixture(scope="module")
def op_results():
    return run_ranks(_op_cases, 2)


def _path_case(key) -> bool:
    return isinstance(key, tuple) and key[0] != "quant"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_numerics_against_float64(op_results, dtype) -> None:
    checked = 0
    for key, (y, h) in ((k, v) for k, v in op_results[0].items() if _path_case(k)):
        dt, tokens, hidden, residual, path = key
        if dt != str(dtype):
            continue
        y_ref, h_ref = float64_reference(2, tokens, hidden, dtype, 1e-6, residual, False)
        assert y.dtype == h.dtype == dtype and y.shape == (tokens, hidden)
        torch.testing.assert_close(h.double(), h_ref, rtol=TOL[dtype], atol=TOL[dtype])
        torch.testing.assert_close(y.double(), y_ref, rtol=TOL[dtype], atol=2 * TOL[dtype])
        checked += 1
    assert checked == 4 * 2 * 4


def test_every_path_gives_the_same_result_on_every_rank(op_results) -> None:
    r0, r1 = op_results
    for key in (k for k in r0 if _path_case(k)):
        base = r0[key[:4] + ("auto",)]
        for rank_out in (r0[key], r1[key]):
            assert torch.equal(rank_out[0], base[0]) and torch.equal(rank_out[1], base[1])


def test_gemma_and_leading_dims(op_results) -> None:
    y, h = op_results[0]["gemma"]
    y_ref, h_ref = float64_reference(2, 5, 64, torch.bfloat16, 1e-5, True, True)
    torch.testing.assert_close(y.double(), y_ref, rtol=2e-2, atol=4e-2)
    y3, h3 = op_results[0]["3d"]
    y2, h2 = op_results[0]["2d"]
    assert y3.shape == (1, 5, 64) and torch.equal(y3.view(5, 64), y2) and torch.equal(h3.view(5, 64), h2)


def test_bad_input_raises_clear_errors(op_results) -> None:
    errors = op_results[0]["errors"]
    assert "path must be one of" in errors["path"]
    assert "weight of shape (10,)" in errors["weight"]
    assert "residual" in errors["residual"]


def test_each_path_reaches_the_backend_as_decided(op_results) -> None:
    assert op_results[0]["asked"] == [
        (64, 100, "one_stage"), (64, 8, "two_stage"),   # baked paths pass through
        (64, 8, "one_stage"), (64, 100, "two_stage"),   # runtime: the gate per call
        (64, 80, "one_stage"), (64, 81, "two_stage"),
        (8200, 8, "two_stage"),                         # 1025 packs: never one-stage
    ]  # unfused and 0 tokens: the backend is not asked


def test_declined_input_falls_back_and_says_why_once(op_results) -> None:
    declined, calls, messages = op_results[0]["declined"]
    reference = op_results[0]["2d"]
    assert calls == 3
    for y, h in declined:
        assert torch.equal(y, reference[0]) and torch.equal(h, reference[1])
    said = [m for m in messages if "falls back" in m]
    assert len(said) == 1 and "declines everything (test)" in said[0]


def test_compiled_op_matches_eager(op_results) -> None:
    for (cy, ch), (ey, eh), inputs_unchanged in op_results[0]["compiled"]:
        assert torch.equal(cy, ey) and torch.equal(ch, eh)
        assert inputs_unchanged


def test_column_major_inputs_give_row_major_outputs_compiled_or_not(op_results) -> None:
    for res in op_results:
        compiled, contiguous_inputs, eager_contiguous = res["column_major"]
        for a, b in zip(compiled, contiguous_inputs):
            assert torch.equal(a, b)
        assert eager_contiguous == [True, True]


def test_eps_as_a_tensor_equals_eps_as_a_float(op_results) -> None:
    for res in op_results:
        for a, b in zip(res["eps_float"], res["eps_tensor"]):
            assert torch.equal(a, b)


def test_fp32_weight_gives_fp32_y_against_float64(op_results) -> None:
    y, h = op_results[0]["fp32_weight_fp32_y"]
    assert y.dtype == torch.float32 and h.dtype == torch.bfloat16
    xs = [make_inputs(r, 6, 256, torch.bfloat16, seed=3) for r in range(2)]
    h_ref = (xs[0][0].double() + xs[1][0].double() + xs[0][1].double()).to(torch.bfloat16).double()
    w = xs[0][2].float().double()
    y_ref = h_ref * torch.rsqrt(h_ref.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    # The unfused reference rounds h twice (the bf16 sum, then + residual).
    torch.testing.assert_close(h.double(), h_ref, rtol=2e-2, atol=2e-2)
    y_from_h = h.double() * torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(y.double(), y_from_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.double(), y_ref, rtol=2e-2, atol=4e-2)


def test_empty_batch_returns_empty_outputs_without_a_collective(op_results) -> None:
    shapes, launched = op_results[0]["empty"]
    assert shapes == [(0, 256), (0, 256), (0,), (0, 256), (0, 256), (0, 2)]
    assert launched == 0


@pytest.mark.parametrize("mode", ["static", "per_token", "per_group"])
def test_fp8_epilogue_against_an_independent_oracle(op_results, mode) -> None:
    """Every FP8 code equals the formula's on y (itself checked against float64), and
    every scale too; both ranks agree bitwise."""
    floor = {"static": 0.0, "per_token": 1 / (448 * 512), "per_group": 1e-10 / 448}[mode]
    recip = mode != "per_group"
    for residual in (False, True):
        for gemma in (False, True):
            key = ("quant", mode, residual, gemma)
            y, h, q, scales = op_results[0][key]
            assert all(torch.equal(a.float(), b.float()) for a, b in zip(op_results[0][key], op_results[1][key]))
            xs = [make_inputs(r, 6, 256, torch.bfloat16, seed=3) for r in range(2)]
            hd = xs[0][0].double() + xs[1][0].double() + (xs[0][1].double() if residual else 0)
            hr = hd.to(torch.bfloat16).double()
            wd = xs[0][2].double() + (1 if gemma else 0)
            y_ref = hr * torch.rsqrt(hr.pow(2).mean(-1, keepdim=True) + 1e-6) * wd
            torch.testing.assert_close(y.double(), y_ref, rtol=2e-2, atol=4e-2)
            scale = torch.tensor([0.02]) if mode == "static" else None
            q_ref, s_ref = fp8_oracle(y, mode, scale, floor=floor, reciprocal=recip)
            assert q.dtype == torch.float8_e4m3fn and q.shape == y.shape
            assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
            if mode == "static":
                assert scales.numel() == 0
            else:
                assert torch.equal(scales, s_ref.reshape(scales.shape))
                assert scales.shape == ((6, 1) if mode == "per_token" else (6, 2))


def test_backend_without_fp8_epilogue_gets_the_quant_done_by_the_op(op_results) -> None:
    (y, h, q, scales), second = op_results[0]["quant_separate"]
    ref = op_results[0][("quant", "per_token", True, False)]
    assert torch.equal(q.view(torch.uint8), ref[2].view(torch.uint8)) and torch.equal(scales, ref[3])
    assert y.numel() == 0  # not emitted
    assert len(op_results[0]["quant_separate_said"]) == 1
