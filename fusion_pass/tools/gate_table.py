"""``fusion-pass gate``: the gate's decision for the shapes you name, as a table.

Asks :func:`fusion_pass.gate.decide` for every combination of hidden size,
dtype, world size and token count (or token range, ``A-B`` / ``A-``), with the
kernel rules alone or with a backend's limits.  Never imports vLLM.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from typing import Any, Iterable, Optional

from ..gate import (DEFAULT_TOKEN_THRESHOLD, ELEMENT_SIZE, UNLIMITED, BackendLimits, TokenRange,
                   Tokens, decide)

# Hidden size (config.json "hidden_size", the width the all-reduce + RMSNorm
# sees) of widely served models.  From each model's published config.
MODEL_HIDDEN_SIZES: dict[str, int] = {
    "Llama 3 8B": 4096,
    "Llama 3 70B": 8192,
    "Llama 3.1 405B": 16384,
    "Mistral 7B": 4096,
    "Mistral Small 3 24B": 5120,
    "Mistral Large 2 123B": 12288,
    "Mixtral 8x7B": 4096,
    "Mixtral 8x22B": 6144,
    "Qwen2.5 0.5B": 896,
    "Qwen2.5 1.5B": 1536,
    "Qwen2.5 3B": 2048,
    "Qwen2.5 7B": 3584,
    "Qwen2.5 14B": 5120,
    "Qwen2.5 32B": 5120,
    "Qwen2.5 72B": 8192,
    "Qwen3 0.6B": 1024,
    "Qwen3 1.7B": 2048,
    "Qwen3 4B": 2560,
    "Qwen3 8B": 4096,
    "Qwen3 14B": 5120,
    "Qwen3 32B": 5120,
    "Qwen3 30B-A3B": 2048,
    "Qwen3 235B-A22B": 4096,
    "DeepSeek-V3": 7168,
    "GPT-OSS 20B": 2880,
    "GPT-OSS 120B": 2880,
    "Gemma 2 2B": 2304,
    "Gemma 2 9B": 3584,
    "Gemma 2 27B": 4608,
    "Gemma 3 1B": 1152,
    "Gemma 3 4B": 2560,
    "Gemma 3 12B": 3840,
    "Gemma 3 27B": 5376,
    "Phi-3 mini": 3072,
    "Phi-3 medium": 5120,
    "Phi-3.5 MoE": 4096,
    "Phi-4": 5120,
    "Phi-4 mini": 3072,
}

DEFAULT_TOKENS: tuple[int, ...] = (1, 8, 32, 64, 80, 81, 128, 256, 512, 1024, 2048, 4096, 8192)
DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32")

COLUMNS = ("model", "hidden", "dtype", "world_size", "tokens", "path", "reason")


def parse_tokens(text: str) -> Tokens:
    """``"64"`` -> 64; ``"1-80"`` -> TokenRange(1, 80); ``"96-"`` -> TokenRange(96, None)."""
    try:
        if "-" not in text:
            return int(text)
        lo, hi = text.split("-", 1)
        return TokenRange(int(lo), int(hi) if hi else None)
    except ValueError:
        raise ValueError(f"token count {text!r} is not N, A-B or A-") from None


def limits_for(backend: Optional[str]) -> BackendLimits:
    """The kernel rules alone (None or ``"kernel"``), AITER's limits at a version
    (``"aiter-0.1.20"``, no AITER needed), or a registered backend's limits."""
    if backend in (None, "kernel"):
        return UNLIMITED
    if backend.startswith("aiter-"):
        from ..backends.aiter import limits_for_version

        return limits_for_version(backend.removeprefix("aiter-"))
    from .. import backends

    try:
        return backends.get(backend).limits
    except Exception as e:  # an unknown name, or a backend whose libraries are missing here
        raise ValueError(f"backend {backend!r} is not available here: {e}") from None


def gate_table(hiddens: Iterable[int], dtypes: Iterable[str] = DTYPES,
               world_sizes: Iterable[int] = (2, 4, 8), tokens: Iterable[Tokens] = DEFAULT_TOKENS,
               *, limits: BackendLimits = UNLIMITED, threshold: Optional[int] = None,
               models: Optional[dict[int, str]] = None) -> list[dict[str, Any]]:
    """One row per combination: ``model, hidden, dtype, world_size, tokens, path, reason``.

    ``models`` names hidden sizes (hidden -> label) for the ``model`` column.
    ``tokens`` in a row is an int or a string such as ``"[1, 80]"`` for a range.
    """
    rows = []
    for h, dt, ws, n in itertools.product(list(hiddens), list(dtypes), list(world_sizes), list(tokens)):
        d = decide(h, dt, ws, n, limits=limits, threshold=threshold)
        rows.append({"model": (models or {}).get(h, ""), "hidden": h, "dtype": dt, "world_size": ws,
                     "tokens": n if isinstance(n, int) else str(n),
                     "path": d.path.value, "reason": d.reason})
    return rows


