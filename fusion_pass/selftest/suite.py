"""The Triton kernels' correctness suite on a simulated group (:mod:`.sim_group`):
N ranks on one GPU, or in Triton's interpreter on the CPU (smaller cases).

    python -m fusion_pass.selftest.suite OUTDIR [--worlds 2 4 8] [--interpret] [--quick]
                                         [--only ID ...]

(``fusion-pass selftest`` runs it for users, with a verdict: :mod:`fusion_pass.tools.selftest`.)

At every N it checks what ``tests/gpu`` checks at two real ranks: every element
of ``h`` and ``y`` against float64; ``h`` the kernels' rank-order sum bit for
bit (:func:`.kernel_checks.rank_order_h`) and every output identical on every
rank; FP8 codes exact in every mode (static, per-token, groups of 128 in every
scale layout, UE8M0, e4m3fnuz); residual and none, Gemma ``1 + w``, fp32 and
16-bit weights, epsilon as a tensor, ``round_normed``, a scalar multiplier (a
literal, a tensor of the model dtype, an fp32 one; on a GPU ``h`` is also
Inductor's compile of the graph's multiply and add, bit for bit), bf16/fp16/fp32, odd
token counts, the widest rows the limits accept; calls back to back with new
data; CUDA graphs captured per rank and replayed with new data, after pauses
and with the ranks' replays skewed; a buffer grown outside capture and the
growth refused inside it (the graph captured before still replays); a rank
held back seconds is waited for; a rank that never comes ends in the
documented error.  ``x`` differs per rank, the residual and the weight are the
same on every rank (tensor parallelism).

How it runs: the cases go in groups, each group in a subprocess of its own (a
kernel that times out leaves the CUDA context unusable, and a group's timeout
ends a hung one); a group writes one JSON line per case as it finishes, and a
case that did not finish is recorded failed with the reason and the end of the
group's output.  On a GPU a first pass runs the groups in parallel only as far
as compiling their kernels (Triton's cache keeps them; the passes share it),
then the groups run one after another, each alone on the GPU.

Writes ``OUTDIR/gpu_tests_1gpu_sim.json`` (interpreter:
``OUTDIR/sim_interpreted.json``): provenance (commit, torch, CUDA and Triton
versions, device, command), every case (N, path, shape, dtype, the layout it
ran, max error over tolerance, pass, and its outcome: passed, failed, or not
run with the reason), a summary line, and the counts by N and path.  Exit
status 0 when at least one case ran and every case passed.  ``--quick`` runs
the subset :data:`QUICK` names; other modules' cases join through
:data:`EXTRA`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, NamedTuple, Optional

import torch

from ..gate import Path
from ..quant import QuantSpec
from . import kernel_checks as kc
from ..testing.calls import make_call
from ..testing.source_digest import source_digest

RESULT = {"gpu": "gpu_tests_1gpu_sim.json", "interpret": "sim_interpreted.json"}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
ONE, TWO = Path.ONE_STAGE.value, Path.TWO_STAGE.value
EPS = 1e-6
TIMEOUT_S = {"gpu": 10.0, "interpret": 30.0}
"""The kernels' wait bound in the ordinary cases: a deadlock fails a case, not the run."""
LATE_S = {"gpu": 5.0, "interpret": 2.0}
"""How long the late rank is held back (its peers wait with a bound of 60 s)."""
NEVER_TIMEOUT_S = 2.0
TIMED_OUT = "timed out waiting for a peer rank"
"""The device assertion's message: what a rank that waits in vain prints."""


# ---------------------------------------------------------------- the cases


def _call(path: str, dtype: str, hidden: int, tokens: int, seed: int, **kw: Any) -> dict:
    """A case of one call shape: ``calls`` calls back to back with new data."""
    case = dict(kind="call", path=path, dtype=dtype, hidden=hidden, tokens=tokens, seed=seed,
                residual=True, gemma=False, wdtype=None, out_dtype=None, eps="float",
                quant=None, scale=None, emit_y=True, round_normed=False, multiplier=None,
                calls=2)
    case.update(kw)
    if isinstance(case["quant"], QuantSpec):
        case["quant"] = case["quant"].encode()
    return case


def _specs(group: int) -> dict[str, QuantSpec]:
    """The FP8 epilogues, with groups of ``group`` columns (128 on a GPU as vLLM's
    block FP8; smaller rows in the interpreter)."""
    floor = 1e-10 / 448.0
    return {
        "static": QuantSpec("static"),
        "static_r": QuantSpec("static", reciprocal=True),
        "token": QuantSpec("per_token", scale_floor=1.0 / (448.0 * 512.0), reciprocal=True),
        "group": QuantSpec("per_group", group=group),
        "col": QuantSpec("per_group", group=group, scale_floor=floor, scale_layout="col"),
        "tma": QuantSpec("per_group", group=group, scale_floor=floor, scale_layout="col_tma"),
        "ue8m0": QuantSpec("per_group", group=group, scale_floor=1e-10, ue8m0=True),
        "ue8m0_tma": QuantSpec("per_group", group=group, scale_floor=1e-10,
                               scale_layout="col_tma", ue8m0=True),
        "fnuz": QuantSpec("per_token", fp8_dtype="float8_e4m3fnuz", qmax=224.0),
    }


def _gpu_sweep() -> list[dict]:
    """Every dtype x hidden x token count of the two-rank GPU suite, both paths, and
    the widest row the limits accept (``MAX_BLOCK``) in every dtype."""
    from ..backends.triton_symm import MAX_BLOCK

    # Every kernel compiles per (N, shape class, rank class): the sweep keeps the shapes
    # that change the code or the layout (one row, odd counts, the one-/two-stage cut at
    # 80, more rows than one launch of the widest row takes) and stays within the
    # suite's compile budget of a few minutes on one GPU host.
    hiddens = {"bfloat16": (128, 2880, 4096, 5120, 7168, 8192, MAX_BLOCK),
               "float16": (128, 8192, MAX_BLOCK), "float32": (2880, MAX_BLOCK)}
    cases = []
    for dtype, hs in hiddens.items():
        for hidden in hs:
            for tokens in (1, 7, 80, 127, 2048):
                for path in (TWO, ONE):
                    cases.append(_call(path, dtype, hidden, tokens, len(cases) + 1,
                                       residual=tokens != 7, gemma=hidden == 5120))
    return cases


