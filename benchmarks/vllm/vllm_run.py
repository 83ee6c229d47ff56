"""The run of a vLLM benchmark (offline or serving): its engines (or servers) in waves that
fit the GPUs' memory (``wave_plan.py``), one wave at a time started, pinned, measured and
stopped, each given its planned share of the time left; the results file rewritten after
each wave (a wave that runs out of time leaves the ones before it), and the exit code of
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
import wave_plan
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
    latest: Optional[float] = None
    """Where later than ``deadline``: how late its waves' starts and first rounds may
    reach (``--latest-s``, less the same reserve)."""

    def head(self, benchmark: str) -> dict[str, Any]:
        """What every results file starts with."""
        return {"benchmark": benchmark, "meta": self.meta, "settings": self.settings,
                "device": "cpu" if on_cpu() else "gpu", "attention_backend": self.attention,
                "kernel_settings": setup.kernel_settings(self.shape.kernel_choice)}


def begin(args: Any, argv: Optional[list[str]], script: str, reserve_s: float,
          started: float) -> Run:
    """The run's metadata, its deadline (``--budget-s`` from ``started``, less ``reserve_s``
    to stop the engines and write the results) and its latest (``--latest-s`` likewise), the
    engines' shape and the work folder."""
    attention, why = setup.attention_backend(args.attention_backend)
    root = args.work_dir or Path(tempfile.mkdtemp(prefix=f"{Path(script).stem}-"))
    root.mkdir(parents=True, exist_ok=True)
    return Run(meta=run_metadata(None if argv is None else [script, *argv]),
               deadline=started + args.budget_s - reserve_s if args.budget_s else float("inf"),
               attention={"requested": attention, "why": why},
               shape=setup.engine_shape(args, attention, root), root=root,
               settings={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               started=started,
               latest=started + args.latest_s - reserve_s
               if getattr(args, "latest_s", 0) > args.budget_s > 0 else None)


def planned(args: Any, shape: setup.EngineShape, groups: dict[str, list[str]],
            free_gib: Optional[list[float]]) -> wave_plan.Plan:
    """The benchmark's waves: ``groups`` (per model, its engines' labels) sized against
    ``free_gib`` (each GPU's free memory; None: not known, one wave per model), the first
    wave beside ``--beside-gib``."""
    engine = {m: wave_plan.engine_memory(setup.MODELS[m], shape.tp, shape.dtype, shape.kv_tokens,
                                         shape.step_tokens(m))
              for m in groups}
    return wave_plan.plan_waves(groups, engine, free_gib, getattr(args, "beside_gib", 0.0))


def wait_for_memory(plan: wave_plan.Plan, wave: wave_plan.Wave, tp: int,
                    read: Callable[[int], Optional[list[float]]], timeout: float = 20.0) \
        -> Optional[list[float]]:
    """Until every GPU has the wave's memory free (the wave before it may still be giving
    its memory back), at most ``timeout`` seconds; each GPU's free memory then."""
    if plan.free_gib is None:
        return None
    until = time.monotonic() + timeout
    while True:
        free = read(tp)
        if free is None or min(free) - plan.margin_gib >= wave.gib or time.monotonic() >= until:
            return None if free is None else [round(x, 2) for x in free]
        time.sleep(0.5)


def shares(deadline: float, times: list[wave_plan.WaveTime]) -> float:
    """The deadline of the first of ``times`` (the waves left): the time to ``deadline``
    shared in proportion to their planned seconds."""
    if deadline == float("inf"):
        return deadline
    left = deadline - time.monotonic()
    return time.monotonic() + left * times[0].total / max(sum(t.total for t in times), 1e-9)


def reach(deadline: float, later: list[wave_plan.WaveTime], least: bool = False) -> float:
    """The latest a wave may measure while short of its minimum rounds: the run's
    ``deadline`` less the planned seconds of the waves after it.  A wave whose rounds take
    longer than planned (the plan's times come from another card, or one round ran slow)
    still gets its minimum where the run has the time, and the later waves keep theirs.
    ``least``: less only what the later waves need to have results at all
    (:attr:`wave_plan.WaveTime.least`): how late a wave's engines may come up and its first
    round end (:func:`start_limit`, :func:`limit_now`)."""
    return deadline - sum(t.least if least else t.total for t in later)


def limit_now(deadline: float, reach_at: Optional[float], rounds: int, least: int,
              first_at: Optional[float] = None) -> float:
    """The time a wave measures until, once ``rounds`` are measured: its ``deadline``, or,
    while fewer than ``least``, ``reach_at`` (:func:`reach`; None: none) where that is later;
    before its first timed round ends, ``first_at`` (:func:`reach` with ``least``) where
    later still, so that a wave whose engines came up late has results."""
    limit = deadline if reach_at is None or rounds >= least else max(deadline, reach_at)
    return limit if first_at is None or rounds > 0 else max(limit, first_at)


def round_fits(now: float, round_s: float, deadline: float, reach_at: Optional[float],
               rounds: int, least: int, first_at: Optional[float] = None) -> bool:
    """Whether another round may start at ``now``: one of ``round_s`` (0: not known yet)
    ends by :func:`limit_now`; never one that starts past it."""
    limit = limit_now(deadline, reach_at, rounds, least, first_at)
    return now < limit and not (round_s and now + round_s > limit)


def start_limit(wave_deadline: float, t: wave_plan.WaveTime, timeout: float,
                latest_at: Optional[float] = None) -> float:
    """When a wave's engines must be up: within ``timeout``, and early enough to leave its
    untimed rounds, one timed round and its stop before the latest it may measure until (its
    deadline, or ``latest_at`` where later: :func:`reach` with ``least``, the run's deadline
    less what the later waves need to have results).  Engines late cost the wave its
    rounds and the later waves theirs beyond one each, not anybody's results.  Each limit
    before this one dropped engines that were seconds from up: the wave's deadline less two
    rounds (on one H100, three engines compiling beside the end-to-end check in 70 s where
    51 s had been measured), then the run's deadline less the later waves' planned seconds
    (on another, a baseline up in 84 s where its twins took 82 and 83 s: the wave measured
    nothing it could compare)."""
    latest = wave_deadline if latest_at is None else max(wave_deadline, latest_at)
    return min(time.monotonic() + timeout, latest - (t.first + t.round + t.stop))


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


_HELD: list[int] = []
"""A SIGTERM that came while a wave's engines were being stopped."""


def _held(signum: int, frame: Any) -> None:
    _HELD.append(signum)


def execute(run: Run, args: Any, result: dict[str, Any], path: Path,
            groups: dict[str, list[str]], make: Callable[[str, list[str]], list[Any]],
            start_all: Callable[..., None],
            measure: Callable[..., dict[str, Any]],
            stop: Callable[[list[Any]], None], wave_time: Callable[[wave_plan.Wave], Any],
            problems: Callable[[dict[str, Any], int, str], list[str]], name: str,
            primary: tuple[str, ...], body: Callable[[dict[str, Any]], list[str]],
            free_gib: Callable[[int], Optional[list[float]]] = wave_plan.gpu_free_gib) -> int:
    """A benchmark's engines (or servers), ``groups`` (per model, their labels), in the
    waves of :func:`planned`; per wave: its units made (``make(model, labels)``), started
    in :func:`launch_order` (``start_all(units, parallel, timeout, deadline)``) once the
    GPUs have its memory free, pinned, measured (``measure(units, deadline, clocks,
    seats, reach_at=..., first_at=...)``: a model's result; the GPUs' clocks sampled in
    this process; ``seats`` the :class:`cpu_placement.Seats` of the wave) within the
    wave's share of the time (``wave_time(wave)``: its planned :class:`wave_plan.WaveTime`,
    measuring until its stop; while short of its minimum rounds, until :func:`reach`; until
    its first round, until :func:`reach` of the later waves' least), and stopped whatever
    happened; the results file written after each wave; then :func:`finish`."""
    given = getattr(args, "gpu_free_gib", None)
    plan = planned(args, run.shape, groups, given if given is not None else free_gib(args.tp))
    times = [wave_time(w) for w in plan.waves]
    result["plan"] = {**plan.describe(), "time": [t.describe() for t in times]}
    result["waves"] = []
    result["launch_seed"] = getattr(args, "launch_seed", None)
    if result["launch_seed"] is None:
        result["launch_seed"] = int.from_bytes(os.urandom(4), "little")
    result["complete"] = False
    print("\n".join(plan.lines(name)), flush=True)
    write_json(path, result)
    # Engines and servers run in process groups of their own, which a time limit's SIGTERM
    # to this process does not reach: turned into an exit, it runs the stop below (where
    # nothing else in this process handles SIGTERM, and for this call only).
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_DFL and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)
    clocks = ClockSampler(args.tp)
    result["clock_sampler"] = clocks.describe()
    check = None if args.check == "none" else (lambda r: problems(r, args.tp, args.check))
    cpus = sorted(os.sched_getaffinity(0))
    try:
        for i, wave in enumerate(plan.waves):
            units = make(wave.model, wave.labels)
            deadline = shares(run.deadline, times[i:])
            reach_at = reach(run.deadline, times[i + 1:])
            first_at = reach(getattr(run, "latest", None) or run.deadline, times[i + 1:],
                             least=True)
            record: dict[str, Any] = {"model": wave.model, "labels": wave.labels}
            result["waves"].append(record)
            if wave.after_beside and getattr(args, "after_pid", None):
                result["after_pid"] = wait_for_pid(args.after_pid, deadline)
            record["gpu_free_gib_at_start"] = wait_for_memory(plan, wave, args.tp, free_gib)
            # The engines' own share of the wave's count (the first offline wave's counts
            # the job beside it too): what :func:`held_gib` is set against.
            record["gib_planned_engines"] = round(
                len(wave.labels) * plan.engine[wave.model].total, 2)
            order = launch_order(units, getattr(args, "launch_order", "given"),
                                 f"{result.get('launch_seed')}/{i}")
            record["launch_order"] = [getattr(u, "label", str(u)) for u in order]
            t0, ended = time.monotonic(), False
            try:
                _run_wave(args, result, record, units, order, start_all, measure, stop, clocks,
                          cpus, start_limit(deadline, times[i], args.start_timeout_s, first_at),
                          deadline - times[i].stop, first=i == 0,
                          reach_at=reach_at - times[i].stop,
                          first_at=first_at - times[i].stop, free_gib=free_gib)
                ended = True
            finally:  # what the wave measured is written, however it ended
                record["seconds"] = round(time.monotonic() - t0, 1)
                result["aa_overall"] = paired_ratios.overall(
                    {f"{m['model']['name']}" + (f" (wave {m['wave']})" if len(plan.waves) >
                                                len(groups) else ""): m["aa"]
                     for m in result["models"]})
                result["complete"] = ended and i == len(plan.waves) - 1 and not plan.unplanned
                result["seconds"] = round(time.monotonic() - run.started, 1)
                if check is not None:
                    result["check"] = {"what": result["settings"]["check"],
                                       "problems": check(result)}
                write_json(path, result)
    finally:
        if signal.getsignal(signal.SIGTERM) in (_terminated, _held):
            signal.signal(signal.SIGTERM, previous)
    return finish(result, path, summary(result, name, primary, body(result)), check,
                  None if args.work_dir else run.root)


