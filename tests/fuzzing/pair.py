"""Pairs of gloo ranks that run the cases: a leader (rank 0) that compiles and judges each
case (:func:`.oracle.check_case`), and a peer (rank 1) that runs it beside the leader
(:func:`.oracle.serve`).

:func:`run` splits the cases over ``jobs`` pairs, each two spawned processes, and
starts a pair again where one dies: the case it was on is then wrong, with the exit
codes.  A pair also starts afresh every ``per_process`` cases, so a long run does
not grow one process's memory without end.  The leader appends each verdict to a
JSON-lines log as it comes, so a rank that dies leaves the case it was on there.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
import time
from typing import Any, Optional

from . import collectives
from .generator import generate

STOP = -(2 ** 62)
"""The control message that ends the peer's loop."""
BROKEN = 75
"""The leader's exit code when its peer can no longer follow (:class:`.oracle.PairBroken`)."""

_control: Any = None
"""This rank's control group: the leader's requests to the peer travel apart from the
collectives of the case being run."""


def send(seed: int, mode: int) -> None:
    import torch
    import torch.distributed as dist

    dist.broadcast(torch.tensor([seed, mode], dtype=torch.int64), src=0, group=_control)


def receive() -> tuple[Optional[int], int]:
    """The next (seed, mode) the leader asks for; (None, 0) when it says stop."""
    import torch
    import torch.distributed as dist

    msg = torch.zeros(2, dtype=torch.int64)
    dist.broadcast(msg, src=0, group=_control)
    seed, mode = (int(v) for v in msg)
    return (None, 0) if seed == STOP else (seed, mode)


def answer(issued: int) -> None:
    """The peer's word on the run it was asked for: the collectives it issued."""
    import torch
    import torch.distributed as dist

    dist.broadcast(torch.tensor([issued], dtype=torch.int64), src=1, group=_control)


class _RemotePeer:
    """The leader's handle on rank 1 (:class:`.oracle.Peer`)."""

    def run(self, seed: int, mode: int) -> None:
        send(seed, mode)

    def result(self) -> int:
        import torch
        import torch.distributed as dist

        msg = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(msg, src=1, group=_control)
        return int(msg[0])