def model_table(models: Optional[dict[str, int]] = None, **kwargs: Any) -> list[dict[str, Any]]:
    """:func:`gate_table` over the models' hidden sizes, one row per model."""
    models = MODEL_HIDDEN_SIZES if models is None else models
    rows = []
    for name, hidden in models.items():
        for r in gate_table([hidden], **kwargs):
            rows.append({**r, "model": name})
    return rows


def path_ranges(rows: list[dict[str, Any]], *, limits: BackendLimits = UNLIMITED,
                threshold: Optional[int] = None) -> list[dict[str, Any]]:
    """Collapse rows of ascending int token counts into runs with one path:
    ``{..., "tokens": "81-8192", "path": "two_stage", "reason": ...}``, the reason
    being the gate's for the run's token range (same limits and threshold)."""
    out: list[dict[str, Any]] = []
    key = lambda r: (r["model"], r["hidden"], r["dtype"], r["world_size"])  # noqa: E731
    for _, group in itertools.groupby(rows, key):
        for path, run in itertools.groupby(group, lambda r: r["path"]):
            run = list(run)
            lo, hi = run[0]["tokens"], run[-1]["tokens"]
            first = run[0]
            reason = decide(first["hidden"], first["dtype"], first["world_size"], TokenRange(lo, hi),
                            limits=limits, threshold=threshold).reason
            out.append({**first, "tokens": f"{lo}" if lo == hi else f"{lo}-{hi}", "path": path,
                        "reason": reason})
    return out


def format_table(rows: list[dict[str, Any]], columns: Iterable[str] = COLUMNS) -> str:
    """A plain-text table; columns that are empty in every row are left out."""
    cols = [c for c in columns if any(str(r.get(c, "")) for r in rows)]
    cells = [[str(r.get(c, "")) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(r) for r in cells])


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fusion-pass gate",
        description="Print which path (one_stage / two_stage / runtime / unfused) the gate "
                    "chooses for each hidden size x dtype x world size x token count.")
    parser.add_argument("--hidden", type=int, nargs="+", default=[],
                        help="hidden sizes (e.g. 2880 4096 8192)")
    parser.add_argument("--model", nargs="+", default=[], metavar="NAME",
                        help="models by name (see --list-models); adds their hidden sizes")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=sorted(ELEMENT_SIZE))
    parser.add_argument("--world-size", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--tokens", nargs="+", default=[str(t) for t in DEFAULT_TOKENS],
                        help="token counts N or ranges A-B / A- (a compile range)")
    parser.add_argument("--backend", default="kernel",
                        help="'kernel' (the kernel rules alone), 'aiter-<version>' (AITER's "
                             "limits at that version) or a registered backend name")
    parser.add_argument("--threshold", type=int, default=None,
                        help="force one-stage up to this many tokens (default: the backend's "
                             f"measured schedule where it has one, else {DEFAULT_TOKEN_THRESHOLD})")
    parser.add_argument("--ranges", action="store_true",
                        help="collapse consecutive token counts with the same path")
    parser.add_argument("--json", action="store_true", help="print JSON rows")
    parser.add_argument("--list-models", action="store_true", help="print the known models and exit")
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)

    def fail(msg: str) -> int:
        print(f"fusion-pass gate: error: {msg}", file=sys.stderr)
        return 2

    if ns.list_models:
        print(format_table([{"model": m, "hidden": h} for m, h in MODEL_HIDDEN_SIZES.items()],
                           ("model", "hidden")))
        return 0
    lower = {m.lower(): m for m in MODEL_HIDDEN_SIZES}
    unknown = [m for m in ns.model if m.lower() not in lower]
    if unknown:
        return fail(f"unknown model(s) {unknown}; see --list-models")
    models = {m: MODEL_HIDDEN_SIZES[m] for m in (lower[x.lower()] for x in ns.model)}
    if not ns.hidden and not models:
        return fail("name at least one --hidden size or --model")
    try:
        tokens = [parse_tokens(t) for t in ns.tokens]
        limits = limits_for(ns.backend)
    except ValueError as e:
        return fail(str(e))
    kwargs = dict(dtypes=ns.dtype, world_sizes=ns.world_size, tokens=tokens, limits=limits,
                  threshold=ns.threshold)
    rows = model_table(models, **kwargs) + gate_table(ns.hidden, **kwargs)
    if ns.ranges:
        if not all(isinstance(t, int) for t in tokens):
            return fail("--ranges needs plain token counts, not ranges")
        rows = path_ranges(rows, limits=limits, threshold=ns.threshold)
    try:
        print(json.dumps(rows, indent=1) if ns.json else format_table(rows))
    except BrokenPipeError:  # `| head`: the reader has what it wanted
        sys.stdout = open(os.devnull, "w")
    return 0