def _gpu_features() -> list[dict]:
    """Epsilon as a tensor, weight and output dtypes of their own, every FP8
    epilogue on both kernels, y not emitted, ``round_normed``, Gemma without a
    residual (the two-rank suite's feature cases and more)."""
    s = _specs(128)
    bf, f16, f32 = "bfloat16", "float16", "float32"
    out = [
        _call(ONE, bf, 4096, 8, 5001, wdtype=f32), _call(TWO, bf, 8192, 300, 5002, wdtype=f32),
        _call(ONE, bf, 7168, 3, 5003, out_dtype=f32), _call(TWO, bf, 4096, 129, 5004, out_dtype=f32),
        _call(ONE, f16, 2880, 80, 5005, wdtype=bf, out_dtype=bf),
        _call(ONE, bf, 4096, 8, 5006, eps="tensor"), _call(TWO, bf, 4096, 200, 5007, eps="tensor16"),
        _call(ONE, f32, 8192, 2, 5008, eps="tensor"),
        _call(ONE, bf, 4096, 8, 5009, round_normed=True),
        _call(TWO, f16, 2880, 81, 5010, round_normed=True, wdtype=f16),
        _call(ONE, bf, 8192, 1, 5011, residual=False, gemma=True),
        _call(TWO, bf, 7168, 81, 5012, residual=False, gemma=True),
    ]
    seed = 5100
    for name, scale in (("static", 0.02), ("static_r", 0.013), ("token", None), ("group", None)):
        for path, hidden, tokens in ((ONE, 4096, 8), (ONE, 8192, 1), (TWO, 7168, 81),
                                     (TWO, 4096, 512)):
            seed += 1
            out.append(_call(path, bf, hidden, tokens, seed, quant=s[name], scale=scale))
    out += [
        _call(ONE, bf, 4096, 6, 5201, quant=s["col"]),
        _call(ONE, bf, 7168, 7, 5202, quant=s["tma"]),
        _call(TWO, bf, 4096, 301, 5203, quant=s["tma"], emit_y=False),
        _call(TWO, bf, 7168, 81, 5204, quant=s["ue8m0"]),
        _call(ONE, bf, 4096, 5, 5205, quant=s["ue8m0_tma"]),
        _call(TWO, bf, 8192, 130, 5206, quant=s["ue8m0_tma"]),
        _call(ONE, bf, 8192, 1, 5207, quant=s["group"], emit_y=False),
        _call(TWO, bf, 4096, 512, 5208, quant=s["token"], emit_y=False),
        _call(ONE, bf, 7168, 7, 5209, quant=s["group"], wdtype=f32, out_dtype=f32,
              eps="tensor"),
        _call(TWO, f16, 2880, 200, 5210, quant=s["token"]),
        _call(ONE, f32, 4096, 8, 5211, quant=s["static"], scale=0.05),
        _call(ONE, bf, 4096, 8, 5212, quant=s["fnuz"]),
        _call(TWO, bf, 4096, 200, 5213, quant=s["fnuz"]),
        _call(ONE, bf, 16384, 2, 5214, quant=s["group"]),
        _call(ONE, bf, 8192, 16, 5215, quant=s["static"], scale=0.02, round_normed=True),
    ]
    out += [  # Granite's literal, Gemma's normalizer buffer (no residual), an fp32 tensor
        _call(ONE, bf, 4096, 8, 5301, multiplier="literal"),
        _call(TWO, bf, 4096, 200, 5302, multiplier="literal"),
        _call(ONE, bf, 2880, 1, 5303, residual=False, gemma=True, multiplier="tensor"),
        _call(TWO, bf, 7168, 81, 5304, residual=False, gemma=True, multiplier="tensor"),
        _call(ONE, f16, 8192, 2, 5305, multiplier="tensor32"),
        _call(ONE, f32, 4096, 7, 5306, multiplier="literal"),
        _call(ONE, bf, 7168, 16, 5307, multiplier="literal", quant=s["group"]),
    ]
    return out


def _interpreted_calls(world: int) -> list[dict]:
    """The interpreter's cases: the same kinds, rows of 128-384 elements (groups
    of 64 columns), a few tokens; the widest row once."""
    s = _specs(64)
    bf, f16, f32 = "bfloat16", "float16", "float32"
    out = [
        _call(ONE, f16, 256, 3, 1), _call(TWO, f16, 256, 3, 2),
        _call(ONE, bf, 128, 5, 3, residual=False, gemma=True),
        _call(TWO, bf, 128, 5, 4, residual=False, gemma=True),
        _call(TWO, f32, 128, 1, 5),  # most ranks own no row
        _call(ONE, bf, 256, 2, 6, eps="tensor", wdtype=f32, out_dtype=f32),
        _call(ONE, f16, 384, 3, 7, quant=s["static"], scale=0.013),
        _call(TWO, f16, 256, 3, 8, quant=s["token"], out_dtype=f32),
        _call(ONE, f16, 256, 5, 9, quant=s["ue8m0_tma"]),
        _call(TWO, f16, 256, 5, 10, quant=s["col"], emit_y=False),
        _call(TWO, f16, 256, 5, 11, round_normed=True),
    ]
    if world == 2:
        from ..backends.triton_symm import MAX_BLOCK

        out += [
            _call(ONE, f16, 384, 7, 12, quant=s["group"]), _call(ONE, f32, 128, 7, 13),
            _call(TWO, f16, 256, 7, 14, eps="tensor16", wdtype=bf, out_dtype=bf),
            _call(ONE, f16, 256, 3, 15, quant=s["fnuz"]),
            _call(ONE, f16, 256, 3, 16, round_normed=True),
            _call(ONE, f16, MAX_BLOCK, 1, 17), _call(TWO, f16, MAX_BLOCK, 1, 18),
            _call(ONE, f16, 256, 3, 19, multiplier="literal"),
            _call(TWO, bf, 128, 5, 20, residual=False, multiplier="tensor"),
            _call(TWO, f32, 128, 3, 21, multiplier="tensor32", quant=s["token"]),
        ]
    for c in out:
        c["calls"] = 1 if world == 8 else 2
    return out


BACK_TO_BACK = {
    "gpu": dict(calls=240, cycle=((8, 4096, ONE, None), (81, 4096, TWO, None),
                                  (200, 4096, ONE, None), (1, 8192, ONE, None),
                                  (80, 4096, TWO, None), (3, 16384, ONE, None),
                                  (8, 4096, ONE, "token"), (5, 7168, TWO, None))),
    "interpret": dict(calls=6, cycle=((3, 256, ONE, None), (5, 256, TWO, None),
                                      (2, 128, ONE, "token"), (1, 384, TWO, None))),
}
"""Calls back to back without a host sync, shapes, paths and epilogues in turn
(tokens, hidden, path, FP8 spec name), bf16 on a GPU, fp16 in the interpreter."""


