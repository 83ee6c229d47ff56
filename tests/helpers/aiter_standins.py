"""Stand-ins for AITER's ``CustomAllreduce``, one per release line, written by hand from
ROCm/aiter's sources at the tags each class names and from the PyPI wheel
``amd-aiter`` 0.1.7.post2.dev18.

Each class has its line's signatures of everything the backend touches
(``__init__``, ``should_custom_ar``, ``capture``, ``fused_ar_rms`` and, where the
line has it, ``fused_ar_rms_per_group_quant``), so a keyword the release lacks
raises TypeError exactly as the release would.  Each records its calls and stands
in for the kernels on one rank whose peers hold the same input: it computes what
the release computes (its rounding steps, its FP8 epilogue), and it notes in
``violations`` every call on which the release would throw, write nothing,
silently miscompute, or hit a known corruption bug the test did not accept.  Tests
assert that the backend never causes one.

The rules here are transcribed independently of ``fusion_pass.backends.aiter``
(they are the oracle it is tested against): ``custom_all_reduce.cuh``'s
dispatchers and launchers, and ``custom_all_reduce.py`` of each tag.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

fp8 = torch.float8_e4m3fn
"""What ``aiter.utility.dtypes.fp8`` is on gfx950 (e4m3fnuz on gfx942); the classes'
module attribute, read the way AITER's own module reads it."""


def capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


