"""Which host CPUs a benchmark's engine processes run on, and keeping those CPUs awake.

A decode step of a model whose GPU work is short (the hidden-2880 model at TP=1: about
0.8 ms of weight reads, 1.7-2.5 ms per token measured) is bound by the host: vLLM's engine
core and its frontend each keep a core busy, and wait on each other every step.  On one
H200 (a KVM guest) one engine's calls fell into two modes, about 1.7 and 2.4 ms per token,
switching between calls and not at the same time for the engines measured one after
another, and two identical engines differed by up to 18 % in a round.  The modes showed
under every placement of the processes (``benchmarks/vllm/placement_probe.py``), so placement
is not their cause; pinning still gives every engine the same CPUs, and :class:`Spinners`
answers the likeliest cause left on the host's side, not yet isolated by a measurement:
idle virtual CPUs halting (docs/vllm_benchmark.md).

Pinned, every engine's processes run on the same CPUs, one physical core per CPU and, where
the host says which CPUs are near the GPU, near it:

- the frontend (the process that made the ``LLM`` or the OpenAI server) on ``frontend``;
- the engine core on ``core``;
- at TP > 1 each worker on a CPU of its own (``workers[rank]``);
- the benchmark's own process (NVML sampling; ``vllm bench serve``'s client) on ``driver``:
  the remaining CPUs of the other physical cores;
- the engines of the wave not being measured on ``park``, one physical core of their own
  (:class:`Seats`): at TP > 1 an engine's core and workers poll vLLM's shared-memory queues
  for a second after its last message, and an idle server's threads wake now and then; on
  ``park`` neither touches the CPUs of the engine measured next.

The SMT sibling of a CPU given to an engine process is given to nobody (a busy sibling
slows a core down).  Engines start unpinned (their compiles use every CPU) and are pinned
once up; only one engine runs at a time, on the same CPUs as every other.  A host with too
few CPUs for the plan is left unpinned, and the results say why; one with no core to spare
for ``park`` pins without parking.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from pathlib import Path
from typing import Any, Optional

SYS_CPU = Path("/sys/devices/system/cpu")
SYS_PCI = Path("/sys/bus/pci/devices")


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (the kernel's list format)."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


@dataclasses.dataclass
class Topology:
    """The CPUs this process may use, grouped by physical core, and those near the GPUs."""
    allowed: list[int]
    cores: list[list[int]]
    """Physical cores: each the allowed CPUs that share it (SMT siblings), in CPU order."""
    gpu_local: Optional[list[int]]
    """CPUs the host lists as local to the GPUs used (all of them), None if it does not say."""
    smt_visible: bool

    def describe(self) -> dict[str, Any]:
        return {"allowed": self.allowed, "physical_cores": len(self.cores),
                "smt_visible": self.smt_visible, "gpu_local": self.gpu_local}


def topology(gpu_bus_ids: Optional[list[str]] = None, sys_cpu: Path = SYS_CPU,
             sys_pci: Path = SYS_PCI) -> Topology:
    """This host's CPUs as the kernel reports them (``/sys``)."""
    allowed = sorted(os.sched_getaffinity(0))
    by_core: dict[tuple[str, str], list[int]] = {}
    for c in allowed:
        topo = sys_cpu / f"cpu{c}" / "topology"
        try:
            key = ((topo / "physical_package_id").read_text().strip(),
                   (topo / "core_id").read_text().strip())
        except OSError:
            key = ("?", str(c))  # unknown: a core of its own
        by_core.setdefault(key, []).append(c)
    cores = sorted((sorted(v) for v in by_core.values()), key=lambda v: v[0])
    local: Optional[set[int]] = None
    for bus in gpu_bus_ids or []:
        try:
            cpus = parse_cpu_list((sys_pci / bus / "local_cpulist").read_text())
        except (OSError, ValueError):
            continue
        local = (local or set()) | set(cpus)
    if local is not None and set(allowed) <= local:
        local = None  # every CPU is local: nothing to choose by
    return Topology(allowed=allowed, cores=cores,
                    gpu_local=sorted(local & set(allowed)) if local else None,
                    smt_visible=any(len(v) > 1 for v in cores))


def gpu_bus_ids(count: int) -> list[str]:
    """The sysfs PCI names (``0000:19:00.0``) of the first ``count`` GPUs, from NVML; empty
    without it."""
    try:
        import pynvml

        from gpu_telemetry import _indices

        pynvml.nvmlInit()
        out = []
        for i in _indices(count):
            bus = pynvml.nvmlDeviceGetPciInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).busId
            bus = bus.decode() if isinstance(bus, bytes) else bus
            # NVML: 8-digit domain; sysfs: 4 digits, lower case.
            out.append(bus[-12:].lower())
        return out
    except Exception:  # noqa: BLE001 - no NVML: no GPU-local CPUs known
        return []