def cases(form: str, world: int) -> dict[str, list[dict]]:
    """The groups of cases at ``world`` ranks, in the order they run, the
    :data:`EXTRA` sources' among them; every case gets its ``id`` and ``world``."""
    if form == "gpu":
        groups = {"sweep": _gpu_sweep(), "features": _gpu_features()}
        protocol = [dict(kind="back_to_back", seed=7000, **BACK_TO_BACK["gpu"]),
                    dict(kind="graph", seed=8000, replays=50),
                    dict(kind="growth", seed=8500), dict(kind="late", seed=9100)]
        groups["protocol"] = protocol
    else:  # one group: a worker survives its timeout, and the rank never coming is last
        groups = {"all": _interpreted_calls(world) + [
            dict(kind="back_to_back", seed=7000, **BACK_TO_BACK["interpret"]),
            dict(kind="growth", seed=8500), dict(kind="late", seed=9100),
            dict(kind="never", seed=9000)]}
    for extra in EXTRA:
        if extra.group in groups or extra.group in ("never", QUICK_GROUP):
            raise ValueError(f"a case source's group is named {extra.group!r}, as another is")
        groups[extra.group] = [dict(c) for c in extra.cases(form, world)]
    if form == "gpu":  # the CUDA context dies: alone, and last
        groups["never"] = [dict(kind="never", seed=9000)]
    for name, cs in groups.items():
        for i, c in enumerate(cs):
            c.update(id=f"n{world}-{name}-{i}", world=world)
    return groups


QUICK_GROUP = "quick"
"""The one group per N that ``--quick`` runs its cases in (a group's subprocess
costs seconds to start; the cases keep the ids they have in the whole suite)."""

QUICK_WORLDS = {"gpu": (2, 8), "interpret": (2,)}
"""The N that ``--quick`` runs at unless told: the smallest group and the largest
(the most ranks in flight, the narrowest share of the GPU, split rows in the most
parts); in the interpreter N = 2 alone, for time."""

QUICK: dict[str, tuple[tuple[str, dict[str, Any]], ...]] = {
    # Under a minute on one H100 from an empty Triton cache: every kernel compiles per
    # N, shape class and rank, so the choice is few shapes that each run other code.
    "gpu": (
        # Decode at Llama-70B's width: at N = 8 split rows whose parts own their columns.
        ("sweep", dict(dtype="bfloat16", hidden=8192, tokens=1, path=ONE)),
        # An odd count without a residual on the two-stage kernel.
        ("sweep", dict(dtype="bfloat16", hidden=8192, tokens=7, path=TWO)),
        # GPT-OSS's width (not a power of two), an odd count past one launch's rows.
        ("sweep", dict(dtype="bfloat16", hidden=2880, tokens=127, path=ONE)),
        # Prefill: more rows than one launch takes, two-stage.
        ("sweep", dict(dtype="bfloat16", hidden=4096, tokens=2048, path=TWO)),
        # fp32 on the two-stage kernel at an odd count (not the widest fp32 rows: their
        # kernels spill, and compiling them for 8 ranks takes half a minute); fp32
        # one-stage in split rows, epsilon a tensor.
        ("sweep", dict(dtype="float32", hidden=2880, tokens=127, path=TWO)),
        ("features", dict(seed=5008)),
        # vLLM's block FP8 (groups of 128, column-major TMA-aligned scales) at
        # DeepSeek's width, one-stage; per-token FP8 without ``y``, two-stage.
        ("features", dict(seed=5202)),
        ("features", dict(seed=5208)),
        # Twenty calls of both paths captured in a CUDA graph per rank, replayed 52
        # times: at N = 2 only (at N = 8 it takes 8 s, and its kernels the compile
        # pass's longest batch).
        ("protocol", dict(kind="graph", world=2)),
    ),
    # In CI on two cores the processes' start costs most: one call of each kernel.
    "interpret": (
        ("all", dict(seed=1)),  # one-stage, fp16, three tokens
        ("all", dict(seed=8)),  # two-stage, the same shape, per-token FP8, fp32 y
    ),
}
"""What ``--quick`` runs (:func:`groups`): (group, fields that a case has, its
``world`` among them where only at that N) for each, and the first
:attr:`Extra.quick` cases of every :data:`EXTRA` source.
Left out: the sweep's other shapes, the other features, calls back to back,
buffer growth, a late and a missing rank (the missing rank's timeout leaves a
CUDA context unusable)."""


def quick_case(form: str, group: str, case: dict) -> bool:
    """Whether ``--quick`` runs ``case`` of ``group`` (:data:`QUICK`)."""
    return any(g == group and all(case.get(k) == v for k, v in fields.items())
               for g, fields in QUICK[form])


def groups(form: str, world: int, quick: bool = False) -> dict[str, list[dict]]:
    """The groups that run at ``world``: those of :func:`cases`, or with ``quick``
    the quick subset in one group, :data:`QUICK_GROUP`."""
    every = cases(form, world)
    if not quick:
        return every
    chosen = [c for name, cs in every.items() for c in cs if quick_case(form, name, c)]
    for extra in EXTRA:
        chosen += every.get(extra.group, [])[:extra.quick]
    return {QUICK_GROUP: chosen}


# ---------------------------------------------------------------- running a case


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


class Inputs:
    """One call of ``case``'s shape on every rank: ``x`` different per rank, the
    residual and the norm weight the same on all (tensor parallelism)."""

    def __init__(self, group: Any, case: dict, seed: int, tokens: Optional[int] = None,
                 hidden: Optional[int] = None, path: Optional[str] = None,
                 quant: Optional[str] = "case") -> None:
        self.device = torch.device("cpu") if group.device < 0 else torch.device("cuda",
                                                                              group.device)
        self.case = case
        dtype = DTYPES[case.get("dtype", "bfloat16" if group.device >= 0 else "float16")]
        tokens = case["tokens"] if tokens is None else tokens
        hidden = case["hidden"] if hidden is None else hidden
        g = _generator(self.device, seed)
        self.xs = [torch.randn(tokens, hidden, device=self.device, generator=g).to(dtype)
                   for _ in range(group.world)]
        self.xs[0][0, :2] = torch.tensor([-0.0, 0.0])  # a negative zero travels as zero
        self.res = (torch.randn(tokens, hidden, device=self.device, generator=g).to(dtype)
                    if case.get("residual", True) else None)
        wdtype = DTYPES[case["wdtype"]] if case.get("wdtype") else dtype
        self.w = (1 + 0.1 * torch.randn(hidden, device=self.device, generator=g)).to(wdtype)
        eps = case.get("eps", "float")
        self.eps: Any = (EPS if eps == "float" else
                         torch.tensor(1e-5, device=self.device).to(
                             dtype if eps == "tensor16" else torch.float32))
        self.eps_value = float(self.eps) if isinstance(self.eps, float) else float(self.eps.float())
        mult = case.get("multiplier")
        self.mult: Any = (None if mult is None else 0.22 if mult == "literal" else
                          torch.tensor(hidden ** 0.5 if mult == "tensor" else 0.7,
                                       device=self.device,
                                       dtype=dtype if mult == "tensor" else torch.float32))
        self.mult_value = (None if self.mult is None else
                           float(torch.tensor(self.mult, dtype=torch.float32)
                                 if isinstance(self.mult, float) else self.mult.float()))
        enc = case.get("quant") if quant == "case" else quant
        self.spec = QuantSpec.decode(enc) if enc else None
        scale = case.get("scale")
        if self.spec is not None and self.spec.mode == "static":
            scale = 0.02 if scale is None else scale
        self.scale = torch.tensor([scale], device=self.device) if scale is not None else None
        out_dtype = DTYPES[case["out_dtype"]] if case.get("out_dtype") else None
        self.calls = [make_call(x, self.res, self.w, self.eps, group.name,
                                Path(path or case["path"]), gemma=case.get("gemma", False),
                                out_dtype=out_dtype, quant=self.spec, scale=self.scale,
                                emit_y=case.get("emit_y", True),
                                round_normed=case.get("round_normed", False),
                                multiplier=self.mult)
                      for x in self.xs]

    def refill(self, seed: int) -> None:
        """New data in the same tensors (what a graph replays on)."""
        g = _generator(self.device, seed)
        for x in self.xs:
            x.copy_(torch.randn(x.shape, device=self.device, generator=g))
        if self.res is not None:
            self.res.copy_(torch.randn(self.res.shape, device=self.device, generator=g))


