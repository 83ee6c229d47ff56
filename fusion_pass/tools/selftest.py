"""``fusion-pass selftest``: prove the Triton kernels on this machine, with a verdict.

On an NVIDIA GPU it runs the kernels' suite (:mod:`fusion_pass.selftest.suite`)
at N = 2, 4 and 8 ranks simulated on that GPU, under the torch and Triton
installed; ``--quick`` runs the suite's quick subset (its ``QUICK``) at N = 2
and 8.  Without one it runs the quick subset in Triton's interpreter on the
CPU at N = 2, and says so.  A line per group as it ends, then the verdict: the
cases passed by N and path, the worst error against the tolerance, what failed
and what did not run and why, and the versions and device it ran on.  Exit
status 0 only when at least one case ran and every case passed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import textwrap
from typing import Any, Optional

PATH_COLUMNS = ("one_stage", "two_stage")
"""The verdict's columns for calls; every other kind of case counts as "other"
(calls back to back, CUDA graphs, buffer growth, a late and a missing rank)."""

WIDTH = 100
"""The verdict's lines wrap at this width."""

NAMED = 24
"""A run of at most this many cases has each one named in the verdict (by the id
that ``--only`` takes)."""

SHOWN = 8
"""Failed cases (and reasons a case did not run) the verdict names before
pointing to the JSON."""

INTERPRETER_TESTED = (3, 9)
"""The oldest Triton whose interpreter is known to run the kernels (3.6's did not)."""


def choose_form() -> tuple[str, str]:
    """("gpu", the GPU) where torch sees an NVIDIA GPU, else ("interpret", why not)."""
    import torch

    if torch.version.hip is not None:
        return "interpret", "torch is a ROCm build (the Triton backend is for NVIDIA GPUs)"
    if not torch.cuda.is_available():
        why = ("torch sees no CUDA GPU" if torch.version.cuda
               else "torch is a CPU build")
        return "interpret", why
    return "gpu", torch.cuda.get_device_name()


def progress_line(event: dict) -> Optional[str]:
    """One line for an event of :func:`~fusion_pass.selftest.suite.run_suite`."""
    kind = event["event"]
    if kind == "compiling":
        return (f"compiling the kernels: {event['units']} batches of cases, "
                f"{event['jobs']} at a time")
    if kind == "compiled":
        bad = event["not_ok"]
        return (f"compiled in {event['seconds']:.0f} s"
                + (f" ({len(bad)} batches ended early; their cases still run)" if bad else ""))
    if kind == "group":
        line = (f"N={event['world']} {event['group']:<9} {event['passed']}/{event['total']} "
                f"passed  {event['seconds']:6.1f} s")
        extra = [f"{event[k]} {k}" for k in ("failed", "not run") if event[k]]
        if event["status"] != "ok":
            extra.append(f"group {event['status']}")
        return line + (f"  ({'; '.join(extra)})" if extra else "")
    return None


def _first_line(problems: list[str]) -> str:
    """The first problem on one line (of a traceback, its exception's line)."""
    for p in problems:
        lines = [ln.strip() for ln in str(p).splitlines() if ln.strip()]
        if lines:
            return (lines[-1] if lines[0].startswith("Traceback") else lines[0])[:160]
    return "no reason recorded"


def _cell(counts: Optional[dict[str, int]]) -> str:
    if not counts:
        return "-"
    total = sum(counts.values())
    text = f"{counts['passed']}/{total}"
    notes = [f"{counts[k]} {k}" for k in ("failed", "not run") if counts[k]]
    return text + (f" ({', '.join(notes)})" if notes else "")


def _columns(by_what: dict[str, dict[str, int]]) -> list[Optional[dict[str, int]]]:
    cells: list[Optional[dict[str, int]]] = [by_what.get(p) for p in PATH_COLUMNS]
    other = [c for what, c in by_what.items() if what not in PATH_COLUMNS]
    cells.append({k: sum(c[k] for c in other) for k in ("passed", "failed", "not run")}
                 if other else None)
    return cells


def exit_code(result: dict) -> int:
    """0 when at least one case ran and every case passed, else 1."""
    from ..selftest.suite import outcome

    cases = result.get("cases") or []
    return 0 if cases and all(outcome(c) == "passed" for c in cases) else 1


