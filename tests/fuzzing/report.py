"""What a run found: the summary line, and each wrong case written out to re-run."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

STATUSES = ("fused", "unfused", "wrong", "invalid", "skipped")


def counts(results: list[dict]) -> dict[str, int]:
    return {s: sum(r["status"] == s for r in results) for s in STATUSES}


def summary(results: list[dict]) -> str:
    """``fuzz: N cases, F fused, U unfused, W wrong`` (invalid and skipped cases are
    the rest of N, said apart by :func:`aside`)."""
    c = counts(results)
    return (f"fuzz: {len(results)} cases, {c['fused']} fused, {c['unfused']} unfused, "
            f"{c['wrong']} wrong")


def aside(results: list[dict]) -> str:
    """The cases that are neither fused, unfused nor wrong, and why in a word."""
    c = counts(results)
    return (f"{c['invalid']} invalid (torch does not compile or run them, with or without "
            f"the pass), {c['skipped']} skipped (vLLM's ops without vLLM)")


def provenance(argv: list[str]) -> dict:
    """What ran where: the command, versions, the commit and the digest of the code, and
    the time; taken as a run starts (a long run outlives commits made meanwhile)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from bench_common import run_metadata

    return run_metadata(argv)


def run_record(results: list[dict], seed: Optional[int], wall_s: float, jobs: int,
               argv: list[str], started: Optional[dict] = None) -> dict:
    """A run as JSON: what ran where (``started``: :func:`provenance` of its start, else
    taken now), the counts, the line."""
    c = counts(results)
    return {
        "provenance": started or provenance(argv),
        "seed": seed, "cases": len(results), "jobs": jobs, "cpus": os.cpu_count(),
        "counts": c, "fused_fraction": round(c["fused"] / max(1, len(results)), 4),
        "wall_s": round(wall_s, 1), "cases_per_s": round(len(results) / max(wall_s, 1e-9), 3),
        "wrong": [{"seed": r["seed"], "why": r["why"]} for r in results if r["status"] == "wrong"],
        "invalid": [{"seed": r["seed"], "why": r["why"][:300]} for r in results
                    if r["status"] == "invalid"],
        "summary": summary(results),
    }


def write_failures(results: list[dict], sources: dict, out_dir: str) -> list[str]:
    """Each wrong or invalid case as a Python file (why, the records, the source) that
    ``fuzz_pass.py --replay`` runs again; the paths written."""
    paths = []
    for r in results:
        if r["status"] in ("wrong", "invalid"):
            os.makedirs(out_dir, exist_ok=True)
            path = os.path.join(out_dir, f"case_{r['seed']}_{r['status']}.py")
            why = "\n".join("# " + line for line in r["why"].splitlines())
            with open(path, "w") as fh:
                fh.write(f"# seed {r['seed']}: {r['status']}\n{why}\n"
                         f"# records: {r.get('records', '')}\n"
                         f"# re-run: python tests/fuzzing/fuzz_pass.py --replay {path}\n")
                fh.write(sources[r["seed"]])
            paths.append(path)
    return paths