def _vllm_groups(rank: int, world_size: int, timeout_s: float) -> None:
    """vLLM's distributed state, its TP group over both ranks, in a vLLM config that
    stays current for the process; nothing where vLLM is not installed (its cases are
    then skipped)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return
    import vllm.ir.ops  # noqa: F401  (registers torch.ops.vllm_ir)
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    # vLLM's CPU all-reduce sums in place and returns its input, against the contract
    # of its custom op (out of place): Inductor then lends the input's buffer to another
    # tensor and the sum is overwritten, with or without the pass.  The ranks use it
    # out of place, as vLLM's GPU communicators are, so a case judges the pass alone.
    def all_reduce_out_of_place(self, input_):
        out = input_.clone()
        self.dist_module.all_reduce(out, group=self.device_group)
        return out

    CpuCommunicator.all_reduce = collectives.count(all_reduce_out_of_place)

    config = VllmConfig()
    # A rank left waiting gives up after the run's timeout, not gloo's 30 minutes.
    for name in ("distributed_timeout_seconds", "cpu_distributed_timeout_seconds"):
        if hasattr(config.parallel_config, name):
            setattr(config.parallel_config, name, int(timeout_s))
    ctx = set_current_vllm_config(config)
    ctx.__enter__()
    ps.init_distributed_environment(world_size, rank, "env://", rank, "gloo",
                                    timeout=datetime.timedelta(seconds=timeout_s))
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)


def _rank_main(rank: int, port: int, seeds: list[int], sources: dict, log_path: str,
               always_baseline: bool, sabotage: dict, timeout_s: float) -> None:
    global _control
    import importlib.util
    import logging
    import warnings

    import torch
    import torch.distributed as dist

    from . import oracle

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1
    # A cache hit would skip the pass; the C++ kernel cache stays on (compile time only).
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    logging.getLogger("fusion_pass").setLevel(logging.ERROR)
    logging.getLogger("vllm").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    timeout = datetime.timedelta(seconds=timeout_s)
    needs_vllm = any("NEEDS_VLLM = True" in sources[s] for s in seeds)
    if needs_vllm:
        _vllm_groups(rank, 2, timeout_s)
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timeout)
    _control = dist.new_group(backend="gloo", timeout=timeout)
    kernels = collectives.install()  # noqa: F841  (kept alive for the process)
    try:
        if rank == 1:
            oracle.serve(sources)
            return
        with open(log_path, "a", buffering=1) as log:
            for seed in seeds:
                log.write(json.dumps({"start": seed}) + "\n")
                try:
                    res = oracle.check_case(sources[seed], f"fuzz_case_{seed}", _RemotePeer(),
                                            seed, always_baseline, sabotage.get(seed))
                except oracle.PairBroken as e:
                    # The peer waits in a collective that will never come: the pair
                    # ends here, and the runner starts a new one for the rest.
                    log.write(json.dumps(dict(e.verdict, seed=seed)) + "\n")
                    os._exit(BROKEN)
                res["seed"] = seed
                log.write(json.dumps(res) + "\n")
            send(STOP, 0)
    finally:
        if needs_vllm and importlib.util.find_spec("vllm") is not None:
            from vllm.distributed import parallel_state as ps

            ps.destroy_model_parallel()  # frees the shared memory of vLLM's CPU all-reduce
            ps.destroy_distributed_environment()
        if dist.is_initialized():
            dist.destroy_process_group()


def read_log(path: str) -> tuple[dict, Optional[int]]:
    """The verdicts in a leader's log, by seed, and the case it started and gave no
    verdict for (None if none)."""
    done, current = {}, None
    if os.path.exists(path):
        with open(path) as fh:
            for line in fh:
                if not line.endswith("\n"):  # still being written
                    break
                d = json.loads(line)
                if "start" in d:
                    current = d["start"]
                else:
                    done[d["seed"]] = d
                    current = None
    return done, current


class _Pair:
    """One leader and its peer, working through their share of the cases."""

    def __init__(self, index: int, todo: list[int], sources: dict, log_dir: str,
                 options: dict) -> None:
        self.todo, self.sources, self.options = list(todo), sources, options
        self.log = os.path.join(log_dir, f"pair{index}.jsonl")
        self.results: dict[int, dict] = {}
        self.procs: list[Any] = []
        self.batch: list[int] = []
        self.dead_since: Optional[float] = None
        self.barren = 0
        """Starts in a row that judged no case: ranks that cannot start."""
        self.last_change = time.time()
        self.last_count = 0

    @property
    def done(self) -> bool:
        return not self.todo and not self.procs

    def logged(self) -> dict:
        return {**self.results, **(read_log(self.log)[0] if self.procs else {})}

    def start(self) -> None:
        import torch.multiprocessing as mp

        from fusion_pass.testing.spawn import free_port

        if os.path.exists(self.log):
            os.remove(self.log)
        self.batch = self.todo[:self.options["per_process"]]
        sources = {s: self.sources[s] for s in self.batch}
        port = free_port()
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_rank_main, args=(
            r, port, self.batch, sources, self.log, self.options["always_baseline"],
            self.options["sabotage"], self.options["timeout_s"])) for r in range(2)]
        for p in self.procs:
            p.start()
        self.dead_since = None
        self.last_change, self.last_count = time.time(), 0

    def poll(self) -> None:
        """Start, watch or wind up the pair's processes."""
        if not self.procs:
            if self.todo:
                self.start()
            return
        alive = [p for p in self.procs if p.is_alive()]
        count = len(read_log(self.log)[0])
        if count != self.last_count:
            self.last_change, self.last_count = time.time(), count
        stuck = time.time() - self.last_change > self.options["timeout_s"] + 60
        if alive and (len(alive) < len(self.procs) or stuck):
            # The other rank may be blocked in a collective with the one that ended.
            self.dead_since = self.dead_since or time.time()
            if stuck or time.time() - self.dead_since > 10:
                for p in alive:
                    p.kill()
            return
        if alive:
            return
        for p in self.procs:
            p.join()
        codes = [p.exitcode for p in self.procs]
        done, current = read_log(self.log)
        self.results.update({s: done[s] for s in self.batch if s in done})
        if current is not None:  # the case the leader was on when a rank died or hung
            self.results[current] = dict(seed=current, status="wrong", fused=0, sites=0,
                                         why=f"a rank died or hung on this case (exit codes {codes})")
        self.barren = 0 if done or current is not None else self.barren + 1
        if self.barren >= 3:
            raise RuntimeError(f"a pair of fuzz ranks ended three times before its first "
                               f"case (exit codes {codes})")
        self.todo = [s for s in self.todo if s not in self.results]
        self.procs = []


def default_jobs() -> int:
    """One pair per core: the leader works, the peer mostly waits for it."""
    return max(1, len(os.sched_getaffinity(0)))


def run(seeds: list[int], sources: Optional[dict] = None, jobs: Optional[int] = None,
        progress: bool = False, always_baseline: bool = False,
        sabotage: Optional[dict[int, str]] = None,
        per_process: int = 150, timeout_s: float = 180) -> list[dict]:
    """Every case in ``seeds`` on ``jobs`` pairs of ranks; the verdicts in order.  The
    cases in ``sabotage`` run with a sabotaged pass of the kind given there
    (:data:`.oracle.SABOTAGES`: the oracle's own check)."""
    sources = sources or {s: generate(s).source for s in seeds}
    jobs = max(1, min(jobs or default_jobs(), len(seeds)))
    options = dict(always_baseline=always_baseline, sabotage=dict(sabotage or {}),
                   per_process=per_process, timeout_s=timeout_s)
    t0, shown = time.time(), 0
    with tempfile.TemporaryDirectory(prefix="fuzz_pass_") as log_dir:
        pairs = [_Pair(i, seeds[i::jobs], sources, log_dir, options) for i in range(jobs)]
        try:
            while not all(p.done for p in pairs):
                for p in pairs:
                    p.poll()
                time.sleep(1)
                if progress:
                    seen = [r for p in pairs for r in p.logged().values()]
                    if len(seen) // 25 > shown // 25:
                        shown = len(seen)
                        bad = sum(r["status"] == "wrong" for r in seen)
                        print(f"fuzz: {len(seen)}/{len(seeds)} cases, {bad} wrong so far, "
                              f"{len(seen) / (time.time() - t0):.2f} cases/s", file=sys.stderr,
                              flush=True)
        finally:  # an error here, or Ctrl-C, leaves no rank running
            for p in pairs:
                for proc in p.procs:
                    if proc.is_alive():
                        proc.kill()
                    proc.join()
        results = {s: r for p in pairs for s, r in p.results.items()}
    return [results[s] for s in seeds]
