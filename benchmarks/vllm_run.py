"""The run of a vLLM benchmark (offline or serving), once its engines are up: the models in
turn, each given an equal share of the time left, the results file rewritten after each
(a model that runs out of time leaves the ones before it), and the exit code of
``--check``."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import shutil
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import cpu_placement
import paired_ratios
import vllm_setup as setup
from bench_common import run_metadata
from gpu_telemetry import ClockSampler

from fusion_pass.tools.demo import on_cpu

Problems = Callable[[dict[str, Any]], list[str]]
STOP_S = 8.0
"""How long a step's engines (or servers) get, all together, for vLLM's own shutdown before
their process groups are killed: less than the 10 s between the SIGTERM of a step's time
limit and its SIGKILL, which would leave them running (they are in process groups of their
own)."""


@dataclasses.dataclass
class Run:
    """What a benchmark's ``main`` starts from."""
    meta: dict[str, Any]
    deadline: float
    attention: dict[str, Any]
    shape: setup.EngineShape
    root: Path
    settings: dict[str, Any]
    started: float

    def head(self, benchmark: str) -> dict[str, Any]:
        """What every results file starts with."""
        return {"benchmark": benchmark, "meta": self.meta, "settings": self.settings,
                "device": "cpu" if on_cpu() else "gpu", "attention_backend": self.attention,
                "kernel_settings": setup.kernel_settings(self.shape.kernel_choice)}