@dataclasses.dataclass
class Placement:
    """The CPUs of each role (``workers``: one list per TP rank, empty at TP=1), and where
    the engines not measured wait (``park``: empty where no core was left for it)."""
    frontend: list[int]
    core: list[int]
    workers: list[list[int]]
    driver: list[int]
    park: list[int] = dataclasses.field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def plan(tp: int, topo: Topology, frontend_cpus: int = 1, core_cpus: int = 1) \
        -> tuple[Optional[Placement], str]:
    """One CPU of a physical core per CPU an engine role gets: ``frontend_cpus`` for the
    frontend, ``core_cpus`` for the engine core, one per worker at TP > 1, from the cores
    near the GPUs first and never the first core (where the host's own housekeeping and
    interrupts tend to run); the next core (all its CPUs) parks the engines not measured,
    where one is left beside the driver's; the driver gets every CPU of the cores left.
    ``(None, why)`` where there are too few cores to leave the driver at least one."""
    need = frontend_cpus + core_cpus + (tp if tp > 1 else 0)
    local = set(topo.gpu_local or topo.allowed)
    # Near the GPUs first; the first core last (it is used only if nothing else is left).
    order = sorted(topo.cores, key=lambda core: (core[0] not in local, core is topo.cores[0]))
    if len(order) < need + 1:
        return None, (f"{len(order)} physical core(s) here, {need} for an engine's processes "
                      "and one for the benchmark needed: left unpinned")
    picked, rest = order[:need], order[need:]
    park, rest = (sorted(rest[0]), rest[1:]) if len(rest) >= 2 else ([], rest)
    cpus = [core[0] for core in picked]
    workers = [[cpus[frontend_cpus + core_cpus + r]] for r in range(tp)] if tp > 1 else []
    return Placement(frontend=cpus[:frontend_cpus],
                     core=cpus[frontend_cpus:frontend_cpus + core_cpus], workers=workers,
                     driver=sorted(c for core in rest for c in core), park=park), ""


# -- pinning ------------------------------------------------------------------------

def pin_process(pid: int, cpus: list[int]) -> int:
    """Every thread of ``pid`` on ``cpus`` (``sched_setaffinity`` sets one thread; threads
    started later inherit their starter's).  Returns how many threads were pinned."""
    n = 0
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
            n += 1
        except OSError:
            continue  # a thread that ended meanwhile, or CPUs its cgroup does not allow
    return n


def _title(pid: int) -> str:
    """What vLLM named the process (``VLLM::EngineCore_DP0``, ``VLLM::Worker_TP1``...):
    its command line, which vLLM's process titles replace."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return ""


def role_of(title: str) -> tuple[str, Optional[int]]:
    """``("core", None)``, ``("worker", rank)`` or ``("frontend", None)`` from a title."""
    if "EngineCore" in title:
        return "core", None
    if "Worker" in title:
        m = re.search(r"_TP(\d+)", title)
        return "worker", int(m.group(1)) if m else None
    return "frontend", None


def _tree(root_pid: int) -> list[Any]:
    """``root_pid``'s process and every process below it (psutil)."""
    import psutil

    root = psutil.Process(root_pid)
    return [root, *root.children(recursive=True)]


def pin_engine(root_pid: int, placement: Placement) -> dict[str, Any]:
    """An engine's processes, from its frontend's pid down, each on its role's CPUs.
    Returns what was pinned where (the role of every process found)."""
    import psutil

    try:
        procs = _tree(root_pid)
    except psutil.Error as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    out: dict[str, Any] = {}
    workers_seen = 0
    for p in procs:
        role, rank = role_of(_title(p.pid)) if p.pid != root_pid else ("frontend", None)
        if role == "worker":
            if rank is None:
                rank = workers_seen
            workers_seen += 1
            if not placement.workers:
                cpus = placement.core
            else:
                cpus = placement.workers[rank % len(placement.workers)]
        else:
            cpus = placement.core if role == "core" else placement.frontend
        threads = pin_process(p.pid, cpus)
        out[str(p.pid)] = {"role": role if rank is None else f"worker{rank}", "cpus": cpus,
                           "threads": threads}
    return out


def place_engine(root_pid: int, cpus: list[int]) -> None:
    """Every process of an engine on ``cpus``: the host's allowed CPUs (unpinned), or where
    it waits while another is measured (:class:`Seats`)."""
    import psutil

    try:
        procs = _tree(root_pid)
    except psutil.Error:
        return
    for p in procs:
        pin_process(p.pid, cpus)


