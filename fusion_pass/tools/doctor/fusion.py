"""The fusion section: the backend the fused op would run here, the gate's path per token
count for the asked shape (or why it declines), and the verdict of the whole report."""

from __future__ import annotations

import os
from typing import Any, Mapping

from ... import gate
from ..gate_table import DEFAULT_TOKENS, gate_table
from .context import Context
from .findings import Finding, no, ok, skip

WHAT_RUNS = {
    "reference": "c10d all-reduce + RMSNorm in torch, no fused kernel",
    "triton": "Triton kernels on torch symmetric memory",
    "aiter": "AITER's fused kernels",
}


def backend(ctx: Context) -> Finding:
    env = os.environ.get("FUSION_PASS_BACKEND")
    try:
        name, device, _ = ctx.backend()
    except ValueError as e:  # an unknown name in FUSION_PASS_BACKEND
        return no("backend", str(e), name=env, device=None, fused_kernel=False)
    chosen = (f"FUSION_PASS_BACKEND={env}" if env else
              f"chosen for the {'GPUs' if device == 'cuda' else 'CPU'}")
    runs = WHAT_RUNS.get(name, "a registered backend")
    return ok(f"backend {name} ({chosen}): {runs}", name=name, device=device,
              fused_kernel=name != "reference")


def gate_paths(ctx: Context) -> Finding:
    """The gate's path for every token count at the asked hidden size, dtype and TP, with
    the selected backend's limits, as the pass asks it."""
    q, tp = ctx.query, ctx.tp
    label = f"gate (hidden {q.hidden}, {q.dtype}, TP {tp})"
    try:
        name, _, chosen = ctx.backend()
    except Exception as e:
        return skip(label, f"no backend to ask ({e})", segments=[], tokens=[])
    limits = chosen.limits
    shape = dict(hidden=q.hidden, dtype=q.dtype, tp=tp, limits=limits.name)
    whole = gate.decide(q.hidden, q.dtype, tp, None, limits=limits)
    if whole.path is gate.FusionPath.UNFUSED:
        return no(label, f"declines with backend {name}: {whole.reason}", **shape, segments=[],
                  tokens=[])
    segments = gate.segments(q.hidden, q.dtype, tp, limits=limits)
    rows = gate_table([q.hidden], [q.dtype], [tp], DEFAULT_TOKENS, limits=limits)
    text = ", ".join(f"{_span(s.lo, s.hi)} {s.path.value}" for s in segments)
    return ok(f"{label}: tokens {text}", **shape,
              segments=[dict(lo=s.lo, hi=s.hi, path=s.path.value, why=s.why) for s in segments],
              tokens=[dict(tokens=r["tokens"], path=r["path"], reason=r["reason"]) for r in rows])


def _span(lo: int, hi: Any) -> str:
    if hi is None:
        return f"{lo}+"
    return str(lo) if lo == hi else f"{lo}-{hi}"


BLOCKERS = (("versions", "vllm"), ("plugin", "entry_point"), ("plugin", "compilation_config"),
            ("plugin", "in_tree_fusion"), ("plugin", "sequence_parallelism"),
            ("plugin", "architecture"), ("fusion", "backend"), ("fusion", "gate"))
"""The findings that, when not ok, keep sites from running fused kernels under vLLM."""


def verdict(found: Mapping[str, Mapping[str, Finding]]) -> Finding:
    """One line from the other findings: what keeps the fusion from paying off here.  Without
    vLLM installed, the plugin's findings are no obstacle (plain torch.compile needs none)."""
    vllm = found.get("versions", {}).get("vllm")
    sections = {"versions", "fusion"} | (set() if vllm is not None and vllm.status == "skip"
                                         else {"plugin"})
    blockers = [found[s][p].line() for s, p in BLOCKERS
                if s in sections and p in found.get(s, {})
                and found[s][p].status in ("no", "error")]
    chosen = found.get("fusion", {}).get("backend")
    name = chosen.data.get("name") if chosen is not None and chosen.ok else None
    if name == "reference":
        where = "on the CPU" if chosen.data.get("device") == "cpu" else "here"
        blockers.append(f"no fused kernel {where}: the reference backend runs c10d all-reduce "
                        "+ RMSNorm in torch")
    elif name == "triton":
        symm = found.get("gpus", {}).get("symmetric_memory")
        if symm is not None and symm.status in ("no", "error"):
            blockers.append(f"{symm.line()}: each call falls back to the reference")
    if blockers:
        return no("verdict", f"no speed-up expected: {blockers[0]}"
                  + (f" (and {len(blockers) - 1} more above)" if len(blockers) > 1 else ""),
                  blockers=blockers)
    return ok(f"verdict: nothing in the way: sites of this shape run the {name} backend's "
              "fused kernels", blockers=[])
