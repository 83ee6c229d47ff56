"""The end of a ``scripts/gpu_vllm.sh`` run: its A/A ratios first (offline, then serving, then
serving at each concurrency), then FlashInfer's verdict and the comparisons, read from the
results files (a missing file is named, not an error).

    python benchmarks/vllm/vllm_summary.py FLASHINFER.json VLLM.json SERVE.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import paired_ratios  # noqa: E402
import vllm_report  # noqa: E402


def load(path: str) -> Optional[dict[str, Any]]:
    p = Path(path)
    return json.loads(p.read_text()) if p.is_file() else None


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__)
        return 2
    flashinfer, offline, serving = (load(a) for a in argv)
    lines = ["==== summary"]
    for name, r, primary in (("offline", offline, vllm_report.OFFLINE_PRIMARY),
                             ("serving", serving, vllm_report.SERVING_PRIMARY)):
        lines += paired_ratios.aa_lines(name, r["models"], primary) if r else \
            [f"A/A {name}: no results file"]
    if serving:
        lines += vllm_report.serving_aa_lines(serving)
    if flashinfer is None:
        lines.append("flashinfer: not probed")
    else:
        lines.append(f"flashinfer: usable by vLLM's in-tree fusion: {flashinfer['usable']} "
                     f"(flashinfer-python {flashinfer['versions'].get('flashinfer-python')})")
    if offline:
        lines += vllm_report.offline_lines(offline)
    if serving:
        lines += vllm_report.serving_lines(serving)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