def held_gib(before: Optional[list[float]], after: Optional[list[float]]) -> dict[str, Any]:
    """What a wave's engines hold on each GPU once measured: the free memory before they
    started (``before``) less the free memory now (``after``), their activations' peak and
    the caching allocator's reserve included (it keeps what a step took).  Set against the
    plan's count of the wave's engines (``gib_planned_engines``) it shows how near the plan
    is.  It reads low where the memory free at the start was low for other reasons: the
    job beside the first offline wave holding memory then, or the wave before still giving
    its memory back (the wave starts once its own count is free).  Nothing where either
    reading is missing (no NVML); not read at all in a run given ``--gpu-shared`` (the job
    beside the first offline wave: that wave's engines start after its reading)."""
    if not before or not after or len(before) != len(after):
        return {}
    return {"gpu_free_gib_measured": [round(x, 2) for x in after],
            "gib_held_per_gpu": round(max(b - a for b, a in zip(before, after)), 2)}


def settle_s(given: Optional[float], tp: int, seats: cpu_placement.Seats) -> float:
    """The pause before a turn's timed calls, counted from the end of the turn before:
    ``given``, else 0.2 s, or 1.2 s at TP > 1 on GPUs where the engine measured before is
    not parked (its engine core and workers poll vLLM's shared-memory queues for a second
    after its last message, ``SpinCondition`` in ``shm_broadcast.py``, on these very CPUs)."""
    if given is not None:
        return given
    return 1.2 if tp > 1 and not on_cpu() and not seats.parks else 0.2


