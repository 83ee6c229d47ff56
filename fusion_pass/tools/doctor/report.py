"""The report: every probe run once, in sections, as text for a screen or as JSON.

:data:`SECTIONS` lists the probes by section, in the order they print; each is called with
the :class:`~.context.Context` through :func:`~.findings.run`, so a probe that raises is one
``error`` line and the rest still run.  The verdict is made from the others' findings.
"""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any, Callable

from . import fusion, gpus, versions, vllm_plugin
from .context import Context, Query
from .findings import Finding, run

SCHEMA_VERSION = 1
"""The JSON form's version: raised when a field changes meaning or goes (docs/doctor.md)."""

SECTIONS: dict[str, dict[str, Callable[[Context], Finding]]] = {
    "versions": {
        "python": versions.python,
        "fusion_pass": versions.fusion_pass,
        "torch": versions.torch,
        "triton": versions.triton,
        "triton_launcher": versions.triton_launcher,
        "vllm": versions.vllm,
        "aiter": versions.aiter,
        "depyf": versions.depyf,
    },
    "plugin": {
        "entry_point": vllm_plugin.entry_point,
        "compilation_config": vllm_plugin.compilation_config,
        "cli_json": vllm_plugin.cli_json,
        "in_tree_fusion": vllm_plugin.in_tree_fusion,
        "sequence_parallelism": vllm_plugin.sequence_parallelism,
        "architecture": vllm_plugin.architecture,
    },
    "gpus": {
        "devices": gpus.devices,
        "p2p": gpus.p2p,
        "nvlink": gpus.nvlink,
        "symmetric_memory": gpus.symmetric_memory,
        "pdl": gpus.pdl,
    },
    "fusion": {
        "backend": fusion.backend,
        "gate": fusion.gate_paths,
    },
}

VERDICT: Callable[[dict[str, dict[str, Finding]]], Finding] = fusion.verdict

MARKS = {"ok": "ok", "no": "NO", "skip": "--", "error": "ERR"}


class Report:
    """The findings of one run, by section and probe name."""

    def __init__(self, query: Query, tp: int, found: dict[str, dict[str, Finding]]) -> None:
        self.query = query
        self.tp = tp
        self.found = found

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "version": SCHEMA_VERSION,
            "query": {"hidden": self.query.hidden, "dtype": self.query.dtype, "tp": self.tp,
                      "arch": self.query.arch}}
        for section, probes in self.found.items():
            out[section] = {name: f.to_json() for name, f in probes.items()}
        return out

    def format(self) -> str:
        q = self.query
        lines = [f"fusion-pass doctor: hidden {q.hidden}, {q.dtype}, TP {self.tp}"
                 + (f", {q.arch}" if q.arch else "")]
        for section, probes in self.found.items():
            lines.append(f"{section}:")
            lines += [f"  {MARKS[f.status]:<4}{f.line()}" for f in probes.values()]
        return "\n".join(lines)


def build(query: Query) -> Report:
    """Run every probe for ``query``.  What the libraries print or log while they are
    imported and asked (vLLM's platform lines, the package's one-line warnings) is kept
    out of the report's output."""
    ctx = Context(query)
    found: dict[str, dict[str, Finding]] = {}
    noise = io.StringIO()
    with contextlib.redirect_stdout(noise), contextlib.redirect_stderr(noise):
        for section, probes in SECTIONS.items():
            found[section] = {name: run(f"{section}.{name}", probe, ctx)
                              for name, probe in probes.items()}
        found.setdefault("fusion", {})["verdict"] = run("fusion.verdict", VERDICT, found)
        try:
            tp = ctx.tp
        except Exception:  # no GPU count: the default the probes fell back to
            tp = query.tp or 2
    return Report(query, tp, found)


def dumps(report: Report) -> str:
    return json.dumps(report.to_json(), indent=1)