def _same_bits(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    """Both absent, or the same shape and bits (a negative zero is not a zero)."""
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                              b.contiguous().view(torch.uint8))


def judge(inputs: Inputs, outs: list[Any], interpreted: bool,
          twin: Optional[list[Any]] = None) -> dict[str, Any]:
    """Every rank's outputs of one call: errors over tolerance against float64, ``h``
    the rank-order rule's bits, the outputs the same on every rank, FP8 codes and
    scales (``twin``: the same call with ``y`` emitted, for codes without ``y``)."""
    bad = [f"rank {r}: {o}" for r, o in enumerate(outs) if o is None or isinstance(o, str)]
    if bad:
        return {"max_error": None, "problems": bad}
    call = inputs.calls[0]
    ref = kc.reference(inputs.xs, inputs.res, inputs.w, call.spec.gemma, inputs.eps_value,
                       inputs.mult_value)
    worst = max(float(kc.violation(o.y, o.h, ref)) for o in outs)
    h_rule = kc.rank_order_h(inputs.xs, inputs.res, interpreted, inputs.mult_value)
    first = outs[0]
    problems = []
    if not worst <= 1.0:
        problems.append(f"error {worst:.3g} x tolerance")
    if not all(_same_bits(o.h, h_rule) for o in outs):
        problems.append("h differs from the rank-order sum's bits")
    if inputs.mult is not None and not interpreted and not _same_bits(
            first.h, kc.inductor_h(inputs.xs, inputs.res, inputs.mult)):
        problems.append("h differs from Inductor's compile of the graph's multiply and add")
    for name in ("y", "h", "q", "scales"):
        if not all(_same_bits(getattr(first, name), getattr(o, name)) for o in outs[1:]):
            problems.append(f"{name} differs between ranks")
    if (first.y is not None) != call.spec.emit_y and call.spec.quant is not None:
        problems.append("y returned though not asked for" if first.y is not None else "y missing")
    if first.y is not None and first.y.dtype != call.out_dtype:
        problems.append(f"y is {first.y.dtype}, not {call.out_dtype}")
    result: dict[str, Any] = {"max_error": worst, "problems": problems}
    if call.spec.quant is not None:
        y = first.y if first.y is not None else (twin[0].y if twin else None)
        if y is None:
            problems.append("no y to check the codes against")
            return result
        fp8 = kc.fp8_check(first.q, first.scales, y, call.spec.quant, inputs.scale, interpreted)
        result["fp8"] = fp8
        if not (fp8["differ_not_tie"] == 0 and fp8["scale_ulps"] <= 1.0 and fp8["strides_ok"]
                and fp8["ue8m0_ok"] and fp8["dtype_ok"]):
            problems.append("FP8 codes or scales differ")
        if twin is not None and not (_same_bits(twin[0].q, first.q)
                                     and _same_bits(twin[0].scales, first.scales)):
            problems.append("codes differ without y")
    return result


def _layouts(group: Any, prepared: list[Any]) -> list[dict]:
    from .sim_group import layout

    return [p if isinstance(p, dict) else layout(p, group.budget) for p in prepared]


def _merge(results: list[dict]) -> dict[str, Any]:
    """One case's result from its calls' judgements."""
    errors = [r["max_error"] for r in results if r["max_error"] is not None]
    out: dict[str, Any] = {"max_error": max(errors) if errors else None,
                           "problems": sorted({p for r in results for p in r["problems"]})}
    fp8 = [r["fp8"] for r in results if "fp8" in r]
    if fp8:
        out["fp8"] = {"codes": sum(f["codes"] for f in fp8),
                      "differ": sum(f["differ"] for f in fp8),
                      "differ_not_tie": sum(f["differ_not_tie"] for f in fp8),
                      "scale_ulps": max(f["scale_ulps"] for f in fp8)}
    return out


LAUNCHING = "sim_suite: launching "
"""The line a group prints before a case's first launch, with what it is about to
run: a case whose group dies there keeps it in its record (:func:`launched`)."""

_announced: dict[str, dict] = {}


def announce(case_id: str, ran: dict) -> None:
    """Say what a case is about to launch, in the group's output and to
    :func:`run_group` (a case whose launch raises keeps it in its record)."""
    _announced[case_id] = ran
    print(LAUNCHING + json.dumps({"id": case_id, **ran}), flush=True)


def launched(output: str, case_id: str) -> dict:
    """What a group said it was launching for ``case_id`` (:func:`announce`), or {}."""
    said: dict = {}
    for line in output.splitlines():
        if line.startswith(LAUNCHING):
            try:
                rec = json.loads(line[len(LAUNCHING):])
            except ValueError:
                continue
            if rec.pop("id", None) == case_id:
                said = rec
    return said


