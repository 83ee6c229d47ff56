"""Run a function on N gloo ranks in fresh processes and collect what each returns.

Used by the tests, the example dump and the notebooks: CPU-only "tensor
parallelism" with one process per rank.
"""

from __future__ import annotations

import io
import os
import queue as queue_mod
import socket
import traceback
from typing import Any, Callable, Optional

import torch

from ..environ import patched


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # Bytes, not tensors: tensors sent through the queue live in shared memory
        # that vanishes when this process exits before the parent reads them.
        buf = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buf)
        queue.put((rank, None, buf.getvalue()))
    except BaseException:  # reported to the parent, which must not wait forever
        queue.put((rank, traceback.format_exc(), None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any, env: Optional[dict[str, str]] = None,
              timeout: float = 600) -> list[Any]:
    """``fn(rank, world_size, *args)`` on gloo ranks in spawned processes; results by rank.

    ``fn`` must be importable (module level) and its result picklable.  ``env``
    is set before the children start: torch reads some settings (Inductor's
    caches) when the child imports it, before ``fn`` runs.  A rank that raises
    fails the caller with that rank's traceback; silence fails it after ``timeout``.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, fn, args, queue))
             for r in range(world_size)]
    with patched(env or {}):
        for p in procs:
            p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            try:
                rank, error, value = queue.get(timeout=timeout)
            except queue_mod.Empty:
                raise RuntimeError(f"no answer from the ranks within {timeout} s") from None
            if error is not None:
                raise RuntimeError(f"rank {rank} failed:\n{error}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
