"""Differential fuzzing of the pass: generated graphs around all-reduce -> (+ residual) -> RMSNorm.

Each case (:mod:`fuzzing.generator`) is compiled with the pass and without it on a
pair of gloo ranks and judged by :mod:`fuzzing.oracle`: outputs equal within the
dtype's tolerance, every all-reduce recorded, one fused op per site recorded fused.

    python tests/fuzzing/fuzz_pass.py --seed S --cases N [--jobs J] [--out DIR]

prints, last, ``fuzz: N cases, F fused, U unfused, W wrong``; wrong cases are written
to DIR with their seed, what was wrong and their source, re-run with
``--replay FILE`` and made small with ``--shrink FILE``.  Exit status 1 when a case
is wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

# tests/, the folder that holds the fuzzing package
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fuzzing import oracle, pair, report, shrink  # noqa: E402
from fuzzing.generator import case_seeds, generate  # noqa: E402


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", type=int, default=100)
    p.add_argument("--jobs", type=int, default=None,
                   help="pairs of ranks run side by side (default: one per core)")
    p.add_argument("--out", default="fuzz_failures", help="folder for wrong cases")
    p.add_argument("--replay", nargs="*", default=[], help="case files to re-run")
    p.add_argument("--case", nargs="*", type=int, default=[],
                   help="run these case seeds (as a run's output names them) instead")
    p.add_argument("--always-baseline", action="store_true",
                   help="compile without the pass even where the pass left the graph unchanged")
    p.add_argument("--show", type=int, help="print the source of one case seed and exit")
    p.add_argument("--json", help="write the run (counts, wrong cases, commit, versions) here")
    p.add_argument("--shrink", metavar="FILE",
                   help="make a wrong case (a written one) as small as it stays wrong in; "
                        "writes FILE's name with .shrunk.py")
    p.add_argument("--sabotage", choices=sorted(oracle.SABOTAGES),
                   help="run with a pass that is wrong on purpose (the oracle must say so)")
    a = p.parse_args(argv)
    if a.show is not None:
        print(generate(a.show).source)
        return 0
    if a.shrink:
        with open(a.shrink) as fh:
            small, verdict = shrink.shrink(fh.read(), a.sabotage, a.jobs, say=print)
        path = a.shrink[:-3] + ".shrunk.py" if a.shrink.endswith(".py") else a.shrink + ".shrunk.py"
        with open(path, "w") as fh:
            fh.write(small)
        print(small[small.index("def f("):])
        print(f"shrunk case written to {path}: {verdict['why'].splitlines()[0]}")
        return 0
    if a.replay:
        sources = {}
        for i, path in enumerate(a.replay):
            with open(path) as fh:
                sources[-1 - i] = fh.read()
        seeds = list(sources)
    else:
        seeds = a.case or case_seeds(a.seed, a.cases)
        sources = {s: generate(s).source for s in seeds}
    command = sys.argv if argv is None else ["tests/fuzzing/fuzz_pass.py", *argv]
    started = report.provenance(command) if a.json else None
    t0 = time.time()
    jobs = a.jobs or pair.default_jobs()
    results = pair.run(seeds, sources, jobs=jobs, progress=True,
                       always_baseline=a.always_baseline,
                       sabotage={s: a.sabotage for s in seeds} if a.sabotage else None)
    dt = time.time() - t0
    for r in results:
        if r["status"] in ("wrong", "invalid"):
            print(f"case {r['seed']} {r['status']}: {r['why'].splitlines()[0] if r['why'] else ''}")
    paths = report.write_failures(results, sources, a.out)
    if paths:
        print(f"{len(paths)} case(s) written to {a.out}")
    print(report.aside(results))
    if a.json:
        record = report.run_record(results, None if a.replay or a.case else a.seed, dt, jobs,
                                   command, started)
        with open(a.json, "w") as fh:
            json.dump(record, fh, indent=1)
            fh.write("\n")
    print(f"{len(results) / dt:.2f} cases/s over {dt:.0f} s")
    print(report.summary(results))
    return 1 if any(r["status"] == "wrong" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
