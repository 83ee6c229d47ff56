"""One ``vllm.LLM`` engine in a process of its own, driven by the benchmark over a pipe.

Each engine of ``bench_vllm.py`` lives in such a process: the engines start side by side
(their compiles run in parallel), each with its own environment (compile caches, record
folder), and one that is not being measured waits on its pipe, its engine core blocked on
its input queue: idle.  The process measures its own calls: wall time, vLLM's per-request
times from the engine core's timestamps, and the CPU time its engine processes used.

Run by :class:`EngineProcess`; the protocol is one JSON object per line: the spec on
stdin first, then commands (``generate``, ``stop``) on stdin, each answered on the
process's original stdout (vLLM's own output goes to stderr).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional


ROOT = Path(__file__).resolve().parents[2]
TAIL = 300
"""Lines of an engine's output kept for its root cause (vLLM's traceback of an engine core
that failed, a few dozen lines, comes after it has already logged its own error)."""


class EngineError(RuntimeError):
    """The engine process failed, said so, or did not answer in time."""


_EXCEPTION = re.compile(r"\b((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception)): \S")
_OOM = ("OutOfMemoryError", "CUDA out of memory")
_GENERIC = ("See root cause above", "Engine core initialization failed")
"""What vLLM's front end says of any engine core that failed to start: not the cause."""
_NOT_AN_ERROR = re.compile(r"\b(?:DEBUG|INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d \[")
"""A line of a record vLLM logs below ERROR (its logger's ``LEVEL MM-DD HH:MM:SS [file]``):
a traceback there is one vLLM went on after (vLLM 0.26 logs one for DeepGEMM's missing
extension in every engine), not why an engine failed."""


def root_cause(lines: list[str]) -> Optional[str]:
    """The cause of a failed start in an engine's (or server's) log lines: the line that
    says the GPU ran out of memory, else the last exception line that is not vLLM's own
    pointer to a cause logged above (``Engine core initialization failed. See root cause
    above``) nor part of a record vLLM logged as a warning or below; from the exception's
    name on, without the process's log prefix."""
    found = None
    for line in lines:
        m = _EXCEPTION.search(line)
        if m is None or any(g in line for g in _GENERIC) or _NOT_AN_ERROR.search(line):
            continue
        text = line[m.start():].strip()
        if any(o in line for o in _OOM):
            return text
        found = text
    return found


# -- in the engine's process ----------------------------------------------------------

def _tree_usage() -> dict[str, float]:
    """CPU seconds and involuntary context switches of this process's children (the
    engine core and, at TP > 1, its workers), and this process's own CPU seconds."""
    import psutil

    me = psutil.Process()
    cpu = switches = 0.0
    for p in me.children(recursive=True):
        try:
            t = p.cpu_times()
            cpu += t.user + t.system
            switches += p.num_ctx_switches().involuntary
        except psutil.Error:
            continue
    t = me.cpu_times()
    return {"engine_cpu_s": cpu, "engine_involuntary_switches": switches,
            "frontend_cpu_s": t.user + t.system, "steal_s": _steal_seconds()}