def launch_order(units: list[Any], how: str, seed: str) -> list[Any]:
    """The order a wave's engines are launched in (``--launch-order``): as given, or
    shuffled by ``seed`` (the run's, recorded, and the wave's number).  An engine launched
    first loads and compiles beside fewer others; an offset that lasts as long as an engine
    and comes with the order of its start (docs/vllm_benchmark.md, section 8) then lands
    on any variant, not always on the same."""
    order = list(units)
    if how == "shuffled":
        import random

        random.Random(seed).shuffle(order)
    return order


def _run_wave(args: Any, result: dict[str, Any], record: dict[str, Any], units: list[Any],
              order: list[Any], start_all: Callable[..., None],
              measure: Callable[..., dict[str, Any]], stop: Callable[[list[Any]], None],
              clocks: ClockSampler, cpus: list[int], start_by: float, deadline: float,
              first: bool, reach_at: Optional[float] = None,
              first_at: Optional[float] = None,
              free_gib: Callable[[int], Optional[list[float]]] = wave_plan.gpu_free_gib) \
        -> None:
    """One wave: started in ``order``, up by ``start_by``, pinned, measured until
    ``deadline`` (until ``reach_at`` while short of its minimum rounds, ``first_at`` until its
    first round: :func:`round_fits`; the engines not measured parked), unpinned and stopped,
    whatever happens (a SIGTERM included).  Once measured, what the wave holds on each GPU
    (:func:`held_gib`)."""
    spinners: Optional[cpu_placement.Spinners] = None
    try:
        start_all(order, args.start_parallel, args.start_timeout_s, start_by)
        if first and getattr(args, "after_pid", None) and "after_pid" not in result:
            result["after_pid"] = wait_for_pid(args.after_pid, start_by)
        # Pinned only now: the engines' compiles had every CPU.
        placed = cpu_placement.apply(
            args.tp, [(u.name, u.pid) for u in units if u.not_run_reason is None and u.pid]) \
            if args.cpu_placement == "pinned" else {"mode": "scheduler"}
        record["cpu_placement"] = placed
        result.setdefault("cpu_placement", placed)
        seats = cpu_placement.Seats(placed, {
            u.name: u.pid for u in units
            if getattr(u, "not_run_reason", None) is None and getattr(u, "pid", None)})
        seats.park_all()
        spinners = cpu_placement.keep_awake(args.cpu_no_halt, placed, cpus, args.tp)
        model = measure(units, deadline, clocks, seats, reach_at=reach_at,
                        first_at=first_at)
        if getattr(args, "gpu_shared", False):
            record["held_not_measured"] = "another job shares the GPUs"
        else:
            record.update(held_gib(record.get("gpu_free_gib_at_start"), free_gib(args.tp)))
        model["wave"] = len(result["waves"])
        result["models"].append(model)
    finally:
        # A SIGTERM while stopping must not cut the stop short (the engines and servers, in
        # process groups of their own, would outlive this process, and their memory with
        # them): it is kept and acted on once they are stopped.
        armed = signal.getsignal(signal.SIGTERM) is _terminated
        if armed:
            signal.signal(signal.SIGTERM, _held)
        try:
            if spinners is not None:
                spinners.stop()
            # Unpinned first: the engines' processes, on a few shared CPUs while measuring,
            # shut down side by side.
            if args.cpu_placement == "pinned":  # a SIGTERM may have come while pinning
                cpu_placement.unpin({"mode": "pinned"},
                                    [p for u in units if (p := getattr(u, "pid", None))], cpus)
        finally:
            stop(units)
            if armed:
                signal.signal(signal.SIGTERM, _terminated)
                if _HELD:
                    _HELD.clear()
                    raise SystemExit(128 + signal.SIGTERM)
