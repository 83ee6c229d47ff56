"""How the kernels' outputs are judged, shared by the GPU suite of real ranks
(``tests/gpu``), the simulated group's suite (:mod:`.suite`) and the CPU
tests that run the kernels in Triton's interpreter.

* :func:`violation`: ``h`` and ``y`` against float64, as the largest error over
  its tolerance (above 1 fails);
* :func:`rank_order_h`: the ``h`` the kernels must give bit for bit: the ranks'
  fp32 sum in rank order rounded to the dtype, then the residual added and
  rounded again (``norm.add_residual``);
* :func:`fp8_check`: every FP8 code and scale against torch's quantization of
  the kernel's own ``y``.

Triton's interpreter computes two things its own way, which the checks allow
for when told ``interpreted``: it rounds fp32 to bf16 toward zero
(:func:`machine_round`), and its software FP8 conversion differs from the
hardware's at ties, at a carry into the next power of two and below the
smallest normal (:func:`same_codes_but_interpreter`).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch


def unit(dtype: torch.dtype) -> float:
    """Relative spacing of the dtype's numbers (one ulp at 1.0)."""
    return torch.finfo(dtype).eps


def reference(xs: Sequence[torch.Tensor], residual: Optional[torch.Tensor], w: torch.Tensor,
              gemma: bool, eps: float, multiplier: Optional[float] = None,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """float64 ``(h_ref, magnitude, weight, eps)`` of every rank's ``x``: ``h_ref``
    the exact sum (times the multiplier, plus the residual), ``magnitude`` the sum
    of the absolute values of its terms, the norm's weight (``w + 1`` for Gemma)."""
    h = torch.zeros(xs[0].shape, dtype=torch.float64, device=xs[0].device)
    mag = torch.zeros_like(h)
    for x in xs:
        h += x.double()
        mag += x.double().abs()
    if multiplier is not None:
        h, mag = h * multiplier, mag * abs(multiplier)
    if residual is not None:
        h, mag = h + residual.double(), mag + residual.double().abs()
    return h, mag, w.double() + 1.0 if gemma else w.double(), float(eps)


def violation(y: Optional[torch.Tensor], h: torch.Tensor, ref: tuple) -> torch.Tensor:
    """Largest error over its tolerance, on the device (> 1 fails; NaN fails).

    ``h`` against the exact sum: one ulp of its dtype plus fp32 summation error,
    plus one ulp of the terms' magnitude (large next to ``h`` where the terms
    cancel): every path rounds the ranks' sum to the dtype before the residual
    is added, as the graph's all-reduce does.  ``y`` against the float64 norm of
    the ``h`` it came with (so ``y`` must be normalised from the rounded ``h``):
    two ulps of its own dtype plus the fp32 normalisation error (``y`` None:
    ``h`` alone).  Wrong indexing or a missing row is off by O(1), far beyond
    either."""
    h_ref, mag, wd, eps = ref
    f32 = unit(torch.float32)
    tol_h = unit(h.dtype) * (h_ref.abs() + mag) + 8 * f32 * mag + 1e-30
    v = ((h.double() - h_ref).abs() / tol_h).max()
    finite = torch.isfinite(h).all()
    if y is not None:
        hd = h.double()
        y_ref = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + eps) * wd
        tol_y = 2 * unit(y.dtype) * y_ref.abs() + 64 * f32 * (y_ref.abs() + 1)
        v = torch.maximum(v, ((y.double() - y_ref).abs() / tol_y).max())
        finite = finite & torch.isfinite(y).all()
    return torch.where(finite, v, torch.full_like(v, float("inf")))


def machine_round(t: torch.Tensor, dtype: torch.dtype, interpreted: bool) -> torch.Tensor:
    """fp32 ``t`` converted to ``dtype`` as the kernels' machine does: round to
    nearest even on a GPU; Triton's interpreter rounds to bf16 by dropping the
    low 16 bits (toward zero) and to the other dtypes as torch does."""
    if not interpreted or dtype != torch.bfloat16:
        return t.to(dtype)
    return (t.float().view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)


def rank_order_sum(xs: Sequence[torch.Tensor], interpreted: bool = False) -> torch.Tensor:
    """The ranks' fp32 sum in rank order, rounded to their dtype as the graph's
    all-reduce output is."""
    acc = torch.zeros(xs[0].shape, dtype=torch.float32, device=xs[0].device)
    for x in xs:
        acc += x.float()
    return machine_round(acc, xs[0].dtype, interpreted)


def inductor_h(xs: Sequence[torch.Tensor], residual: Optional[torch.Tensor],
               multiplier: Union[float, torch.Tensor]) -> torch.Tensor:
    """``h`` of a graph with a multiplier as Inductor compiles it on the GPU: the
    multiply (and the residual add) after the all-reduce, one kernel of its own
    (the all-reduce's output is the rounded rank-order sum)."""
    reduced = rank_order_sum(xs)

    def graph(a: torch.Tensor, r: Optional[torch.Tensor]) -> torch.Tensor:
        return a * multiplier if r is None else r + a * multiplier

    torch._dynamo.reset()
    return torch.compile(graph, fullgraph=True, dynamic=False)(reduced, residual)


def rank_order_h(xs: Sequence[torch.Tensor], residual: Optional[torch.Tensor],
                 interpreted: bool = False, multiplier: Optional[float] = None) -> torch.Tensor:
    """``h`` as the kernels compute it: the ranks' fp32 sum in rank order rounded
    as the graph's all-reduce output, then the residual added in fp32 and
    rounded.  At two ranks this is also NCCL's sum plus the residual.  With a
    multiplier (its fp32 value): the rounded sum times it, plus the residual in one
    fused multiply-add (in float64: the product of two fp32 values is exact, the sum
    too unless its terms lie some thirty binades apart), then rounded."""
    h = rank_order_sum(xs, interpreted)
    if multiplier is not None:
        scaled = h.double() * multiplier
        if residual is not None:
            scaled = scaled + residual.double()
        return machine_round(scaled.float(), h.dtype, interpreted)
    if residual is None:
        return h
    return machine_round(h.float() + residual.float(), h.dtype, interpreted)