def _steal_seconds() -> float:
    """CPU time the hypervisor gave to others, summed over this host's CPUs (0 where
    the kernel does not say)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0.0
    except (OSError, ValueError):
        return 0.0


def request_times(out: Any) -> dict[str, Optional[float]]:
    """vLLM's times of one finished request, in seconds, from the engine core's
    timestamps: ``tpot`` (last token - first token) / (tokens - 1), ``prefill`` (first
    token - scheduled); None where this vLLM keeps no request stats or a time is empty."""
    m = getattr(out, "metrics", None)
    n = getattr(m, "num_generation_tokens", 0)
    first, last = getattr(m, "first_token_ts", 0.0), getattr(m, "last_token_ts", 0.0)
    scheduled = getattr(m, "scheduled_ts", 0.0)
    return {"tpot": (last - first) / (n - 1) if n >= 2 and last > first else None,
            "prefill": first - scheduled if first > scheduled > 0 else None}


def engine_settings(llm: Any) -> dict[str, Any]:
    """What the engine was built with, as vLLM resolved it."""
    vc = llm.llm_engine.vllm_config
    cc = vc.compilation_config

    def get(obj: Any, *names: str) -> dict[str, Any]:
        out = {}
        for n in names:
            v = getattr(obj, n, None)
            out[n] = v if isinstance(v, (int, float, str, bool, type(None), list)) else str(v)
        return out

    pass_cfg = getattr(cc, "pass_config", None)
    ranges = getattr(cc, "get_compile_ranges", None)
    icc = getattr(cc, "inductor_compile_config", None) or {}
    post = icc.get("post_grad_custom_post_pass")
    return {
        "compilation": {**get(cc, "mode", "cudagraph_mode", "backend", "compile_sizes",
                              "compile_ranges_endpoints", "cudagraph_capture_sizes",
                              "max_cudagraph_capture_size", "splitting_ops", "debug_dump_path"),
                        "pass_config": get(pass_cfg, *(f.name for f in dataclasses.fields(
                            pass_cfg))) if pass_cfg else None,
                        "post_grad_custom_post_pass": None if post is None else type(post).__name__,
                        "inductor_compile_config": {k: v for k, v in icc.items() if isinstance(
                            v, (int, float, str, bool))},
                        # As the pass's records name them.
                        "compile_ranges": [f"[{r.start}, {r.end}]" for r in ranges()]
                        if ranges else None},
        "model": get(vc.model_config, "dtype", "max_model_len", "enforce_eager"),
        "scheduler": get(vc.scheduler_config, "max_num_seqs", "max_num_batched_tokens",
                         "enable_chunked_prefill", "async_scheduling"),
        "cache": get(vc.cache_config, "block_size", "gpu_memory_utilization", "cache_dtype",
                     "enable_prefix_caching", "kv_cache_memory_bytes", "num_gpu_blocks"),
        "parallel": get(vc.parallel_config, "tensor_parallel_size",
                        "distributed_executor_backend"),
        "attention": get(getattr(vc, "attention_config", None), "backend"),
        "optimization_level": str(getattr(vc, "optimization_level", None)),
    }


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            detokenize=False)
    before = _tree_usage()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = _tree_usage()
    times = [request_times(o) for o in outs]
    return {"seconds": seconds, "ids": [list(o.outputs[0].token_ids) for o in outs],
            "tpot_s": [t["tpot"] for t in times], "prefill_s": [t["prefill"] for t in times],
            "host": {k: after[k] - before[k] for k in after}}


def child_main() -> int:
    # Answers go to the original stdout; everything vLLM prints goes to stderr.
    answer = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def say(obj: dict[str, Any]) -> None:
        answer.write(json.dumps(obj) + "\n")
        answer.flush()

    spec = json.loads(sys.stdin.readline())
    start = time.perf_counter()
    try:
        from vllm import LLM
        from vllm.plugins import load_general_plugins

        # As vLLM's command line does before it reads a config: the plugin's pass must be
        # published under its JSON name before the compilation config resolves it.
        load_general_plugins()
        # Request stats on: the engine core's timestamps of every request.
        llm = LLM(**spec["kwargs"], disable_log_stats=False)
    except BaseException as exc:  # noqa: BLE001 - any failure is reported, then the exit
        import traceback

        traceback.print_exc()
        say({"event": "error", "error": f"{type(exc).__name__}: {exc}"[:4000]})
        return 1
    say({"event": "ready", "seconds_to_start": time.perf_counter() - start,
         "settings": engine_settings(llm), "pid": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "stop":
            llm.llm_engine.engine_core.shutdown()
            say({"event": "stopped"})
            # The engine is down: end here, without the interpreter's shutdown, which after
            # vLLM's took long enough on one H200 (the six engines' processes still there
            # 20 s after vLLM's last shutdown line) to run the benchmark into its limit.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        try:
            say(_generate(llm, cmd["prompts"], cmd["max_tokens"]))
        except Exception as exc:  # noqa: BLE001 - the caller decides what a failed call means
            say({"error": f"{type(exc).__name__}: {exc}"[:4000]})
    return 0


# -- in the benchmark's process -------------------------------------------------------

class EngineProcess:
    """An engine process: ``start`` (returns at once), ``wait_ready``, ``generate``,
    ``stop``.  Its log lines reach this process's stderr prefixed with its label."""

    def __init__(self, label: str, variant: str, kwargs: dict[str, Any], env: dict[str, str],
                 work: Path) -> None:
        self.label, self.variant, self.kwargs, self.env, self.work = (
            label, variant, kwargs, env, work)
        self.proc: Optional[subprocess.Popen] = None
        self.ready: Optional[dict[str, Any]] = None
        self._buf = b""
        self.log_tail: list[str] = []
        """The last lines of the engine's output (its root cause, where it fails)."""
        self._relay_thread: Optional[threading.Thread] = None
        self._failed = False

    def start(self) -> None:
        # The repository on the path: the plugin's pass is named by its module in the
        # compilation config, and vLLM imports it in every process it starts.
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": path, **self.env}, start_new_session=True)
        self._relay_thread = threading.Thread(target=self._relay, daemon=True)
        self._relay_thread.start()
        self._send({"label": self.label, "kwargs": self.kwargs})

    def _relay(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for raw in iter(self.proc.stderr.readline, b""):
            line = raw.decode(errors="replace")
            self.log_tail = (self.log_tail + [line])[-TAIL:]
            sys.stderr.write(f"[{self.label}] {line}")
        sys.stderr.flush()

    def _send(self, obj: dict[str, Any]) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(obj) + "\n").encode())
            self.proc.stdin.flush()
        except OSError as exc:
            raise EngineError(f"{self.label}: its process is gone ({exc})") from exc

    def _receive(self, timeout: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineError(f"{self.label}: no answer within {timeout:.0f} s")
                if not sel.select(min(left, 5.0)):
                    continue
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    code = self.proc.wait(timeout=30)
                    raise EngineError(f"{self.label}: its process exited with {code}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def failure(self, exc: Exception) -> str:
        """Why the engine did not start: ``exc``, and vLLM's root cause from its log where
        the error itself does not name one (an engine core that failed says only that)."""
        if self.proc is not None and self._relay_thread is not None:
            try:  # an engine that said it failed exits: its last lines relayed first
                self.proc.wait(timeout=5 if self._failed else 0.5)
                self._relay_thread.join(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        cause = root_cause(self.log_tail)
        return str(exc) if cause is None or cause in str(exc) else f"{cause} ({exc})"

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        msg = self._receive(timeout)
        if msg.get("event") != "ready":
            self._failed = True
            raise EngineError(f"{self.label}: its engine did not start: {msg.get('error')}")
        self.ready = msg
        return msg

    def generate(self, prompts: list[list[int]], max_tokens: int,
                 timeout: float = 600) -> dict[str, Any]:
        """The engine's answer within ``timeout``; an engine that gives none is killed at
        once (a hung engine would hold its GPU memory past the benchmark's stop)."""
        self._send({"op": "generate", "prompts": prompts, "max_tokens": max_tokens})
        try:
            out = self._receive(timeout)
        except Exception as exc:  # noqa: BLE001 - no usable answer: the engine is done for
            self.kill()
            if isinstance(exc, EngineError):
                raise
            raise EngineError(f"{self.label}: {type(exc).__name__}: {exc}") from exc
        if "error" in out:
            raise EngineError(f"{self.label}: generate failed: {out['error']}")
        return out

    def stop(self, timeout: float = 90) -> None:
        """vLLM's shutdown, then the process group if it lingers (or never started)."""
        self.request_stop()
        self.wait_stopped(timeout)

    def request_stop(self) -> None:
        """Ask for the shutdown without waiting (engines stop side by side)."""
        self._stopping = False
        if self.proc is None or self.proc.poll() is not None or self.ready is None:
            return
        try:
            self._send({"op": "stop"})
            self._stopping = True
        except EngineError:
            self.kill()

    def wait_stopped(self, timeout: float = 90) -> None:
        """Until the process has ended, at most ``timeout`` seconds in all; then its process
        group is killed."""
        if self.proc is None:
            return
        until = time.monotonic() + timeout
        try:
            if self.proc.poll() is None and getattr(self, "_stopping", False):
                self._receive(max(until - time.monotonic(), 0.1))
            self.proc.wait(timeout=max(until - time.monotonic(), 0.1))
        except Exception:  # noqa: BLE001 - no clean stop: killed
            pass
        # Whatever is left of its process group (an engine core whose frontend has ended).
        self.kill()

    def kill(self) -> None:
        if self.proc is not None:
            kill_group(self.proc)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the process group ``proc`` leads (``start_new_session=True``): the
    processes it started too (an engine core, its workers), even where ``proc`` itself has
    ended already; then ``proc`` reaped.  Never raises."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass  # in uninterruptible sleep: it ends when the kernel lets it


if __name__ == "__main__":
    sys.exit(child_main())