def run_call(group: Any, case: dict, interpreted: bool) -> dict:
    """``calls`` calls of one shape back to back, new data each; then judged."""
    sets = [Inputs(group, case, case["seed"] * 16 + k) for k in range(case["calls"])]
    twins = None
    if not case["emit_y"]:
        twins = [Inputs(group, dict(case, emit_y=True), case["seed"] * 16 + k)
                 for k in range(case["calls"])]
    prepared = group.prepare(*[s.calls for s in sets + (twins or [])])
    layouts = _layouts(group, prepared[0])
    ran = dict(layout=layouts[0], layouts_agree=all(lo == layouts[0] for lo in layouts),
               cap=getattr(group, "cap", None), stack_bytes=getattr(group, "stack", None))
    announce(case["id"], ran)
    outs = [group.launch(s.calls) for s in sets + (twins or [])]
    error = group.finish()
    n = len(sets)
    judged = [judge(s, o, interpreted, outs[n + i] if twins else None)
              for i, (s, o) in enumerate(zip(sets, outs[:n]))]
    result = _merge(judged)
    result.update(ran)
    if error:
        result["problems"].append(error)
    return result


def run_back_to_back(group: Any, case: dict, interpreted: bool) -> dict:
    """Calls of changing shapes, paths and epilogues, all launched before any is
    waited for, each on new data."""
    specs = _specs(128 if not interpreted else 64)
    cycle = case["cycle"]

    def inputs(i: int) -> Inputs:
        tokens, hidden, path, spec = cycle[i % len(cycle)]
        return Inputs(group, {"residual": True}, case["seed"] + i, tokens, hidden, path,
                      specs[spec].encode() if spec else None)

    sets = [inputs(i) for i in range(case["calls"])]
    group.prepare(*[s.calls for s in sets[:len(cycle)]])
    outs = [group.launch(s.calls) for s in sets]
    error = group.finish()
    result = _merge([judge(s, o, interpreted) for s, o in zip(sets, outs)])
    if error:
        result["problems"].append(error)
    return result


def run_graph(group: Any, case: dict, interpreted: bool) -> dict:
    """Twenty calls (both paths, a per-token FP8 epilogue, epsilon on the device)
    captured in one CUDA graph per rank, replayed with new data each time, then
    with the ranks' replays skewed and after a pause."""
    tok = _specs(128)["token"].encode()
    shapes = (1, 8, 80, 81, 512)
    sets = []
    for i in range(20):
        c = {"residual": True, "eps": "tensor" if i % 5 == 1 else "float"}
        sets.append(Inputs(group, c, case["seed"] + i, shapes[i % 5], 2880,
                           TWO if shapes[i % 5] > 80 else ONE, tok if i % 7 == 3 else None))
    group.prepare(*[s.calls for s in sets])
    for _ in range(2):  # warm up: every launcher's first call, as production's warm-up does
        for s in sets:
            group.launch(s.calls)
    problems = [e for e in [group.finish()] if e]
    graphs, outs = group.capture(lambda r: [group.call(r, s.calls[r]) for s in sets])
    judged, seed = [], case["seed"] + 100
    for mode in ["replay"] * case["replays"] + ["skewed", "pause"]:
        seed += 1
        for s in sets:
            s.refill(seed * 32 + sets.index(s))
        if mode == "pause":
            group.finish()
            time.sleep(1.0)
        group.replay(graphs, order=list(reversed(range(group.world))) if mode == "skewed" else None,
                     gap_s=0.3 if mode == "skewed" else 0.0)
        err = group.finish()
        if err:
            problems.append(err)
            break
        judged += [judge(s, [outs[r][i] for r in range(group.world)], interpreted)
                   for i, s in enumerate(sets)]
    result = _merge(judged)
    result["problems"] += problems
    result["replays"] = case["replays"] + 2
    return result


def run_growth(group: Any, case: dict, interpreted: bool) -> dict:
    """A buffer grown outside capture, the growth refused inside it: a small call
    (and, on a GPU, a graph of it), then a call too large for the buffer: inside a
    capture every rank declines it with the reason; outside it every rank's
    buffer grows and the call is right; the graph captured on the old buffer
    still replays right, and the small call runs on the new buffer."""
    from ..backends.triton_symm.backend import GROWTH_IN_CAPTURE

    base = {"residual": True}
    small = Inputs(group, base, case["seed"], 8, 2048, ONE)
    # Beyond the 1 MiB a first buffer has: 64 MiB a slot (GPU), 1.3 MiB (interpreter).
    big = Inputs(group, base, case["seed"] + 1, 2048 if not interpreted else 40, 8192, TWO)
    group.prepare(small.calls)
    judged = [judge(small, group.launch(small.calls), interpreted)]
    problems = [e for e in [group.finish()] if e]
    result: dict[str, Any] = {}
    graphs = None
    if not interpreted:
        graphs, outs = group.capture(lambda r: group.call(r, small.calls[r]))
        _, refused = group.capture(lambda r: group.call(r, big.calls[r]))
        result["refused_in_capture"] = refused
        if refused != [GROWTH_IN_CAPTURE] * group.world:
            problems.append(f"in capture: {refused}")
    generations = group.generations()
    group.prepare(big.calls)
    judged.append(judge(big, group.launch(big.calls), interpreted))
    problems += [e for e in [group.finish()] if e]
    grown = group.generations()
    result["generations"] = [generations, grown]
    if not all(b > a for a, b in zip(generations, grown)):
        problems.append("not every rank's buffer grew")
    if graphs is not None:
        small.refill(case["seed"] + 2)
        group.replay(graphs)
        problems += [e for e in [group.finish()] if e]
        judged.append(judge(small, outs, interpreted))
    small.refill(case["seed"] + 3)
    group.prepare(small.calls)
    judged.append(judge(small, group.launch(small.calls), interpreted))
    problems += [e for e in [group.finish()] if e]
    result.update(_merge(judged))
    result["problems"] += problems
    return result


def run_late(group: Any, case: dict, interpreted: bool) -> dict:
    """The last rank's call made seconds after the others': with a wait bound of
    a minute its peers wait for it, and every output is right."""
    late = LATE_S["interpret" if interpreted else "gpu"]
    group.timeout_s = 60.0
    inputs = Inputs(group, {"residual": True}, case["seed"], 8, 4096 if not interpreted else 256,
                    ONE)
    group.prepare(inputs.calls)
    group.launch(inputs.calls)  # a call on time first
    group.finish()
    inputs.refill(case["seed"] + 1)
    t0 = time.perf_counter()
    outs = group.launch(inputs.calls, late=(group.world - 1, late))
    error = group.finish()
    seconds = time.perf_counter() - t0
    result = _merge([judge(inputs, outs, interpreted)])
    result.update(late_by_s=late, seconds=seconds)
    if error:
        result["problems"].append(error)
    if seconds < late:
        result["problems"].append(f"finished in {seconds:.2f} s, before the late rank came")
    return result


