"""Token schedules of the Triton backend from measured one-stage / two-stage latencies.

``bench_op.py`` measures both kernels (paths forced) at every hidden size and
token count; :func:`table` turns those rows into the schedule table that
``fusion_pass/data/triton_schedule.json`` holds and the gate reads
(format: :mod:`fusion_pass.schedules`).

The rule, per hidden size, walking the measured token counts upwards:

1. A count takes the faster path, unless the two are within ``noise``
   (relative to the faster, default 3 %): then it keeps the previous count's
   path, so run-to-run noise cannot flip the schedule back and forth around a
   tie.  The first count, if tied, takes one-stage (what AITER's rule does at
   small counts).  A count where only one path was measured (the other
   declined the shape) takes that one.
2. Consecutive counts with the same path form a run.
3. Each run's step ends at its last measured count (``up_to`` is inclusive);
   the last run is unbounded.  Every ``up_to`` in the table is thus a count at
   which the step's path was measured to be the better one, and the counts
   between two measured ones take the path measured at the next count above
   them: nothing is known between measurements, and a cut anywhere else (a
   midpoint, say) would claim a crossover nobody measured.  It is also the
   convention of the 80-token rule (one-stage up to and including 80).

Hidden sizes where one path was never measured (the one-stage kernel holds a
row in one block: bf16 rows above 8192) get no schedule: the gate's pack rule
already decides them, and a one-path schedule would only mislead the gate's
nearest-hidden lookup for rows that do fit.

CLI: ``python benchmarks/op/crossover.py RESULT.json --out fusion_pass/data/triton_schedule.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Iterable, Optional

NOISE = 0.03
PATHS = ("one_stage", "two_stage")
Step = tuple[Optional[int], str]


def _measured(row: dict[str, Any], path: str) -> Optional[float]:
    v = row.get(path)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) and v > 0 else None


def choose(points: Iterable[tuple[int, Optional[float], Optional[float]]],
           noise: float = NOISE) -> list[tuple[int, str]]:
    """``(tokens, path)`` per measured count from ``(tokens, one_stage_us, two_stage_us)``."""
    out: list[tuple[int, str]] = []
    for tokens, one, two in sorted(points):
        if one is None and two is None:
            continue
        if one is None or two is None:
            path = "one_stage" if two is None else "two_stage"
        elif abs(one - two) < noise * min(one, two):
            path = out[-1][1] if out else "one_stage"
        else:
            path = "one_stage" if one < two else "two_stage"
        out.append((tokens, path))
    return out


def steps(chosen: list[tuple[int, str]]) -> list[Step]:
    """Runs of one path, each cut at its last measured count; the last is unbounded."""
    out: list[Step] = []
    for tokens, path in chosen:
        if out and out[-1][1] == path:
            out[-1] = (tokens, path)
        else:
            out.append((tokens, path))
    if out:
        out[-1] = (None, out[-1][1])
    return out


def table(rows: Iterable[dict[str, Any]], dtype: str, world_size: int, source: str,
          noise: float = NOISE) -> dict[str, Any]:
    """The schedule table of bench rows (``hidden``, ``tokens``, ``one_stage``, ``two_stage``)."""
    by_hidden: dict[int, list[tuple[int, Optional[float], Optional[float]]]] = {}
    for r in rows:
        by_hidden.setdefault(int(r["hidden"]), []).append(
            (int(r["tokens"]), _measured(r, "one_stage"), _measured(r, "two_stage")))
    schedules = []
    for hidden, points in sorted(by_hidden.items()):
        if not all(any(p[i] is not None for p in points) for i in (1, 2)):
            continue
        chosen = choose(points, noise)
        schedules.append({"dtype": dtype, "world_size": world_size, "hidden": hidden,
                          "steps": [list(s) for s in steps(chosen)],
                          "measured": [[t, one, two] for t, one, two in sorted(points)]})
    return {"source": source, "noise": noise,
            "rule": "per count the faster path (ties within noise keep the previous path); "
                    "runs cut at their last measured count, inclusive; last run unbounded",
            "schedules": schedules}


def from_result(result: dict[str, Any], source: str, noise: float = NOISE) -> dict[str, Any]:
    """The table of a ``bench_op.py`` result file's rows (dtype and world size from its meta)."""
    meta = result["meta"]
    return table(result["rows"], str(meta["dtype"]), int(meta["world_size"]), source, noise)


def describe(tab: dict[str, Any]) -> str:
    lines = []
    for s in tab["schedules"]:
        parts = ", ".join(f"{p} up to {u}" if u is not None else f"{p} above"
                          for u, p in s["steps"])
        lines.append(f"hidden {s['hidden']} ({s['dtype']}, world {s['world_size']}): {parts}")
    return "\n".join(lines) or "no hidden size with both paths measured: empty table"


def write(tab: dict[str, Any], path: str) -> None:
    """Write ``tab`` after checking that the gate parses it."""
    from fusion_pass import schedules

    schedules.parse(tab)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(tab, f, indent=1)
        f.write("\n")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("result", help="a bench_op.py result JSON (op_h200x2.json)")
    ap.add_argument("--out", default="fusion_pass/data/triton_schedule.json")
    ap.add_argument("--noise", type=float, default=NOISE,
                    help="relative difference below which a count keeps the previous path")
    args = ap.parse_args(argv)
    with open(args.result) as f:
        result = json.load(f)
    meta = result["meta"]
    source = (f"benchmarks/op/bench_op.py on {meta.get('world_size')} x {meta.get('device')}, "
              f"{meta.get('date')} ({os.path.basename(args.result)})")
    tab = from_result(result, source, args.noise)
    write(tab, args.out)
    print(describe(tab))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
