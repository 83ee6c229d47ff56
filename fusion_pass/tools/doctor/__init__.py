"""``fusion-pass doctor``: whether the plugin will load and fuse on this machine, and why not.

One command for the first questions of a user who sees no speed-up: is the plugin loaded by
this vLLM, will it take this model's sites on these GPUs, will its kernels launch with this
Triton.  Four sections of one-line findings, each ``ok``, ``NO`` (with why), ``--`` (does
not apply here) or ``ERR`` (the check itself failed, with its error):

* :mod:`.versions`: Python, fusion_pass, torch, Triton and its launcher generation, vLLM
  against the supported range, AITER's known-bad paths, depyf;
* :mod:`.vllm_plugin`: the entry point, the config helpers' output on this vLLM, and what
  in vLLM would take the sites first (its in-tree fusion, sequence parallelism, running the
  model uncompiled);
* :mod:`.gpus`: the GPUs, P2P, NVLink, torch symmetric memory for the TP group, PDL;
* :mod:`.fusion`: the backend, the gate's path per token count, and a verdict.

It never raises (a failing probe is one line) and exits 0 unless its arguments are bad;
``--json`` prints the stable form described in docs/doctor.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from ...gate import ELEMENT_SIZE
from .context import Query
from .report import SCHEMA_VERSION, SECTIONS, Report, build, dumps

__all__ = ["Query", "Report", "SCHEMA_VERSION", "SECTIONS", "build", "main"]


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fusion-pass doctor",
        description="Say whether the fusion plugin will load and fuse on this machine, and "
                    "why not: versions, the plugin as vLLM sees it, the GPUs, the gate.")
    parser.add_argument("--hidden", type=_positive, default=Query.hidden,
                        help="the model's hidden size (default %(default)s)")
    parser.add_argument("--dtype", default=Query.dtype, choices=sorted(ELEMENT_SIZE),
                        help="the model's dtype (default %(default)s)")
    parser.add_argument("--tp", type=_positive, default=None,
                        help="tensor-parallel size (default: the visible GPUs, at least 2)")
    parser.add_argument("--arch", default=None, metavar="NAME",
                        help="a vLLM architecture name (e.g. Qwen3_5ForCausalLM): does vLLM "
                             "compile it here?")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    report = build(Query(hidden=ns.hidden, dtype=ns.dtype, tp=ns.tp, arch=ns.arch))
    try:
        print(dumps(report) if ns.json else report.format())
    except BrokenPipeError:  # `| head`: the reader has what it wanted
        sys.stdout = open(os.devnull, "w")
    return 0