def run_never(group: Any, case: dict, interpreted: bool) -> dict:
    """The last rank never makes a call its peers make: they fail with the
    device assertion after the wait bound, not hang (the CUDA context is then
    unusable: this case runs last, in a group of its own)."""
    group.timeout_s = NEVER_TIMEOUT_S
    inputs = Inputs(group, {"residual": True}, case["seed"], 8, 4096 if not interpreted else 256,
                    ONE)
    group.prepare(inputs.calls)
    ok = judge(inputs, group.launch(inputs.calls), interpreted)
    group.finish()
    inputs.refill(case["seed"] + 1)
    t0 = time.perf_counter()
    outs = group.launch(inputs.calls, skip=[group.world - 1])
    error = group.finish()
    seconds = time.perf_counter() - t0
    failed = [str(o) for o in outs[:-1] if isinstance(o, str)]
    result: dict[str, Any] = {"max_error": ok["max_error"], "problems": list(ok["problems"]),
                              "wait_bound_s": NEVER_TIMEOUT_S, "seconds": seconds,
                              "error": error or (failed[0][-300:] if failed else None)}
    if interpreted:
        if len(failed) != group.world - 1 or not all(TIMED_OUT in f for f in failed):
            result["problems"].append(f"not every waiting rank failed with the message: {failed}")
    else:
        if not error or "device-side assert" not in error:
            result["problems"].append(f"no device assertion: {error}")
        result["needs_output"] = TIMED_OUT  # the runner looks for it in the group's output
    if seconds < NEVER_TIMEOUT_S:
        result["problems"].append(f"failed after {seconds:.2f} s, before the wait bound")
    return result


Runner = Callable[[Any, dict, bool], dict]
"""``runner(group, case, interpreted) -> result``: ``max_error`` (over tolerance,
None when nothing was judged), ``problems`` (empty when the case passed), and
whatever else its record should keep."""

RUNNERS: dict[str, Runner] = {
    "call": run_call, "back_to_back": run_back_to_back, "graph": run_graph,
    "growth": run_growth, "late": run_late, "never": run_never}


class Extra(NamedTuple):
    """Cases of another module: ``cases(form, world) -> list[dict]`` (``form``
    "gpu" or "interpret"; each case a dict with its ``kind`` and ``seed``), run by
    ``runners[kind](group, case, interpreted)`` (a :data:`Runner`) in a group of
    their own, ``group``: a subprocess of its own, after the other groups and
    before the missing rank's.  The compile pass runs each case with a group
    that stops it at its first launch.  ``--quick`` runs the first ``quick``
    last in its one group per N (:data:`QUICK_GROUP`), on the group the other
    quick cases ran on."""

    group: str
    cases: Callable[[str, int], list[dict]]
    runners: dict[str, Runner]
    quick: int = 1


EXTRA: list[Extra] = []
"""The other modules' case sources, registered here (a group's subprocess imports
this module, so a source registered elsewhere would not run there)."""

from . import remake  # noqa: E402  (it imports this module only inside its functions)

# A group destroyed and made again under its name: not in --quick, whose minute on one
# H100 is spent on the kernels (a remake compiles every kernel again at a second size).
EXTRA.append(Extra("remake", remake.cases, {"remake": remake.run_remake}, quick=0))


def runner(kind: str) -> Runner:
    """The runner of a case of ``kind``: this module's or an :data:`EXTRA` source's."""
    if kind in RUNNERS:
        return RUNNERS[kind]
    for extra in EXTRA:
        if kind in extra.runners:
            return extra.runners[kind]
    raise KeyError(f"no runner for cases of kind {kind!r}")


def describe(case: dict) -> dict[str, Any]:
    """What a case's record says of it besides its outcome."""
    keys = ("id", "kind", "world", "path", "dtype", "tokens", "hidden", "residual", "gemma",
            "wdtype", "out_dtype", "eps", "quant", "emit_y", "round_normed", "multiplier",
            "calls", "sizes")
    return {k: case[k] for k in keys if k in case}


# ---------------------------------------------------------------- a group, in its subprocess


class _Stop(Exception):
    """Raised by the compile pass's group at the first launch."""


class _CompileOnly:
    """A group that prepares (compiles) and stops a case at its first launch."""

    def __init__(self, group: Any) -> None:
        self._group = group

    def __getattr__(self, name: str) -> Any:
        if name in ("launch", "capture", "replay", "call"):
            raise _Stop
        return getattr(self._group, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "_group":
            object.__setattr__(self, name, value)
        else:
            setattr(self._group, name, value)


def run_group(form: str, world: int, name: str, out_path: str, compile_only: bool,
              only: Optional[list[str]] = None, quick: bool = False) -> None:
    """Every case of group ``name`` (``only``: these ids; ``quick``: of the quick
    subset's group), one JSON line each to ``out_path`` as it finishes."""
    from .sim_group import GpuGroup, InterpretedGroup

    todo = [c for c in groups(form, world, quick)[name] if only is None or c["id"] in only]
    interpreted = form == "interpret"
    group: Any = (InterpretedGroup(world, timeout_s=TIMEOUT_S[form]) if interpreted
                  else GpuGroup(world, timeout_s=TIMEOUT_S[form]))
    if compile_only:
        group = _CompileOnly(group)
    try:
        with open(out_path, "a") as f:
            for case in todo:
                if not compile_only:
                    print(STARTING + case["id"], flush=True)
                t0 = time.perf_counter()
                group.timeout_s = TIMEOUT_S[form]
                try:
                    result = runner(case["kind"])(group, case, interpreted)
                except _Stop:
                    continue
                except Exception:
                    result = {**_announced.get(case["id"], {}), "max_error": None,
                              "problems": [traceback.format_exc()[-3000:]]}
                record = describe(case)
                record.update(result, seconds=round(time.perf_counter() - t0, 3))
                record["pass"] = not record["problems"] and record["max_error"] is not None
                f.write(json.dumps(record) + "\n")
                f.flush()
    finally:
        group.close()


STARTING = "sim_suite: starting "
"""The line a group prints as it starts a case: a case without a record that
started was running when its group ended (failed); one that did not start, did
not run."""


# ---------------------------------------------------------------- the suite


def _python_env(form: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # The groups import the checkout this module came from, wherever they start; an
    # installed package is on their path already (and put first it would also put its
    # site-packages' Triton before one the user put first on PYTHONPATH).
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if os.path.basename(root) not in ("site-packages", "dist-packages"):
        env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]]
                                                      if env.get("PYTHONPATH") else []))
    # Streams beyond CUDA's hardware queues share one (sim_group's note): at least 32.
    try:
        connections = int(env.get("CUDA_DEVICE_MAX_CONNECTIONS", "0"))
    except ValueError:
        connections = 0
    env["CUDA_DEVICE_MAX_CONNECTIONS"] = str(max(32, connections))
    if form == "interpret":
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    return env