class _Release:
    """Kernel behaviour of one release; subclasses add the release's signatures."""

    VERSION = ""
    KEY = (0, 0, 0, 0)
    ACCEPTED: frozenset[int] = frozenset()
    """Known bugs (upstream PR numbers) the test opted into."""
    WORLD_SIZE = 2
    RESIDUAL_OUT_FIRST = False
    """Releases before 0.1.10.post2 return ``(res_out, out)``."""
    created: list["_Release"] = []

    def _setup(self, params: dict[str, Any]) -> None:
        self.init_args = (params["group"], params["device"])
        self.init_kwargs = {k: v for k, v in params.items()
                            if k not in ("self", "group", "device", "__class__")}
        if "enable_register_for_capturing" in params:
            self.enable_register_for_capturing = params["enable_register_for_capturing"]
        self.world_size = self.WORLD_SIZE
        self.disabled = False
        self.accept = True
        self._IS_CAPTURING = False
        self.flushes = 0
        self.calls: list[tuple[str, tuple, dict]] = []
        self.violations: list[str] = []
        if capturing():
            self.violations.append("communicator made under graph capture")
        type(self).created.append(self)

    def _should(self, inp: torch.Tensor) -> bool:
        self.calls.append(("should_custom_ar", (inp,), {}))
        nbytes = inp.numel() * inp.element_size()
        if self.KEY >= (0, 1, 18, 0) and nbytes == 0:  # ROCm/aiter#4233
            return False
        return self.accept and not self.disabled and nbytes % 16 == 0 and inp.is_contiguous()

    @contextlib.contextmanager
    def capture(self):
        self._IS_CAPTURING = True
        try:
            yield
        finally:
            self._IS_CAPTURING = False
            self.flushes += 1

    def fused(self) -> list[dict]:
        """kwargs (plus ``args`` and ``fn``) of every fused call so far."""
        return [dict(kw, args=a, fn=name) for name, a, kw in self.calls
                if name != "should_custom_ar"]

    # -- the two entry points ------------------------------------------------------

    def _fused_ar_rms(self, params: dict[str, Any]):
        """``fused_ar_rms`` given its own ``locals()``."""
        kw = {k: v for k, v in params.items() if k not in ("self", "inp", "res_inp", "__class__")}
        inp = params["inp"]
        args = (inp, params["res_inp"]) if "res_inp" in params else (inp,)
        self.calls.append(("fused_ar_rms", args, kw))
        res_inp = params.get("res_inp")
        quant = kw.get("post_per_token_quant", False)
        y, h, q, scales = self._kernel(
            inp, torch.zeros_like(inp) if res_inp is None else res_inp, kw["w"], kw["eps"],
            kw["registered"], kw.get("use_1stage", False), kw.get("gemma_norm", False),
            inp.shape[-1] if quant else None)
        kw["res_out"].copy_(h)
        if quant:
            if kw["out"].dtype != fp8:
                self.violations.append(f"FP8 output of dtype {kw['out'].dtype}, the kernel "
                                       f"writes {fp8}")
            kw["out"].copy_(q)
            kw["scale_out"].copy_(scales.reshape(kw["scale_out"].shape))
            return kw["out"], kw["res_out"], kw["scale_out"]
        kw["out"].copy_(y)
        return (kw["res_out"], kw["out"]) if self.RESIDUAL_OUT_FIRST else (kw["out"], kw["res_out"])

    def _per_group_quant(self, params: dict[str, Any]):
        """``fused_ar_rms_per_group_quant`` given its own ``locals()``: it allocates its outputs."""
        kw = {k: v for k, v in params.items() if k not in ("self", "inp", "res_inp", "__class__")}
        inp, res_inp, group = params["inp"], params["res_inp"], kw["group_size"]
        self.calls.append(("fused_ar_rms_per_group_quant", (inp, res_inp), kw))
        tpg = group // (16 // inp.element_size())
        if group % (16 // inp.element_size()) or tpg & (tpg - 1) or tpg > 64 \
                or inp.shape[-1] % group:
            self.violations.append(f"per-group quant rejects group {group}")
            raise ValueError(f"per-group quant: unsupported group_size {group}")
        _, h, q, scales = self._kernel(inp, res_inp, kw["w"], kw["eps"], kw["registered"],
                                       kw["use_1stage"], False, group)
        return q, h, scales

    # -- the kernels ------------------------------------------------------------

    def _kernel(self, inp, res_inp, w, eps, registered, use_1stage, gemma, quant_group):
        """``(y, h, q, scales)`` as the release computes them; notes what it would break."""
        n = inp.shape[-1]
        m = inp.numel() // n if n else 0
        if inp.dtype not in (torch.bfloat16, torch.float16) or w.dtype != inp.dtype:
            self.violations.append(f"dtypes {inp.dtype}, {w.dtype}")
        if registered and not (self._IS_CAPTURING and capturing()):
            self.violations.append("registered input outside AITER's capture context")
        problems, throws = self.problems(use_1stage, n, m, self.world_size, quant_group is not None)
        self.violations += problems
        if throws:
            raise RuntimeError(f"AITER {self.VERSION}: {problems[-1]}")

        t = inp.dtype
        reduced = (inp.float() * self.world_size).to(t)
        if use_1stage and self._one_stage_takes(n):
            # the norm reads the fp32 sum of the rounded reduction and the residual
            acc = reduced.float() + res_inp.float()
            h = acc.to(t)
        else:  # the second stage adds in the input dtype and normalises that
            h = (reduced.float() + res_inp.float()).to(t)
            acc = h.float()
        wf = w.float() + 1.0 if gemma else w.float()
        y32 = acc * torch.rsqrt(acc.pow(2).mean(-1, keepdim=True) + eps) * wf
        if quant_group is None:
            return y32.to(t), h, None, None
        return (None, h) + self._fp8_epilogue(y32, quant_group)

    @staticmethod
    def _fp8_epilogue(y32: torch.Tensor, group: int):
        """``scale = amax / FP8_MAX`` (1 for an all-zero group), ``q = fp8(y / scale)``."""
        rows = y32.unflatten(-1, (-1, group))
        amax = rows.abs().amax(-1, keepdim=True)
        scale = torch.where(amax == 0, torch.ones_like(amax), amax / torch.finfo(fp8).max)
        return (rows / scale).to(fp8).flatten(-2), scale.squeeze(-1)

    @classmethod
    def _one_stage_takes(cls, n: int) -> bool:
        if cls.KEY < (0, 1, 12, 0):  # the hidden size was a template parameter
            return n in (512, 1024, 2048, 4096)
        return n % 8 == 0 and n // 8 <= 1024

    @classmethod
    def problems(cls, use_1stage: bool, n: int, m: int, ws: int,
                 quant: bool = False) -> tuple[list[str], bool]:
        """What a call of ``m`` tokens x ``n`` (a 2-byte dtype) over ``ws`` ranks would break
        on this release, and whether the release throws on it (then last in the list)."""
        out: list[str] = []
        one = use_1stage and cls._one_stage_takes(n)
        packs = n // 8
        if use_1stage and not one:
            out.append(f"use_1stage silently ignored for hidden {n}")
        if ws not in (2, 4, 8):
            out.append(f"world size {ws}")
        if m == 0:
            out.append("0 tokens launched")
        if n % 8:
            out.append(f"hidden {n} is not whole 16-byte packs")
        if one and cls.KEY < (0, 1, 19, 1) and 4346 not in cls.ACCEPTED:
            out.append("one-stage without its end barrier (ROCm/aiter#4346)")
        if not one:
            if quant:
                out.append("two-stage FP8 kernel (other limits than the two-stage norm)")
            if (m * packs) % ws:
                out.append(f"two-stage drops the remainder of {m} x {packs} packs / {ws}")
            if cls.KEY < (0, 1, 14, 0) and 2890 not in cls.ACCEPTED:
                out.append("two-stage with relaxed ordering (ROCm/aiter#2890)")
            if cls.KEY < (0, 1, 12, 0) and ((2 * n) % 1024 or not 1024 <= 2 * n <= 32768):
                out.append(f"two-stage writes nothing for hidden {n}")
        if one and cls.KEY < (0, 1, 17, 0) and m > 80:  # ROCm/aiter#3745
            out.append(f"one-stage launcher throws for {m} tokens")
            return out, True
        if not one and cls.KEY >= (0, 1, 12, 0) and not 64 <= packs <= 2048:
            out.append(f"two-stage throws 'n too {'small' if packs < 64 else 'large'}'")
            return out, True
        return out, False


def release(cls: type, version: str, key: tuple[int, int, int, int],
            accepted: frozenset[int] = frozenset()) -> type:
    """``cls`` as release ``version``, with the known bugs the test accepts."""
    return type(f"{cls.__name__}[{version}]", (cls,),
                {"VERSION": version, "KEY": key, "ACCEPTED": accepted, "created": []})


# -- the release lines ---------------------------------------------------------------

class NoResidual(_Release):
    """v0.1.7, v0.1.7.post1: ``fused_ar_rms`` takes no residual input."""

    RESIDUAL_OUT_FIRST = True

    def __init__(self, group, device, max_size=8192 * 1024 * 8) -> None:
        self._setup(locals())

    def should_custom_ar(self, inp):
        return self._should(inp)

    def fused_ar_rms(self, inp, *, res_out=None, out=None, w, eps, registered=False):
        return self._fused_ar_rms(locals())


class ResidualNoPathChoice(NoResidual):
    """PyPI ``amd-aiter`` 0.1.7.post2.dev18, and v0.1.7.post2 .. v0.1.10.post1: a residual
    (ROCm/aiter#1401), no ``use_1stage`` (always the two-stage kernel)."""

    def fused_ar_rms(self, inp, res_inp, *, res_out=None, out=None, w, eps, registered=False):
        return self._fused_ar_rms(locals())


class UseOneStage(ResidualNoPathChoice):
    """v0.1.10.post2: ``use_1stage`` (ROCm/aiter#1949)."""

    RESIDUAL_OUT_FIRST = False

    def __init__(self, group, device, max_size=8192 * 1024 * 8 * 2) -> None:
        self._setup(locals())

    def fused_ar_rms(self, inp, res_inp, *, res_out=None, out=None, w, eps, registered=False,
                     use_1stage=False):
        return self._fused_ar_rms(locals())


class PerTokenQuant(UseOneStage):
    """v0.1.10.post3 .. v0.1.13.post1: ``scale_out``, ``post_per_token_quant``
    (ROCm/aiter#1990); from v0.1.11 ``__init__`` takes ``enable_register_for_capturing``."""

    def __init__(self, group, device, max_size=8192 * 1024 * 8 * 2,
                 enable_register_for_capturing=True) -> None:
        self._setup(locals())

    def fused_ar_rms(self, inp, res_inp, *, res_out=None, out=None, scale_out=None, w, eps,
                     registered=False, use_1stage=False, post_per_token_quant=False):
        return self._fused_ar_rms(locals())


class PerGroupQuant(PerTokenQuant):
    """v0.1.14 .. v0.1.16.post6: ``fused_ar_rms_per_group_quant`` (ROCm/aiter#2823);
    ``fused_ar_rms`` gains ``out_hidden_dim`` (0.1.16); ``should_custom_ar`` gains
    ``prefill_support`` (0.1.13)."""

    def should_custom_ar(self, inp, prefill_support=False):
        return self._should(inp)

    def fused_ar_rms(self, inp, res_inp, *, res_out=None, out=None, scale_out=None, w, eps,
                     registered=False, use_1stage=False, post_per_token_quant=False,
                     out_hidden_dim=0):
        return self._fused_ar_rms(locals())

    def fused_ar_rms_per_group_quant(self, inp, res_inp, *, w, eps, group_size=128,
                                     registered=False, use_1stage=False, emit_bf16=False):
        return self._per_group_quant(locals())


class Gemma(PerGroupQuant):
    """v0.1.18 .. v0.1.19.post2: ``gemma_norm`` (ROCm/aiter#3792, from 0.1.17) and
    ``emit_bf16`` on ``fused_ar_rms``."""

    def fused_ar_rms(self, inp, res_inp, *, res_out=None, out=None, scale_out=None, w, eps,
                     registered=False, use_1stage=False, post_per_token_quant=False,
                     out_hidden_dim=0, gemma_norm=False, emit_bf16=False):
        return self._fused_ar_rms(locals())


class Current(Gemma):
    """v0.1.20 .. v0.1.20.post1: ``__init__``'s default buffer is 1 GiB;
    ``fused_ar_rms_per_group_quant`` has ``transpose_scale``."""

    def __init__(self, group, device, max_size=1024 * 1024 * 1024,
                 enable_register_for_capturing=True) -> None:
        self._setup(locals())

    def fused_ar_rms_per_group_quant(self, inp, res_inp, *, w, eps, group_size=128,
                                     registered=False, use_1stage=False, emit_bf16=False,
                                     transpose_scale=False):
        return self._per_group_quant(locals())


LINES = (
    release(NoResidual, "0.1.7.post1", (0, 1, 7, 1)),
    release(ResidualNoPathChoice, "0.1.7.post2.dev18", (0, 1, 7, 2)),  # the PyPI wheel
    release(ResidualNoPathChoice, "0.1.10.post1", (0, 1, 10, 1)),
    release(UseOneStage, "0.1.10.post2", (0, 1, 10, 2)),
    release(PerTokenQuant, "0.1.11", (0, 1, 11, 0)),
    release(PerTokenQuant, "0.1.13", (0, 1, 13, 0)),
    release(PerGroupQuant, "0.1.14", (0, 1, 14, 0)),
    release(PerGroupQuant, "0.1.16.post6", (0, 1, 16, 6)),
    release(Gemma, "0.1.19", (0, 1, 19, 0)),
    release(Gemma, "0.1.19.post1", (0, 1, 19, 1)),
    release(Current, "0.1.20.post1", (0, 1, 20, 1)),
)
"""Every release line, as the version string its installation reports."""


def by_version(version: str) -> type:
    return next(c for c in LINES if c.VERSION == version)


def all_violations(cls: type) -> list[str]:
    return [v for ca in cls.created for v in ca.violations]

