"""FP8 quantization epilogues: what the fused op quantizes ``y`` with, and the torch math.

A :class:`QuantSpec` is everything a quantization of the norm output needs
besides the tensors: the mode (a static per-tensor scale from the checkpoint,
a dynamic scale per token, or per group of ``group`` elements along hidden),
the FP8 dtype, the clamp bound, the floor of a dynamic scale, and whether
``y`` is multiplied by the scale's reciprocal or divided by the scale.  The
last three come from the graph (vLLM's native ``QuantFP8`` multiplies by
``reciprocal()`` and floors the scale at ``1 / (448 * 512)``; its per-group
form divides), so that the fused op computes the same bits as the graph it
replaces.  The spec travels in the op call as a string (:meth:`QuantSpec.encode`).

:func:`quantize` is the unfused math: the reference backend's epilogue and the
oracle's formula.  Every kernel epilogue follows the same steps:

1. ``yq = y`` rounded to its output dtype, then read in fp32 (the graph
   quantizes the norm's output tensor);
2. dynamic: ``scale = max(amax(|yq|) / qmax, scale_floor)`` over the token row
   or over each group; static: the given scale;
3. UE8M0 (per group): the scale rounded up to a power of two,
   ``2 ** ceil(log2(scale))``, after the floor (vLLM's CUDA kernel:
   ``exp2f(ceilf(log2f(fmaxf(y_s, 1e-10f))))``, its ``1e-10f`` folded into the floor);
4. ``q = fp8(clamp(yq * (1 / scale) or yq / scale, -qmax, qmax))``.

Per-group scales are laid out as the graph allocated them (:attr:`QuantSpec.scale_layout`):
row-major ``[tokens, groups]``, or column-major as vLLM's block-FP8 GEMMs read them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

IntLike = Union[int, torch.SymInt]

MODES = ("static", "per_token", "per_group")
SCALE_LAYOUTS = ("row", "col", "col_tma")
# Rows a TMA-aligned column of scales is padded to: 16 bytes of fp32 (vLLM's
# ``get_tma_aligned_size(m, 4)``, DeepGEMM's TMA alignment).
TMA_ALIGN = 4
FP8_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e4m3fnuz": torch.float8_e4m3fnuz}


@dataclass(frozen=True)
class QuantSpec:
    mode: str
    fp8_dtype: str = "float8_e4m3fn"
    qmax: float = 448.0
    group: int = 0
    """Elements per scale along hidden (``per_group`` only)."""
    scale_floor: float = 0.0
    """Lower clamp of a dynamic scale (0: none)."""
    reciprocal: bool = False
    """``y * (1 / scale)`` (True) or ``y / scale`` (False): the graph's choice."""
    scale_layout: str = "row"
    """Where a token's group scales lie (``per_group`` only): ``row``, row-major
    ``[tokens, groups]``; ``col``, column-major (token stride 1, group stride
    ``tokens``: vLLM's ``column_major_scales``); ``col_tma``, column-major with the
    group stride padded to a multiple of :data:`TMA_ALIGN` (``tma_aligned_scales``).
    Column layouts take 2-D inputs ``[tokens, hidden]``, as vLLM's kernels do."""
    ue8m0: bool = False
    """The floored dynamic scale rounded up to a power of two (``per_group`` only:
    vLLM's per-token and static ops have no UE8M0 form)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"fusion_pass: quant mode must be one of {MODES}, not {self.mode!r}")
        if self.fp8_dtype not in FP8_DTYPES:
            raise ValueError(f"fusion_pass: FP8 dtype must be one of {sorted(FP8_DTYPES)}, "
                             f"not {self.fp8_dtype!r}")
        if (self.mode == "per_group") != (self.group > 0):
            raise ValueError("fusion_pass: a group size goes with per_group quantization only")
        if not self.qmax > 0:
            raise ValueError(f"fusion_pass: qmax must be positive, not {self.qmax}")
        if self.scale_layout not in SCALE_LAYOUTS:
            raise ValueError(f"fusion_pass: scale layout must be one of {SCALE_LAYOUTS}, "
                             f"not {self.scale_layout!r}")
        if (self.scale_layout != "row" or self.ue8m0) and self.mode != "per_group":
            raise ValueError("fusion_pass: column-major and UE8M0 scales go with per_group "
                             "quantization only")
        # Made once (eager calls pass it every time), as a plain attribute: Dynamo traces
        # a read of it, not a functools.cached_property (its lock stops a graph).
        object.__setattr__(self, "_encoded", self._encode())

    @property
    def dtype(self) -> torch.dtype:
        return FP8_DTYPES[self.fp8_dtype]

    @property
    def dynamic(self) -> bool:
        return self.mode != "static"

    def encode(self) -> str:
        """The op argument: ``key=value`` pairs, floats in ``repr`` (exact round trip)."""
        return self._encoded

    def _encode(self) -> str:
        # The layout and UE8M0 keys only when not the default: a spec without them
        # encodes as before, so graphs compiled earlier (and their cache keys) still match.
        extra = "" if self.scale_layout == "row" else f",layout={self.scale_layout}"
        extra += ",ue8m0=1" if self.ue8m0 else ""
        return (f"mode={self.mode},fp8={self.fp8_dtype},qmax={self.qmax!r},group={self.group},"
                f"scale_floor={self.scale_floor!r},reciprocal={int(self.reciprocal)}{extra}")

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def decode(text: str) -> "QuantSpec":
        try:
            kv = dict(part.split("=", 1) for part in text.split(","))
            return QuantSpec(mode=kv["mode"], fp8_dtype=kv["fp8"], qmax=float(kv["qmax"]),
                             group=int(kv["group"]), scale_floor=float(kv["scale_floor"]),
                             reciprocal=kv["reciprocal"] == "1",
                             scale_layout=kv.get("layout", "row"), ue8m0=kv.get("ue8m0") == "1")
        except (KeyError, ValueError) as e:
            raise ValueError(f"fusion_pass: malformed quant spec {text!r}: {e}") from None

    def scales_shape(self, x_shape: torch.Size) -> tuple[int, ...]:
        """Shape of the scales output: ``[..., 1]`` per token, ``[..., hidden / group]``
        per group (whatever its layout), ``[0]`` static."""
        if self.mode == "per_token":
            return (*x_shape[:-1], 1)
        if self.mode == "per_group":
            return (*x_shape[:-1], x_shape[-1] // self.group)
        return (0,)

    def scale_strides(self, x_shape: Sequence[IntLike]) -> tuple[IntLike, IntLike]:
        """Element strides of the scales output between tokens and between groups
        (what a kernel needs to store a token's scales)."""
        if self.mode != "per_group":
            return 1, 0
        if self.scale_layout == "row":
            return x_shape[-1] // self.group, 1
        if len(x_shape) != 2:
            raise ValueError(f"fusion_pass: {self.scale_layout} group scales take a 2-D input "
                             f"[tokens, hidden], not {len(x_shape)}-D (as vLLM's kernels)")
        tokens = x_shape[0]
        return 1, tokens if self.scale_layout == "col" else tma_aligned(tokens)

    def empty_scales(self, x: torch.Tensor) -> torch.Tensor:
        """An uninitialised scales output for ``x``, laid out as :meth:`scale_strides` says."""
        shape = self.scales_shape(x.shape)
        if self.scale_layout == "row":
            return x.new_empty(shape, dtype=torch.float32)
        return x.new_empty_strided(shape, self.scale_strides(x.shape), dtype=torch.float32)

    def check(self, hidden: int, scale: Optional[torch.Tensor]) -> None:
        """Errors a caller must fix (they would be wrong on every backend)."""
        if self.mode == "per_group" and hidden % self.group:
            raise ValueError(f"fusion_pass: hidden {hidden} is not a whole number of "
                             f"{self.group}-element groups")
        if (scale is not None) != (self.mode == "static"):
            raise ValueError("fusion_pass: static quantization takes a scale tensor, "
                             "dynamic quantization none")
        if scale is not None and scale.numel() != 1:
            raise ValueError(f"fusion_pass: a static scale has one element, not {scale.numel()}")


def quantize(y: torch.Tensor, spec: QuantSpec,
             scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)`` of ``y`` (the norm output in its own dtype) by ``spec``."""
    yf = y.float()
    if spec.mode == "static":
        assert scale is not None
        s = scale.float().reshape(())
        out_scales = yf.new_empty(0)
        applied = s
    else:
        rows = yf if spec.mode == "per_token" else yf.unflatten(-1, (-1, spec.group))
        s = (rows.abs().amax(-1, keepdim=True) / spec.qmax).clamp(min=spec.scale_floor)
        if spec.mode == "per_token":
            out_scales, applied = s, s
        else:
            if spec.ue8m0:
                s = pow2_ceil(s)
            out_scales = s.squeeze(-1)
            if spec.scale_layout != "row":
                out_scales = spec.empty_scales(y).copy_(out_scales)
            applied = s
        yf = rows
    v = yf * applied.reciprocal() if spec.reciprocal else yf / applied
    q = v.clamp(-spec.qmax, spec.qmax).to(spec.dtype)
    return q.reshape(y.shape), out_scales


def tma_aligned(tokens: IntLike) -> IntLike:
    """``tokens`` rounded up to a multiple of :data:`TMA_ALIGN`, spelled as vLLM's
    ``cdiv(m, 4) * 4`` (``-(m // -4) * 4``) so that a symbolic token count gives the
    same expression as the graph's allocation."""
    return -(tokens // -TMA_ALIGN) * TMA_ALIGN


def pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= ``s`` (fp32, non-negative), from the exponent bits:
    ``2 ** ceil(log2(s))`` computed exactly, with no ``log2`` whose last-bit rounding
    varies between libraries; 0, inf and NaN stay themselves."""
    bits = s.view(torch.int32)
    up = ((bits & 0x7FFFFF) != 0).to(torch.int32)  # any mantissa bit: the next exponent
    p = (((bits >> 23) + up) << 23).view(torch.float32)
    return torch.where((s > 0) & torch.isfinite(s), p, s)


def fp32(value: float) -> float:
    """``value`` rounded to fp32, as torch rounds a Python number it computes with."""
    return float(torch.tensor(value, dtype=torch.float32))


def fp32_div(a: float, b: float) -> float:
    """``a / b`` as fp32 kernels compute it: both operands and the quotient rounded to fp32."""
    return float(torch.tensor(a, dtype=torch.float32) / torch.tensor(b, dtype=torch.float32))
