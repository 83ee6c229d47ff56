"""Device functions shared by the one-stage and two-stage kernels: RMSNorm and the
FP8 epilogue, written once so that every rank and both kernels compute the same bits.

The FP8 steps are those of :mod:`fusion_pass.quant` (and of the torch ops it
runs on CUDA), operation for operation:

1. ``yq``: ``y`` rounded to its output dtype, read back in fp32;
2. dynamic scale ``max(amax(|yq|) * INV_QMAX, FLOOR)``, where ``INV_QMAX`` is
   the fp32 reciprocal of ``qmax`` (torch divides a tensor by a Python number as
   a multiplication by the number's reciprocal in fp32); static: the given scale;
3. UE8M0: the scale rounded up to a power of two from its exponent bits
   (:func:`fusion_pass.quant.pow2_ceil`);
4. ``q = fp8(clamp(yq * (1 / scale) or yq / scale, -QMAX, QMAX))`` with IEEE
   round-to-nearest divisions (``div_rn``: Triton's ``/`` is approximate) and a
   round-to-nearest-even conversion.

``QUANT`` (codes named in :mod:`.call_args`): none, static per tensor, dynamic
per token, dynamic per group of ``GROUP`` elements along the row, the same with
UE8M0 (power-of-two) scales.  The scales' layout (row-major or column-major) is
in the strides alone.

``h`` before its rounding (:func:`add_residual`, :func:`scale_reduced`): the
ranks' fp32 sum rounded to ``DT`` first, as the graph's all-reduce output is,
then times the multiplier ``m`` (``MUL``: none, a float argument, a pointer) and
plus the residual in fp32, one rounding of the result to come, as the compiled
graph computes those two ops in one kernel.
"""

import triton
import triton.language as tl

from .call_args import MUL_NONE, MUL_PTR, QUANT_MODE, QUANT_NONE, QUANT_UE8M0

NO_QUANT = tl.constexpr(QUANT_NONE)
STATIC = tl.constexpr(QUANT_MODE["static"])
PER_TOKEN = tl.constexpr(QUANT_MODE["per_token"])
UE8M0 = tl.constexpr(QUANT_UE8M0)
NO_MUL = tl.constexpr(MUL_NONE)
MUL_POINTER = tl.constexpr(MUL_PTR)


@triton.jit
def load_weight(w_ptr, offs, mask, GEMMA: tl.constexpr):
    """The norm weight in fp32 whatever its dtype (``w + 1`` for Gemma); loaded
    before any wait so that its latency hides behind the exchange."""
    w = tl.load(w_ptr + offs, mask=mask, other=0).to(tl.float32)
    if GEMMA:
        w = w + 1.0
    return w


@triton.jit
def load_eps(eps, EPS_PTR: tl.constexpr):
    """Epsilon in fp32: a kernel argument, or a 0-dim tensor on the device (a
    graph that computes epsilon) loaded here."""
    if EPS_PTR:
        return tl.load(eps).to(tl.float32)
    else:
        return eps


@triton.jit
def load_scale(scale_ptr, QUANT: tl.constexpr):
    """The static FP8 scale in fp32 (1.0, unused, for the other modes)."""
    if QUANT == STATIC:
        return tl.load(scale_ptr).to(tl.float32)
    else:
        return 1.0


@triton.jit
def load_multiplier(mult, MUL: tl.constexpr):
    """The multiplier in fp32: a kernel argument, or a one-element tensor on the
    device loaded here (1.0, unused, without one); before any wait, as the weight."""
    if MUL == MUL_POINTER:
        return tl.load(mult).to(tl.float32)
    else:
        return mult


@triton.jit
def add_residual(acc, res, m, DT: tl.constexpr, MUL: tl.constexpr):
    """``h`` before its rounding: the ranks' fp32 sum ``acc`` rounded to ``DT``
    first, as the graph's all-reduce output is (at world size 2 NCCL's bits: the
    fp32 sum of two bf16 or fp16 values rounds to their correctly rounded sum),
    then the residual added in fp32.  Rounding the three-term sum once instead (FlashInfer, AITER)
    moves ``h`` by an ulp where the graph's two roundings differ, and FP8
    models carry such flips from layer to layer.  With a multiplier ``m``, one fused
    multiply-add of the rounded sum, ``m`` and the residual: the multiply and the
    add are one kernel in the compiled graph, which Triton fuses into one FMA."""
    reduced = acc.to(DT).to(tl.float32)
    if MUL == NO_MUL:
        return reduced + res
    else:
        return tl.fma(reduced, m, res)


@triton.jit
def scale_reduced(acc, m, DT: tl.constexpr, MUL: tl.constexpr):
    """``h`` before its rounding without a residual: the ranks' fp32 sum, or, with a
    multiplier, that sum rounded to ``DT`` times ``m`` in fp32."""
    if MUL == NO_MUL:
        return acc
    else:
        return acc.to(DT).to(tl.float32) * m