def _subprocess(form: str, world: int, name: str, out_path: str, log_path: str,
                compile_only: bool, timeout_s: float, only: Optional[list[str]] = None,
                quick: bool = False) -> str:
    """Run one group in a subprocess; what happened ("ok", "exit N", "timed out")."""
    cmd = [sys.executable, "-m", "fusion_pass.selftest.suite", "--group", name,
           "--world", str(world), "--out", out_path, *(["--interpret"] if form == "interpret"
                                                        else []),
           *(["--quick"] if quick else []),
           *(["--compile-only"] if compile_only else []), *(["--only", *only] if only else [])]
    with open(log_path, "a") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=_python_env(form),
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout_s:.0f} s"
    return "ok" if proc.returncode == 0 else f"exit {proc.returncode}"


def _tail(path: str, chars: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


def _read_lines(path: str) -> dict[str, dict]:
    """The records a group wrote (a line cut short by the group's end is not one)."""
    out = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and "id" in rec:
                    out[rec["id"]] = rec
    return out


def _last_words(output: str) -> str:
    """The last line of a group's output that says something (an exception's
    message, mostly), for a reason on one line."""
    lines = [ln.strip() for ln in output.splitlines()
             if ln.strip() and not ln.startswith((STARTING, LAUNCHING))]
    return lines[-1][:300] if lines else "no output"


def _unfinished(rec: dict, group: str, status: str, output: str, running: Optional[str]) -> None:
    """Fill in the record of a case that a group left without one: failed if it
    was running when the group ended, else not run, with the reason."""
    rec.update(max_error=None, **{"pass": False}, problems=[
        f"did not finish: group {status}; its output ends:\n{output[-3000:]}"])
    if running == rec["id"]:
        rec["outcome"] = "failed"
    elif status.startswith("not run"):
        rec.update(outcome="not run", reason=status[len("not run: "):])
    else:
        why = f"group {group} {status}" if status != "ok" else f"group {group} ended"
        rec.update(outcome="not run", reason=(
            f"{why} during {running}" if running else f"{why} before its first case: "
            f"{_last_words(output)}"))


def group_records(cs: list[dict], name: str, status: str, done: dict[str, dict],
                  output: str) -> list[dict]:
    """The records of group ``name``'s cases ``cs``: those it wrote (``done``), and
    for the rest, what its ``status`` and ``output`` tell (:func:`_unfinished`)."""
    started = [ln[len(STARTING):].strip() for ln in output.splitlines()
               if ln.startswith(STARTING)]
    running = next((i for i in reversed(started) if i not in done), None)
    records = []
    for case in cs:
        rec = done.get(case["id"])
        if rec is None:
            rec = describe(case)
            rec.update(launched(output, case["id"]))
            _unfinished(rec, name, status, output, running)
        else:
            rec["outcome"] = "passed" if rec["pass"] else "failed"
        rec["group"] = name
        needs = rec.pop("needs_output", None)
        if needs is not None:
            rec["message_printed"] = needs in output
            if not rec["message_printed"]:
                rec["problems"].append(f"the output does not say '{needs}'")
                rec["pass"] = False
                rec["outcome"] = "failed"
        records.append(rec)
    return records


def tally(records: list[dict]) -> dict[str, dict[str, dict[str, int]]]:
    """Outcomes by N and by path (calls) or kind (the other cases):
    ``{"2": {"one_stage": {"passed": 5, "failed": 0, "not run": 0}, ...}, ...}``."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for r in records:
        what = r.get("path") or r.get("kind", "?")
        counts = out.setdefault(str(r["world"]), {}).setdefault(
            what, {"passed": 0, "failed": 0, "not run": 0})
        counts[outcome(r)] += 1
    return out


def outcome(record: dict) -> str:
    """"passed", "failed" or "not run" (a record of before ``outcome`` was
    written: passed or failed)."""
    return record.get("outcome") or ("passed" if record.get("pass") else "failed")


GROUP_TIMEOUT_S = 200.0
"""The most one group's subprocess may take (a hung group ends there, recorded)."""


def default_jobs() -> int:
    """Parallel compile subprocesses: every core but one, at most 16."""
    return max(1, min(16, (os.cpu_count() or 2) - 1))


def run_suite(outdir: str, form: str, worlds: list[int], jobs: int, deadline_s: float,
              group_timeout_s: float, only: Optional[list[str]] = None, quick: bool = False,
              json_path: Optional[str] = None, command: Optional[list[str]] = None,
              progress: Optional[Callable[[dict], None]] = None) -> dict[str, Any]:
    """Every group at every N (the module's note; ``only``: the cases of these ids;
    ``quick``: the quick subset, :data:`QUICK`); the results' dict, also written to
    ``json_path`` (``OUTDIR/<RESULT[form]>``).  The groups' output goes to
    ``OUTDIR/sim_groups``; ``progress`` is told of the compile pass and of each
    group as it ends."""
    os.makedirs(outdir, exist_ok=True)
    work = os.path.join(outdir, "sim_groups")
    os.makedirs(work, exist_ok=True)
    start = time.perf_counter()
    every = {w: cases(form, w) for w in worlds}
    plan = [(w, name, [c for c in cs if only is None or c["id"] in only])
            for w in worlds for name, cs in groups(form, w, quick).items()]
    plan = [(w, name, cs) for w, name, cs in plan if cs]
    planned = sum(len(cs) for _, _, cs in plan)
    whole = sum(len(cs) for gs in every.values() for cs in gs.values())
    left_out = [] if not quick and only is None else (
        ["--quick (the quick subset: QUICK in fusion_pass/selftest/suite.py)"] * quick
        + ["--only"] * (only is not None))
    compile_pass: dict[str, str] = {}
    compile_seconds: dict[str, float] = {}
    if form == "gpu" and plan:
        # Compile in parallel: chunks of a group's cases, stopped at their first launch
        # (chunks small enough to spread a few cases over every job).
        size = max(1, min(12, -(-planned // max(1, jobs))))
        units = [(w, name, [c["id"] for c in cs[i:i + size]]) for w, name, cs in plan
                 for i in range(0, len(cs), size)]
        if progress:
            progress({"event": "compiling", "units": len(units), "jobs": max(1, jobs)})
        t0 = time.perf_counter()

        def unit(k: int, w: int, name: str, ids: list[str]) -> tuple[str, float]:
            stem = os.path.join(work, f"compile_{w}_{name}_{k}")
            for p in (stem + ".jsonl", stem + ".log"):
                if os.path.exists(p):
                    os.unlink(p)
            t = time.perf_counter()
            status = _subprocess(form, w, name, stem + ".jsonl", stem + ".log", True,
                                 group_timeout_s, ids, quick)
            return status, round(time.perf_counter() - t, 1)

        with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
            futures = {pool.submit(unit, k, w, name, ids): f"n{w}-{name}-{k}"
                       for k, (w, name, ids) in enumerate(units)}
            for fut in concurrent.futures.as_completed(futures):
                compile_pass[futures[fut]], compile_seconds[futures[fut]] = fut.result()
        if progress:
            progress({"event": "compiled", "units": len(units),
                      "seconds": round(time.perf_counter() - t0, 1),
                      "not_ok": {k: v for k, v in compile_pass.items() if v != "ok"}})
    records: list[dict] = []
    group_info: dict[str, dict] = {}
    for w, name, cs in plan:
        out_path = os.path.join(work, f"n{w}_{name}.jsonl")
        log_path = os.path.join(work, f"n{w}_{name}.log")
        for p in (out_path, log_path):
            if os.path.exists(p):
                os.unlink(p)
        left = deadline_s - (time.perf_counter() - start)
        t0 = time.perf_counter()
        if left < 10:
            status = f"not run: the suite's deadline ({deadline_s:.0f} s) passed before its group"
        else:
            status = _subprocess(form, w, name, out_path, log_path, False,
                                 min(group_timeout_s, left),
                                 None if only is None else [c["id"] for c in cs], quick)
            group_info[f"n{w}-{name}"] = {"status": status,
                                          "seconds": round(time.perf_counter() - t0, 1)}
        mine = group_records(cs, name, status, _read_lines(out_path), _tail(log_path, 200_000))
        records += mine
        if progress:
            counts = {k: sum(1 for r in mine if outcome(r) == k)
                      for k in ("passed", "failed", "not run")}
            progress({"event": "group", "world": w, "group": name, "total": len(mine),
                      **counts, "status": status, "seconds": round(time.perf_counter() - t0, 1)})
    failed = [r["id"] for r in records if not r["pass"]]
    errors = [r["max_error"] for r in records if r["max_error"] is not None]
    worst = max((r for r in records if r["max_error"] is not None),
                key=lambda r: r["max_error"], default=None)
    split = {w: sum(1 for r in records if r["world"] == w and r.get("kind") == "call"
                    and r.get("layout", {}).get("own") and r.get("tokens", 0) > 1) for w in worlds}
    capped = {w: sum(1 for r in records if r["world"] == w and r.get("layout", {}).get("capped"))
              for w in worlds}
    seconds = time.perf_counter() - start
    summary = (f"{len(records) - len(failed)} of {len(records)} cases passed at N = "
               f"{', '.join(map(str, worlds))} ({form}); worst error "
               f"{max(errors) if errors else float('nan'):.3f} of tolerance; calls of several "
               f"tokens in split rows whose parts own their columns, by N: {split}; calls run "
               f"with a capped SM budget, by N: {capped}; {seconds:.0f} s")
    result = {"provenance": provenance(form, command), "summary": summary, "failed": failed,
              "groups": group_info, "compile_pass": compile_pass,
              "compile_seconds": compile_seconds, "cases": records,
              "form": form, "worlds": list(worlds),
              "selection": {"quick": quick, "only": only, "cases": planned, "of": whole,
                            "left_out_by": left_out},
              "not_run": [r["id"] for r in records if outcome(r) == "not run"],
              "worst": None if worst is None else {"id": worst["id"],
                                                   "max_error": worst["max_error"]},
              "tally": tally(records), "seconds": round(seconds, 1)}
    path = json_path or os.path.join(outdir, RESULT[form])
    if os.path.dirname(os.path.abspath(path)):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return result


def provenance(form: str, command: Optional[list[str]] = None) -> dict[str, Any]:
    """Commit, versions (Triton's as imported: a Triton put first on the path
    counts, and where it came from), device and command of the run (``command``,
    or this module's); paths inside the repository are given relative to it."""
    import platform

    import triton

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def git(*args: str) -> Optional[str]:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                                  timeout=30, cwd=root).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    def relative(path: str) -> str:
        return os.path.relpath(path, root) if os.path.abspath(path).startswith(root + os.sep) \
            else path

    status = git("status", "--porcelain", "--untracked-files=no")
    triton_dir = os.path.dirname(os.path.abspath(triton.__file__))
    origin = ("an installed package" if os.path.basename(os.path.dirname(triton_dir)) in
              ("site-packages", "dist-packages") else relative(triton_dir))
    gpu = None
    if form == "gpu" and torch.cuda.is_available():
        device = torch.cuda.get_device_name()
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        gpu = {"name": device, "capability": f"{props.major}.{props.minor}",
               "sms": props.multi_processor_count,
               "memory_gib": round(props.total_memory / 2**30, 1)}
    else:
        device = f"cpu: {platform.machine()} x {os.cpu_count()}" + (
            " (Triton's interpreter)" if form == "interpret" else " (no GPU)")
    if command is None:
        command = ["python", "-m", "fusion_pass.selftest.suite", *sys.argv[1:]]
    out = {"commit": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status),
           "source_digest": source_digest(root),
           "versions": {"python": platform.python_version(), "torch": torch.__version__,
                        "triton": triton.__version__, "cuda": torch.version.cuda},
           "triton_from": origin, "device": device,
           "command": [relative(a) if os.path.isabs(a) else a for a in command],
           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if gpu is not None:
        out["gpu"] = gpu
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", nargs="?")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--interpret", action="store_true",
                    help="the CPU form: Triton's interpreter, one process per rank")
    ap.add_argument("--quick", action="store_true",
                    help="the quick subset (QUICK), in one group per N")
    ap.add_argument("--jobs", type=int, default=default_jobs(),
                    help="parallel compile subprocesses (GPU)")
    ap.add_argument("--deadline-s", type=float, default=float("inf"),
                    help="groups not started by then are recorded as not run (default: none)")
    ap.add_argument("--group-timeout-s", type=float, default=GROUP_TIMEOUT_S)
    ap.add_argument("--group", help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--only", nargs="+", metavar="ID",
                    help="only the cases of these ids (as the results name them, e.g. "
                         "n8-sweep-275)")
    args = ap.parse_args(argv)
    form = "interpret" if args.interpret else "gpu"
    if args.group:
        run_group(form, args.world, args.group, args.out, args.compile_only, args.only,
                  args.quick)
        sys.stdout.flush()
        sys.stderr.flush()
        # No interpreter teardown: after a device assertion the CUDA context is
        # unusable and freeing into it can hang; every record is written.
        os._exit(0)
    if not args.outdir:
        ap.error("OUTDIR is required")
    result = run_suite(args.outdir, form, args.worlds, args.jobs, args.deadline_s,
                       args.group_timeout_s, args.only, args.quick)
    print(result["summary"])
    for rec in result["cases"]:
        if not rec["pass"]:
            print(f"FAILED {rec['id']}: {rec['problems']}"[:2000])
    return 0 if not result["failed"] and result["cases"] else 1


if __name__ == "__main__":
    sys.exit(main())