FRONTEND_CPUS = 2
CORE_CPUS = 2
"""The CPUs (physical cores) a pinned engine's frontend and engine core get: each runs
more than one busy thread (the frontend's output thread, the engine core's input and
output threads beside its loop)."""


def apply(tp: int, engines: list[tuple[str, int]]) -> dict[str, Any]:
    """``--cpu-placement pinned``: ``engines`` ((name, frontend pid) of every engine that
    is up) pinned to one plan, and this process to its driver CPUs; what was done, for the
    results (``mode`` says whether anything was pinned, ``why`` when not).  Every engine is
    pinned as planned or none is: an engine whose processes' roles could not all be told
    apart (vLLM names them in their titles) would have them stacked on the frontend's CPUs,
    so then every engine goes back to the scheduler, and the results say which."""
    allowed = sorted(os.sched_getaffinity(0))
    try:
        placed = _apply(tp, engines)
        touched = placed["mode"] != "pinned" and "engines" in placed
    except Exception as exc:  # noqa: BLE001 - pinning is an aid: never the end of a run
        placed = {"mode": "scheduler", "why": f"pinning failed: {type(exc).__name__}: {exc}"}
        touched = True
    if touched:  # pinned, then given up: every engine back where it was
        unpin({"mode": "pinned"}, [pid for _, pid in engines], allowed)
    return placed


def _apply(tp: int, engines: list[tuple[str, int]]) -> dict[str, Any]:
    topo = topology(gpu_bus_ids(tp))
    pl, why = plan(tp, topo, FRONTEND_CPUS, CORE_CPUS)
    if pl is None:
        return {"mode": "scheduler", "why": why, "topology": topo.describe()}
    want = {"frontend", "core", *(f"worker{r}" for r in range(tp) if tp > 1)}
    found: dict[str, Any] = {}
    for name, pid in engines:
        procs = pin_engine(pid, pl)
        roles = sorted({v["role"] for v in procs.values()} if "error" not in procs else [])
        found[name] = {"roles": roles, "processes": len(procs) if "error" not in procs else 0,
                       **({"missing": sorted(want - set(roles))} if want - set(roles) else {}),
                       **({"error": procs["error"]} if "error" in procs else {})}
    bad = {n: f.get("error") or f"no {', '.join(f['missing'])} found"
           for n, f in found.items() if "missing" in f or "error" in f}
    if bad:
        return {"mode": "scheduler", "topology": topo.describe(), "engines": found,
                "why": "not every engine's processes told apart, none pinned: "
                       + "; ".join(f"{n}: {w}" for n, w in bad.items())}
    pin_process(os.getpid(), pl.driver)
    return {"mode": "pinned", "placement": pl.describe(), "topology": topo.describe(),
            "engines": found}


def unpin(placed: Optional[dict[str, Any]], pids: list[int], cpus: list[int]) -> None:
    """Where :func:`apply` pinned (``placed``), every engine's processes (frontend pids) and
    this process back on ``cpus``; never raises (it runs while a benchmark stops)."""
    if not placed or placed.get("mode") != "pinned":
        return
    for pid in pids:
        try:
            place_engine(pid, cpus)
        except Exception:  # noqa: BLE001 - a process that ended meanwhile
            continue
    pin_process(os.getpid(), cpus)


class Seats:
    """Where the engines of a wave sit while one of them is measured: that one on the
    placement's CPUs (:meth:`take`), each other on ``park`` (:meth:`leave`), so that nothing
    an idle engine does (its polling for a second after its last message at TP > 1, an idle
    server's threads) runs on the CPUs of the one measured.  Where :func:`apply` pinned
    nothing, or left no core for ``park``, it moves nothing.  Never raises: a process that
    ended meanwhile is passed over."""

    def __init__(self, placed: dict[str, Any], engines: dict[str, int]) -> None:
        pl = placed.get("placement") if placed.get("mode") == "pinned" else None
        self.placement = None if pl is None else Placement(**pl)
        self.engines = dict(engines)
        self.parks = bool(self.placement is not None and self.placement.park)

    def park_all(self) -> None:
        for name in self.engines:
            self.leave(name)

    def take(self, name: str) -> None:
        """The engine whose turn it is, each process on its role's CPUs."""
        if self.parks and name in self.engines:
            try:
                pin_engine(self.engines[name], self.placement)
            except Exception:  # noqa: BLE001 - gone: its turn fails on its own
                pass

    def leave(self, name: str) -> None:
        """The engine whose turn has ended, every process of it on ``park``."""
        if self.parks and name in self.engines:
            try:
                place_engine(self.engines[name], self.placement.park)
            except Exception:  # noqa: BLE001 - gone: nothing to move
                pass


# -- keeping the CPUs from halting ----------------------------------------------------