@triton.jit
def sum_squares(h):
    """The sum of squares of ``h`` (its dtype) in fp32; masked lanes must be zero.

    Each square is rounded on its own (an FMA with a zero addend): a plain product
    lets the compiler contract squares into the reduction's adds, and it pairs them
    differently in each inlined copy, so the owner of a row and its peers, which
    finish it in different copies, got different fp32 ``rstd`` and so ``y``.  For
    16-bit ``h`` the squares are exact and nothing changes."""
    hf = h.to(tl.float32)
    return tl.sum(tl.fma(hf, hf, 0.0), axis=0)


@triton.jit
def rstd(ss, eps, HIDDEN: tl.constexpr):
    """``rsqrt(mean(h^2) + eps)`` from the row's sum of squares ``ss``."""
    return tl.rsqrt(ss / HIDDEN + eps)


@triton.jit
def apply_scale(v, s, RECIP: tl.constexpr):
    if RECIP:
        return v * tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    else:
        return tl.math.div_rn(v, s)


@triton.jit
def pow2_ceil(s):
    """The smallest power of two >= ``s`` (fp32, non-negative): the exponent field
    plus one when any mantissa bit is set; 0, inf and NaN stay themselves."""
    bits = s.to(tl.uint32, bitcast=True)
    up = tl.where((bits & 0x7FFFFF) != 0, 1, 0).to(tl.uint32)
    p = (((bits >> 23) + up) << 23).to(tl.float32, bitcast=True)
    return tl.where((s > 0) & (s < float("inf")), p, s)


@triton.jit
def to_fp8(v, FNUZ: tl.constexpr):
    """FP8 of ``v`` (already clamped to +-qmax), round to nearest even.

    e4m3fn: the hardware conversion.  e4m3fnuz (bias 8, no negative zero, no
    native conversion on CUDA): its code of ``v`` is e4m3fn's code of ``2 v``
    (the same grid scaled by two, subnormals included) up to 224, the largest
    value both share; 232 is the tie between 224 and 240 (even: 224); negative
    zero becomes zero.  Returned as raw bits (the output is viewed as uint8).
    """
    if FNUZ:
        a = tl.abs(v)
        code = (v * 2.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        top = tl.where(a > 232.0, 0x7F, 0x7E) | tl.where(v < 0, 0x80, 0)
        code = tl.where(a > 224.0, top.to(tl.uint8), code)
        return tl.where(code == 0x80, 0, code).to(tl.uint8)
    else:
        return v.to(tl.float8e4nv)


@triton.jit
def finish_row(h, w, rstd, scale, row, out_off, offs, lo, hi, first, y_ptr, q_ptr, s_ptr,
               s_row, s_group, HIDDEN: tl.constexpr, BLOCK: tl.constexpr,
               EMIT_Y: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr,
               QMAX: tl.constexpr, INV_QMAX: tl.constexpr, FLOOR: tl.constexpr,
               RECIP: tl.constexpr, FNUZ: tl.constexpr, ROUND_N: tl.constexpr):
    """Normalise ``h`` (its dtype; the ``BLOCK`` columns from ``first``) by the
    row's ``rstd`` and store ``y`` and the FP8 epilogue's ``q`` and scales for
    the columns ``[lo, hi)`` alone (a split row's part; the whole row for an
    unsplit one).  A token's amax (per-token scales) needs the whole row in
    ``h``; a group's, the whole group.  ``rstd`` is the same bits in every part
    of a row, so is everything else.  A token's scales go to ``s_ptr + row *
    s_row (+ group * s_group)``: the layout of the scales tensor.  ``ROUND_N``:
    the normalised row is rounded to ``h``'s dtype before the weight multiplies
    it (the graph's ``weight * normed.to(dtype)``: the product of two values of
    that dtype is exact in fp32, so ``y`` is the graph's bits)."""
    smask = (offs >= lo) & (offs < hi) & (offs < HIDDEN)
    n = h.to(tl.float32) * rstd
    if ROUND_N:
        n = n.to(h.dtype).to(tl.float32)
    y = (n * w).to(y_ptr.dtype.element_ty)
    if EMIT_Y:
        tl.store(y_ptr + out_off + offs, y, mask=smask)
    if QUANT != NO_QUANT:
        yq = y.to(tl.float32)
        if QUANT == STATIC:
            v = apply_scale(yq, scale, RECIP)
        elif QUANT == PER_TOKEN:
            s = tl.maximum(tl.max(tl.abs(yq), axis=0) * INV_QMAX, FLOOR)
            v = apply_scale(yq, s, RECIP)
            if lo == 0:
                tl.store(s_ptr + tl.cast(row, tl.int64) * s_row, s)
        else:
            NG: tl.constexpr = BLOCK // GROUP
            yg = tl.reshape(yq, [NG, GROUP])
            s = tl.maximum(tl.max(tl.abs(yg), axis=1) * INV_QMAX, FLOOR)
            if QUANT == UE8M0:
                s = pow2_ceil(s)
            v = tl.reshape(apply_scale(yg, s[:, None], RECIP), [BLOCK])
            g = first // GROUP + tl.arange(0, NG)
            start = g * GROUP
            tl.store(s_ptr + tl.cast(row, tl.int64) * s_row + g * s_group, s,
                     mask=(start >= lo) & (start < hi) & (start < HIDDEN))
        q = to_fp8(tl.minimum(tl.maximum(v, -QMAX), QMAX), FNUZ)
        tl.store(q_ptr + out_off + offs, q, mask=smask)
