"""What an engine compiled, as digests that two engines can be compared by.

Inductor writes each generated kernel to its cache folder under a name that is the hash
of the kernel's source, the graph's wrapper module likewise, and beside a kernel whose
config it chose by timing candidates at the first run, a ``.best_config`` file (named
from the kernel's hash) with the pick.  Read from an engine's own cache folder after it
ran: the set of kernels (Triton sources and C++ ones on the CPU), the set of graph
modules, and the picks.  Two engines that compiled the same graphs with the same picks
have the same digests; :func:`compare` names what differs.

A wrapper module (``def call(``) is a graph even where it holds its kernels' Triton
sources (on GPUs it does); a kernel module with Inductor's benchmark harness has a ``def
call(`` too, and ``def benchmark_all_configs(`` beside it, and stays a kernel. A graph
is known by its text less the ``# kernel path:`` comments, which name the engine's own
cache folder: two engines that compiled one graph into two folders wrote two wrappers
that differ only there, under two names.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

# Parts of a pick that are not the pick: how long the timing took, the compiled binary's hash.
_NOT_THE_PICK = ("time_taken_ms", "triton_cache_hash")
# Where this engine's cache put each kernel, not what the graph runs.
_PATH_COMMENT = re.compile(r"^# kernel path: .*$", re.MULTILINE)


def _sha(items: Any) -> str:
    return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()[:16]


def scan(root: Path) -> dict[str, Any]:
    """The kernels, graph modules and autotune picks under ``root`` (full sets)."""
    kernels: set[str] = set()
    graphs: set[str] = set()
    picks: dict[str, str] = {}
    if root.is_dir():
        for f in root.rglob("*"):
            if not f.is_file():
                continue
            if f.suffix == ".best_config":
                try:
                    pick = json.loads(f.read_text())
                except (OSError, ValueError):
                    continue
                picks[f.stem] = json.dumps({k: v for k, v in pick.items()
                                            if k not in _NOT_THE_PICK}, sort_keys=True)
            elif f.suffix == ".cpp":
                kernels.add(f.stem)
            elif f.suffix == ".py":
                try:
                    text = f.read_text(errors="replace")
                except OSError:
                    continue
                if "def call(" in text and "def benchmark_all_configs(" not in text:
                    graphs.add(_graph_id(text))
                elif "@triton.jit" in text:
                    kernels.add(f.stem)
    return {"kernels": kernels, "graphs": graphs, "picks": picks}


def _graph_id(text: str) -> str:
    """A wrapper module's identity: its text less the cache paths it names."""
    return hashlib.sha256(_PATH_COMMENT.sub("", text).encode()).hexdigest()[:32]


def summary(found: dict[str, Any]) -> dict[str, Any]:
    """Counts and digests of a :func:`scan` (what the results file keeps)."""
    return {"kernels": len(found["kernels"]), "kernels_sha": _sha(sorted(found["kernels"])),
            "graph_modules": len(found["graphs"]), "graphs_sha": _sha(sorted(found["graphs"])),
            "autotuned": len(found["picks"]), "picks_sha": _sha(found["picks"])}


def compare(a: dict[str, Any], b: dict[str, Any], keep: int = 10) -> dict[str, Any]:
    """``a`` against ``b`` (two :func:`scan` results): kernels in one only, and the
    kernels both timed whose picks differ (up to ``keep`` named)."""
    common = sorted(set(a["picks"]) & set(b["picks"]))
    differ = [k for k in common if a["picks"][k] != b["picks"][k]]
    return {"same_kernels": a["kernels"] == b["kernels"],
            "same_graphs": a["graphs"] == b["graphs"],
            "kernels_only_here": len(a["kernels"] - b["kernels"]),
            "kernels_only_there": len(b["kernels"] - a["kernels"]),
            "autotuned_both": len(common), "different_picks": len(differ),
            "different_picks_named": differ[:keep],
            "same_picks": not differ and set(a["picks"]) == set(b["picks"])}