_SPIN = """
import ctypes, os, signal, sys, time
cpu, parent, max_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
try:  # killed with the benchmark, however it ends (Linux: PR_SET_PDEATHSIG)
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
except (OSError, AttributeError):
    pass
until = time.monotonic() + max_s
os.sched_setaffinity(0, {cpu})
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
print("spinning", flush=True)
while os.getppid() == parent and time.monotonic() < until:
    for _ in range(200000):
        pass
"""


def virtual_machine() -> bool:
    """Whether this host is a virtual machine (the ``hypervisor`` CPU flag)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " hypervisor" in line for line in f)
    except OSError:
        return False


class Spinners:
    """A busy loop on each of ``cpus`` at the lowest priority there is (``SCHED_IDLE``:
    any other task that wakes on that CPU takes it at once), so that no CPU ever has
    nothing to run.  In a virtual machine a CPU with nothing to run halts, the hypervisor
    may take the host core away, and waking it again takes a time that depends on the
    hypervisor's state (KVM adapts its halt polling per virtual CPU): in a host-bound
    decode loop whose processes wait on each other every step, that is per-step time.
    Each loop ends with this process (however it ends) or after ``max_s``; meant for
    virtual machines (:func:`virtual_machine`): on bare metal busy cores may lower the
    clocks of the others."""

    def __init__(self, cpus: list[int], max_s: float = 900) -> None:
        self.cpus, self.max_s = cpus, max_s
        self.procs: list[Any] = []
        self.failed: dict[int, str] = {}
        """CPUs whose loop did not start (its own error, or no word within its time)."""

    def start(self, timeout: float = 10.0) -> "Spinners":
        """A loop started on every CPU and each waited for until it spins on its CPU at its
        priority; those that do not are ended and left out of ``cpus`` (``failed``)."""
        import selectors
        import subprocess
        import sys

        started: list[tuple[int, Any]] = []
        try:
            for c in self.cpus:
                started.append((c, subprocess.Popen(
                    [sys.executable, "-c", _SPIN, str(c), str(os.getpid()), str(self.max_s)],
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE)))
        except OSError:
            for _, p in started:
                p.kill()
                p.wait()
            raise
        until = time.monotonic() + timeout
        for c, p in started:
            line = b""
            with selectors.DefaultSelector() as sel:
                sel.register(p.stdout, selectors.EVENT_READ)
                if sel.select(max(until - time.monotonic(), 0.0)):
                    line = p.stdout.readline()
            if line.strip() == b"spinning":
                self.procs.append(p)
                continue
            p.kill()
            err = p.communicate()[1].decode(errors="replace").strip().splitlines()
            self.failed[c] = err[-1] if err else "no word within the time given"
        self.cpus = [c for c, _ in started if c not in self.failed]
        return self

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        self.procs = []


def keep_awake(mode: str, placed: dict[str, Any], cpus: list[int],
               tp: int = 1) -> Optional[Spinners]:
    """``--cpu-no-halt`` (``on``, ``off``, ``auto``: on in a virtual machine): started
    :class:`Spinners`, or None.  ``placed`` is :func:`apply`'s answer: where it pinned, the
    loops go on the CPUs it gave out, not on their idle SMT siblings (a busy sibling slows
    its core); else on ``cpus``.  At TP > 1 not on the engine core's and the workers'
    CPUs (so none where they are not pinned): there those processes poll vLLM's
    shared-memory queues while in use (for a second after each message, ``SpinCondition``
    in vLLM's ``shm_broadcast.py``), yielding between polls, so their CPUs do not halt,
    and a yield could hand the CPU to the loop until the next scheduler tick.  The CPUs kept busy go into ``placed["no_halt"]``; a
    loop that could not start is left out (``no_halt_failed``), and starting none at all
    is not the end of the run (``no_halt_error``)."""
    if mode == "off" or (mode == "auto" and not virtual_machine()):
        return None
    pl = placed.get("placement")
    if tp > 1 and not pl:
        placed["no_halt_why"] = ("none: at TP > 1 the polling processes' CPUs are known only "
                                 "where they are pinned")
        return None
    if pl:
        # Not on park: the engines parked there poll at TP > 1, and none is measured there.
        polling = set(pl["core"]) | {c for w in pl["workers"] for c in w} if tp > 1 else set()
        cpus = sorted({*pl["frontend"], *pl["core"], *(c for w in pl["workers"] for c in w),
                       *pl["driver"]} - polling)
    try:
        spinners = Spinners(cpus).start()
    except OSError as exc:
        placed["no_halt_error"] = f"{type(exc).__name__}: {exc}"
        return None
    placed["no_halt"] = spinners.cpus
    if spinners.failed:
        placed["no_halt_failed"] = {str(c): why for c, why in spinners.failed.items()}
    return spinners