def begin(args: Any, argv: Optional[list[str]], script: str, reserve_s: float,
          started: float) -> Run:
    """The run's metadata, its deadline (``--budget-s`` from ``started``, less ``reserve_s``
    to stop the engines and write the results), the engines' shape and the work folder."""
    attention, why = setup.attention_backend(args.attention_backend)
    root = args.work_dir or Path(tempfile.mkdtemp(prefix=f"{Path(script).stem}-"))
    root.mkdir(parents=True, exist_ok=True)
    return Run(meta=run_metadata(None if argv is None else [script, *argv]),
               deadline=started + args.budget_s - reserve_s if args.budget_s else float("inf"),
               attention={"requested": attention, "why": why},
               shape=setup.engine_shape(args, attention, root), root=root,
               settings={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               started=started)


def run_models(result: dict[str, Any], path: Path, units: dict[str, list[Any]],
               measure: Callable[[list[Any], float], dict[str, Any]], deadline: float,
               problems: Optional[Problems], started: float) -> None:
    """``measure(units_of_a_model, its_deadline)`` for each model; ``result`` filled in
    and written to ``path`` after each."""
    for i, (name, us) in enumerate(units.items()):
        share = (deadline - time.monotonic()) / (len(units) - i)
        result["models"].append(measure(us, time.monotonic() + share
                                        if share != float("inf") else deadline))
        result["aa_overall"] = paired_ratios.overall(
            {m["model"]["name"]: m["aa"] for m in result["models"]})
        result["complete"] = len(result["models"]) == len(units)
        result["seconds"] = round(time.monotonic() - started, 1)
        if problems is not None:
            result["check"] = {"what": result["settings"]["check"],
                               "problems": problems(result)}
        write_json(path, result)


def write_json(path: Path, obj: dict[str, Any]) -> None:
    """``path`` replaced whole: a step stopped while writing leaves the previous file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def finish(result: dict[str, Any], path: Path, text: str, problems: Optional[Problems],
           scratch: Optional[Path]) -> int:
    """Remove ``scratch`` (a work folder of the run's own), print the summary; 1 if
    ``--check`` found problems, else 0."""
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)
    print(text)
    print(f"wrote {path}")
    if problems is None:
        return 0
    bad = problems(result)
    for b in bad:
        print(f"CHECK FAILED: {b}")
    print(f"check ({result['settings']['check']}): {'FAILED' if bad else 'OK'}")
    return 1 if bad else 0


def summary(result: dict[str, Any], name: str, primary: tuple[str, ...], body: list[str]) -> str:
    """The A/A verdict first, then ``body``."""
    return "\n".join([*paired_ratios.aa_lines(name, result["models"], primary), *body])


def wait_for_pid(pid: int, deadline: float) -> dict[str, Any]:
    """Until process ``pid`` has ended, at most until ``deadline``: how long it took, and
    whether it ended (if not, what is measured next overlaps it, and the results say so)."""
    t = time.monotonic()
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    ended = not _alive(pid)
    if not ended:
        print(f"process {pid} still runs at the end of the start-up time: the measurements "
              "overlap it", flush=True)
    return {"pid": pid, "ended": ended, "waited_s": round(time.monotonic() - t, 1)}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A child of this process that has exited but is not yet reaped has ended too.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def exit_now(code: int) -> None:
    """End the process once its results are written and its engines stopped, without the
    interpreter's own shutdown: in the first run on one H200 the offline benchmark was
    still there 25 s after its last line, until its time limit killed it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main_then_exit(main: Callable[[], int]) -> None:
    """A benchmark's ``main`` and then :func:`exit_now`, however ``main`` ends (its engines
    are stopped by then: :func:`execute`): an exception is printed and exits 1, a time
    limit's SIGTERM with its own code."""
    try:
        code = main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed, then the same quick exit
        traceback.print_exc()
        code = 1
    exit_now(code)


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def execute(run: Run, args: Any, result: dict[str, Any], path: Path,
            units: dict[str, list[Any]], start_all: Callable[..., None],
            measure: Callable[[list[Any], float, ClockSampler], dict[str, Any]],
            stop: Callable[[list[Any]], None], startup_share: float,
            problems: Callable[[dict[str, Any], int, str], list[str]], name: str,
            primary: tuple[str, ...], body: Callable[[dict[str, Any]], list[str]]) -> int:
    """A benchmark's engines (or servers) per model, ``units``: all started
    (``start_all(units, parallel, timeout, deadline)``) and up within ``startup_share`` of
    the time, :func:`run_models` (``measure(units_of_a_model, deadline, clocks)``, the
    GPUs' clocks sampled in this process), all stopped whatever happened; then
    :func:`finish`."""
    every = [u for us in units.values() for u in us]
    # Engines and servers run in process groups of their own, which a time limit's SIGTERM to this
    # process does not reach: turned into an exit, it runs the stop below (where nothing
    # else in this process handles SIGTERM, and for this call only).
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_DFL and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)
    clocks = ClockSampler(args.tp)
    result["clock_sampler"] = clocks.describe()
    check = None if args.check == "none" else (lambda r: problems(r, args.tp, args.check))
    spinners: Optional[cpu_placement.Spinners] = None
    cpus = sorted(os.sched_getaffinity(0))
    try:
        started_by = setup.part_of(run.deadline, startup_share)
        start_all(every, args.start_parallel, args.start_timeout_s, started_by)
        if getattr(args, "after_pid", None):
            result["after_pid"] = wait_for_pid(args.after_pid, started_by)
        # Pinned only now: the engines' compiles had every CPU.
        placed = cpu_placement.apply(
            args.tp, [(u.name, u.pid) for u in every if u.not_run_reason is None and u.pid]) \
            if args.cpu_placement == "pinned" else {"mode": "scheduler"}
        result["cpu_placement"] = placed
        spinners = cpu_placement.keep_awake(args.cpu_no_halt, placed, cpus, args.tp)
        run_models(result, path, units, lambda us, dl: measure(us, dl, clocks), run.deadline,
                   check, run.started)
    finally:
        # A second SIGTERM while stopping must not cut the stop short (the engines and
        # servers, in process groups of their own, would outlive this process, and their
        # memory with them).
        if signal.getsignal(signal.SIGTERM) is _terminated:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            if spinners is not None:
                spinners.stop()
            # Unpinned first: the engines' processes, on a few shared CPUs while measuring,
            # shut down side by side.
            if args.cpu_placement == "pinned":  # a SIGTERM may have come while pinning
                cpu_placement.unpin({"mode": "pinned"},
                                    [p for u in every if (p := getattr(u, "pid", None))], cpus)
        finally:
            stop(every)
            if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
                signal.signal(signal.SIGTERM, previous)
    return finish(result, path, summary(result, name, primary, body(result)), check,
                  None if args.work_dir else run.root)