def verdict(result: dict, json_path: Optional[str] = None) -> str:
    """The run on one screen: the answer, where it ran, the cases by N and path, the
    worst error, what failed, what did not run and why, what was left out."""
    from ..selftest.suite import outcome, tally

    cases = result.get("cases") or []
    prov = result.get("provenance", {})
    versions = prov.get("versions", {})
    form = result.get("form", "gpu")
    worlds = result.get("worlds") or sorted({c["world"] for c in cases})
    outcomes = [outcome(c) for c in cases]
    n_failed, n_not_run = outcomes.count("failed"), outcomes.count("not run")
    ok = exit_code(result) == 0
    if ok:
        head = f"PASSED: {len(cases)} of {len(cases)} cases"
    elif not cases:
        head = "FAILED: no case ran"
    else:
        head = (f"FAILED: {outcomes.count('passed')} of {len(cases)} cases passed"
                + (f", {n_failed} failed" if n_failed else "")
                + (f", {n_not_run} did not run" if n_not_run else ""))
    took = f" ({result['seconds']:.0f} s)" if result.get("seconds") is not None else ""
    lines = [f"== fusion-pass selftest: {head}{took} =="]
    gpu = prov.get("gpu")
    device = (f"{gpu['name']} (sm {gpu['capability']}, {gpu['sms']} SMs)" if gpu
              else prov.get("device", "?"))
    cuda = f" (CUDA {versions['cuda']})" if versions.get("cuda") else ""
    lines.append(f"ran on:   {device}; torch {versions.get('torch', '?')}{cuda}, Triton "
                 f"{versions.get('triton', '?')} ({prov.get('triton_from', '?')}), "
                 f"commit {(prov.get('commit') or '?')[:10]}"
                 + (" with local changes" if prov.get("dirty") else ""))
    sel = result.get("selection", {})
    subset = (f"the quick subset, {sel.get('cases', len(cases))} of {sel.get('of', '?')} cases"
              if sel.get("quick") else
              f"{sel.get('cases', len(cases))} of {sel.get('of', '?')} cases" if sel.get("only")
              else "every case")
    n_text = ", ".join(map(str, worlds))
    if form == "gpu":
        lines.append(f"what:     the Triton kernels at N = {n_text} ranks simulated on one GPU "
                     f"(a CUDA stream per rank), {subset}")
    else:
        lines.append(f"what:     the Triton kernels in Triton's interpreter on the CPU, N = "
                     f"{n_text} ranks as processes, {subset}")
    by_n = tally(cases)
    lines.append(f"   {'N':>2}  {'one_stage':<22}{'two_stage':<22}other")
    for w in worlds:
        cells = [_cell(c) for c in _columns(by_n.get(str(w), {}))]
        lines.append(f"   {w:>2}  {cells[0]:<22}{cells[1]:<22}{cells[2]}")
    if 0 < len(cases) <= NAMED:
        lines.append("cases:    " + ", ".join(c["id"] for c in cases))
    worst = max((c for c in cases if c.get("max_error") is not None),
                key=lambda c: c["max_error"], default=None)
    if worst is not None:
        lines.append(f"worst error: {worst['max_error']:.3f} of the tolerance ({worst['id']}); "
                     f"every case must stay at or below 1")
    failed = [c for c in cases if outcome(c) == "failed"]
    for c in failed[:SHOWN]:
        lines.append(f"failed:   {c['id']}: {_first_line(c.get('problems') or [])}")
    if len(failed) > SHOWN:
        lines.append(f"failed:   {len(failed) - SHOWN} more (the JSON has each one's problems)")
    reasons: dict[str, list[str]] = {}
    for c in cases:
        if outcome(c) == "not run":
            reasons.setdefault(c.get("reason") or "no reason recorded", []).append(c["id"])
    for why, ids in list(reasons.items())[:SHOWN]:
        named = ", ".join(ids[:3]) + (f" and {len(ids) - 3} more" if len(ids) > 3 else "")
        lines.append(f"not run:  {named}: {why}")
    if sel.get("left_out_by"):
        left = sel.get("of", 0) - sel.get("cases", 0)
        lines.append(f"left out: {left} cases of the whole suite at these N, by "
                     f"{' and '.join(sel['left_out_by'])}; `fusion-pass selftest` on an "
                     f"NVIDIA GPU runs them all")
    if form == "gpu":
        lines.append("not proven here: NVLink (every rank's stores stay in one GPU), torch's "
                     "symmetric-memory rendezvous, NCCL, runs on several GPUs (docs/testing.md)")
    else:
        lines.append("not proven here: any GPU. This checks the kernels' logic and their "
                     "protocol between ranks; CUDA graphs and the GPU's own layouts need "
                     "`fusion-pass selftest` on an NVIDIA GPU (docs/testing.md)")
        if not ok and _version(versions.get("triton", "")) < INTERPRETER_TESTED:
            lines.append(f"note:     Triton {versions.get('triton')}'s interpreter may not run "
                         f"these kernels (3.9's does); the failures may be its own")
    if json_path:
        lines.append(f"results:  {json_path}")
    return "\n".join(out for line in lines
                     for out in (textwrap.wrap(line, WIDTH, subsequent_indent=" " * 10)
                                 if len(line) > WIDTH else [line]))


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="fusion-pass selftest",
        description="Prove the Triton kernels on this machine: N ranks simulated on one NVIDIA "
                    "GPU (about 6 minutes; --quick under one), or, without a GPU, Triton's "
                    "interpreter on the CPU (the quick subset at N = 2). Exit status 0 only "
                    "when every case passed.")
    ap.add_argument("--quick", action="store_true",
                    help="a subset (both paths, bf16 and fp32, FP8, a CUDA graph, odd token "
                         "counts) at N = 2 and 8; always so without a GPU, unless --only "
                         "names cases")
    ap.add_argument("--json", metavar="PATH",
                    help="write the full results (provenance, every case, the summary) to PATH; "
                         "the groups' output goes beside it, in sim_groups/ (default: a "
                         "temporary folder, printed)")
    ap.add_argument("--worlds", type=int, nargs="+", metavar="N",
                    help="simulated world sizes (2, 4, 8; default 2 4 8, with --quick 2 8, "
                         "without a GPU 2)")
    ap.add_argument("--only", nargs="+", metavar="ID",
                    help="only the cases of these ids, as the results name them (n8-sweep-51)")
    ap.add_argument("--deadline-s", type=float, default=float("inf"),
                    help="groups not started this many seconds after the start are recorded as "
                         "not run (default: none; a run that must end in time sets one)")
    args = ap.parse_args(argv)
    try:
        from ..backends.triton_symm.limits import LIMITS
        from ..selftest import suite
    except ImportError as e:
        print(f"fusion-pass selftest: cannot run: {e} (the self-test needs torch and Triton)",
              file=sys.stderr)
        return 1
    form, about = choose_form()
    quick = args.quick or (form == "interpret" and not args.only)
    named = sorted({int(i[1:].split("-")[0]) for i in args.only or []
                    if i[1:].split("-")[0].isdigit()})
    worlds = args.worlds or named or list(suite.QUICK_WORLDS[form] if quick else (2, 4, 8))
    bad = sorted(set(worlds) - set(LIMITS.world_sizes))
    if bad:  # also an N that --only's ids name
        ap.error(f"the kernels take N in {sorted(LIMITS.world_sizes)}, not {bad}")
    if form == "gpu":
        print(f"fusion-pass selftest: {about}: the Triton kernels at N = "
              f"{', '.join(map(str, worlds))} ranks simulated on this GPU"
              + (" (the quick subset)" if quick else ""))
    else:
        print(f"fusion-pass selftest: no NVIDIA GPU here ({about}): the Triton kernels run in "
              f"Triton's interpreter on the CPU at N = {', '.join(map(str, worlds))}"
              + (", the quick subset" if quick else ", the cases named")
              + "; this checks their logic, not a GPU")
    if args.json:
        json_path = os.path.abspath(args.json)
        outdir = os.path.dirname(json_path)
    else:
        outdir = tempfile.mkdtemp(prefix="fusion-pass-selftest-")
        json_path = os.path.join(outdir, suite.RESULT[form])
    print(f"results go to {json_path}", flush=True)

    def progress(event: dict) -> None:
        line = progress_line(event)
        if line:
            print(line, flush=True)

    result = suite.run_suite(outdir, form, worlds, jobs=suite.default_jobs(),
                             deadline_s=args.deadline_s, group_timeout_s=suite.GROUP_TIMEOUT_S,
                             only=args.only,
                             quick=quick, json_path=json_path,
                             command=["fusion-pass", "selftest", *(argv if argv is not None
                                                                   else sys.argv[2:])],
                             progress=progress)
    print(verdict(result, json_path))
    return exit_code(result)
