"""vLLM's tensor-parallel group over gloo in a rank process (see :mod:`.spawn`), for tests
that compile vLLM's graph forms (``vllm.all_reduce`` names vLLM's group, not a c10d one)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional


@contextlib.contextmanager
def vllm_tp_group(rank: int, world_size: int,
                  vllm_config: Optional[Any] = None) -> Iterator[tuple[str, str]]:
    """Inside ``vllm_config`` (a default ``VllmConfig`` if None) as vLLM's current config,
    vLLM's distributed environment and TP group over gloo; yields ``(vLLM's group name for
    torch.ops.vllm.all_reduce, the c10d group name under it)``.  Imports vLLM."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    import vllm.ir.ops  # noqa: F401  (registers torch.ops.vllm_ir)

    with set_current_vllm_config(vllm_config if vllm_config is not None else VllmConfig()):
        ps.init_distributed_environment(world_size, rank, "env://", rank, "gloo")
        ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
        group = ps.get_tp_group()
        yield group.unique_name, group.device_group.group_name


def run_vllm_ranks(fn: Any, world_size: int = 2, *args: Any) -> list[Any]:
    """:func:`.spawn.run_ranks` for ranks that start vLLM's CPU platform: one core each
    (``VLLM_CPU_OMP_THREADS_BIND``, unless set; without it vLLM asks for NUMA nodes)."""
    import os

    from .spawn import run_ranks

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                          "|".join(str(r % (os.cpu_count() or 1)) for r in range(world_size)))
    return run_ranks(fn, world_size, *args)