def vllm_strides(spec, shape: torch.Size) -> tuple[int, ...]:
    """The scales' strides vLLM allocates: row-major, or column-major with the
    group stride the token count (rounded up to 4 for TMA)."""
    if spec.mode != "per_group" or spec.scale_layout == "row":
        return torch.empty(spec.scales_shape(shape)).stride()
    tokens = shape[0]
    return (1, tokens if spec.scale_layout == "col" else (tokens + 3) // 4 * 4)


def fp8_device_math(y: torch.Tensor, spec, scale: Optional[torch.Tensor],
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quant.quantize`` as torch computes it on CUDA, on any device: a tensor
    divided by a Python number is multiplied by the number's fp32 reciprocal
    (the CPU divides).  UE8M0 as vLLM's CUDA kernel writes it,
    ``exp2(ceil(log2(scale)))``.  ``(codes, scales, the clamped values coded)``."""
    yf = y.float()
    inv = torch.tensor(1.0) / torch.tensor(spec.qmax)
    if spec.mode == "static":
        s = scale.float().reshape(())
        out_s = yf.new_empty(0)
        rows = yf
    else:
        rows = yf if spec.mode == "per_token" else yf.unflatten(-1, (-1, spec.group))
        s = (rows.abs().amax(-1, keepdim=True) * inv.to(yf.device)).clamp(min=spec.scale_floor)
        if spec.ue8m0:
            s = torch.exp2(torch.ceil(torch.log2(s)))
        out_s = s if spec.mode == "per_token" else s.squeeze(-1)
    v = (rows * s.reciprocal() if spec.reciprocal else rows / s).clamp(-spec.qmax, spec.qmax)
    return v.to(spec.dtype).reshape(y.shape), out_s, v.reshape(y.shape)


def same_codes_but_interpreter(got: torch.Tensor, want: torch.Tensor,
                               v: torch.Tensor) -> torch.Tensor:
    """Where FP8 codes of ``v`` agree, counting as agreeing where the
    interpreter's software conversion is known to differ from round-to-nearest-
    even: at exact ties (it rounds them away from zero), where the mantissa
    rounds up to the next power of two (it drops the carry: the same sign,
    exponent one lower, mantissa zero), and below the smallest normal (it rounds
    subnormals on a grid twice too coarse: 1.94 units gives 1).  The GPU
    converts in hardware, and the GPU suites compare every code exactly."""
    g, w = got.view(torch.uint8).to(torch.int32), want.view(torch.uint8).to(torch.int32)
    carry = (w - g == 8) & ((w & 7) == 0) & ((g & 7) == 0)
    subnormal = ((w & 0x78) == 0) | ((w & 0x7F) == 0x08)  # or rounded up out of them
    tie = (v - got.float()).abs() == (v - want.float()).abs()
    return (g == w) | carry | subnormal | tie


def fp8_check(q: torch.Tensor, scales: torch.Tensor, y: torch.Tensor, spec, scale,
              interpreted: bool = False) -> dict:
    """The kernel's codes and scales against torch's quantization of the kernel's
    own ``y``: every code compared; a differing code counts as a tie when ``y /
    scale`` lies exactly halfway between the two codes' values (and, where
    ``interpreted``, as the interpreter's conversion where
    :func:`same_codes_but_interpreter` says so).  On a GPU the reference is
    ``quant.quantize`` on the device; in the interpreter, :func:`fp8_device_math`."""
    from ..quant import quantize

    if interpreted:
        q_ref, s_ref, v = fp8_device_math(y, spec, scale)
        shaped = spec.empty_scales(y)
        s_ref = shaped.copy_(s_ref.reshape(shaped.shape)) if s_ref.numel() else s_ref
    else:
        q_ref, s_ref = quantize(y, spec, scale)
        yf = y.float()
        if spec.mode == "static":
            s = scale.float().reshape(())
            rows = yf
        else:  # the reference's scales (their layout aside), one per row or group
            rows = yf if spec.mode == "per_token" else yf.unflatten(-1, (-1, spec.group))
            s = s_ref if spec.mode == "per_token" else s_ref.unsqueeze(-1)
        v = (rows * s.reciprocal() if spec.reciprocal else rows / s).reshape(y.shape)
        v = v.clamp(-spec.qmax, spec.qmax)
    differ = q.view(torch.uint8) != q_ref.view(torch.uint8)
    if interpreted:
        allowed = same_codes_but_interpreter(q, q_ref, v)
    else:
        allowed = (v - q.float()).abs() == (v - q_ref.float()).abs()  # a tie
    tiny = torch.finfo(torch.float32).tiny
    s_ulps = (((scales - s_ref).abs() / (s_ref.abs() * 2.0 ** -23).clamp(min=tiny)).max()
              if s_ref.numel() else torch.zeros((), device=q.device))
    return dict(codes=q.numel(), differ=int(differ.sum()),
                differ_not_tie=int((differ & ~allowed).sum()), scale_ulps=float(s_ulps),
                scales_shape=list(scales.shape),
                strides_ok=scales.stride() == vllm_strides(spec, y.shape)
                and (interpreted or s_ref.stride() == scales.stride()),
                ue8m0_ok=not spec.ue8m0 or bool((torch.frexp(scales)[0] == 0.5).all()),
                dtype_ok=q.dtype == spec.dtype and scales.dtype == torch.float32)
